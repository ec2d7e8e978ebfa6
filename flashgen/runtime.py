"""Load kernel images and launch them on PyTorch's current stream, through the CUDA driver API.

A generic launcher: it knows modules, functions, grids, shared memory and packed parameter bytes,
and no kernel kind. The driver is called directly with ctypes (libcuda is there wherever a kernel
can run): importing CuPy alone costs more than the whole warm load of a cached kernel, and its
launch path more than ours. The library is loaded as a PyDLL (calls keep the GIL, as PyTorch's own
launches do), which saves releasing and retaking it on every launch. Kernels run in the device's
primary context, the one PyTorch uses, so they read and write torch tensors through their raw
pointers. CuPy is only needed to compile (compile.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import torch

from .axes import ELEMENT_TYPES
from .params import MAX_BYTES

_MAX_DYNAMIC_SMEM, _SMEM_CARVEOUT = 8, 9  # CUfunction_attribute values


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


@functools.cache
def driver():
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
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]
    check(lib, lib.cuInit(0), "cuInit")
    return lib


def check(lib, result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


_contexts: dict[int, int] = {}
_lock = threading.Lock()
_local = threading.local()


def launch_slot():
    """This thread's parameter buffer (callers pack into slot[0]), the kernelParams arrays that
    point into it (slot[1], one per layout of offsets), and an out-parameter for cuCtxGetCurrent:
    made once per thread, not per call."""
    slot = getattr(_local, "slot", None)
    if slot is None:
        buffer, current = ctypes.create_string_buffer(MAX_BYTES), ctypes.c_void_p()
        slot = _local.slot = (buffer, {}, current, ctypes.byref(current))
    return slot


def param_pointers(slot, offsets: tuple[int, ...]):
    """cuLaunchKernel's kernelParams: one pointer per parameter, into the slot's buffer. The driver
    copies each parameter to the place the compiled kernel has for it, which is not always the
    packed offset: a 64-byte-aligned CUtensorMap is aligned in the constant bank, whose parameter
    space starts at 0x210, so the first one sits at 0x30 (cuobjdump -elf, EIATTR_KPARAM_INFO)."""
    pointers = slot[1].get(offsets)
    if pointers is None:
        base = ctypes.addressof(slot[0])
        pointers = slot[1][offsets] = (ctypes.c_void_p * len(offsets))(*(base + offset for offset in offsets))
    return pointers


# The current stream's raw handle. The private accessor skips building a torch.cuda.Stream object:
# a few microseconds a call.
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def capture_of(stream: int, device: int) -> int:
    """The id of the CUDA graph capture under way on `stream` (a raw handle of `device`), or 0 when
    none is. (The driver's three-argument cuStreamGetCaptureInfo, which every driver since CUDA 10 keeps.)"""
    if not stream:  # the legacy default stream is never captured (and asking it needs a current context)
        return 0
    lib = driver()
    status, capture = _local_capture()
    result = lib.cuStreamGetCaptureInfo(ctypes.c_void_p(stream), status[1], capture[1])
    if result == _INVALID_CONTEXT:  # a thread with none current: ask again in the device's
        with device_context(device):
            result = lib.cuStreamGetCaptureInfo(ctypes.c_void_p(stream), status[1], capture[1])
    check(lib, result, "cuStreamGetCaptureInfo")
    return capture[0].value if status[0].value else 0


def _local_capture():
    """This thread's out-parameters of cuStreamGetCaptureInfo (status, id), each with its pointer."""
    pair = getattr(_local, "capture", None)
    if pair is None:
        status, capture = ctypes.c_int(), ctypes.c_uint64()
        pair = _local.capture = ((status, ctypes.byref(status)), (capture, ctypes.byref(capture)))
    return pair


def make_current(device: int) -> None:
    """Make `device`'s primary context (PyTorch's) current on this thread."""
    lib = driver()
    context = _contexts.get(device)
    if context is None:
        handle, ctx = ctypes.c_int(), ctypes.c_void_p()
        check(lib, lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "cuDevicePrimaryCtxRetain")
        context = _contexts[device] = ctx.value
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    if current.value != context:
        check(lib, lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")


@contextlib.contextmanager
def device_context(device: int):
    """`device`'s primary context current for the block, and the thread's own (or none) after it:
    the driver calls that need one (loading, tensor maps) may come on a thread that has another, or
    none at all (the autograd thread starts a backward with none)."""
    lib = driver()
    previous = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(previous))
    make_current(device)
    try:
        yield
    finally:
        _restore(lib, previous.value, device)


_TENSOR_MAP_DTYPES = {torch.float32: 7,  # CU_TENSOR_MAP_DATA_TYPE_* (the fp32 dQ sum's, and each element type's)
                      **{getattr(torch, element.torch): element.tensor_map for element in ELEMENT_TYPES.values()}}
_SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS = 3, 2, 0


_tensor_maps: dict[tuple, bytes] = {}


def tensor_map(t: torch.Tensor, box_rows: int, box_cols: int | None = None) -> bytes:
    """The TMA descriptor (CUtensorMap, 128 bytes) of a (B, H, T, d) tensor with a contiguous last
    dimension (or of a packed (total, H, d) one, seen as a batch of one: (1, H, total, d)):
    rank 4 over (d, T, H, B), tiles of box_rows x box_cols elements (by default one 128-byte row:
    64 16-bit or 128 FP8 elements), 128-byte swizzle,
    elements outside the tensor read as zero. A descriptor depends on nothing but the address,
    shape, strides, dtype and box, so the last ones made are kept (the same buffers come back call
    after call: PyTorch's allocator reuses addresses)."""
    box_cols = box_cols or 128 // t.element_size()
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, box_rows, box_cols)
    descriptor = _tensor_maps.get(key)
    if descriptor is None:
        if len(_tensor_maps) >= 256:
            _tensor_maps.clear()
        descriptor = _tensor_maps[key] = _encode_tensor_map(t, box_rows, box_cols)
    return descriptor


