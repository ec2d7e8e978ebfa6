"""Load cubins with CuPy and launch them on PyTorch's current stream.

CuPy and PyTorch share the device's primary CUDA context, so a function loaded here can read and
write torch tensors through their raw pointers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .spec import KernelSpec

LOG2E = 1.4426950408889634


class _Stream:
    """The one attribute CuPy's launcher reads from a stream object."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class Kernel:
    """A compiled kernel, loaded on each device the first time it runs there."""

    def __init__(self, spec: KernelSpec, cubin: bytes):
        self.spec = spec
        self.cubin = cubin
        self._functions: dict[int, object] = {}
        self._grid_m = spec.block_m
        self._block = (spec.num_threads, 1, 1)

    def function(self, device: int):
        function = self._functions.get(device)
        if function is None:
            function = self._functions[device] = self._load(device)
        return function

    def _load(self, device: int):
        import cupy
        from cupy.cuda import driver

        with cupy.cuda.Device(device):
            module = cupy.cuda.function.Module()
            module.load(self.cubin)
            function = module.get_function(self.spec.name)
            driver.funcSetAttribute(
                function.ptr,
                driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.spec.smem_bytes,
            )
            # Ask for the largest shared-memory carve-out so two blocks fit on one SM.
            driver.funcSetAttribute(
                function.ptr, driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100
            )
        return function

    def forward(self, q, k, v, o, lse, scale: float) -> None:
        """o, lse = attention(q, k, v) for (B, H, T, d) tensors already validated by the caller."""
        batch, heads, seqlen_q, _ = q.shape
        seqlen_k, kv_heads = k.shape[2], k.shape[1]
        device = q.device.index
        args = (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
            np.int32(seqlen_q), np.int32(seqlen_k), np.int32(heads // kv_heads),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            np.float32(scale * LOG2E),
        )
        grid = (math.ceil(seqlen_q / self._grid_m), heads, batch)
        self._launch(device, grid, args)

    def _launch(self, device: int, grid, args) -> None:
        import cupy

        stream = _Stream(torch.cuda.current_stream(device).cuda_stream)
        function = self.function(device)
        if cupy.cuda.runtime.getDevice() == device:
            function(grid, self._block, args, shared_mem=self.spec.smem_bytes, stream=stream)
        else:  # the function belongs to that device's context
            with cupy.cuda.Device(device):
                function(grid, self._block, args, shared_mem=self.spec.smem_bytes, stream=stream)
