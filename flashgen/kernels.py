"""Loaded kernels, and the one memo of them that stands in front of the disk cache.

`get(spec)` is the only way a spec becomes a runnable Kernel: the memo, else a prebuilt kernel
registered by flashgen.load(), else the cache (which compiles on a miss, unless FLASHGEN_NO_JIT).
`prefetch(specs)` starts that in background threads for kernels a call will need soon (a training
step's backward, while its forward compiles): NVRTC releases the GIL, so the compiles overlap, and
`get` then waits for the one under way instead of starting another.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from . import runtime
from .compile import NoJitError
from .spec import KernelSpec
from .workload import RECORD_ENV

_loaded: dict[KernelSpec, Kernel] = {}
_pending: dict[KernelSpec, Future] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_generation = 0  # moved by clear(): a prefetch started before it does not register its kernel


class Kernel:
    """A compiled kernel: its spec, its image (loaded on each device on first use), its launch
    geometry, and `launch(device, values)`, which takes the family's named arguments from a mapping
    of the call's values."""

    def __init__(self, spec: KernelSpec, image: bytes):
        self.spec = spec
        self.image = image
        family = spec.family
        self.threads, self.smem = family.threads(spec), spec.smem_bytes
        self.dependent = family.dependent_launch(spec)
        self._pack = family.packer(spec)  # its .arguments: the named arguments launch() reads
        self._offsets = tuple(family.params(spec).offsets)
        self._module = runtime.Module(image, spec.name)
        self._functions: dict[int, object] = {}

    def __repr__(self) -> str:
        return f"Kernel({self.spec.ident})"

    def function(self, device: int):
        function = self._functions.get(device)
        if function is None:
            function = self._functions[device] = self._module.function(device, self.spec.name, self.smem)
        return function

    def launch(self, device: int, values) -> None:
        """Pack the parameters from `values` (a mapping that holds at least the family's named
        arguments the parameters read; it may hold more) and launch on `device`'s stream."""
        slot = runtime.launch_slot()
        x, y, z = self._pack(slot[0], values)
        function = self._functions.get(device) or self.function(device)
        pointers = slot[1].get(self._offsets) or runtime.param_pointers(slot, self._offsets)
        runtime.launch(function, x, y, z, self.threads, self.smem, device, slot, pointers, self.spec.name, self.dependent)


def get(spec: KernelSpec) -> Kernel:
    """The loaded kernel for `spec`: from the memo, from a prefetch under way (its compile error,
    if it failed), or from the cache (built on a miss). (Plans keep what it returns: it runs
    once per plan, not per call.)"""
    record(spec)
    kernel = _loaded.get(spec)
    if kernel is None:
        future = _pending.pop(spec, None)
        if future is not None and not future.cancel():  # under way (or done): wait for it; still queued: load it here
            return future.result()
        from .cache import default_cache

        kernel = _load(spec, default_cache(), _generation)
    return kernel


def _load(spec: KernelSpec, cache, generation: int) -> Kernel:
    try:
        artifact = cache.get(spec)
    except NoJitError:  # say which build makes it, and where it goes
        from .aot import missing_kernel

        raise missing_kernel(spec) from None
    kernel = Kernel(spec, artifact.cubin)  # built outside the lock, which a fork may copy held
    with _lock:
        if generation != _generation:  # cleared meanwhile: a kernel for the caller, not the memo
            return kernel
        return _loaded.setdefault(spec, kernel)


def prefetch(specs) -> None:
    """Start loading (compiling on a cache miss) each of `specs` that is neither loaded nor under
    way, in background threads, from the cache the process uses now."""
    global _pool
    from .cache import default_cache

    cache = default_cache()
    with _lock:
        for spec in specs:
            record(spec)
            if spec not in _loaded and spec not in _pending:
                if _pool is None:
                    _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="flashgen-compile")
                    _at_exit(_pool)
                _pending[spec] = _pool.submit(_load, spec, cache, _generation)


_recorded: set[tuple[str, KernelSpec]] = set()


def record(spec: KernelSpec) -> None:
    """With FLASHGEN_RECORD=FILE, add the spec to FILE (a line of its canonical JSON, once per
    process): what `flashgen build --from FILE` makes, so a deployment holds every kernel the
    recorded run loaded. One write(2) of a line to a file opened for appending, so processes that
    record into one file at once never interleave their lines."""
    path = os.environ.get(RECORD_ENV)
    if not path or (path, spec) in _recorded:
        return
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (spec.canonical() + "\n").encode())
    finally:
        os.close(descriptor)
    _recorded.add((path, spec))


def register(kernel: Kernel) -> Kernel:
    """Make a kernel loaded elsewhere (a prebuilt one) the one `get` returns for its spec."""
    with _lock:
        return _loaded.setdefault(kernel.spec, kernel)


def _at_exit(pool: ThreadPoolExecutor) -> None:
    """At interpreter exit, drop the prefetches not yet started (a script that never runs its
    backward must not wait for its kernels' compiles); those under way finish. This runs before
    the executor's own exit hook, which waits for all queued work: threading runs these hooks
    newest first."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(lambda: pool.shutdown(wait=False, cancel_futures=True))


def _after_fork() -> None:
    """A forked child has none of its parent's compile threads (it starts a pool of its own), and
    a lock a parent's thread held at the fork would stay held: it takes a new one."""
    global _pool, _lock
    _pool = None
    _pending.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def clear() -> None:
    """Forget every loaded kernel and prefetch (tests; a cleared disk cache)."""
    global _generation
    with _lock:
        _loaded.clear()
        _pending.clear()
        _generation += 1
