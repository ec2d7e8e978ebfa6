"""The launch path without a GPU: the packed parameter layouts match the rendered kernels'
signatures, and a launch packs every value in signature order (the driver is stubbed)."""

import ctypes
import re
import struct

import pytest
import torch

from flashgen import runtime, tuning
from flashgen.render import render
from flashgen.runtime import BACKWARD_ARGS, FORWARD_ARGS, LOG2E, PREP_ARGS, Kernel
from flashgen.spec import KernelSpec

CODES = {"i64": "q", "int": "i", "float": "f"}  # a parameter whose type ends in * is a pointer: P


def signature(source: str, function: str) -> str:
    """The struct codes of a kernel's parameters, in order."""
    params = re.search(rf"^{function}\((.*?)\)", source, re.M | re.S).group(1)
    params = re.sub(r"//[^\n]*", "", params)
    codes = []
    for param in params.split(","):
        kind = param.rsplit(None, 1)[0]  # drop the name
        codes.append("P" if kind.endswith("*") or "*" in kind else CODES[kind.split()[-1]])
    return "".join(codes)


def expanded(layout: struct.Struct) -> str:
    """'@5P3i' -> 'PPPPPiii'."""
    return "".join(code * int(count or 1) for count, code in re.findall(r"(\d*)([A-Za-z])", layout.format))


def test_forward_layout_matches_the_kernel():
    spec = KernelSpec(64, causal=True)
    assert signature(render(spec), spec.name) == expanded(FORWARD_ARGS)


@pytest.mark.parametrize("kind", ["bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v", "bwd_q"])
def test_backward_layouts_match_the_kernels(kind):
    spec = tuning.tuned_spec(kind, 128, "bf16", False, "sm_90a")
    source = render(spec)
    outputs = 1 if kind == "bwd_q" else len(spec.grads)
    assert signature(source, spec.name) == expanded(BACKWARD_ARGS[outputs])
    if kind != "bwd_q":
        assert signature(source, spec.name + "_prep") == expanded(PREP_ARGS)


class StubDriver:
    """Records cuLaunchKernel's arguments; every call succeeds."""

    def __init__(self):
        self.launches = []

    def cuCtxGetCurrent(self, ref):
        return 0

    def cuLaunchKernel(self, *args):
        self.launches.append(args)
        return 0


@pytest.fixture
def driver(monkeypatch):
    stub = StubDriver()
    monkeypatch.setattr(runtime, "_driver", lambda: stub)
    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setitem(runtime._contexts, -1, None)  # CPU tensors report device -1; nothing current
    return stub


def test_forward_launch_packs_values_in_signature_order(driver):
    spec = KernelSpec(64, block_m=128, causal=True)
    kernel = Kernel(spec, b"")
    kernel._functions[(-1, "")] = ctypes.c_void_p(0x77)
    # (B, T, H, d) storage seen as (B, H, T, d), like x.view(B, T, H, d).transpose(1, 2); GQA 2:1.
    q = torch.zeros(2, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.zeros(2, 200, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.zeros(2, 2, 200, 64, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    kernel.forward(-1, q, k, v, o, lse, 0.125)

    (function, gx, gy, gz, bx, by, bz, smem, stream, params, extra), = driver.launches
    assert function.value == 0x77 and (gx, gy, gz) == (3, 4, 2) and (bx, by, bz) == (spec.num_threads, 1, 1)
    assert smem == spec.smem_bytes and stream.value == 0xABC0 and params is None
    buffer, size = runtime._launch_slot()[:2]
    assert size.value == FORWARD_ARGS.size and extra[1] == ctypes.addressof(buffer)
    values = FORWARD_ARGS.unpack_from(buffer)
    assert values[:5] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
    assert values[5:8] == (300, 200, 2)
    assert values[8:20] == (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    assert values[20] == pytest.approx(0.125 * LOG2E)


def test_forward_without_lse_passes_a_null_pointer(driver):
    kernel = Kernel(KernelSpec(64), b"")
    kernel._functions[(-1, "")] = ctypes.c_void_p(0x77)
    q = torch.zeros(1, 1, 17, 64, dtype=torch.bfloat16)
    kernel.forward(-1, q, q, q, torch.empty_like(q), None, 1.0)
    assert FORWARD_ARGS.unpack_from(runtime._launch_slot()[0])[4] == 0


def test_a_failed_launch_raises_with_the_kernel_name(driver, monkeypatch):
    kernel = Kernel(KernelSpec(64), b"")
    kernel._functions[(-1, "")] = ctypes.c_void_p(0x77)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: 1, raising=False)

    def error_name(result, ref):
        ref._obj.value = b"CUDA_ERROR_INVALID_VALUE"  # ref is ctypes.byref(c_char_p)
        return 0

    driver.cuGetErrorName = error_name
    q = torch.zeros(1, 1, 17, 64, dtype=torch.bfloat16)
    with pytest.raises(runtime.CudaError, match=f"launching {kernel.spec.name} failed: CUDA_ERROR_INVALID_VALUE"):
        kernel.forward(-1, q, q, q, torch.empty_like(q), None, 1.0)



@pytest.mark.parametrize("head_dim", [32, 40, 64, 96, 128, 256])
def test_prep_launch_covers_every_padded_row(driver, head_dim):
    spec = tuning.tuned_spec("bwd_kvq" if head_dim <= 128 else "bwd_kq", head_dim, "bf16", False, "sm_90a")
    lanes = int(re.search(r"constexpr int PREP_LANES = (\d+);", render(spec)).group(1))
    kernel = Kernel(spec, b"")
    kernel._functions[(-1, "_prep")] = ctypes.c_void_p(0x78)
    o = torch.zeros(2, 3, 100, head_dim, dtype=torch.bfloat16)
    delta = torch.zeros(2, 3, 128)
    kernel.backward_prep(o, o, torch.zeros(2, 3, 100), delta, torch.zeros_like(delta))
    (function, gx, gy, gz, block, *_), = driver.launches
    assert function.value == 0x78 and block == 128 and (gy, gz) == (3, 2)
    assert gx * (128 // lanes) == 128  # the template's rows per block times the grid: every padded row
