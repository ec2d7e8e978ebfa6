"""GPU tier: gradients against the fp32 reference by FlashAttention's rule with factor 3:
max|grad - ref| <= 3 * max|grad_lp - ref| + 1e-5, where ref comes from naive attention in fp32 and
grad_lp from the same computation in the kernel's dtype."""

import pytest
import torch
from conftest import check_by_the_numerics_rule, run_prebuilt

import flashgen
from flashgen import reference, tuning
from flashgen.reference import naive_attention

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLENS = (1, 17, 113, 128, 1000, 1023, 2048)


@pytest.fixture(scope="module", autouse=True)
def prebuilt(tmp_path_factory):
    from flashgen.plans import device_arch

    flashgen.build(tuning.shipped_specs(device_arch(0)), tmp_path_factory.mktemp("prebuilt"), backward=False)


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def grads(fn, q, k, v, d_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(d_o)
    return out, q.grad, k.grad, v.grad


def upstream_gradient(q):
    """dO for a check, from its own seeded generator: a failure must reproduce. (Where the true
    gradient is 0, e.g. dk with a single key, the error is fp32 rounding at the rule's 1e-5 floor:
    FlashAttention-2's own backward lands there too, so an unseeded draw made such a case flaky.)"""
    gen = torch.Generator(device=q.device).manual_seed(20261202)
    return torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=gen)


def check_gradients(q, k, v, causal, deterministic=False, d_o=None):
    d_o = upstream_gradient(q) if d_o is None else d_o
    ours = grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, deterministic=deterministic), q, k, v, d_o)
    ref = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal), q, k, v, d_o)
    low = grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, upcast=False), q, k, v, d_o)
    for name, mine, exact, lowp in zip(("out", "dq", "dk", "dv"), ours, ref, low):
        assert mine.shape == exact.shape and mine.dtype == q.dtype, name
        assert not mine.isnan().any(), f"NaN in {name}"
        err = (mine.float() - exact.float()).abs().max().item()
        bound = (2 if name == "out" else 3) * (lowp.float() - exact.float()).abs().max().item() + 1e-5
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
    return ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
