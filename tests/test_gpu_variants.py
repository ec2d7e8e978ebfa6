"""GPU tier: the attention variants (sliding window, softcap, ALiBi) forward and backward against the
fp32 oracle, by the numerics rule: max|x - ref| <= c * max|x_lp - ref| + 1e-5, x_lp the same
computation in the inputs' dtype (c = 2 for the output, 3 for gradients)."""

import pytest
import torch
from conftest import check_by_the_numerics_rule, outputs_and_grads

import flashgen
from flashgen import tuning
from flashgen.plans import device_arch
from flashgen.reference import naive_attention

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def slopes_for(batch, heads, per_batch=False):
    """ALiBi's geometric slopes (2^(-8 i / heads)), varied per batch when asked."""
    base = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    return torch.stack([base * (1 + 0.5 * b) for b in range(batch)]) if per_batch else base


def run_both(q, k, v, causal, variant, deterministic=False, grad=True):
    """(ours, exact, low-precision): each (out, dq, dk, dv), or (out,) without grad."""
    ours = outputs_and_grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, deterministic=deterministic, **variant),
                             q, k, v, grad)
    exact = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, **variant), q, k, v, grad)
    low = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, upcast=False, **variant), q, k, v, grad)
    return ours, exact, low


def check(q, k, v, causal, variant, deterministic=False, grad=True):
    ours, exact, low = run_both(q, k, v, causal, variant, deterministic, grad)
    check_by_the_numerics_rule(ours, exact, low, q.dtype)
    return ours


