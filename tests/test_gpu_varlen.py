"""GPU tier: attention_varlen against the reference (naive attention per sequence), by
FlashAttention's rule: max|out - ref| <= 2 * max|ref_lp - ref| + 1e-5, factor 3 for gradients."""

import pytest
import torch

from conftest import check_by_the_numerics_rule

import flashgen
from flashgen import tuning
from flashgen.reference import attention_varlen as reference_varlen

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (32, 64, 80, 128, 256)
# (query lengths, key lengths): odd sizes, an empty sequence, q != k (both ways), one token
BATCHES = [
    ([1, 17, 113, 0, 1023, 128], [1, 17, 113, 0, 1023, 128]),
    ([1, 17, 113, 0, 1023, 128], [64, 5, 300, 7, 1000, 129]),
    ([200, 1, 0, 65], [3, 700, 9, 0]),
]


@pytest.fixture(scope="module", autouse=True)
def prebuilt(tmp_path_factory):
    """Compile every varlen spec the sweep needs in parallel processes before the tests run."""
    from flashgen.plans import device_arch

    flashgen.build(tuning.shipped_varlen_specs(device_arch(0), HEAD_DIMS), tmp_path_factory.mktemp("prebuilt"), backward=False)


def make_inputs(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def check_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, out, lse, **variant):
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, **variant)
    ref_lp = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, upcast=False, **variant)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert not out.isnan().any(), "NaN in output"
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    bound = 2 * ((ref_lp.float() - ref.float()).abs().max().item() if out.numel() else 0.0) + 1e-5
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), "rows with no visible key differ"
    finite = ref_lse.isfinite()
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-3
    assert (out.transpose(0, 1)[ref_lse.isneginf()] == 0).all(), "a row that sees no key is not 0"


