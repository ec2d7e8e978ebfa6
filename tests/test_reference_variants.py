"""The oracle's attention variants (window, softcap, ALiBi, score_mod, mask_mod) against attention
written out one query and one key at a time in float64, and the built-ins against the same rules
written as user modifiers."""

import math

import pytest
import torch

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