def test_gradients_match_reference(head_dim, seqlen, causal, dtype):
    q, k, v = make_qkv(2, 2, 2, seqlen, seqlen, head_dim, DTYPES[dtype], seed=seqlen * 7 + head_dim)
    check_gradients(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (17, 1000), (113, 2048), (128, 1), (1000, 17), (2048, 113)])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gradients_for_different_lengths(head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = make_qkv(2, 2, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=seqlen_q + seqlen_k)
    check_gradients(q, k, v, causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_grouped_query_gradients(head_dim, kv_heads, deterministic):
    q, k, v = make_qkv(2, 8, kv_heads, 333, 333, head_dim, torch.bfloat16)
    check_gradients(q, k, v, causal=True, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_mode_matches_reference(head_dim, causal):
    q, k, v = make_qkv(2, 2, 2, 1000, 777, head_dim, torch.float16, seed=head_dim)
    check_gradients(q, k, v, causal, deterministic=True)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_deterministic_reruns_are_bitwise_identical(head_dim):
    q, k, v = make_qkv(2, 8, 2, 2048, 2048, head_dim, torch.bfloat16)
    d_o = torch.randn_like(q)
    fn = lambda q, k, v: flashgen.attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
    first = grads(fn, q, k, v, d_o)
    for _ in range(3):
        again = grads(fn, q, k, v, d_o)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_default_mode_dk_dv_are_bitwise_identical():
    q, k, v = make_qkv(2, 8, 2, 2048, 2048, 64, torch.bfloat16)
    d_o = torch.randn_like(q)
    fn = lambda q, k, v: flashgen.attention(q, k, v, causal=True)  # noqa: E731
    _, _, dk, dv = grads(fn, q, k, v, d_o)
    _, _, dk2, dv2 = grads(fn, q, k, v, d_o)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_rows_of_very_negative_scores_past_a_partial_key_tile(head_dim, deterministic, dtype):
    """Every score below -100 (lse below -95) and Tk = 100, not a multiple of any key tile: the
    zeros read past the keys give S = 0 and an unmasked P = exp(-lse) = inf there, and inf * 0 K
    made whole dQ rows NaN (fixed length, non-causal; fp16 already near -15)."""
    dtype = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(7)
    noise = lambda *shape: 0.1 * torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q = (2.5 + noise(1, 2, 64, head_dim)).to(dtype)  # scores about -12.5 sqrt(d): -100 to -173
    k = (-5 + noise(1, 2, 100, head_dim)).to(dtype)
    v = torch.randn(1, 2, 100, head_dim, device="cuda", generator=gen).to(dtype)
    lse = naive_attention(q, k, v, return_lse=True)[1]
    assert lse.max().item() < -80  # the case: exp(-lse) overflows fp32
    check_gradients(q, k, v, False, deterministic)


def test_strided_inputs_and_gradient():
    batch, seqlen, heads, head_dim = 2, 300, 4, 64
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    d_o = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    check_gradients(q, k, v, causal=True, d_o=d_o)


@pytest.mark.parametrize("batch, heads, kv_heads", [(1, 70_000, 14_000), (70_000, 2, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_with_more_than_65535_heads_or_batches(batch, heads, kv_heads, deterministic):
    q, k, v = make_qkv(batch, heads, kv_heads, 8, 8, 32, torch.bfloat16)
    check_gradients(q, k, v, causal=True, deterministic=deterministic)


def test_gradient_through_lse():
    q, k, v = make_qkv(1, 2, 2, 200, 300, 64, torch.float32)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))

    def loss(fn):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qq, kk, vv)
        (out.float().sum() + lse.float().sum()).backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    ours = loss(lambda q, k, v: flashgen.attention(q, k, v, causal=True, return_lse=True))
    exact = loss(lambda q, k, v: naive_attention(q, k, v, causal=True, return_lse=True))
    low = loss(lambda q, k, v: naive_attention(q, k, v, causal=True, upcast=False, return_lse=True))
    check_by_the_numerics_rule(ours, exact, low, torch.bfloat16)  # (the lse's part of dS included)


def test_torch_compile_forward_and_backward():
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        return flashgen.attention(q, k, v, causal=True).float().square().sum()

    def eager(q, k, v):
        return flashgen.attention(q, k, v, causal=True, deterministic=True).float().square().sum()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward()
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager(*expected).backward()
    for a, b in zip(leaves, expected):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)


def test_cuda_graph_of_a_training_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 3 * 64, device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 256, 64, device="cuda", dtype=torch.bfloat16)

    def train_step():
        optimizer.zero_grad(set_to_none=False)
        q, k, v = model(x).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        loss = flashgen.attention(q, k, v, causal=True, deterministic=True).float().square().mean()
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile, load, allocate outside the capture
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static_loss).item()
    assert not torch.equal(weights["weight"], model.weight)  # the replay trained
    # The same step in eager mode from the same parameters gives the same update.
    replayed = model.weight.detach().clone()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    eager_loss = train_step()
    torch.testing.assert_close(model.weight, replayed, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(eager_loss, static_loss, rtol=1e-3, atol=0)


def test_backward_memory_is_linear_at_32k():
    from flashgen.bench import backward_peak_bytes

    batch, heads, seqlen, head_dim = 1, 4, 32768, 64
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, heads, heads, seqlen, seqlen, head_dim, torch.bfloat16))
    extra = backward_peak_bytes(flashgen.attention(q, k, v, causal=True), (q, k, v))
    tensor = batch * heads * seqlen * head_dim * 2
    # dq, dk, dv (3 tensors), the fp32 dq accumulator (2 tensors' worth) and O(T) statistics.
    assert extra <= 5 * tensor + (8 << 20), f"backward allocated {extra / 2**20:.0f} MiB"


def test_prebuilt_module_is_differentiable_without_a_compiler(tmp_path):
    spec = flashgen.KernelSpec(head_dim=64, block_m=128, block_n=64, causal=True)
    out = run_prebuilt(tmp_path, spec, """
        q, k, v = (torch.randn(2, 4, 500, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        for deterministic in (False, True):
            module.attention(q, k, v, deterministic=deterministic).float().sum().backward()
            ours = [t.grad.float().clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            naive_attention(q, k, v, causal=True).float().sum().backward()
            for a, t in zip(ours, (q, k, v)):
                assert (a - t.grad.float()).abs().max().item() < 5e-2, deterministic
                t.grad = None
        print("ok")
    """)
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("head_dim, block_n", [(64, 128), (128, 128), (136, 64), (192, 64), (256, 64)])
def test_hopper_runs_its_own_backward_at_every_head_dim(head_dim, block_n):
    """On sm_90a the tables pick the Hopper family (TMA, wgmma, warp specialization), above head
    dim 128 in its split layout (block_n=64); the sweeps above then check its gradients."""
    hopper_only()
    for deterministic, kinds in ((False, ["bwd_prep", "bwd_sm90_kvq"]), (True, ["bwd_prep", "bwd_sm90_kv", "bwd_q"])):
        specs = backward_kernels(head_dim, torch.bfloat16, True, deterministic)
        assert [spec.kind for spec in specs] == kinds and specs[1].block_n == block_n