def grads(fn, q, k, v, d_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(d_o)
    return out, q.grad, k.grad, v.grad


def check_gradients(q, k, v, cu_q, cu_k, max_q, max_k, causal, deterministic=False, **variant):
    d_o = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator(device="cuda").manual_seed(20261202))
    args = (cu_q, cu_k, max_q, max_k)
    ours = grads(lambda q, k, v: flashgen.attention_varlen(q, k, v, *args, causal=causal, deterministic=deterministic, **variant),
                 q, k, v, d_o)
    ref = grads(lambda q, k, v: reference_varlen(q, k, v, *args, causal=causal, **variant), q, k, v, d_o)
    low = grads(lambda q, k, v: reference_varlen(q, k, v, *args, causal=causal, upcast=False, **variant), q, k, v, d_o)
    for name, mine, exact, lowp in zip(("out", "dq", "dk", "dv"), ours, ref, low):
        assert mine.shape == exact.shape and mine.dtype == q.dtype, name
        assert not mine.isnan().any(), f"NaN in {name}"
        err = (mine.float() - exact.float()).abs().max().item()
        bound = (2 if name == "out" else 3) * (lowp.float() - exact.float()).abs().max().item() + 1e-5
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
    return ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", range(len(BATCHES)))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_matches_reference(head_dim, batch, causal, dtype):
    inputs = make_inputs(*BATCHES[batch], 4, 2, head_dim, DTYPES[dtype], seed=head_dim + batch)
    out, lse = flashgen.attention_varlen(*inputs, causal=causal, return_lse=True)
    check_forward(*inputs, causal, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", range(len(BATCHES)))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gradients_match_reference(head_dim, batch, causal):
    inputs = make_inputs(*BATCHES[batch], 4, 2, head_dim, torch.bfloat16, seed=head_dim * 3 + batch)
    check_gradients(*inputs, causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_grouped_query_gradients(head_dim, kv_heads, deterministic):
    inputs = make_inputs([300, 17, 0, 129], [250, 40, 3, 129], 8, kv_heads, head_dim, torch.float16)
    check_gradients(*inputs, causal=True, deterministic=deterministic)


def test_short_sequences_run_the_mma_forward_and_long_ones_the_tables_choice():
    from flashgen import plans

    short = make_inputs([64, 3, 50], [64, 3, 50], 4, 4, 128, torch.bfloat16)
    out, lse = flashgen.attention_varlen(*short, causal=True, return_lse=True)
    check_forward(*short, True, out, lse)
    kind = plans.forward_varlen(0, 128, torch.bfloat16, True, 64, "").kernels[0].spec
    assert kind.kind == "fwd" and kind.varlen
    expected = "fwd_sm90" if plans.device_arch(0) == "sm_90a" else "fwd"
    assert plans.forward_varlen(0, 128, torch.bfloat16, True, 1000, "").kernels[0].spec.kind == expected


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_reruns_are_bitwise_identical(head_dim):
    inputs = make_inputs([1000, 17, 0, 513], [900, 40, 5, 513], 8, 2, head_dim, torch.bfloat16)
    q, k, v, *rest = inputs
    d_o = torch.randn_like(q)
    fn = lambda q, k, v: flashgen.attention_varlen(q, k, v, *rest, causal=True, deterministic=True)  # noqa: E731
    first = grads(fn, q, k, v, d_o)
    for _ in range(3):
        for a, b in zip(first, grads(fn, q, k, v, d_o)):
            assert torch.equal(a, b)


def test_nothing_is_read_past_the_packed_tensors():
    """q, k, v are slices of larger buffers poisoned with NaN after their ends: a kernel that read a
    row past total_q or total_k would put NaN into the output."""
    lengths_q, lengths_k = [130, 1, 77, 0, 200], [64, 300, 77, 9, 1]
    inputs = make_inputs(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed=5)
    views = []
    for t in inputs[:3]:
        big = torch.full((t.shape[0] + 300, *t.shape[1:]), float("nan"), device="cuda", dtype=t.dtype)
        big[: t.shape[0]] = t
        views.append(big[: t.shape[0]])
    for causal in (False, True):
        out, lse = flashgen.attention_varlen(*views, *inputs[3:], causal=causal, return_lse=True)
        check_forward(*views, *inputs[3:], causal, out, lse)
    # the backward over the same poisoned storage (detach keeps it; a clone would not), dO poisoned too
    leaves = [t.detach().requires_grad_() for t in views]
    d_o = torch.full((views[0].shape[0] + 300, *views[0].shape[1:]), float("nan"), device="cuda", dtype=torch.bfloat16)
    d_o[: views[0].shape[0]] = torch.randn(views[0].shape, device="cuda", dtype=torch.bfloat16)
    flashgen.attention_varlen(*leaves, *inputs[3:], causal=True).backward(d_o[: views[0].shape[0]])
    for name, t in zip(("dq", "dk", "dv"), leaves):
        assert not t.grad.isnan().any(), f"NaN in {name}: a backward kernel read past the packed rows"
    check_gradients(*inputs, causal=True)


def test_outputs_stay_inside_their_rows_when_written_into_a_poisoned_buffer(monkeypatch):
    """o, dq, dk, dv allocated as slices of poisoned buffers (empty_like patched): every row past
    each tensor's end keeps its poison, so no block writes past total_q or total_k."""
    from flashgen import varlen

    lengths_q, lengths_k = [130, 1, 77, 0, 200], [64, 300, 77, 9, 1]
    inputs = make_inputs(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed=7)
    q, k, v, *rest = inputs
    guards = []

    def poisoned_like(t, **kwargs):
        big = torch.full((t.shape[0] + 256, *t.shape[1:]), 13.0, device=t.device, dtype=kwargs.get("dtype", t.dtype))
        guards.append(big)
        return big[: t.shape[0]]

    monkeypatch.setattr(varlen.torch, "empty_like", poisoned_like)
    for deterministic in (False, True):
        guards.clear()
        q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flashgen.attention_varlen(q_, k_, v_, *rest, causal=True, deterministic=deterministic)
        out.backward(torch.randn_like(out))
        assert len(guards) == 4, "o, dq, dk and dv come from empty_like: the guards must see all four"
        for big, n in zip(guards, [q.shape[0], q.shape[0], k.shape[0], k.shape[0]]):
            assert torch.equal(big[n:], torch.full_like(big[n:], 13.0)), "a kernel wrote past the end"
    monkeypatch.undo()
    check_gradients(*inputs, causal=True)


def test_empty_inputs():
    q, k, v, cu_q, cu_k, _, _ = make_inputs([0, 0], [3, 4], 2, 2, 64, torch.bfloat16)
    out, lse = flashgen.attention_varlen(q, k, v, cu_q, cu_k, 0, 4, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k, _, _ = make_inputs([5, 2], [0, 0], 2, 2, 64, torch.bfloat16)
    out, lse = flashgen.attention_varlen(q, k, v, cu_q, cu_k, 5, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_cuda_graph_capture_and_replay_with_new_lengths():
    inputs = make_inputs([300, 17, 120], [300, 17, 120], 4, 4, 64, torch.bfloat16)
    q, k, v, cu_q, cu_k, max_q, max_k = inputs
    expected = flashgen.attention_varlen(*inputs, causal=True)  # warm: compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashgen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    cu_q.copy_(torch.tensor([0, 100, 300, 437], dtype=torch.int32))  # new lengths, no longer than max
    cu_k.copy_(cu_q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashgen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True))
    assert not torch.equal(out, expected)


def test_torch_compile_fullgraph_forward_and_backward():
    inputs = make_inputs([300, 17, 0, 129], [250, 40, 3, 129], 4, 2, 64, torch.bfloat16)
    q, k, v, cu_q, cu_k, max_q, max_k = inputs

    @torch.compile(fullgraph=True)
    def step(q, k, v, cu_q, cu_k):
        return flashgen.attention_varlen(q * 1.0, k, v, cu_q, cu_k, max_q, max_k, causal=True).float().square().sum()

    def eager(q, k, v, cu_q, cu_k):
        return flashgen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True).float().square().sum()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled = step(*leaves, cu_q, cu_k)
    compiled.backward()
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss = eager(*expected, cu_q, cu_k)
    loss.backward()
    torch.testing.assert_close(compiled, loss, rtol=1e-3, atol=0)
    for a, b in zip(leaves, expected):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)


def test_gradient_through_lse():
    inputs = make_inputs([200, 33], [300, 33], 2, 2, 64, torch.bfloat16)
    q, k, v, *rest = inputs

    def loss(fn):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qq, kk, vv)
        (out.float().sum() + lse[lse.isfinite()].sum()).backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    ours = loss(lambda q, k, v: flashgen.attention_varlen(q, k, v, *rest, causal=True, return_lse=True))
    exact = loss(lambda q, k, v: reference_varlen(q, k, v, *rest, causal=True, return_lse=True))
    low = loss(lambda q, k, v: reference_varlen(q, k, v, *rest, causal=True, return_lse=True, upcast=False))
    check_by_the_numerics_rule(ours, exact, low, torch.bfloat16)  # (the lse's part of dS included)


