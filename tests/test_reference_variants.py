"""The oracle's attention variants (window, softcap, ALiBi, score_mod, mask_mod) against attention
written out one query and one key at a time in float64, and the built-ins against the same rules
written as user modifiers."""

import math

import pytest
import torch

import flashgen
from flashgen import reference, variants

from flashgen.reference import naive_attention


def by_hand(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None, score_mod=None, mask_mod=None):
    batch, heads, seqlen_q, _ = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kh = h // (heads // kv_heads)
            for i in range(seqlen_q):
                shifted = i + seqlen_k - seqlen_q
                scores, keys = [], []
                for j in range(seqlen_k):
                    s = float((q[b, h, i].double() * k[b, kh, j].double()).sum()) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = float(slopes[h] if slopes.dim() == 1 else slopes[b, h])
                        s -= slope * abs(shifted - j)
                    if score_mod is not None:
                        s = float(score_mod(torch.tensor(s), b, h, i, j))
                    left, right = window
                    right = 0 if causal else right
                    hidden = (left >= 0 and j < shifted - left) or (right >= 0 and j > shifted + right)
                    if mask_mod is not None and not bool(mask_mod(b, h, i, j)):
                        hidden = True
                    if not hidden:
                        scores.append(s)
                        keys.append(j)
                if scores:
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    total = sum(weights)
                    lse[b, h, i] = top + math.log(total)
                    for w, j in zip(weights, keys):
                        out[b, h, i] += w / total * v[b, kh, j].double()
    return out, lse


def inputs(batch=2, heads=4, kv_heads=2, seqlen_q=7, seqlen_k=11, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, d, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, d, generator=gen) for _ in range(2))
    return q, k, v


def close(got, want):
    (o, lse), (o_ref, lse_ref) = got, want
    assert torch.equal(lse.isinf(), lse_ref.isinf())
    assert torch.allclose(o.double(), o_ref, atol=1e-5)
    finite = lse_ref.isfinite()
    assert torch.allclose(lse.double()[finite], lse_ref[finite], atol=1e-5)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 11), (11, 7), (1, 9)])
@pytest.mark.parametrize("case", [
    dict(window=(3, -1)), dict(window=(2, 1)), dict(window=(-1, 0)), dict(window=(0, 0)), dict(window=(4, 2), causal=True),
    dict(softcap=2.0), dict(slopes=SLOPES), dict(slopes=SLOPES.repeat(2, 1) * torch.tensor([[1.0], [2.0]])),
    dict(softcap=1.5, window=(3, 0), causal=True),
    dict(score_mod=lambda s, b, h, i, j: s + 0.1 * (h + 1) * ((i - j) % 3)),
    dict(mask_mod=lambda b, h, i, j: (i + j + b) % 3 != 0),
], ids=lambda case: ",".join(case))
def test_variants_match_attention_written_out(case, seqlen_q, seqlen_k):
    q, k, v = inputs(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    scale = 0.3
    got = naive_attention(q, k, v, causal=case.get("causal", False), scale=scale, window_size=case.get("window", (-1, -1)),
                          softcap=case.get("softcap", 0.0), alibi_slopes=case.get("slopes"),
                          score_mod=case.get("score_mod"), mask_mod=case.get("mask_mod"), return_lse=True)
    close(got, by_hand(q, k, v, scale, **case))


def test_builtins_equal_the_same_rules_as_modifiers():
    q, k, v = inputs(seqlen_q=9, seqlen_k=13)
    shift = 13 - 9
    window = naive_attention(q, k, v, window_size=(3, 0), return_lse=True)
    as_mask = naive_attention(q, k, v, mask_mod=lambda b, h, i, j: (j <= i + shift) & (j >= i + shift - 3), return_lse=True)
    assert torch.allclose(window[0], as_mask[0]) and torch.equal(window[1], as_mask[1])
    alibi = naive_attention(q, k, v, alibi_slopes=SLOPES, return_lse=True)
    as_score = naive_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - SLOPES[h] * (i + shift - j).abs(), return_lse=True)
    assert torch.allclose(alibi[0], as_score[0], atol=1e-6) and torch.allclose(alibi[1], as_score[1], atol=1e-6)


def test_no_variant_is_the_plain_computation():
    q, k, v = inputs()
    plain = naive_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(plain[0], naive_attention(q, k, v, causal=True, window_size=(-1, -1), softcap=0.0))


def test_window_sides_of_at_least_seqlen_k_are_unbounded():
    """flash_attn_func's rule: a side of at least seqlen_k keys is -1. With more queries than keys
    plus one, an unclipped right side would hide every key from the first rows."""
    q, k, v = inputs(seqlen_q=11, seqlen_k=4)
    scale = 8**-0.5
    got = naive_attention(q, k, v, window_size=(2, 4), return_lse=True)
    close(got, by_hand(q, k, v, scale, window=(2, -1)))
    assert by_hand(q, k, v, scale, window=(2, 4))[1].isinf().any() and not got[1].isinf().any()  # the rule shows
    close(naive_attention(q, k, v, window_size=(4, 3), return_lse=True), by_hand(q, k, v, scale, window=(-1, 3)))