VARIANTS = {
    "window": dict(window_size=(100, 37)),
    "window_left": dict(window_size=(300, -1)),
    "window_right": dict(window_size=(-1, 5)),
    "window_zero": dict(window_size=(0, 0)),
    "softcap": dict(softcap=5.0),
    "softcap_loose": dict(softcap=50.0),
    "window_softcap": dict(window_size=(128, 0), softcap=30.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_variant_matches_reference(head_dim, name, causal, dtype):
    q, k, v = make_qkv(2, 4, 2, 555, 555, head_dim, DTYPES[dtype], seed=head_dim)
    check(q, k, v, causal, VARIANTS[name])


@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_alibi_matches_reference(head_dim, causal, per_batch):
    q, k, v = make_qkv(2, 4, 4, 300, 300, head_dim, torch.bfloat16, seed=7)
    check(q, k, v, causal, dict(alibi_slopes=slopes_for(2, 4, per_batch)))


@pytest.mark.parametrize("seqlen_q, seqlen_k, dtype", [(1000, 2100, "bf16"), (2100, 1000, "fp16"), (40, 1500, "bf16")])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_alibi_alone_for_different_lengths(head_dim, causal, seqlen_q, seqlen_k, dtype):
    """The forwards split ALiBi's distance where a warp's rows see a whole key tile on one side of
    their diagonal: tiles left and right of it, and the ones across it, with Tq != Tk (diagonal not
    at 0), the Hopper forward and the mma.sync one (40 queries), GQA 2:1."""
    q, k, v = make_qkv(2, 4, 2, seqlen_q, seqlen_k, head_dim, DTYPES[dtype], seed=seqlen_q + head_dim)
    check(q, k, v, causal, dict(alibi_slopes=slopes_for(2, 4, per_batch=True)))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 700), (129, 700), (700, 129), (17, 17), (1000, 1023)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_everything_together_for_different_lengths(seqlen_q, seqlen_k, causal):
    """Tq != Tk aligns the window bottom-right, like causal; GQA 4:1; every variant at once."""
    q, k, v = make_qkv(2, 8, 2, seqlen_q, seqlen_k, 96, torch.float16, seed=seqlen_q)
    variant = dict(window_size=(200, 64), softcap=20.0, alibi_slopes=slopes_for(2, 8, per_batch=True))
    check(q, k, v, causal, variant)


@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
def test_every_head_dim(head_dim):
    q, k, v = make_qkv(1, 2, 1, 300, 333, head_dim, torch.bfloat16, seed=head_dim)
    check(q, k, v, True, dict(window_size=(96, -1), softcap=30.0, alibi_slopes=slopes_for(1, 2)))


def test_deterministic_gradients_are_bitwise_reproducible_and_exact():
    q, k, v = make_qkv(2, 4, 2, 400, 400, 128, torch.bfloat16, seed=3)
    variant = dict(window_size=(64, 64), softcap=10.0, alibi_slopes=slopes_for(2, 4))
    first = check(q, k, v, False, variant, deterministic=True)
    again, _, _ = run_both(q, k, v, False, variant, deterministic=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_a_row_whose_window_holds_no_key_is_zero_with_lse_minus_inf():
    """Tq > Tk with a left bound of 0: the first Tq - Tk rows sit before every key."""
    q, k, v = make_qkv(1, 1, 1, 64, 16, 64, torch.bfloat16)
    out, lse = flashgen.attention(q, k, v, window_size=(0, 0), return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, window_size=(0, 0), return_lse=True)
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and lse.isinf().any()
    assert (out[..., :48, :] == 0).all()
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_window_sides_of_at_least_seqlen_k_are_unbounded():
    """flash_attn_func's rule, with more queries than keys plus one (where it shows): right = Tk is
    no bound, so the first rows see keys; the kernel and the oracle agree, gradients too."""
    q, k, v = make_qkv(1, 2, 2, 150, 40, 64, torch.bfloat16)
    check(q, k, v, False, dict(window_size=(20, 40)))
    assert naive_attention(q, k, v, window_size=(20, 39), return_lse=True)[1].isinf().any()  # right = 39 bounds: the first rows are empty
    assert naive_attention(q, k, v, window_size=(20, 40), return_lse=True)[1].isfinite().all()  # right = 40 does not


def test_softcap_lse_is_of_the_capped_scores():
    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, torch.bfloat16)
    q = q * 4  # large scores, where the cap matters
    _, lse = flashgen.attention(q, k, v, softcap=3.0, return_lse=True)
    _, ref_lse = naive_attention(q, k, v, softcap=3.0, return_lse=True)
    assert (lse - ref_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("seqlen_q", (16, 555), ids=("short_query", "long_query"))  # the mma.sync and Hopper forwards
@pytest.mark.parametrize("softcap", (30.0, 50.0))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_at_saturation(causal, softcap, seqlen_q):
    """Rows whose logits all sit at +softcap, rows at -softcap, and, causal with Tq > Tk, rows that
    see no key, around Gemma 2's cap. The scores saturate tanh outright, so its approximation error
    (2^-11 relative, times the cap) moves every logit of a row alike; the lse carries it, hence its
    tolerance."""
    gen = torch.Generator(device="cuda").manual_seed(int(softcap) + seqlen_q)
    head_dim, seqlen_k = 128, 300 if seqlen_q > 16 else 700
    u = torch.randn(head_dim, device="cuda", generator=gen)
    k = u + 0.3 * torch.randn(2, 2, seqlen_k, head_dim, device="cuda", generator=gen)
    sign = torch.where(torch.arange(seqlen_q, device="cuda") % 2 == 0, 1.0, -1.0)[:, None]
    q = 60 * sign * u + 0.3 * torch.randn(2, 4, seqlen_q, head_dim, device="cuda", generator=gen)  # |s * scale| > 9 softcap
    v = torch.randn(2, 2, seqlen_k, head_dim, device="cuda", generator=gen)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    variant = dict(softcap=softcap)
    _, ref_lse = naive_attention(q, k, v, causal=causal, **variant, return_lse=True)
    seen = ref_lse.isfinite()
    assert ref_lse[..., 0::2][seen[..., 0::2]].min() > softcap - 1 and ref_lse[..., 1::2][seen[..., 1::2]].max() < -softcap + 8
    check(q, k, v, causal, variant, grad=False)
    _, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True, **variant)
    assert not lse.isnan().any() and torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < softcap * 2**-11 + 1e-3


def test_variant_kernels_are_the_tables_tiles_with_the_variant_set():
    from flashgen import plans

    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    flashgen.attention(q, k, v, causal=True, window_size=(32, -1), softcap=5.0)
    spec = plans.forward(0, 64, torch.bfloat16, True, 256, "", ("window", "softcap")).kernels[0].spec
    assert spec.variants == ("window", "softcap") and spec.causal
    plain = tuning.forward_spec(64, "bf16", True, device_arch(0), 256, variant=("window", "softcap"))
    assert spec == plain


def test_cuda_graph_replays_a_new_window_and_cap():
    """Window bounds and the cap are kernel arguments: a captured call replays with the values it
    was captured with, and a new call with new values needs no new kernel."""
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    flashgen.attention(q, k, v, window_size=(16, 16), softcap=4.0)  # compile and warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashgen.attention(q, k, v, window_size=(16, 16), softcap=4.0)
    graph.replay()
    torch.cuda.synchronize()
    ref = naive_attention(q, k, v, window_size=(16, 16), softcap=4.0)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    other = flashgen.attention(q, k, v, window_size=(40, 3), softcap=9.0)
    ref = naive_attention(q, k, v, window_size=(40, 3), softcap=9.0)
    assert (other.float() - ref.float()).abs().max().item() < 2e-2


def test_torch_compile_fullgraph_with_variants():
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.bfloat16)
    slopes = slopes_for(1, 4)

    @torch.compile(fullgraph=True)
    def block(q, k, v):
        return flashgen.attention(q, k, v, causal=True, window_size=(64, -1), softcap=8.0, alibi_slopes=slopes)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = block(*leaves)
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flashgen.attention(*eager, causal=True, window_size=(64, -1), softcap=8.0, alibi_slopes=slopes)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad)


