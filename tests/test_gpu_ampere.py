"""GPU tier: the Ampere/Ada (sm_80) family runs too, on this Hopper GPU.

On sm_90a every tuned backward kernel takes the wgmma branch and adds dQ with vector reductions,
so the mma.sync backward and the atomicAdd reduction of sm_80 never run in the other GPU tests.
An sm_80 cubin does not load on sm_90 (CUDA binaries are compatible within a major version only),
so here the sm_80 kernels are compiled to PTX for compute_80, which the driver compiles for this
GPU when it loads it, and registered as the kernels the sm_80 tables pick.
"""

import pytest
import torch
from test_gpu_backward import check_gradients, make_qkv

import flashgen
from flashgen import kernels, plans, tuning
from flashgen.compile import compile_ptx
from flashgen.kernels import Kernel
from flashgen.render import render

pytestmark = pytest.mark.gpu

HEAD_DIMS = (40, 64, 128)


@pytest.fixture(scope="module", autouse=True)
def ampere():
    plans.clear()
    kernels.clear()
    plans._arch[0] = "sm_80"  # what the tables pick for: the device's target, as on an A100
    specs = tuning.shipped_specs("sm_80", head_dims=HEAD_DIMS)
    for spec in specs:
        kernels.register(Kernel(spec, compile_ptx(spec, render(spec))))
    yield specs
    plans.clear()
    kernels.clear()


def test_the_sm80_kernels_run(ampere):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16)
    flashgen.attention(q, k, v, causal=True)
    plan = plans.forward(0, 64, torch.bfloat16, True, 64, "")
    assert [kernel.spec.arch for kernel in plan.kernels] == ["sm_80"]
    assert all(spec.arch == "sm_80" and not spec.family.context(spec)["wgmma"] for spec in ampere)
    assert "atomicAdd" in render(tuning.tuned_spec("bwd_kvq", 64, "bf16", False, "sm_80"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward(head_dim, causal):
    from test_gpu_forward import check_against_reference

    for seqlen_q, seqlen_k in [(1000, 1000), (113, 300), (17, 17)]:
        q, k, v = make_qkv(2, 4, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=head_dim + seqlen_q)
        out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
        check_against_reference(q, k, v, causal, out, lse)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_backward(head_dim, causal, deterministic):
    for seqlen_q, seqlen_k in [(1000, 1000), (300, 113)]:
        q, k, v = make_qkv(2, 4, 2, seqlen_q, seqlen_k, head_dim, torch.float16, seed=head_dim + seqlen_q)
        check_gradients(q, k, v, causal, deterministic)