# ---- the Hopper backward's split layout (block_n=64: the two consumer warpgroups share 64 keys,
# one computing P^T and dV, the other dS^T and dK), what the tables run above head dim 128 ----------

SPLIT_HEAD_DIMS = (136, 192, 256)


def hopper_only():
    from flashgen import plans

    if plans.device_arch(0) != "sm_90a":
        pytest.skip("needs sm_90a")


def backward_kernels(head_dim, dtype, causal, deterministic):
    from flashgen import plans

    return [kernel.spec for kernel in plans.backward(0, head_dim, dtype, causal, deterministic, "").kernels]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, heads, kv_heads, seqlen_q, seqlen_k", [
    (2, 4, 4, 1023, 1023),  # odd length: a partial last query tile and key block
    (1, 8, 2, 333, 1000),  # GQA, Tq < Tk (causal: bottom-right, every query sees the first 668 keys)
    (2, 4, 1, 1000, 333),  # MQA, Tq > Tk (causal: the first 667 queries see no key)
    (2, 2, 2, 1, 77),
    (1, 2, 2, 17, 1),
    (1, 3, 3, 64, 64),  # one query tile, one key block
])
@pytest.mark.parametrize("head_dim", SPLIT_HEAD_DIMS)
def test_split_hopper_backward_matches_reference(head_dim, batch, heads, kv_heads, seqlen_q, seqlen_k, causal, dtype):
    hopper_only()
    spec = backward_kernels(head_dim, DTYPES[dtype], causal, False)[1]
    assert spec.kind == "bwd_sm90_kvq" and spec.block_n == 64
    q, k, v = make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, DTYPES[dtype], seed=seqlen_q + head_dim)
    check_gradients(q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", SPLIT_HEAD_DIMS)
def test_split_hopper_backward_deterministic_mode(head_dim, causal, dtype):
    """bwd_sm90_kv (dK, dV) and the query-major bwd_q (dQ): within the rule, and bitwise the same on
    every rerun."""
    hopper_only()
    specs = backward_kernels(head_dim, DTYPES[dtype], causal, True)
    assert [s.kind for s in specs] == ["bwd_prep", "bwd_sm90_kv", "bwd_q"] and specs[1].block_n == 64
    q, k, v = make_qkv(2, 8, 2, 777, 1000, head_dim, DTYPES[dtype], seed=head_dim)
    first = check_gradients(q, k, v, causal, deterministic=True)
    fn = lambda q, k, v: flashgen.attention(q, k, v, causal=causal, deterministic=True)  # noqa: E731
    for _ in range(2):
        again = grads(fn, q, k, v, upstream_gradient(q))
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_split_hopper_backward_dk_dv_are_bitwise_identical_in_default_mode(head_dim):
    """Only dQ's bulk reductions vary in order; dK and dV are summed in a fixed order per block."""
    hopper_only()
    q, k, v = make_qkv(2, 8, 2, 2048, 2048, head_dim, torch.bfloat16)
    d_o = torch.randn_like(q)
    fn = lambda q, k, v: flashgen.attention(q, k, v, causal=True)  # noqa: E731
    _, _, dk, dv = grads(fn, q, k, v, d_o)
    _, _, dk2, dv2 = grads(fn, q, k, v, d_o)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("head_dim, block_m, num_stages", [
    (64, 128, 3), (96, 64, 2), (128, 64, 3), (128, 128, 2), (192, 64, 3), (256, 64, 2),
])
def test_split_hopper_backward_tile_variants(head_dim, block_m, num_stages, deterministic):
    """Shapes of the split layout `flashgen tune` may pick (its space has block_n 64 at every head
    dim): other block_m, num_stages (and so dO stages), head dims below 128."""
    hopper_only()
    kind = "bwd_sm90_kv" if deterministic else "bwd_sm90_kvq"
    tiles = {"block_m": block_m, "block_n": 64, "num_stages": num_stages}
    entry = {"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*", "tiles": [tiles]}
    with tuning.override([entry]):
        spec = backward_kernels(head_dim, torch.bfloat16, True, deterministic)[1]
        assert (spec.kind, spec.block_m, spec.block_n, spec.num_stages) == (kind, block_m, 64, num_stages)
        for causal in (False, True):
            q, k, v = make_qkv(2, 4, 2, 333, 1000, head_dim, torch.bfloat16, seed=head_dim + block_m)
            check_gradients(q, k, v, causal, deterministic=deterministic)


TRIO_DIMS = [(192, 192), (192, 128), (160, 64)]  # (d, d_v): q's head dim in three 64-column chunks


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("dims", TRIO_DIMS, ids=[f"d{d}_v{dv}" for d, dv in TRIO_DIMS])
def test_trio_hopper_backward(dims, deterministic):
    """The three-consumer layout (block_n=96: each warpgroup takes 32 keys of S, dP and dV^T and 64
    head-dim columns of dK^T and dQ), forced by a table entry: partial key and query tiles, GQA and
    MQA, Tq < Tk and Tq > Tk (causal: queries that see no key), one key block, V narrower than q
    (warpgroups with fewer dV^T chunks), then varlen with a window."""
    hopper_only()
    head_dim, head_dim_v = dims
    kind = "bwd_sm90_kv" if deterministic else "bwd_sm90_kvq"
    entry = {"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
             "tiles": [{"block_m": 64, "block_n": 96, "num_stages": 2}]}
    from flashgen import plans

    with tuning.override([entry]):
        spec = plans.backward(0, head_dim, torch.bfloat16, True, deterministic, "",
                              head_dim_v=0 if head_dim_v == head_dim else head_dim_v).kernels[1].spec
        assert (spec.kind, spec.block_n) == (kind, 96)
        for batch, heads, kv_heads, seqlen_q, seqlen_k in [(1, 8, 2, 333, 1000), (2, 4, 1, 1000, 333), (1, 3, 3, 96, 96),
                                                            (2, 2, 2, 1, 77)]:
            q, k, v = make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=seqlen_q + head_dim_v)
            v = v[..., :head_dim_v].contiguous()
            d_o = upstream_gradient(q)[..., :head_dim_v].contiguous()
            for causal in (False, True):
                check_gradients(q, k, v, causal, deterministic=deterministic, d_o=d_o)
        lengths = (30, 700, 257)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(head_dim_v)
        q, k = (torch.randn(int(cu[-1]), h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (8, 4))
        v = torch.randn(int(cu[-1]), 4, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
        d_o = torch.randn(int(cu[-1]), 8, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
        call = dict(causal=True, window_size=(200, 0), deterministic=deterministic)
        ours = grads(lambda q, k, v: flashgen.attention_varlen(q, k, v, cu, cu, 700, 700, **call), q, k, v, d_o)
        exact, low = (grads(lambda q, k, v: reference.attention_varlen(q, k, v, cu, cu, 700, 700, upcast=up, **call), q, k, v, d_o)
                      for up in (True, False))
        check_by_the_numerics_rule(ours, exact, low, torch.bfloat16)


def test_expanded_inputs_and_an_expanded_gradient():
    """A stride of 0 reaches no TMA tensor map: an MQA k and v given expanded over the query heads
    (Tq > 64: the Hopper forward on sm_90a), and a loss that sums over heads (dO arrives expanded),
    both by the numerics rule against the reference on the same tensors."""
    q, k, v = make_qkv(2, 4, 1, 200, 300, 64, torch.bfloat16)
    k, v = (t.expand(2, 4, 300, 64) for t in (k, v))

    def loss(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.sum(dim=1).float().square().sum().backward()  # out.sum(dim=1) in its dtype: dO arrives expanded over heads
        return (out.detach(), *(t.grad for t in leaves))

    ours = loss(lambda q, k, v: flashgen.attention(q, k, v, causal=True))
    exact = loss(lambda q, k, v: naive_attention(q, k, v, causal=True))
    low = loss(lambda q, k, v: naive_attention(q, k, v, causal=True, upcast=False))
    check_by_the_numerics_rule(ours, exact, low, torch.bfloat16)
