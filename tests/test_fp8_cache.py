"""FP8 KV caches without a GPU (issue 43's second part): the oracle's quantization and its
dequantized attention, the decode kernels' spec, instructions and resources, the launch values
(stubbed driver), `flashgen build --kv-dtype`, and the named input errors (CPU tensors: every
check runs before the device check)."""

import pytest
import torch
from test_decode import cpu_device  # noqa: F401  (fixture)
from test_launch import driver, stub_kernels, unpack  # noqa: F401  (fixtures)

import flashgen
from flashgen import ops, reference, tuning, variants, workload
from flashgen.compile import compile_ptx, compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def fp8_cache(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 64).clamp(-448, 448).to(E4M3)


def test_quantize_divides_rounds_to_nearest_and_saturates():
    descale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[1.0, 300.0, -1000.0, float("inf")], [3.0, 0.1, -900.0, float("nan")]]])  # (1, heads_kv, 4)
    stored = reference.quantize(x, descale).float()
    assert stored[0, 0].tolist() == [2.0, 448.0, -448.0, 448.0]  # 600 and -2000 saturate, inf too
    assert stored[0, 1, :3].tolist() == [1.5, 0.05078125, -448.0] and stored[0, 1, 3].isnan()  # 0.05 -> nearest e4m3
    assert reference.dequantize(reference.quantize(x, descale), descale, BF16).dtype == torch.float32


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_the_oracle_attends_to_the_dequantized_cache_and_stores_appends_quantized(paged):
    """Over an FP8 cache the oracle is its 16-bit self over the dequantized cache, with the new keys
    and values as they are stored: divided by their descale and rounded to e4m3."""
    batch, kv_heads, d, pages = 2, 2, 64, 12
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, 3, 4, d, generator=gen).to(BF16)
    k, v = (torch.randn(batch, 3, kv_heads, d, generator=gen).to(BF16) for _ in range(2))
    k_descale, v_descale = torch.rand(batch, kv_heads, generator=gen) / 32 + 0.01, torch.rand(batch, kv_heads, generator=gen) / 32 + 0.01
    table = torch.randperm(pages, generator=gen)[:10].view(batch, 5).int() if paged else None
    shape = (pages, 16, kv_heads, d) if paged else (batch, 80, kv_heads, d)
    k_cache, v_cache = fp8_cache(*shape, seed=2), fp8_cache(*shape, seed=3)
    lengths = torch.tensor([20, 61], dtype=torch.int32)
    stored_k, stored_v = k_cache.clone(), v_cache.clone()
    out = reference.attention_with_kvcache(q, stored_k, stored_v, k, v, cache_seqlens=lengths, block_table=table, causal=True,
                                           k_descale=k_descale, v_descale=v_descale)
    # The same by hand: the dequantized caches (each sequence's descale on its rows), the appends quantized.
    wide_k, wide_v = torch.zeros(*shape, dtype=torch.float32), torch.zeros(*shape, dtype=torch.float32)
    for b in range(batch):
        rows = table[b].long() if paged else [b]
        for r in rows:
            wide_k[r] = reference.dequantize(k_cache[r], k_descale[b], BF16)
            wide_v[r] = reference.dequantize(v_cache[r], v_descale[b], BF16)
    new_k = torch.stack([reference.dequantize(reference.quantize(k[b], k_descale[b]), k_descale[b], BF16) for b in range(batch)])
    new_v = torch.stack([reference.dequantize(reference.quantize(v[b], v_descale[b]), v_descale[b], BF16) for b in range(batch)])
    expected = reference.attention_with_kvcache(q.float(), wide_k, wide_v, new_k, new_v, cache_seqlens=lengths, block_table=table,
                                                causal=True)
    assert ((out.float() - expected).abs() <= 2**-8 * expected.abs() + 1e-5).all()  # (out: the fp32 result rounded to bf16)
    for b, length in enumerate(lengths.tolist()):  # the appends: the quantized rows, in place
        for j in range(3):
            pos = length + j
            at = (int(table[b, pos // 16]), pos % 16) if paged else (b, pos)
            assert torch.equal(stored_k[at].view(torch.uint8), reference.quantize(k[b, j], k_descale[b]).view(torch.uint8))
            assert torch.equal(stored_v[at].view(torch.uint8), reference.quantize(v[b, j], v_descale[b]).view(torch.uint8))


def test_an_fp8_cache_is_a_spec_field_the_decode_kinds_take():
    spec = tuning.decode_spec(128, "bf16", "sm_90a", True, 4, kv_dtype="e4m3")
    assert spec.kv_dtype == "e4m3" and "_kve4m3_" in spec.name and spec != spec.replace(kv_dtype="")
    assert KernelSpec(head_dim=128, kind="decode", block_m=64, kv_dtype="bf16").kv_dtype == ""  # dtype's own: one name
    assert spec.smem_bytes < spec.replace(kv_dtype="").smem_bytes  # byte rows in the stages, one wide tile
    with pytest.raises(SpecError, match="kv_dtype='e4m3' on sm_80: an FP8 cache needs a target with FP8 conversions"):
        KernelSpec(head_dim=128, kind="decode", block_m=64, kv_dtype="e4m3", arch="sm_80")
    with pytest.raises(SpecError, match="head_dim=72: an FP8 cache's rows are whole 16-byte chunks"):
        KernelSpec(head_dim=72, kind="decode", block_m=64, kv_dtype="e4m3")
    with pytest.raises(SpecError, match="kv_dtype='fp16': must be one of e4m3"):
        KernelSpec(head_dim=64, kind="decode", block_m=64, kv_dtype="fp16")
    with pytest.raises(SpecError, match="kv_dtype='e4m3': a fwd_sm90 kernel does not use kv_dtype"):
        KernelSpec(head_dim=64, kind="fwd_sm90", block_n=128, num_warps=8, kv_dtype="e4m3")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype, rows", [("bf16", 4), ("fp16", 4), ("bf16", 40)], ids=str)
def test_the_fp8_cache_kernels_hold_their_instructions(dtype, rows, paged):
    """The cache streams in at a byte an element (16-byte cp.async of e4m3 rows), is widened with
    the e4m3x2 conversion, and appends are rounded with satfinite; the 16-bit kernel has none of it.
    A decode block (one warp along the rows) reads the e4m3 tiles with ldmatrix and widens them in
    registers to fp16, its products' type (K's bytes as they come, V's regrouped by dim with prmt);
    a 64-row block widens each tile once in shared memory (8-byte loads), to q's type."""
    spec = tuning.decode_spec(128, dtype, "sm_90a", paged, rows, kv_dtype="e4m3")
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in ("cvt.rn.f16x2.e4m3x2", "cvt.rn.satfinite.e4m3x2.f32", "cp.async.cg.shared.global",
                        "mma.sync.aligned.m16n8k16.row.col.f32"):
        assert instruction in ptx, instruction
    assert ("cvt.rn.bf16x2.f32" in ptx) == (dtype == "bf16")  # (bf16 by way of fp16 and fp32)
    in_registers = spec.block_m == 16
    assert ("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" in ptx and "prmt.b32" in ptx) == in_registers
    assert ("ld.shared.v2.u32" in ptx) == (not in_registers)
    # one warp along the rows: every product in fp16 (the cache widens to it in one cvt), whatever q's type
    assert ("m16n8k16.row.col.f32.bf16.bf16.f32" in ptx) == (dtype == "bf16" and not in_registers)
    assert ("cvt.rn.f16x2.f32" in ptx) == in_registers  # (P, and bf16 Q once)
    stages = {r.name: r.bytes for r in spec.family.smem(spec).regions}["kv"]
    plain_stages = {r.name: r.bytes for r in spec.family.smem(spec.replace(kv_dtype="")).regions}["kv"]
    assert stages < 0.6 * plain_stages  # (bytes a row: d, padded to an odd number of 16-byte units)
    plain = compile_ptx(spec.replace(kv_dtype=""), render(spec.replace(kv_dtype=""))).decode()
    assert "e4m3" not in plain and "ld.shared.v2.u32" not in plain and "x2.trans" not in plain


@pytest.mark.parametrize("head_dim", [32, 80, 112])
def test_fp8_cache_rows_keep_ldmatrix_free_of_bank_conflicts_and_small_tiles_do_not_spill(head_dim):
    """An e4m3 row in the stages is an odd number of 16-byte units (80 dims: 80 bytes; 32: 48), so
    the 8 rows an ldmatrix reads fall in 8 bank groups; the smaller stages let more blocks share an
    SM, but never so many that ptxas is left too few registers (it would spill)."""
    spec = tuning.decode_spec(head_dim, "bf16", "sm_90a", False, 4, kv_dtype="e4m3")
    row = spec.family.cache_row_bytes(spec)
    assert row % 16 == 0 and row // 16 % 2 == 1 and row - head_dim in (0, 16)
    resources = compile_source(spec, render(spec)).resources
    assert resources.spills == 0 and resources.stack_frame == 0


def test_fp8_cache_kernels_compile_on_ada_without_spills():
    for spec in (tuning.decode_spec(128, "bf16", "sm_89", True, 4, kv_dtype="e4m3"),
                 tuning.decode_spec(64, "fp16", "sm_89", False, 40, kv_dtype="e4m3")):
        resources = compile_source(spec, render(spec)).resources
        assert resources.spills == 0 and resources.stack_frame == 0


def test_an_fp8_cache_call_s_values_reach_its_kernel(driver, stub_kernels, cpu_device):
    """attention_with_kvcache over an e4m3 cache: the plan's kernel reads kv_dtype e4m3, and the
    descales (fp32 (batch, heads_kv)) reach its parameters with their strides."""
    q, k = torch.zeros(2, 1, 8, 128, dtype=BF16), torch.zeros(2, 1, 2, 128, dtype=BF16)
    k_cache, v_cache = torch.zeros(50, 16, 2, 128, dtype=E4M3), torch.zeros(50, 16, 2, 128, dtype=E4M3)
    k_descale, v_descale = torch.full((2, 2), 0.5), torch.full((4, 2), 0.25)[::2]
    table = torch.zeros(2, 20, dtype=torch.int32)
    ops.kvcache(q, k_cache, v_cache, k, k, torch.zeros(2, dtype=torch.int32), table, True, 20 * 16, 1, 0.125, True, variants.PLAIN,
                "", None, None, None, None, 1, False, k_descale=k_descale, v_descale=v_descale)  # (checked inputs: past the device check)
    (launch,) = driver.launches
    spec = tuning.decode_spec(128, "bf16", "sm_90a", True, 4, kv_dtype="e4m3")
    got = unpack(spec, launch["params"])
    assert got["k_descale"] == k_descale.data_ptr() and got["v_descale"] == v_descale.data_ptr()
    assert (got["k_descale_batch"], got["k_descale_head"]) == (2, 1) and (got["v_descale_batch"], got["v_descale_head"]) == (4, 1)
    assert got["k_cache_page"] == 16 * 2 * 128 and got["k_cache_row"] == 2 * 128  # (elements: bytes, for e4m3)


def test_fp8_cache_input_errors_are_named():
    q, k = torch.zeros(2, 1, 8, 64, dtype=BF16), torch.zeros(2, 1, 2, 64, dtype=BF16)
    cache = torch.zeros(2, 100, 2, 64, dtype=E4M3)
    descale = torch.ones(2, 2)
    lengths = torch.zeros(2, dtype=torch.int32)
    call = flashgen.attention_with_kvcache
    with pytest.raises(ValueError, match=r"k_cache and v_cache are FP8: pass k_descale, float32 of shape \(batch, heads_kv\) = \(2, 2\)"):
        call(q, cache, cache)
    with pytest.raises(ValueError, match=r"v_descale must be float32 of shape \(batch, heads_kv\) = \(2, 2\); got torch.float32 of shape \(2,\)"):
        call(q, cache, cache, k_descale=descale, v_descale=torch.ones(2))
    with pytest.raises(ValueError, match="k_descale must be float32"):
        call(q, cache, cache, k_descale=descale.double(), v_descale=descale)
    with pytest.raises(TypeError, match="v_cache has dtype torch.float8_e5m2; an FP8 cache is torch.float8_e4m3fn"):
        call(q, cache, cache.to(torch.float8_e5m2), k_descale=descale, v_descale=descale)
    with pytest.raises(TypeError, match="q has dtype torch.float8_e4m3fn; flashgen supports"):
        call(q.to(E4M3), cache, cache, k_descale=descale, v_descale=descale)
    with pytest.raises(ValueError, match=r"k_descale and v_descale are for an FP8 cache \(torch.float8_e4m3fn\); the cache is torch.bfloat16"):
        call(q, cache.to(BF16), cache.to(BF16), k_descale=descale, v_descale=descale)
    with pytest.raises(ValueError, match="head_dim=72 with an FP8 cache: it must be a multiple of 16"):
        call(torch.zeros(2, 1, 8, 72, dtype=BF16), cache[..., :72], cache[..., :72], k_descale=descale, v_descale=descale)
    with pytest.raises(TypeError, match="must share one dtype"):  # the new keys are q's dtype
        call(q, cache, cache, k.to(torch.float16), k.to(torch.float16), cache_seqlens=lengths, k_descale=descale, v_descale=descale)
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):  # (everything else holds: the device check is last)
        call(q, cache, cache, k, k, cache_seqlens=lengths, k_descale=descale, v_descale=descale)


def test_paged_varlen_fp8_cache_input_errors_are_named():
    q = torch.zeros(30, 8, 64, dtype=BF16)
    cache = torch.zeros(10, 16, 2, 64, dtype=E4M3)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 15, 40], dtype=torch.int32)
    table = torch.zeros(2, 5, dtype=torch.int32)
    descale = torch.ones(2, 2)
    call = flashgen.attention_varlen
    with pytest.raises(ValueError, match=r"k and v are FP8: pass k_descale, float32 of shape \(batch, heads_kv\) = \(2, 2\)"):
        call(q, cache, cache, *cu, 20, 25, block_table=table)
    with pytest.raises(ValueError, match="q_descale is for FP8 queries; over a paged FP8 cache"):
        call(q, cache, cache, *cu, 20, 25, block_table=table, q_descale=descale, k_descale=descale, v_descale=descale)
    with pytest.raises(ValueError, match="over a paged FP8 cache the output has q's dtype"):
        call(q, cache, cache, *cu, 20, 25, block_table=table, k_descale=descale, v_descale=descale, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        call(q, cache, cache, *cu, 20, 25, block_table=table, k_descale=descale, v_descale=descale)


def test_build_makes_the_fp8_cache_kernels():
    """`flashgen build --entry kvcache,varlen --kv-dtype same,e4m3`: the decode kernels over both
    caches (each row bucket, contiguous and paged, and the varlen form), and over the 16-bit cache
    alone the paged Hopper forward and its append; the command for an FP8-cache spec says so."""
    load = workload.Workload(head_dims=(128,), entries=("kvcache", "varlen"), kv_dtypes=("", "e4m3"), backward=False)
    specs = load.specs()
    fp8 = [spec for spec in specs if spec.kv_dtype]
    assert {(spec.kind, spec.varlen, spec.block_m) for spec in fp8} == {
        ("decode", False, 16), ("decode", False, 64), ("decode_paged", False, 16), ("decode_paged", False, 64),
        ("decode_paged", True, 16), ("decode_paged", True, 64)}
    assert {spec.kind for spec in specs} >= {"fwd_sm90", "append_paged"} and all(not s.kv_dtype for s in specs if s.kind == "append_paged")
    assert "--kv-dtype e4m3" in workload.command(fp8[0])
    with pytest.raises(SpecError, match="kv_dtypes: 'e5m2' not among"):
        workload.Workload(head_dims=(128,), entries=("kvcache",), kv_dtypes=("e5m2",))


def test_an_fp8_cache_on_a_gpu_without_fp8_is_refused_by_name(driver, stub_kernels, monkeypatch):
    """On an A100 (sm_80: no e4m3 conversions) the call's plan refuses the cache, naming the targets that take it."""
    from flashgen import plans

    monkeypatch.setitem(plans._arch, -1, "sm_80")
    monkeypatch.setitem(plans._sm_counts, -1, 108)
    q, k_cache = torch.zeros(1, 1, 8, 128, dtype=BF16), torch.zeros(1, 64, 2, 128, dtype=E4M3)
    descale = torch.ones(1, 2)
    with pytest.raises(SpecError, match=r"kv_dtype='e4m3' on sm_80: an FP8 cache needs a target with FP8 conversions \(sm_89, sm_90, sm_90a\)"):
        ops.kvcache(q, k_cache, k_cache, None, None, None, None, False, 64, 0, 0.125, False, variants.PLAIN, "", None, None, None, None,
                    1, False, k_descale=descale, v_descale=descale)
