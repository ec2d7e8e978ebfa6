"""GPU tier: the FP8 (e4m3) forward against the fp32 oracle on the dequantized inputs, by the FP8
numerics rule (README): its error is at most 1.5x that of the same computation in PyTorch
(reference.fp8_emulated: bf16 inputs' products in fp32, P rounded to e4m3 the way the kernel rounds
it, 2^8 above the row's max), on standard normal inputs and on inputs with 0.1 % outliers of 10x (FlashAttention-3's
test). The RMSEs are printed for BENCHMARKS.md."""

import pytest
import torch

import flashgen
from flashgen import plans, reference

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn


def needs_hopper():
    if plans.device_arch(0) != "sm_90a":
        pytest.skip("the FP8 forward runs on sm_90a")


def quantized(x, kv_heads):
    """x (B, H, T, d) in e4m3 with a descale per batch and KV head (FlashAttention-3's (B, H_kv)):
    each group's largest magnitude maps to e4m3's 448."""
    batch, heads, seqlen, dim = x.shape
    groups = x.float().reshape(batch, kv_heads, heads // kv_heads * seqlen * dim)
    largest = groups.abs().amax(-1) if groups.shape[-1] else groups.new_ones(groups.shape[:2])  # (an empty sequence: 1)
    descale = (largest / 448.0).clamp_min(1e-12)
    scaled = (groups / descale[..., None]).reshape(x.shape)
    return scaled.to(E4M3), descale.contiguous()


def problem(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v=None, outliers=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
              (batch, kv_heads, seqlen_k, head_dim_v or head_dim))
    tensors = []
    for shape in shapes:
        x = torch.randn(shape, device="cuda", generator=gen)
        if outliers:  # 0.1 % of the entries 10x larger
            x = torch.where(torch.rand(shape, device="cuda", generator=gen) < 1e-3, x * 10, x)
        tensors.append(quantized(x, kv_heads))
    (q, qd), (k, kd), (v, vd) = tensors
    return q, k, v, qd, kd, vd


def emulated(q, k, v, qd, kd, vd, causal):
    """The rule's yardstick: the same computation in PyTorch (flashgen.reference.fp8_emulated)."""
    return reference.fp8_emulated(q, k, v, causal, q_descale=qd, k_descale=kd, v_descale=vd)


def rmse(a, b):
    return (a.float() - b.float()).pow(2).mean().sqrt().item()


def tensor_core_lse(q, k, qd, kd, causal, fast=True):
    """The lse of the scores as Hopper's FP8 tensor cores sum them: q k^T of the stored e4m3
    values by torch._scaled_mm (fast=True: in the MMA's own accumulator, as the forward's wgmma
    chain does; False: promoted to fp32 every few k-steps), times the descales and the softmax
    scale. Its accumulator keeps fewer bits than fp32 (scores with 10x outliers are off by up to
    ~0.3), so this, not the fp32 oracle, is the lse the kernel can match to rounding."""
    batch, heads, rows, dim = q.shape
    group, keys = heads // k.shape[1], k.shape[2]
    padded = lambda t: torch.cat([t, t.new_zeros(-t.shape[0] % 16, dim)]) if t.shape[0] % 16 else t  # noqa: E731
    one = torch.tensor(1.0, device=q.device)
    scores = torch.empty(batch, heads, rows, keys, device=q.device)
    for b in range(batch):
        for h in range(heads):
            a, c = padded(q[b, h]), padded(k[b, h // group])
            s = torch._scaled_mm(a, c.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
            scores[b, h] = s[:rows, :keys] * (qd[b, h // group] * kd[b, h // group])
    scores = scores * dim ** -0.5
    if causal:
        scores = scores.masked_fill(~reference.visible(rows, keys, q.device), -float("inf"))
    return torch.logsumexp(scores, -1)


@pytest.mark.parametrize("outliers", [False, True], ids=["normal", "outliers"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 333, 1500, 64), (1, 4, 1, 700, 700, 256),
                                   (1, 4, 2, 500, 500, 192, 128)], ids=["gqa-d128", "d64-tq<tk", "mqa-d256", "d192-v128"])
def test_fp8_forward_by_the_numerics_rule(shape, causal, outliers):
    needs_hopper()
    q, k, v, qd, kd, vd = problem(*shape, outliers=outliers, seed=len(shape) + causal)
    with torch.no_grad():
        out, lse = flashgen.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    ref, ref_lse = reference.naive_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                             out_dtype=torch.float32, return_lse=True)
    emu = emulated(q, k, v, qd, kd, vd, causal)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err, emu_err = rmse(out, ref), rmse(emu, ref)
    print(f"FP8 RMSE {shape} causal={causal} outliers={outliers}: flashgen {err:.3e}, PyTorch emulation {emu_err:.3e}")
    assert err <= 1.5 * emu_err, (err, emu_err)
    visible = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    # The lse: the tensor cores' scores' lse to rounding, and from the oracle's within 1.5x of how far
    # that one is (the rule's "the same computation in PyTorch"; 2e-3 at least, as for bf16).
    tensor_cores = tensor_core_lse(q, k, qd, kd, causal)
    torch.testing.assert_close(lse[visible], tensor_cores[visible], atol=2e-4, rtol=0)
    own = (tensor_cores - ref_lse)[visible].abs().max().item()
    print(f"FP8 lse {shape} causal={causal} outliers={outliers}: flashgen {(lse - ref_lse)[visible].abs().max().item():.2e}, "
          f"tensor-core scores {own:.2e} from the oracle's")
    torch.testing.assert_close(lse[visible], ref_lse[visible], atol=max(2e-3, 1.5 * own), rtol=0)


def test_fp8_without_descales_and_with_an_fp16_output():
    needs_hopper()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4, 300, 128, device="cuda", generator=gen).to(E4M3) for _ in range(3))  # the true values
    with torch.no_grad():
        out = flashgen.attention(q, k, v, causal=True, out_dtype=torch.float16)
    ref = reference.naive_attention(q, k, v, causal=True, out_dtype=torch.float32)
    ones = torch.ones(1, 4, device="cuda")
    emu = emulated(q, k, v, ones, ones, ones, True)
    assert out.dtype == torch.float16
    assert rmse(out, ref) <= 1.5 * rmse(emu, ref)


@pytest.mark.parametrize("options", [dict(window_size=(200, 0)), dict(softcap=30.0), dict(alibi_slopes="slopes"),
                                     dict(learnable_sink="sink")], ids=["window", "softcap", "alibi", "sink"])
def test_fp8_variants_against_the_oracle(options):
    """The variants on the FP8 kernel by the numerics rule: within 1.5x the error of the emulation
    with the same variant, against the oracle with it."""
    needs_hopper()
    q, k, v, qd, kd, vd = problem(1, 8, 2, 900, 900, 128, seed=7)
    if options.get("alibi_slopes") == "slopes":
        options["alibi_slopes"] = torch.linspace(0.01, 0.1, 8, device="cuda")
    if options.get("learnable_sink") == "sink":
        options["learnable_sink"] = torch.linspace(-1.0, 3.0, 8, device="cuda")
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    with torch.no_grad():
        out = flashgen.attention(q, k, v, causal=True, **descales, **options)
    ref = reference.naive_attention(q, k, v, causal=True, **descales, out_dtype=torch.float32, **options)
    emu = reference.fp8_emulated(q, k, v, True, **descales, **options)
    assert rmse(out, ref) <= 1.5 * rmse(emu, ref), (rmse(out, ref), rmse(emu, ref))


def test_fp8_refuses_gradients():
    needs_hopper()
    q, k, v, qd, kd, vd = problem(1, 2, 2, 64, 64, 64)
    with pytest.raises(RuntimeError, match="FP8 attention is forward-only"):
        flashgen.attention(q.requires_grad_(), k, v)


def test_fp8_under_torch_compile_matches_eager():
    needs_hopper()
    q, k, v, qd, kd, vd = problem(1, 4, 2, 256, 256, 128, seed=11)
    run = lambda q, k, v: flashgen.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)  # noqa: E731
    with torch.no_grad():
        assert torch.equal(torch.compile(run, fullgraph=True)(q, k, v), run(q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_varlen_equals_each_sequence_alone(head_dim, causal):
    """attention_varlen with FP8 inputs (sequences whose starts are no multiple of 16, one empty):
    each sequence's rows and lse are the fixed-length FP8 forward's on that sequence alone, with
    its own descales, bit for bit (the same kernel, the same tiles)."""
    needs_hopper()
    lengths_q, lengths_k = [200, 0, 77, 333], [250, 5, 77, 900]
    heads, kv_heads = 8, 2
    gen = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    parts = []
    for length_q, length_k in zip(lengths_q, lengths_k):
        parts.append([quantized(torch.randn(1, h, t, head_dim, device="cuda", generator=gen), kv_heads)
                      for h, t in ((heads, length_q), (kv_heads, length_k), (kv_heads, length_k))])
    packed = [torch.cat([part[i][0][0].transpose(0, 1) for part in parts]) for i in range(3)]  # (total, H, d)
    descales = [torch.cat([part[i][1] for part in parts]) for i in range(3)]  # (sequences, H_kv)
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for lengths in (lengths_q, lengths_k)]
    with torch.no_grad():
        out, lse = flashgen.attention_varlen(*packed, *cu, max(lengths_q), max(lengths_k), causal=causal, return_lse=True,
                                             q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
        for b, part in enumerate(parts):
            if not lengths_q[b]:
                continue
            alone, alone_lse = flashgen.attention(part[0][0], part[1][0], part[2][0], causal=causal, return_lse=True,
                                                  q_descale=part[0][1], k_descale=part[1][1], v_descale=part[2][1])
            rows = slice(int(cu[0][b]), int(cu[0][b + 1]))
            assert torch.equal(out[rows], alone[0].transpose(0, 1)), b
            assert torch.equal(lse[:, rows], alone_lse[0]), b


def test_fp8_in_a_cuda_graph_replays_the_eager_result():
    """Nothing of an FP8 call waits on the host (transposed V's key order is on the device once)."""
    needs_hopper()
    q, k, v, qd, kd, vd = problem(1, 4, 2, 300, 300, 128, seed=13)
    run = lambda: flashgen.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)  # noqa: E731
    with torch.no_grad():
        eager = run()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # (plans and kernels made outside the capture)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("shape", [(2, 3, 37, 128), (1, 2, 64, 64), (2, 1, 200, 256), (1, 1, 1, 16)])
def test_the_fp8_v_kernel_lays_v_out_as_the_reference_says(shape):
    """The fp8_v kernel (the FP8 forward's first step) against flashgen.reference.fp8_values, byte
    for byte: keys past whole 16s and 32s and 64s, V as a strided view (B, T, H, d -> B, H, T, d)."""
    from flashgen import ops

    batch, heads, keys, head_dim = shape
    v = torch.randn(batch, keys, heads, head_dim, device="cuda").mul(40).to(torch.float8_e4m3fn).transpose(1, 2)
    got, want = ops.fp8_values(v), reference.fp8_values(v)
    assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_fp8_v_kernel_lays_packed_v_out_as_the_reference_says(head_dim):
    """Packed sequences (empty ones, and ones shorter and longer than a block's 64 positions): each
    from its own whole 16, zeros between, every byte of the output written; rows past the last
    sequence's end (7 here) belong to none."""
    from flashgen import ops

    lengths = [5, 0, 37, 16, 3, 100, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    v = torch.randn(sum(lengths) + 7, 3, head_dim, device="cuda").mul(40).to(torch.float8_e4m3fn)
    got, want = ops.fp8_values(v, cu), reference.fp8_values_varlen(v, cu)
    assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