def test_matches_attention_on_a_uniform_batch():
    """Equal lengths: the same numbers as attention() on the (B, H, T, d) view of the same tokens."""
    batch, seqlen, heads, d = 3, 257, 4, 128
    x = torch.randn(batch, seqlen, 3, heads, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x[:, :, i] for i in range(3))
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
    packed = flashgen.attention_varlen(*(t.reshape(batch * seqlen, heads, d) for t in (q, k, v)), cu, cu, seqlen, seqlen, causal=True)
    dense = flashgen.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    assert (packed.float() - dense.reshape(batch * seqlen, heads, d).float()).abs().max().item() < 2e-2


# ---- the variants (window_size, softcap, alibi_slopes), each sequence aligned to its own end --------


def slopes(batch, heads, per_sequence):
    base = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    return torch.stack([base * (1 + 0.25 * b) for b in range(batch)]) if per_sequence else base


VARIANTS = {
    "window": dict(window_size=(100, 21)),
    "window_left": dict(window_size=(64, -1)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slopes="heads"),
    "alibi_per_sequence": dict(alibi_slopes="sequences"),
    "everything": dict(window_size=(200, 0), softcap=20.0, alibi_slopes="sequences"),
}


def variant_values(name, batch, heads):
    variant = dict(VARIANTS[name])
    if "alibi_slopes" in variant:
        variant["alibi_slopes"] = slopes(batch, heads, variant["alibi_slopes"] == "sequences")
    return variant


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("batch", range(len(BATCHES)))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_variants_forward_and_gradients(head_dim, batch, name, causal):
    """Odd lengths, an empty sequence, q != k both ways (the window and ALiBi bottom-right in each)."""
    inputs = make_inputs(*BATCHES[batch], 4, 2, head_dim, torch.bfloat16, seed=head_dim + batch)
    variant = variant_values(name, len(BATCHES[batch][0]), 4)
    out, lse = flashgen.attention_varlen(*inputs, causal=causal, return_lse=True, **variant)
    check_forward(*inputs, causal, out, lse, **variant)
    check_gradients(*inputs, causal, **variant)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
def test_variants_at_every_head_dim(head_dim, deterministic):
    inputs = make_inputs([700, 17, 0, 129], [650, 40, 3, 129], 8, 2, head_dim, torch.float16, seed=head_dim)
    variant = variant_values("everything", 4, 8)
    out, lse = flashgen.attention_varlen(*inputs, causal=True, return_lse=True, **variant)
    check_forward(*inputs, True, out, lse, **variant)
    check_gradients(*inputs, True, deterministic, **variant)


def test_long_variant_calls_run_the_hopper_forward():
    from flashgen import plans

    inputs = make_inputs([1000, 300], [1000, 500], 4, 4, 128, torch.bfloat16)
    variant = variant_values("everything", 2, 4)
    out, lse = flashgen.attention_varlen(*inputs, causal=True, return_lse=True, **variant)
    check_forward(*inputs, True, out, lse, **variant)
    spec = plans.forward_varlen(0, 128, torch.bfloat16, True, 1000, "", ("window", "softcap", "alibi")).kernels[0].spec
    assert spec.varlen and spec.variants == ("window", "softcap", "alibi")
    assert spec.kind == ("fwd_sm90" if plans.device_arch(0) == "sm_90a" else "fwd")


def test_variants_through_torch_compile_and_a_cuda_graph():
    inputs = make_inputs([300, 17, 0, 129], [250, 40, 3, 129], 4, 2, 64, torch.bfloat16)
    q, k, v, cu_q, cu_k, max_q, max_k = inputs
    variant = variant_values("everything", 4, 4)

    @torch.compile(fullgraph=True)
    def step(q, k, v, cu_q, cu_k):
        return flashgen.attention_varlen(q * 1.0, k, v, cu_q, cu_k, max_q, max_k, causal=True, **variant).float().square().sum()

    def eager(q, k, v, cu_q, cu_k):
        return flashgen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True,
                                         **variant).float().square().sum()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled = step(*leaves, cu_q, cu_k)
    compiled.backward()
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss = eager(*expected, cu_q, cu_k)
    loss.backward()
    torch.testing.assert_close(compiled, loss, rtol=1e-3, atol=0)
    for a, b in zip(leaves, expected):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)

    expected = flashgen.attention_varlen(*inputs, causal=True, **variant)  # warm, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashgen.attention_varlen(*inputs, causal=True, **variant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
