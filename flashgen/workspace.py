"""Device buffers a launch plan reuses from call to call instead of allocating them: per stream,
so that no two kernels that may run at once ever share one.

- **Counts** (int32) that a kernel leaves at zero. Each of a split-KV decode's split blocks writes
  its partial state and adds one to its row tile's count; the block that brings the count to the
  number of splits merges the states and sets the count back to zero
  (templates/attention_decode.cu.j2). So counts hold zeros whenever no kernel runs on them, and a
  call pays no zeroing launch. Nothing else writes them, and nothing puts a count that is not
  zero right: the kernel's wrapping increment keeps any offset from kernel to kernel.
- **Scratch** that a kernel fills before it reads it (the decode's partial states): eager calls
  reuse their stream's, which saves an allocation a call. A call being captured allocates its own
  (a replay costs no host time anyway).

Eager calls take their stream's buffers: a stream runs its kernels one after another. A call
being captured into a CUDA graph takes counts of its own for that capture and stream (a graph's
nodes from one stream run in that stream's order; two streams in one capture may run at once),
which every replay of the graph uses: a slice of zeros made outside any capture (the reserve,
made by the first eager call on the device), or, with none left, zeros made inside the capture
(the graph then zeroes them on each replay: a small fill more, still right).

Counts are kept for the process's life (a few bytes per stream and per captured graph); eager
scratch up to KEEP_BYTES per stream. What is kept (here, and the block masks' lists through
`keep`) is made on a thread of its own (`_lasting`):
PyTorch sends a thread's allocations to a CUDA-graph pool while torch.compile's CUDA graphs
(mode="reduce-overhead") warm a function up, and later gives that pool's memory to other tensors,
which would then share it with our counts. Another thread's allocations come from the ordinary
pools.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import runtime

RESERVE = 1 << 20  # counts set aside per device for graph captures (4 MiB)
KEEP_BYTES = 64 << 20  # eager scratch kept per stream, at most

_counts: dict[tuple[int, int, int], torch.Tensor] = {}  # (device, stream, capture id or 0) -> counts
_scratch: dict[tuple[int, int, str], torch.Tensor] = {}  # (device, stream, name) -> eager scratch
_reserves: dict[int, torch.Tensor] = {}
_lock = threading.Lock()


def where(device: int) -> tuple[int, int]:
    """`device`'s current stream (raw handle) and the id of the graph capture under way on it, or 0."""
    stream = runtime._current_stream(device)
    return stream, runtime.capture_of(stream, device)


def counts(device: int, stream: int, capture: int, count: int, place: torch.device) -> torch.Tensor:
    """`count` zeroed int32 counts in `place` (CUDA device `device`) for a kernel about to be
    launched on `stream` (in `capture`, or 0), which leaves them zero when it ends."""
    key = (device, stream, capture)
    found = _counts.get(key)
    if found is not None and found.numel() >= count:
        return found
    with _lock:  # two threads capturing at once must not cut the same counts from the reserve
        if not capture:
            found = _lasting(lambda: torch.zeros(max(count, 1024), dtype=torch.int32, device=place), place, stream)
            if device not in _reserves:
                _reserves[device] = _lasting(lambda: torch.zeros(RESERVE, dtype=torch.int32, device=place), place, stream)
        else:
            reserve = _reserves.get(device)
            if reserve is None or reserve.numel() < count:
                # None left: zeros of this call's own, made in the capture (the graph zeroes them
                # before the kernel on each replay), and dropped after it like any temporary.
                return torch.zeros(count, dtype=torch.int32, device=place)
            found, _reserves[device] = reserve[:count], reserve[count:]
        _counts[key] = found
        return found


def scratch(device: int, stream: int, capture: int, name: str, size: int, dtype: torch.dtype, place: torch.device) -> torch.Tensor:
    """`size` elements of uninitialized scratch for a kernel about to be launched on `stream`: the
    stream's own when eager (kept up to KEEP_BYTES), a new buffer when captured."""
    if capture:
        return torch.empty(size, dtype=dtype, device=place)
    key = (device, stream, name)
    found = _scratch.get(key)
    if found is None or found.numel() < size or found.dtype != dtype:
        if size * dtype.itemsize > KEEP_BYTES:
            return torch.empty(size, dtype=dtype, device=place)  # too big to keep: this call's own
        found = _scratch[key] = _lasting(lambda: torch.empty(size, dtype=dtype, device=place), place, stream)
    return found[:size]


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`, made on the current stream, in memory no CUDA-graph pool owns (see
    _lasting): for what a call computed and later calls reuse (flashgen.blockmask's lists)."""
    stream = torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else 0
    return _lasting(lambda: torch.empty_like(tensor), tensor.device, stream).copy_(tensor)


def _lasting(make, place: torch.device, stream: int) -> torch.Tensor:
    """make(), run on a thread of its own (its allocation from PyTorch's ordinary pools, never a
    CUDA-graph pool the calling thread allocates into) and finished before this returns. The tensor
    is marked as used on `stream`, so that when it is replaced its memory waits for that stream's
    kernels before it is reused."""
    def made():
        tensor = make()
        if place.type == "cuda":  # zeros in place before any stream, or graph, reads them
            torch.cuda.current_stream(place).synchronize()
        return tensor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashgen-workspace") as pool:
        tensor = pool.submit(made).result()
    if place.type == "cuda" and stream:  # (the default stream, 0, is the one it was made on)
        tensor.record_stream(torch.cuda.ExternalStream(stream, device=place))
    return tensor