# ---- the Hopper forward (sm_90a): what the tables pick for variant calls of long queries ----------

def hopper_only():
    if device_arch(0) != "sm_90a":
        pytest.skip("the Hopper forward needs sm_90a")


@pytest.mark.parametrize("fields", [("window",), ("softcap",), ("alibi",), ("window", "softcap", "alibi")], ids="+".join)
@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
def test_variant_calls_run_the_hopper_forward(head_dim, fields):
    hopper_only()
    from flashgen import plans

    q, k, v = make_qkv(2, 4, 2, 1000, 1000, head_dim, torch.bfloat16, seed=head_dim)
    values = {"window": dict(window_size=(200, 17)), "softcap": dict(softcap=15.0), "alibi": dict(alibi_slopes=slopes_for(2, 4, True))}
    variant = {key: value for field in fields for key, value in values[field].items()}
    check(q, k, v, True, variant)
    spec = plans.forward(0, head_dim, torch.bfloat16, True, 1000, "", fields).kernels[0].spec
    assert spec.kind == "fwd_sm90" and spec.variants == fields


def check_forward(q, k, v, causal, variant, spec):
    """The numerics rule for the forward through the kernel `spec` (lse too)."""
    from flashgen.api import call

    out, lse = call(q, k, v, causal, None, True, False, spec=spec, **variant)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, **variant, return_lse=True)
    low = naive_attention(q, k, v, causal=causal, upcast=False, **variant)
    assert not out.isnan().any()
    err, bound = (out.float() - ref.float()).abs().max().item(), 2 * (low.float() - ref.float()).abs().max().item() + 1e-5
    assert err <= bound, f"{spec.name}: max error {err:.3e} > bound {bound:.3e}"
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ref_lse.isfinite()
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-2


WINDOWS = {
    "causal_window": (True, dict(window_size=(700, 0))),  # skips tiles before the window: ~1/3 of a causal row
    "both_ends": (False, dict(window_size=(333, 129))),  # skips tiles at both ends
    "left_only": (False, dict(window_size=(500, -1))),  # shortest rows at the end (the persistent order flips)
    "right_only": (False, dict(window_size=(-1, 64))),
    "everything": (True, dict(window_size=(640, 0), softcap=10.0)),
}


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
@pytest.mark.parametrize("name", WINDOWS)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_hopper_forward_windows_over_long_sequences(head_dim, name, persistent):
    """Windows that skip key tiles at one end or both, Tq != Tk (bottom-right aligned), one tile per
    CTA and the persistent schedule (which walks from the end whose rows see more tiles)."""
    hopper_only()
    causal, variant = WINDOWS[name]
    if name == "everything":
        variant = {**variant, "alibi_slopes": slopes_for(2, 4, True)}
    fields = tuple(f for f, key in (("window", "window_size"), ("softcap", "softcap"), ("alibi", "alibi_slopes")) if key in variant)
    spec = tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", 4096, variant=fields).replace(persistent=persistent)
    for seqlen_q, seqlen_k in ((2000, 2000), (1500, 2100), (2100, 1300)):
        q, k, v = make_qkv(2, 4, 1, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=seqlen_q + head_dim)
        check_forward(q, k, v, causal, variant, spec)


def test_hopper_rows_whose_window_holds_no_key():
    """Tq > Tk with a window of (0, 0): the first Tq - Tk rows see nothing (o = 0, lse = -inf), and
    whole query tiles visit no key tile at all."""
    hopper_only()
    q, k, v = make_qkv(1, 2, 2, 700, 200, 128, torch.bfloat16)
    for persistent in (False, True):
        spec = tuning.forward_spec(128, "bf16", False, "sm_90a", 4096, variant=("window",)).replace(persistent=persistent)
        check_forward(q, k, v, False, dict(window_size=(0, 0)), spec)
