"""The counts a split-KV decode kernel's blocks keep in device memory, zero between kernels.

Each of a row tile's split blocks writes its partial state and adds one to the tile's count; the
block that brings the count to the number of splits is the last, merges the states, and sets the
count back to zero (templates/attention_decode.cu.j2). So a buffer of counts holds zeros whenever
no kernel runs on it, and is reused as it is: a call pays no zeroing launch. Two kernels running
at once must never share one, so:

- eager calls take their stream's buffer (a stream runs its kernels one after another);
- a call being captured into a CUDA graph takes a buffer of its capture's own, which every replay
  of that graph uses: a slice of zeros made outside any capture (the reserve, made by the first
  eager call on the device), or, with none left, zeros made inside the capture (the graph then
  zeroes them on each replay: one small fill more, still right).

Buffers are kept for the process's life: a few bytes per stream and per captured graph.
"""

from __future__ import annotations

import torch

from . import runtime

RESERVE = 1 << 16  # counts set aside per device for graph captures (256 KiB)

_streams: dict[tuple[int, int], torch.Tensor] = {}
_captures: dict[tuple[int, int], torch.Tensor] = {}
_reserves: dict[int, torch.Tensor] = {}


def for_launch(device: int, count: int, place: torch.device) -> torch.Tensor:
    """`count` zeroed int32 counts in `place` (CUDA device `device`) for a kernel about to be
    launched on its current stream, which leaves them zero when it ends."""
    stream = runtime._current_stream(device)
    capture = runtime.capture_of(stream)
    if not capture:
        found = _streams.get((device, stream))
        if found is None or found.numel() < count:
            found = _streams[(device, stream)] = torch.zeros(max(count, 1024), dtype=torch.int32, device=place)
            if device not in _reserves:
                _reserves[device] = torch.zeros(RESERVE, dtype=torch.int32, device=place)
        return found
    found = _captures.get((device, capture))
    if found is None or found.numel() < count:
        reserve = _reserves.get(device)
        if reserve is not None and reserve.numel() >= count:
            found, _reserves[device] = reserve[:count], reserve[count:]
        else:
            found = torch.zeros(count, dtype=torch.int32, device=place)
        _captures[(device, capture)] = found
    return found

