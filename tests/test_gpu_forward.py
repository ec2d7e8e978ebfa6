"""GPU tier: the forward kernel against the fp32 reference, by FlashAttention's numerics rule.

max|out - ref| <= 2 * max|ref_lp - ref| + 1e-5, where ref is naive attention in fp32 and ref_lp the
same computation in the kernel's dtype.
"""

import ctypes
import math

import pytest
import torch
from conftest import in_a_thread_with_no_context, run_prebuilt

import flashgen
from flashgen import tuning
from flashgen.spec import KernelSpec
from flashgen.reference import naive_attention

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = tuning.TEST_HEAD_DIMS
SEQLENS = (1, 17, 113, 128, 1000, 1023, 2048)


@pytest.fixture(scope="session", autouse=True)
def prebuilt(tmp_path_factory):
    """Compile every spec the sweep needs in parallel processes before the tests run."""
    from flashgen.plans import device_arch

    specs = tuning.shipped_specs(device_arch(0))
    flashgen.build(specs, tmp_path_factory.mktemp("prebuilt"))


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_q, shape_kv = (batch, heads, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def check_against_reference(q, k, v, causal, out, lse):
    ref, ref_lse = naive_attention(q, k, v, causal=causal, return_lse=True)
    ref_lp = naive_attention(q, k, v, causal=causal, upcast=False)
    assert not out.isnan().any(), "NaN in output"
    err = (out.float() - ref.float()).abs().max().item()
    bound = 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows with no visible key differ"
    finite = ref_lse.isfinite()
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-3 if finite.any() else True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_reference(head_dim, seqlen, causal, dtype):
    q, k, v = make_qkv(2, 3, 3, seqlen, seqlen, head_dim, DTYPES[dtype], seed=seqlen + head_dim)
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    check_against_reference(q, k, v, causal, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (17, 1000), (113, 2048), (128, 1), (1000, 17), (2048, 113), (1023, 1000)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_different_query_and_key_lengths(head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = make_qkv(2, 2, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=seqlen_q * seqlen_k)
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    check_against_reference(q, k, v, causal, out, lse)


def test_row_with_no_visible_key_is_zero_and_lse_minus_inf():
    q, k, v = make_qkv(1, 2, 2, 300, 100, 64, torch.bfloat16)  # causal: the first 200 rows see nothing
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :200], torch.zeros_like(out[:, :, :200]))
    assert torch.isneginf(lse[:, :, :200]).all() and lse[:, :, 200:].isfinite().all()
    check_against_reference(q, k, v, True, out, lse)


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_grouped_query_attention(ratio):
    q, k, v = make_qkv(2, 8, 8 // ratio, 333, 333, 64, torch.bfloat16)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    check_against_reference(q, k, v, True, out, lse)


def test_strided_inputs_without_copy():
    batch, seqlen, heads, head_dim = 2, 257, 4, 64
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, d) views of one buffer
    assert not q.is_contiguous() and q.stride(-1) == 1
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    check_against_reference(q, k, v, True, out, lse)
    x = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.float16)
    view = x.view(batch, seqlen, heads, head_dim).transpose(1, 2)
    out, lse = flashgen.attention(view, view, view, return_lse=True)
    check_against_reference(view, view, view, False, out, lse)


def test_misaligned_view_is_handled():
    flat = torch.randn(1 * 2 * 100 * 64 + 3, device="cuda", dtype=torch.bfloat16)
    q = flat[3:].view(1, 2, 100, 64)  # 6-byte offset: not 16-byte aligned
    out, lse = flashgen.attention(q, q, q, return_lse=True)
    check_against_reference(q, q, q, False, out, lse)


def test_reruns_are_bitwise_identical():
    q, k, v = make_qkv(2, 4, 4, 1000, 1000, 128, torch.bfloat16)
    first = flashgen.attention(q, k, v, causal=True)
    for _ in range(3):
        assert torch.equal(flashgen.attention(q, k, v, causal=True), first)