def test_the_api_runs_a_window_of_only_such_sides_as_no_window():
    """attention() clips at Tk (flash_attn_func), attention_varlen at max_seqlen_k
    (flash_attn_varlen_func): a window of only such sides is no variant, the plain kernel runs."""
    from flashgen import variants, varlen
    from flashgen.api import call_variant

    q, k = torch.zeros(1, 2, 11, 8), torch.zeros(1, 2, 4, 8)
    assert call_variant(q, k, False, window_size=(4, 9)) == variants.PLAIN
    assert call_variant(q, k, False, window_size=(3, 9)).args == {"window_left": 3, "window_right": -1}
    packed, cu = torch.zeros(11, 2, 8), torch.tensor([0, 11], dtype=torch.int32)
    assert varlen.check_variant(packed, cu, 10, False, (-1, 10), 0.0, None) == variants.PLAIN
    assert varlen.check_variant(packed, cu, 10, False, (-1, 9), 0.0, None).args["window_right"] == 9


def test_the_varlen_oracle_clips_at_max_seqlen_k_not_each_sequence():
    """FlashAttention clips varlen windows at max_seqlen_k: a sequence with fewer keys keeps a right
    side between its own length and max_seqlen_k, so its first rows see no key."""
    from flashgen import reference

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(7, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    cu_q, cu_k = torch.tensor([0, 6, 7], dtype=torch.int32), torch.tensor([0, 2, 12], dtype=torch.int32)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 6, 10, window_size=(-1, 3), return_lse=True)
    first = [t[None].transpose(1, 2) for t in (q[:6], k[:2], v[:2])]
    want_o, want_lse = by_hand(*first, 8**-0.5, window=(-1, 3))
    close((out[:6].transpose(0, 1)[None], lse[:, :6][None]), (want_o, want_lse))
    assert want_lse.isinf().any()  # unclipped at the sequence's own 2 keys


def test_a_prebuilt_window_kernel_runs_a_window_clipped_away_at_tk(monkeypatch):
    """A Mistral-style kernel built with a window, called with window_size=(4096, 0) on 1000 keys:
    the window bounds nothing there (FlashAttention's rule) and the kernel runs it unbounded, where
    it used to refuse the call as one without a window. Other variant mismatches still raise."""
    from flashgen import api, ops
    from flashgen.spec import KernelSpec

    ran = []
    monkeypatch.setattr(api, "check_inputs", lambda *args: None)
    monkeypatch.setattr(ops, "attention", lambda *args, variant, **kw: ran.append(variant) or (None, None))
    spec = KernelSpec(head_dim=8, block_m=64, block_n=64, causal=True, variants=("window",))
    q, k = torch.zeros(1, 2, 1000, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 1000, 8, dtype=torch.bfloat16)
    api.call(q, k, k, True, None, False, False, spec, window_size=(4096, 0))
    api.call(q, k, k, True, None, False, False, spec, window_size=(999, 0))
    assert ran[0][:2] == (-1, 0) and ran[1][:2] == (999, 0)
    full = spec.replace(causal=False)
    api.call(q, k, k, False, None, False, False, full, window_size=(2000, 1000))
    assert ran[2][:2] == (-1, -1)
    with pytest.raises(ValueError, match="built for variants"):
        api.call(q, k, k, True, None, False, False, spec)  # no window asked for at all
    with pytest.raises(ValueError, match="built for variants"):
        api.call(q, k, k, True, None, False, False, spec.replace(variants=()), window_size=(999, 0))


# ---- attention sinks ------------------------------------------------------------------------------


