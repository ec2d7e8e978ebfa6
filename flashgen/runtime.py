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
    """A compiled kernel module, loaded on each device the first time it runs there.

    The module's main function is named after the spec; key-major backward modules also hold
    `<name>_prep`, which computes delta = rowsum(dO * O) and the base-2 log-sum-exp.
    """

    def __init__(self, spec: KernelSpec, cubin: bytes):
        self.spec = spec
        self.cubin = cubin
        self._modules: dict[int, object] = {}
        self._functions: dict[tuple[int, str], object] = {}

    def function(self, device: int, entry: str = ""):
        function = self._functions.get((device, entry))
        if function is None:
            function = self._functions[(device, entry)] = self._load(device, entry)
        return function

    def _load(self, device: int, entry: str):
        import cupy
        from cupy.cuda import driver

        with cupy.cuda.Device(device):
            module = self._modules.get(device)
            if module is None:
                module = self._modules[device] = cupy.cuda.function.Module()
                module.load(self.cubin)
            function = module.get_function(self.spec.name + entry)
            if not entry:
                driver.funcSetAttribute(
                    function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.spec.smem_bytes
                )
                # Ask for the largest shared-memory carve-out so two blocks fit on one SM.
                driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        return function

    def forward(self, q, k, v, o, lse, scale: float) -> None:
        """o, lse = attention(q, k, v) for (B, H, T, d) tensors already checked by the caller."""
        batch, heads, seqlen_q, _ = q.shape
        args = (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
            np.int32(seqlen_q), np.int32(k.shape[2]), np.int32(heads // k.shape[1]),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            np.float32(scale * LOG2E),
        )
        self._launch(q.device.index, (math.ceil(seqlen_q / self.spec.block_m), heads, batch), args)

    def backward_prep(self, o, d_o, lse, delta, lse_log2) -> None:
        """delta = rowsum(dO * O) and lse_log2 = lse * log2(e), padded rows (see the template)."""
        batch, heads, seqlen_q, head_dim = o.shape
        padded_q = delta.shape[-1]
        rows_per_block = 128 // (1 << (head_dim // 8 - 1).bit_length())
        args = (
            o.data_ptr(), d_o.data_ptr(), lse.data_ptr(), delta.data_ptr(), lse_log2.data_ptr(),
            np.int32(seqlen_q), np.int32(padded_q), *o.stride()[:3], *d_o.stride()[:3],
        )
        grid = (padded_q // rows_per_block, heads, batch)
        self._launch(o.device.index, grid, args, entry="_prep", block=(128, 1, 1), smem=0)

    def backward(self, q, k, v, d_o, lse_log2, delta, dk, dv, dq, scale: float) -> None:
        """The gradients this kernel writes (spec.grads): key-major kernels write dk and/or dv and
        add into dq (fp32) with atomics; bwd_q writes dq (q's dtype)."""
        batch, heads, seqlen_q, _ = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
        common = (
            np.int32(seqlen_q), np.int32(seqlen_k), np.int32(lse_log2.shape[-1]), np.int32(heads // kv_heads),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *d_o.stride()[:3],
        )
        inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), d_o.data_ptr(), lse_log2.data_ptr(), delta.data_ptr())
        grads = self.spec.grads
        if self.spec.kind == "bwd_q":
            outputs, out_strides = (dq.data_ptr(),), dq.stride()[:3]
            grid = (math.ceil(seqlen_q / self.spec.block_m), heads, batch)
        else:
            outputs = tuple(t.data_ptr() for g, t in (("k", dk), ("v", dv), ("q", dq)) if g in grads)
            out_strides = dk.stride()[:3]  # dk and dv share one layout
            grid = (math.ceil(seqlen_k / self.spec.block_n), kv_heads, batch)
        args = (*inputs, *outputs, *common, *out_strides, np.float32(scale), np.float32(scale * LOG2E))
        self._launch(q.device.index, grid, args)

    def _launch(self, device: int, grid, args, entry: str = "", block=None, smem=None) -> None:
        import cupy

        block = block or (self.spec.num_threads, 1, 1)
        smem = self.spec.smem_bytes if smem is None else smem
        stream = _Stream(torch.cuda.current_stream(device).cuda_stream)
        function = self.function(device, entry)
        if cupy.cuda.runtime.getDevice() == device:
            function(grid, block, args, shared_mem=smem, stream=stream)
        else:  # the function belongs to that device's context
            with cupy.cuda.Device(device):
                function(grid, block, args, shared_mem=smem, stream=stream)
