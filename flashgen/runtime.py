"""Load cubins and launch them on PyTorch's current stream, through the CUDA driver API.

The driver is called directly with ctypes (libcuda is there wherever a kernel can run): importing
CuPy alone costs more than the whole warm load of a cached kernel, and its launch path more than
ours. The library is loaded as a PyDLL (calls keep the GIL, as PyTorch's own launches do), which
saves releasing and retaking it on every launch. Kernels run in the device's primary context, the
one PyTorch uses, so they read and write torch tensors through their raw pointers. CuPy is only
needed to compile (compile.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading

import torch

from .spec import KernelSpec

LOG2E = 1.4426950408889634
_MAX_DYNAMIC_SMEM, _SMEM_CARVEOUT = 8, 9  # CUfunction_attribute values
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0  # cuLaunchKernel `extra` keys

# Kernel parameters packed with C alignment (struct's "@" mode), in template order.
# P: pointer, i: int, q: long long, f: float.
FORWARD_ARGS = struct.Struct("@5P3i12qf")
PREP_ARGS = struct.Struct("@5P2i6q")
BACKWARD_ARGS = {outputs: struct.Struct(f"@{6 + outputs}P4i15q2f") for outputs in (1, 2, 3)}  # by gradients written


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


@functools.cache
def _driver():
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError as error:
        raise CudaError("flashgen needs the NVIDIA driver (libcuda.so.1) to run kernels") from error
    # cuLaunchKernel has no argtypes: converting eleven arguments through them costs about a third
    # of the call. Its pointers are therefore passed as c_void_p objects (ctypes would truncate a
    # bare Python int to a 32-bit C int), its sizes as small ints.
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuModuleGetFunction.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
    lib.cuModuleLoadData.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib, result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


_contexts: dict[int, int] = {}
_lock = threading.Lock()
_local = threading.local()


def _launch_slot():
    """This thread's parameter buffer, the `extra` array that points cuLaunchKernel at it, and an
    out-parameter for cuCtxGetCurrent: made once per thread, not per call."""
    slot = getattr(_local, "slot", None)
    if slot is None:
        buffer, size, current = ctypes.create_string_buffer(512), ctypes.c_size_t(0), ctypes.c_void_p()
        extra = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER, ctypes.addressof(buffer), _PARAM_BUFFER_SIZE, ctypes.addressof(size), _PARAM_END
        )
        slot = _local.slot = (buffer, size, extra, current, ctypes.byref(current))
    return slot


# The current stream's raw handle. The private accessor skips building a torch.cuda.Stream object:
# a few microseconds a call.
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)


def _make_current(device: int) -> None:
    """Make `device`'s primary context (PyTorch's) current on this thread."""
    lib = _driver()
    context = _contexts.get(device)
    if context is None:
        handle, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check(lib, lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "cuDevicePrimaryCtxRetain")
        context = _contexts[device] = ctx.value
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    if current.value != context:
        _check(lib, lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")


class Kernel:
    """A compiled kernel module, loaded on each device the first time it runs there.

    The module's main function is named after the spec; key-major backward modules also hold
    `<name>_prep`, which computes delta = rowsum(dO * O) and the base-2 log-sum-exp.
    """

    def __init__(self, spec: KernelSpec, cubin: bytes):
        self.spec = spec
        self.cubin = cubin
        self._threads, self._smem = spec.num_threads, spec.smem_bytes  # properties: computed once
        self._modules: dict[int, int] = {}
        self._functions: dict[tuple[int, str], ctypes.c_void_p] = {}

    def function(self, device: int, entry: str = "") -> ctypes.c_void_p:
        function = self._functions.get((device, entry))
        if function is None:
            with _lock:
                function = self._functions[(device, entry)] = self._load(device, entry)
        return function

    def _load(self, device: int, entry: str) -> int:
        lib = _driver()
        _make_current(device)
        module = self._modules.get(device)
        if module is None:
            handle = ctypes.c_void_p()
            _check(lib, lib.cuModuleLoadData(ctypes.byref(handle), self.cubin), f"loading {self.spec.name}")
            module = self._modules[device] = handle.value
        function = ctypes.c_void_p()
        name = (self.spec.name + entry).encode()
        _check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module, name), f"finding {name.decode()}")
        if not entry:
            smem = self.spec.smem_bytes
            _check(lib, lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SMEM, smem), "setting shared memory")
            # The largest shared-memory carve-out, so that two blocks fit on one SM.
            _check(lib, lib.cuFuncSetAttribute(function, _SMEM_CARVEOUT, 100), "setting the carve-out")
        return function

    def forward(self, device: int, q, k, v, o, lse, scale: float) -> None:
        """o, lse = attention(q, k, v) for (B, H, T, d) tensors on `device` already checked by the
        caller; lse may be None (not written)."""
        batch, heads, seqlen_q, _ = q.shape
        _, kv_heads, seqlen_k, _ = k.shape
        slot = _launch_slot()
        FORWARD_ARGS.pack_into(
            slot[0], 0,
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
            seqlen_q, seqlen_k, heads // kv_heads,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], scale * LOG2E,
        )
        self._launch(slot, FORWARD_ARGS.size, device, -(-seqlen_q // self.spec.block_m), heads, batch)

    def backward_prep(self, o, d_o, lse, delta, lse_log2) -> None:
        """delta = rowsum(dO * O) and lse_log2 = lse * log2(e), padded rows (see the template)."""
        batch, heads, seqlen_q, _ = o.shape
        padded_q = delta.shape[-1]
        rows_per_block = 128 // self.spec.prep_lanes
        slot = _launch_slot()
        PREP_ARGS.pack_into(
            slot[0], 0,
            o.data_ptr(), d_o.data_ptr(), lse.data_ptr(), delta.data_ptr(), lse_log2.data_ptr(),
            seqlen_q, padded_q, *o.stride()[:3], *d_o.stride()[:3],
        )
        self._launch(
            slot, PREP_ARGS.size, o.get_device(), padded_q // rows_per_block, heads, batch,
            entry="_prep", block=128, smem=0,
        )

    def backward(self, q, k, v, d_o, lse_log2, delta, dk, dv, dq, scale: float) -> None:
        """The gradients this kernel writes (spec.grads): key-major kernels write dk and/or dv and
        add into dq (fp32) with atomics; bwd_q writes dq (q's dtype)."""
        batch, heads, seqlen_q, _ = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
        if self.spec.kind == "bwd_q":
            outputs, out_strides = (dq.data_ptr(),), dq.stride()[:3]
            grid = (math.ceil(seqlen_q / self.spec.block_m), heads, batch)
        else:
            grads = self.spec.grads
            outputs = tuple(t.data_ptr() for g, t in (("k", dk), ("v", dv), ("q", dq)) if g in grads)
            out_strides = dk.stride()[:3]  # dk and dv share one layout
            grid = (math.ceil(seqlen_k / self.spec.block_n), kv_heads, batch)
        layout, slot = BACKWARD_ARGS[len(outputs)], _launch_slot()
        layout.pack_into(
            slot[0], 0,
            q.data_ptr(), k.data_ptr(), v.data_ptr(), d_o.data_ptr(), lse_log2.data_ptr(), delta.data_ptr(),
            *outputs, seqlen_q, seqlen_k, lse_log2.shape[-1], heads // kv_heads,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *d_o.stride()[:3], *out_strides,
            scale, scale * LOG2E,
        )
        self._launch(slot, layout.size, q.get_device(), *grid)

    def _launch(self, slot, params_size: int, device: int, grid_x: int, grid_y: int, grid_z: int,
                entry: str = "", block: int | None = None, smem: int | None = None) -> None:
        """Launch with the first params_size bytes of the slot's parameter buffer (packed by the
        caller: passing the values through here would cost more than the packing)."""
        lib = _driver()
        function = self._functions.get((device, entry)) or self.function(device, entry)
        _, size, extra, current, current_ref = slot
        size.value = params_size
        lib.cuCtxGetCurrent(current_ref)
        if current.value != _contexts[device]:  # PyTorch's context for this device is usually current
            _make_current(device)
        result = lib.cuLaunchKernel(
            function, grid_x, grid_y, grid_z, block or self._threads, 1, 1,
            self._smem if smem is None else smem, ctypes.c_void_p(_current_stream(device)), None, extra,
        )
        if result:
            _check(lib, result, f"launching {self.spec.name}{entry}")