def test_output_is_the_same_when_lse_is_not_wanted():
    # Inference without return_lse passes no lse buffer: the kernel skips writing it.
    q, k, v = make_qkv(2, 4, 2, 1000, 700, 64, torch.bfloat16)
    with torch.no_grad():
        for causal in (False, True):
            out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
            assert torch.equal(flashgen.attention(q, k, v, causal=causal), out)
        empty_kv = k[:, :, :0]
        assert torch.equal(flashgen.attention(q, empty_kv, empty_kv), torch.zeros_like(q))


def test_empty_inputs_return_empty_without_launch(monkeypatch):
    from flashgen.kernels import Kernel

    def no_launch(*args, **kwargs):
        raise AssertionError("an empty input launched a kernel")

    monkeypatch.setattr(Kernel, "launch", no_launch)
    for shape_q, shape_kv in [((0, 2, 16, 64), (0, 2, 16, 64)), ((1, 2, 0, 64), (1, 2, 16, 64))]:
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
        out, lse = flashgen.attention(q, k, k, return_lse=True)
        assert out.shape == shape_q and lse.shape == shape_q[:3]
    q = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.bfloat16)
    empty_kv = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flashgen.attention(q, empty_kv, empty_kv, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_runs_on_the_current_stream():
    q, k, v = make_qkv(4, 8, 8, 2048, 2048, 64, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = flashgen.attention(q, k, v)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    ref = flashgen.attention(q, k, v)
    assert torch.equal(out, ref)


def test_cuda_graph_capture():
    q, k, v = make_qkv(2, 4, 4, 512, 512, 64, torch.bfloat16)
    expected = flashgen.attention(q, k, v, causal=True)  # warm: compile and load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashgen.attention(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashgen.attention(q, k, v, causal=True))
    assert not torch.equal(out, expected)


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def block(q, k, v):
        return flashgen.attention(q * 1.0, k, v, causal=True) + 1

    torch.testing.assert_close(block(q, k, v), flashgen.attention(q, k, v, causal=True) + 1, rtol=0, atol=0)


def test_no_score_matrix_at_32k():
    q, k, v = make_qkv(1, 4, 4, 32768, 32768, 64, torch.bfloat16)
    flashgen.attention(q, k, v, causal=True)  # warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    # Only the outputs themselves: a bf16 score matrix would be 4 * 32768^2 * 2 bytes = 8 GiB.
    assert extra <= outputs + (2 << 20), f"forward allocated {extra} bytes beyond its outputs ({outputs})"


def test_prebuilt_module_runs_without_a_compiler(tmp_path):
    spec = flashgen.KernelSpec(head_dim=64, block_m=128, block_n=64, causal=True)
    out = run_prebuilt(tmp_path, spec, """
        q, k, v = (torch.randn(2, 4, 999, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = module.attention(q, k, v)
        ref = naive_attention(q, k, v, causal=True)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 2e-2, err
        print("ok", module.spec.name, err)
    """)
    assert out.startswith("ok")


def test_prebuilt_module_casts_fp32_under_autocast_like_attention(tmp_path):
    """A prebuilt module runs through attention()'s own path: autocast included."""
    spec = flashgen.KernelSpec(head_dim=64, block_m=128, block_n=64, causal=True)
    out = run_prebuilt(tmp_path, spec, """
        q, k, v = (torch.randn(1, 2, 100, 64, device="cuda") for _ in range(3))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module.attention(q, k, v)
        low = [t.bfloat16() for t in (q, k, v)]
        ref = naive_attention(*low, causal=True)
        ref_lp = naive_attention(*low, causal=True, upcast=False)
        assert out.dtype == torch.bfloat16, out.dtype
        err, bound = (out.float() - ref.float()).abs().max().item(), 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5
        assert err <= bound, (err, bound)  # the numerics rule
        print("ok", err)
    """)
    assert out.startswith("ok")


@pytest.mark.parametrize("batch, heads, kv_heads", [(1, 70_000, 70_000), (1, 70_000, 14_000), (70_000, 1, 1)])
def test_more_than_65535_heads_or_batches(batch, heads, kv_heads):
    """A grid's y and z stop at 65,535: such calls run in slices, every head and batch computed."""
    q, k, v = make_qkv(batch, heads, kv_heads, 8, 8, 32, torch.bfloat16)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    check_against_reference(q, k, v, True, out, lse)


def test_more_than_2_to_the_31_elements():
    """Offsets past 2**31 elements: 131,080 heads of 64 x 256 (2**31 + 2**21 elements a tensor);
    heads beyond the 2**31-th element are checked against the reference one by one."""
    heads, seqlen, head_dim = 131_080, 64, 256
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    assert q.numel() > 2**31
    with torch.no_grad():
        out, lse = flashgen.attention(q, k, v, return_lse=True)
        for head in (0, 65_535, 65_536, 131_071, 131_072, heads - 1):
            one = slice(head, head + 1)
            check_against_reference(q[:, one], k[:, one], v[:, one], False, out[:, one], lse[:, one])


def test_hopper_forward_is_the_default_on_hopper_and_mma_sync_for_short_queries():
    from flashgen import plans

    if plans.device_arch(0) != "sm_90a":
        pytest.skip("the Hopper family needs sm_90a")
    assert plans.forward(0, 128, torch.bfloat16, True, 1000, "").kernels[0].spec.kind == "fwd_sm90"
    assert plans.forward(0, 128, torch.bfloat16, True, 64, "").kernels[0].spec.kind == "fwd"


def test_tensor_maps_are_encoded_on_a_thread_with_no_current_context():
    """The autograd thread may start a backward with no context current (and each launch puts back
    what it found, none included): the driver encodes a tensor map only under one (else
    CUDA_ERROR_INVALID_CONTEXT), so flashgen makes the tensor's device's current for it."""
    from flashgen import plans, runtime

    if plans.device_arch(0) != "sm_90a":
        pytest.skip("the Hopper family needs sm_90a")
    q, k, v = make_qkv(1, 2, 2, 333, 333, 128, torch.bfloat16)

    def encode_then_run():
        descriptor = runtime._encode_tensor_map(k, 64, 64)
        current = ctypes.c_void_p()
        runtime.driver().cuCtxGetCurrent(ctypes.byref(current))
        runtime.driver().cuCtxSetCurrent(None)
        return descriptor, current.value, flashgen.attention(q, k, v, causal=True)

    descriptor, current, out = in_a_thread_with_no_context(encode_then_run)
    assert len(descriptor) == 128 and current is None  # encoded, and the thread keeps no context
    check_against_reference(q, k, v, True, out, flashgen.attention(q, k, v, causal=True, return_lse=True)[1])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_mma_sync_forward_still_runs_on_hopper_when_asked_for(head_dim):
    """The fallback family, chosen explicitly (as a prebuilt module of it would be)."""
    from flashgen.api import call

    spec = tuning.mma_forward_spec(head_dim, "bf16", True, "sm_90a", seqlen_q=4096)
    q, k, v = make_qkv(2, 4, 2, 1000, 1100, head_dim, torch.bfloat16)
    out, lse = call(q, k, v, True, None, True, False, spec=spec)
    check_against_reference(q, k, v, True, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,block_m,block_n", [(64, 192, 128), (96, 128, 128), (128, 128, 128), (256, 128, 80)])
def test_persistent_hopper_forward(head_dim, block_m, block_n, causal):
    """One block per SM walking the tiles: more tiles than SMs (each block takes several, its
    barriers' phases carried from tile to tile), odd lengths, Tq != Tk, GQA, and fewer tiles than SMs."""
    from flashgen.api import call
    from flashgen.plans import device_arch

    if device_arch(0) != "sm_90a":
        pytest.skip("the Hopper family needs sm_90a")
    spec = KernelSpec(head_dim=head_dim, block_m=block_m, block_n=block_n, causal=causal, kind="fwd_sm90", persistent=True)
    for batch, heads, kv_heads, seqlen_q, seqlen_k in ((3, 16, 4, 1999, 2049), (1, 2, 1, 130, 77), (2, 40, 40, 257, 257)):
        q, k, v = make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, seed=seqlen_q + head_dim)
        out, lse = call(q, k, v, causal, None, True, False, spec=spec)
        check_against_reference(q, k, v, causal, out, lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,block_m,block_n,share", [(64, 192, 128, 2), (128, 128, 128, 3), (128, 128, 80, 8)])
def test_exponentials_on_the_fma_pipes(head_dim, block_m, block_n, share, causal, dtype):
    """exp2_fma: a share of the softmax's exponentials as a polynomial on the FMA pipes. Same
    numerics rule; rows that see no key still give 0 and lse -inf (a masked score's exponential is
    exactly 0); with softcap (the multi-function unit's other work) too."""
    from flashgen.api import call
    from flashgen.plans import device_arch

    if device_arch(0) != "sm_90a":
        pytest.skip("the Hopper family needs sm_90a")
    spec = KernelSpec(head_dim=head_dim, block_m=block_m, block_n=block_n, causal=causal, dtype=dtype, kind="fwd_sm90",
                      exp2_fma=share)
    for batch, heads, kv_heads, seqlen_q, seqlen_k in ((2, 4, 2, 1000, 1100), (1, 3, 3, 300, 100), (2, 2, 1, 17, 2049)):
        q, k, v = make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, DTYPES[dtype], seed=seqlen_q + share)
        out, lse = call(q, k, v, causal, None, True, False, spec=spec)
        check_against_reference(q, k, v, causal, out, lse)
    capped = tuning.forward_spec(head_dim, dtype, causal, "sm_90a", 4096, variant=("softcap",)).replace(exp2_fma=share)
    q, k, v = make_qkv(2, 4, 2, 999, 1001, head_dim, DTYPES[dtype], seed=share)
    out = call(q * 4, k, v, causal, None, False, False, spec=capped, softcap=5.0)
    ref = naive_attention(q * 4, k, v, causal=causal, softcap=5.0)
    ref_lp = naive_attention(q * 4, k, v, causal=causal, softcap=5.0, upcast=False)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5, err


def test_prebuilt_hopper_module_runs_without_a_compiler(tmp_path):
    spec = tuning.tuned_spec("fwd_sm90", 128, "bf16", True, "sm_90a")
    out = run_prebuilt(tmp_path, spec, """
        q, k, v = (torch.randn(2, 4, 999, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = module.attention(q, k, v)
        out.sum().backward()
        ref = naive_attention(q, k, v, causal=True)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 2e-2 and q.grad is not None, err
        print("ok", module.spec.name, err)
    """)
    assert out.startswith("ok fwd_sm90_")


def test_sdpa_agreement_for_equal_lengths():
    """Bottom-right causal equals SDPA's is_causal when Tq == Tk."""
    q, k, v = make_qkv(2, 4, 4, 777, 777, 128, torch.float16)
    ours = flashgen.attention(q, k, v, causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ours.float() - theirs.float()).abs().max().item() < 1e-2
    assert math.isfinite(ours.float().sum().item())


def test_autocast_casts_every_floating_input_like_sdpa():
    """SDPA's autocast policy: every floating input but fp64 in the autocast dtype (fp16 ones too,
    and mixed ones)."""
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, torch.float16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for inputs in ((q, k, v), (q, k.float(), v)):
            out = flashgen.attention(*inputs, causal=True)
            theirs = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True)
            assert out.dtype == theirs.dtype == torch.bfloat16
            assert torch.equal(out, flashgen.attention(*(t.bfloat16() for t in inputs), causal=True))


def test_autocast_casts_fp32_inputs_like_sdpa():
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flashgen.attention(q, k, v, causal=True)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == theirs.dtype == torch.bfloat16
    check_against_reference(*(t.to(torch.bfloat16) for t in (q, k, v)), True, out,
                            flashgen.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, return_lse=True)[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_call_on_another_gpu_leaves_the_current_device_alone():
    """Tensors on cuda:1 while device 0 is current: the result is right, and PyTorch's current
    device (which the CUDA runtime reads from the current context) is still 0 afterwards."""
    torch.cuda.set_device(0)
    q, k, v = (t.to("cuda:1") for t in make_qkv(1, 2, 2, 100, 100, 64, torch.bfloat16))
    out = flashgen.attention(q, k, v, causal=True)
    assert torch.cuda.current_device() == 0 and out.device == q.device
    assert torch.empty(1, device="cuda").device == torch.device("cuda:0")
    check_against_reference(q, k, v, True, out, flashgen.attention(q, k, v, causal=True, return_lse=True)[1])
