"""GPU tier: V with a head dim of its own (d_v != d, DeepSeek's 192 / 128) through attention and
attention_varlen, forward and backward, against the fp32 oracle by the numerics rule (output c = 2,
gradients c = 3): short queries (the mma.sync forward) and long ones (the Hopper forward), causal
and not, GQA, both backward modes, and the kernels the tables pick on the device."""

import pytest
import torch
from conftest import check_by_the_numerics_rule

import flashgen
from flashgen import reference

pytestmark = pytest.mark.gpu

DIMS = [(192, 128), (128, 64), (64, 128)]  # (d, d_v): DeepSeek's, and V narrower / wider than q


def grads(fn, tensors, d_o):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(d_o)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seqlen", [48, 1000])  # 64 query rows or fewer (mma.sync), and more (the Hopper forward)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", DIMS, ids=[f"d{d}_v{dv}" for d, dv in DIMS])
def test_attention_with_a_head_dim_of_its_own_for_v(dims, causal, seqlen, deterministic):
    head_dim, head_dim_v = dims
    gen = torch.Generator(device="cuda").manual_seed(head_dim + head_dim_v + seqlen)
    q = torch.randn(2, 8, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 2, seqlen + 37, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 2, seqlen + 37, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
    d_o = torch.randn(2, 8, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
    ours = grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, deterministic=deterministic), (q, k, v), d_o)
    assert ours[0].shape == (2, 8, seqlen, head_dim_v) and ours[3].shape == v.shape
    exact, low = (grads(lambda q, k, v: reference.naive_attention(q, k, v, causal=causal, upcast=up), (q, k, v), d_o)
                  for up in (True, False))
    check_by_the_numerics_rule(ours, exact, low, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_with_a_head_dim_of_its_own_for_v(dtype):
    lengths = (30, 700, 257)
    gen = torch.Generator(device="cuda").manual_seed(7)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(lengths)
    q = torch.randn(total, 8, 192, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, 4, 192, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, 4, 128, device="cuda", dtype=dtype, generator=gen)
    d_o = torch.randn(total, 8, 128, device="cuda", dtype=dtype, generator=gen)
    ours = grads(lambda q, k, v: flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True), (q, k, v), d_o)
    exact, low = (grads(lambda q, k, v: reference.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, upcast=up),
                        (q, k, v), d_o) for up in (True, False))
    check_by_the_numerics_rule(ours, exact, low, dtype)


def test_the_lse_and_a_window_with_a_head_dim_of_its_own_for_v():
    q = torch.randn(1, 4, 600, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 600, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 4, 600, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flashgen.attention(q, k, v, causal=True, window_size=(128, 0), return_lse=True)
    want, want_lse = reference.naive_attention(q, k, v, causal=True, window_size=(128, 0), return_lse=True)
    low = reference.naive_attention(q, k, v, causal=True, window_size=(128, 0), upcast=False)
    check_by_the_numerics_rule([out], [want], [low], torch.bfloat16)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=2e-2)