def _encode_tensor_map(t: torch.Tensor, box_rows: int, box_cols: int) -> bytes:
    """cuTensorMapEncodeTiled. Strides must be multiples of 16 bytes (the driver refuses others);
    a dimension of size 1 is never stepped over, so any legal stride does for it."""
    size = t.element_size()
    if t.dim() == 3:  # packed (total, H, d): a batch of one (the stride of a size-1 dim is set below)
        (seqlen, heads, head_dim), batch = t.shape, 1
        strides = [t.stride(0) * size, t.stride(1) * size, 0]
    else:
        batch, heads, seqlen, head_dim = t.shape
        strides = [s * size for s in t.stride()[2::-1]]
    sizes = (seqlen, heads, batch)
    for i in range(3):
        if sizes[i] == 1:
            strides[i] = 16 * max(1, -(-(strides[i - 1] * sizes[i - 1] if i else head_dim * size) // 16))
    descriptor = (ctypes.c_uint64 * 16)()
    lib = driver()
    with device_context(t.get_device()):  # the driver encodes only under a current context
        check(lib, lib.cuTensorMapEncodeTiled(
            descriptor, _TENSOR_MAP_DTYPES[t.dtype], 4, ctypes.c_void_p(t.data_ptr()),
            (ctypes.c_uint64 * 4)(head_dim, seqlen, heads, batch), (ctypes.c_uint64 * 3)(*strides),
            (ctypes.c_uint32 * 4)(box_cols, box_rows, 1, 1), (ctypes.c_uint32 * 4)(1, 1, 1, 1),
            0, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS,
        ), f"encoding a tensor map of shape {tuple(t.shape)}, strides {tuple(t.stride())}")
    return bytes(descriptor)


class Module:
    """A kernel image (a cubin, or PTX the driver compiles), loaded into a device's primary context
    the first time one of its functions is asked for there."""

    def __init__(self, image: bytes, name: str):
        self.image, self.name = image, name
        self._handles: dict[int, int] = {}

    def function(self, device: int, symbol: str, smem: int) -> ctypes.c_void_p:
        """The function `symbol` on `device`, allowed `smem` bytes of dynamic shared memory."""
        lib = driver()
        with device_context(device):
            with _lock:
                module = self._handles.get(device)
                if module is None:
                    handle = ctypes.c_void_p()
                    check(lib, lib.cuModuleLoadData(ctypes.byref(handle), self.image), f"loading {self.name}")
                    module = self._handles[device] = handle.value
            function = ctypes.c_void_p()
            check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module, symbol.encode()), f"finding {symbol}")
            check(lib, lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SMEM, smem),
                  f"allowing {symbol} {smem} bytes of shared memory on device {device}")
            # The largest shared-memory carve-out, so that two blocks fit on one SM.
            check(lib, lib.cuFuncSetAttribute(function, _SMEM_CARVEOUT, 100), f"setting {symbol}'s shared-memory carve-out")
        return function


def launch(function, x: int, y: int, z: int, threads: int, smem: int, device: int, slot, pointers, name: str,
           dependent: bool = False) -> None:
    """Launch `function` on `device`'s current stream: an (x, y, z) grid of blocks of `threads`
    threads, `smem` bytes of dynamic shared memory, and its parameters read through `pointers`
    (param_pointers: into the slot's buffer, packed by the caller). `dependent`: a programmatic
    dependent launch (sm_90), which may start before the kernel ahead of it on the stream ends (the
    kernel waits for it with griddepcontrol.wait)."""
    lib = driver()
    _, _, current, current_ref = slot
    lib.cuCtxGetCurrent(current_ref)
    if current.value == _contexts[device]:  # PyTorch's context for this device is usually current
        _launch(lib, function, x, y, z, threads, smem, device, pointers, name, dependent)
        return
    with device_context(device):  # the caller's (or none) comes back after: its device stays PyTorch's current one
        _launch(lib, function, x, y, z, threads, smem, device, pointers, name, dependent)


def _restore(lib, previous, device: int) -> None:
    """Make `previous` (a context, or none) current again after work on `device`: the CUDA runtime,
    and so PyTorch, takes the current context for the current device."""
    if previous != _contexts.get(device):
        lib.cuCtxSetCurrent(ctypes.c_void_p(previous))


def _launch(lib, function, x, y, z, threads, smem, device, pointers, name, dependent) -> None:
    stream = _current_stream(device)
    if dependent:
        config = _dependent_config(x, y, z, threads, smem, stream)
        result = lib.cuLaunchKernelEx(ctypes.byref(config), function, pointers, None)
    else:
        result = lib.cuLaunchKernel(function, x, y, z, threads, 1, 1, smem, ctypes.c_void_p(stream), pointers, None)
    if result:
        check(lib, result, f"launching {name}")


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value (a union)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _dependent_config(x: int, y: int, z: int, threads: int, smem: int, stream: int) -> _LaunchConfig:
    """cuLaunchKernelEx's configuration for a programmatic dependent launch, kept per thread."""
    config = getattr(_local, "dependent", None)
    if config is None:
        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _local.dependent = _LaunchConfig(attrs=ctypes.pointer(attribute), num_attrs=1)
    config.grid[:] = (x, y, z)
    config.block[:] = (threads, 1, 1)
    config.smem, config.stream = smem, stream
    return config