def by_hand_with_sink(q, k, v, sink, causal):
    """softmax over the row's scores and the head's sink, the sink's column dropped (gpt-oss' eager)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        scores = scores.masked_fill(~seen, -math.inf)
    full = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return full.softmax(-1)[..., :-1] @ v, full.logsumexp(-1)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_joins_each_row_s_denominator_and_gets_its_gradient(causal):
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    sink = torch.tensor([2.0, -1.0, 0.0, 5.0], requires_grad=True)
    out, lse = naive_attention(q, k, v, causal=causal, learnable_sink=sink, return_lse=True)
    want, want_lse = by_hand_with_sink(q, k, v, sink.detach(), causal)
    torch.testing.assert_close((out, lse), (want, want_lse), rtol=1e-5, atol=1e-5)
    d_o = torch.randn(out.shape, generator=gen)
    out.backward(d_o)
    # the kernels' path: d sink = -sum_i exp(sink - lse_i) (dO_i . O_i), per batch and head, summed
    delta = (d_o * out.detach()).sum(-1)  # (the prep's)
    formula = variants.GRADIENTS["learnable_sink"](sink.detach().expand(2, 4), delta, lse.detach(), None)
    torch.testing.assert_close(formula.sum(0), sink.grad, rtol=1e-5, atol=1e-6)
    assert (lse >= sink.detach().view(1, -1, 1)).all()  # lse holds the sink


def test_a_row_that_sees_no_key_gives_zero_and_the_sink_as_its_lse():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    sink = torch.tensor([1.5, -2.0])
    out, lse = naive_attention(q, k, k, learnable_sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink.view(1, 2, 1).expand(1, 2, 3))


def test_the_sink_gradient_of_packed_sequences_is_per_sequence_and_head():
    """attention_varlen's path: rows of each sequence add into that sequence's (batch, head) entry;
    rows past the last sequence (no kernel writes them) add nothing."""
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(9, 4, 8, generator=gen) for _ in range(3))  # (one row past the sequences)
    sink = torch.tensor([0.5, 1.0, -1.0, 2.0], requires_grad=True)
    out, lse = reference.attention_varlen(q[:8], k[:8], v[:8], cu, cu, 5, 5, causal=True, learnable_sink=sink, return_lse=True)
    d_o = torch.randn(out.shape, generator=gen)
    out.backward(d_o)
    nan = torch.full((1, 4, 8), math.nan)  # (what an unwritten row may hold)
    delta = (torch.cat([d_o, torch.zeros(1, 4, 8)]) * torch.cat([out.detach(), nan])).sum(-1).t()  # (heads, total_q)
    per_sequence = variants.GRADIENTS["learnable_sink"](
        sink.detach().expand(3, 4), delta, torch.cat([lse.detach(), torch.full((4, 1), math.nan)], dim=1), cu)
    assert per_sequence.shape == (3, 4) and torch.equal(per_sequence[1], torch.zeros(4))  # the empty sequence
    torch.testing.assert_close(per_sequence.sum(0), sink.grad, rtol=1e-5, atol=1e-6)


def test_a_split_cache_counts_the_sink_once():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 8, generator=gen)
    caches = [torch.randn(2, 64, 2, 8, generator=gen) for _ in range(2)]
    sink = torch.tensor([1.0, 3.0, -2.0, 0.0])
    whole, split = (reference.attention_with_kvcache(q, *(c.clone() for c in caches), cache_seqlens=40, causal=True,
                                                     learnable_sink=sink, num_splits=n, return_softmax_lse=True) for n in (1, 5))
    torch.testing.assert_close(whole, split, rtol=1e-5, atol=1e-5)
    plain = reference.attention_with_kvcache(q, *(c.clone() for c in caches), cache_seqlens=40, causal=True,
                                             return_softmax_lse=True)
    torch.testing.assert_close(whole[1], torch.logaddexp(plain[1], sink.view(1, 4, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink, error, message", [
    ([1.0] * 4, TypeError, "learnable_sink must be a torch.Tensor, got list"),
    (torch.ones(4, dtype=torch.bfloat16), TypeError, "learnable_sink has dtype torch.bfloat16; it must be torch.float32"),
    (torch.ones(2), ValueError, r"learnable_sink has shape \(2,\); it must be \(4,\): one logit per query head"),
    (torch.ones(2, 4), ValueError, r"learnable_sink has shape \(2, 4\)"),
])
def test_a_bad_sink_is_refused_by_name(sink, error, message):
    from flashgen.api import call_variant

    q, k = torch.zeros(2, 4, 5, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(error, match=message):
        call_variant(q, k, False, learnable_sink=sink)  # (attention()'s check of its variants; its device check comes first)
    with pytest.raises((TypeError, ValueError), match="learnable_sink"):
        naive_attention(q, k, k, learnable_sink=sink)  # (the oracle's own check)


def test_sinks_run_on_the_plain_kernels_tiles_and_leave_the_backward_kernels_alone():
    from flashgen import tuning

    for head_dim, causal in ((64, False), (128, True), (256, False)):
        plain = tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", 4096)
        sink = tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", 4096, variant=("sink",))
        assert sink == plain.replace(variants=("sink",))
        for deterministic in (False, True):
            assert tuning.backward_specs(head_dim, "bf16", causal, "sm_90a", deterministic, variant=("window", "sink")) == \
                tuning.backward_specs(head_dim, "bf16", causal, "sm_90a", deterministic, variant=("window",))
    with pytest.raises(flashgen.SpecError, match="a bwd_kvq kernel does not build sink"):
        flashgen.KernelSpec(head_dim=64, kind="bwd_kvq", block_m=64, block_n=64, variants=("sink",))
