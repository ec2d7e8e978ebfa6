"""GPU tier: attention sinks (learnable_sink) through every entry point against the fp32 oracle, by
the numerics rule (output c = 2, gradients c = 3; the sink's gradient by the same rule), with
causal, a window, GQA, short and long queries (the mma.sync and the Hopper forward), packed
sequences, and a KV cache split across blocks (the sink counted once, in the merge)."""

import pytest
import torch
from conftest import check_by_the_numerics_rule

import flashgen
from flashgen import reference

pytestmark = pytest.mark.gpu

SINK = [2.0, -1.0, 0.5, 4.0, -3.0, 1.0, 0.0, 6.0]  # per query head: some above the scores, some far below


def sink_for(heads):
    return torch.tensor(SINK[:heads], device="cuda")


def grads(fn, tensors, d_o):
    """(out, then each tensor's gradient) of fn over fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(d_o)
    return [out.detach(), *(t.grad for t in leaves)]


def rule(ours, exact, low, low_lse, d_o, sink):
    """The numerics rule; the sink's gradient held to it too, against its low-precision value by
    FlashAttention's formula, -sum_i exp(sink - lse_i) (dO_i . O_i), from the low-precision oracle's
    output and lse. (Not against the low oracle's autograd: that never reads the output rounded to
    bf16, whose rounding the formula sums over every row. At a sink far above the scores that noise
    is most of the error: d = 128, 2 x 1000 rows, sink 6.0 gives 0.004-0.015 in an fp64 emulation.)"""
    check_by_the_numerics_rule(ours[:4], exact[:4], low[:4], ours[0].dtype)
    delta = (d_o.float() * low[0].float()).sum(-1)
    if low_lse.dim() == 2:  # packed: o (total, heads, d), lse (heads, total)
        low_sink = -(torch.exp(sink[:, None] - low_lse) * delta.t()).sum(1)
    else:
        low_sink = -(torch.exp(sink[None, :, None] - low_lse) * delta).sum((0, 2))
    err = (ours[4] - exact[4]).abs().max().item()
    assert err <= 3 * (low_sink - exact[4]).abs().max().item() + 1e-4, ("sink gradient", err)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seqlen", [48, 1000])  # 64 query rows or fewer (mma.sync), and more (the Hopper forward)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("keywords", [dict(causal=True), dict(causal=True, window_size=(128, 0)), dict(causal=False)],
                         ids=["causal", "window", "full"])
def test_attention_with_sinks_forward_and_backward(keywords, head_dim, seqlen, deterministic):
    gen = torch.Generator(device="cuda").manual_seed(head_dim + seqlen)
    q = torch.randn(2, 8, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    sink = sink_for(8)
    ours = grads(lambda q, k, v, s: flashgen.attention(q, k, v, learnable_sink=s, deterministic=deterministic, **keywords),
                 (q, k, v, sink), d_o)
    exact, low = (grads(lambda q, k, v, s: reference.naive_attention(q, k, v, learnable_sink=s, upcast=up, **keywords),
                        (q, k, v, sink), d_o) for up in (True, False))
    _, low_lse = reference.naive_attention(q, k, v, learnable_sink=sink, upcast=False, return_lse=True, **keywords)
    rule(ours, exact, low, low_lse, d_o, sink)
    plain = flashgen.attention(q, k, v, **keywords)
    assert (plain.float() - ours[0].float()).abs().max() > 0.05  # (the sinks matter at these values)


def test_the_lse_holds_the_sink_and_a_row_that_sees_no_key_gets_zero():
    q = torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
    sink = sink_for(4)
    out, lse = flashgen.attention(q, k, k, causal=True, learnable_sink=sink, return_lse=True)  # rows 0..99 see no key
    assert torch.equal(out[:, :, :100], torch.zeros_like(out[:, :, :100]))
    torch.testing.assert_close(lse[:, :, :100], sink.view(1, 4, 1).expand(1, 4, 100))
    _, want = reference.naive_attention(q, k, k, causal=True, learnable_sink=sink, return_lse=True)
    torch.testing.assert_close(lse, want, rtol=1e-3, atol=2e-2)


@pytest.mark.parametrize("lengths", [(10, 64, 33), (30, 700, 257)])
def test_varlen_with_sinks_forward_and_backward(lengths):
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(lengths)
    q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    sink = sink_for(8)
    ours = grads(lambda q, k, v, s: flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, learnable_sink=s),
                 (q, k, v, sink), d_o)
    exact, low = (grads(lambda q, k, v, s: reference.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True,
                                                                      learnable_sink=s, upcast=up), (q, k, v, sink), d_o)
                  for up in (True, False))
    _, low_lse = reference.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, learnable_sink=sink, upcast=False,
                                            return_lse=True)
    rule(ours, exact, low, low_lse, d_o, sink)


@pytest.mark.parametrize("num_splits", [1, 0, 7])  # one block a sequence, the shapes' choice, and seven
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 40])
def test_kvcache_with_sinks_counts_the_sink_once_across_splits(seqlen_q, paged, num_splits):
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q + num_splits)
    q = torch.randn(2, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    new = [torch.randn(2, seqlen_q, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    if paged:
        caches = [torch.randn(64, 64, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]
        table = torch.randperm(64, device="cuda", dtype=torch.int32)[:60].view(2, 30)
    else:
        caches = [torch.randn(2, 2048, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]
        table = None
    lengths = torch.tensor([300, 1500], dtype=torch.int32, device="cuda")
    sink = sink_for(8)
    outs = []
    for fn in (flashgen.attention_with_kvcache, reference.attention_with_kvcache,
               lambda *a, **kw: reference.attention_with_kvcache(*a, **kw, upcast=False)):
        extra = {"num_splits": num_splits} if fn is flashgen.attention_with_kvcache else {}
        outs.append(fn(q, *(c.clone() for c in caches), *new, cache_seqlens=lengths, block_table=table, causal=True,
                       learnable_sink=sink, return_softmax_lse=True, **extra))
    (o, lse), (o_ref, lse_ref), (o_low, _) = outs
    check_by_the_numerics_rule([o], [o_ref], [o_low], torch.bfloat16)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=2e-2)


def test_a_sink_through_torch_compile():
    q = torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = sink_for(4).requires_grad_()
    compiled = torch.compile(lambda q, s: flashgen.attention(q, q, q, causal=True, learnable_sink=s), fullgraph=True)
    out = compiled(q, sink)
    out.sum().backward()
    want = flashgen.attention(q.detach(), q.detach(), q.detach(), causal=True, learnable_sink=sink.detach())
    torch.testing.assert_close(out.detach(), want)
    assert sink.grad is not None and sink.grad.isfinite().all()
