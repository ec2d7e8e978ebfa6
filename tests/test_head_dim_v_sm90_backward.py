"""The sm_90a backward with V's head dim of its own (head_dim_v: DeepSeek's 192 / 128), without a GPU:
q, k, dq and dk have head_dim, v, dO and dv have head_dim_v. V and dO tiles, dV's accumulators and its
staging are d_v's (padded to 64 columns); dP^T = V dO^T runs its k-steps over d_v; S^T, dK and dQ keep
head_dim. Both layouts: block_n=128 (both pads at most 128) and the split block_n=64, where each
consumer warpgroup runs its own instance of the code (the two gradients differ in size)."""

import collections
import functools
import re

import pytest
import torch

from flashgen.compile import compile_ptx, compile_source
from flashgen.render import render
from flashgen.spec import SMEM_LIMIT, KernelSpec, SpecError


def spec(kind, head_dim, head_dim_v, block_n, **fields):
    return KernelSpec(kind=kind, head_dim=head_dim, head_dim_v=head_dim_v, block_m=64, block_n=block_n, **fields)


@functools.cache
def ptx_of(s: KernelSpec) -> str:
    return compile_ptx(s, render(s)).decode()


def wgmma_widths(ptx: str) -> collections.Counter:
    """How many warpgroup MMAs of each N the PTX issues (every loop of the kernel is unrolled)."""
    return collections.Counter(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.", ptx))


def pad64(d: int) -> int:
    return -(-d // 64) * 64


def test_names_fields_and_the_dq_reader():
    s = spec("bwd_sm90_kvq", 192, 128, 64, varlen=True)
    assert s.name.startswith("bwd_sm90_kvq_d192_v128_m64_n64_") and s.d_v == 128
    assert spec("bwd_sm90_kvq", 128, 128, 128).head_dim_v == 0  # the same head dim is no head_dim_v
    reader = s.family.dq_reader(s)  # dQ's fp32 sum is q's: the reader knows nothing of v
    assert (reader.kind, reader.head_dim, reader.head_dim_v) == ("bwd_dq_sm90", 192, 0)
    with pytest.raises(SpecError, match="does not use head_dim_v"):
        KernelSpec(kind="bwd_dq_sm90", head_dim=192, head_dim_v=128, varlen=True)
    # dQ's sum keeps q's padded head dim (160 -> 192), whatever v's (128)
    odd = spec("bwd_sm90_kvq", 160, 128, 64)
    assert odd.family.dq_accum_shape(odd, {"q": torch.empty(2, 3, 100, 160)}) == (2, 3, 128, 192)


@pytest.mark.parametrize("head_dim, head_dim_v, block_n", [(192, 128, 64), (128, 64, 128), (64, 128, 128), (256, 128, 64)])
def test_layout_sizes_v_and_do_by_d_v(head_dim, head_dim_v, block_n):
    """K and Q tiles of head_dim's 64-column chunks, V and dO tiles of head_dim_v's."""
    s = spec("bwd_sm90_kvq", head_dim, head_dim_v, block_n)
    layout, family = s.family.smem(s), s.family
    regions = {r.name: r.bytes for r in layout.regions}
    do_stages = family.do_stages(s)
    assert regions["k"] == pad64(head_dim) * block_n * 2 and regions["v"] == pad64(head_dim_v) * block_n * 2
    assert regions["q"] == s.num_stages * pad64(head_dim) * 64 * 2 and regions["do"] == do_stages * pad64(head_dim_v) * 64 * 2
    assert all(layout.offsets[name] % 1024 == 0 for name in ("k", "v", "q", "do", "ds", "dq"))
    assert layout.size <= SMEM_LIMIT["sm_90a"]
    source = render(s)
    assert f"constexpr int HEAD_DIM_V = {head_dim_v};" in source and f"constexpr int DV_PAD = {pad64(head_dim_v)};" in source
    assert "mbar_arrive_expect_tx(smem + BAR_KV, KV_TILE_BYTES + V_TILE_BYTES);" in source
    assert "mbar_arrive_expect_tx(do_full, DO_TILE_BYTES + STATS_BYTES);" in source


# Both layouts, both kinds, varlen and not, both dtypes: a handful of compiles
COMPILED = [
    spec("bwd_sm90_kvq", 192, 128, 64, causal=True, varlen=True),
    spec("bwd_sm90_kv", 192, 128, 64, dtype="fp16"),
    spec("bwd_sm90_kvq", 128, 64, 128, causal=True, varlen=True),
    spec("bwd_sm90_kv", 64, 128, 128, causal=True),
    spec("bwd_sm90_kvq", 256, 128, 64, causal=True, dtype="fp16"),
]


@pytest.mark.parametrize("s", COMPILED, ids=lambda s: s.name)
def test_compiles_without_spills_with_dv_and_dk_at_their_widths(s):
    source = render(s)
    binary = compile_source(s, source)
    assert binary.resources.spills == 0 and binary.resources.stack_frame == 0, binary.log
    assert "serialized" not in binary.log and "setmaxnreg" not in binary.log, binary.log
    ptx = ptx_of(s)
    assert "ld.local" not in ptx and "mma.sync" not in ptx
    pad, v_pad = pad64(s.head_dim), pad64(s.d_v)
    widths = wgmma_widths(ptx)
    assert widths[v_pad] and widths[pad] and set(widths) <= {64, s.block_m, pad, v_pad}
    # dV's accumulators are d_v's and dK's head_dim's (the wgmma_grads overload their size picks)
    if s.family.split(s):
        assert "constexpr int ACC_TILES = dv_side ? DV_TILES : D_TILES;" in source
        assert "if (cw == 0) consume(Side<true>());" in source
    else:
        assert "float acc_dv[DV_TILES][4], acc_dk[D_TILES][4];" in source
    for width in {pad, v_pad}:
        assert re.search(rf"wgmma_grads\(float \(&d\)\[{width // 8}\]\[4\][^\n]*\n[^\n]*\n\s*\"wgmma\.mma_async\.sync\.aligned"
                         rf"\.m64n{width}k16\.", source)
    if s.varlen:  # dK and dV have strides of their own
        signature = s.family.params(s).signature()
        assert "i64 dk_row, i64 dk_head" in signature and "i64 dv_row, i64 dv_head" in signature and "dkv" not in signature
        assert "store_rows<" in source and ("HEAD_DIM_V>" in source or "OUT_COLUMNS>" in source)


@pytest.mark.parametrize("s, expected", [
    # S^T: head_dim / 16 k-steps, dP^T: d_v / 16 (N = block_m = 64); dV: N = d_v, dK: N = head_dim (4 each: 64 queries)
    (spec("bwd_sm90_kv", 192, 128, 64, dtype="fp16"), {64: 12 + 8, 128: 4, 192: 4}),
    (spec("bwd_sm90_kv", 64, 128, 128, causal=True), {64: 4 + 8 + 4, 128: 4}),  # dK at N = 64
    (spec("bwd_sm90_kv", 128, 64, 64), {64: 8 + 4 + 4, 128: 4}),  # dV at N = 64
], ids=lambda x: x.name if isinstance(x, KernelSpec) else "")
def test_each_product_runs_over_its_own_head_dim(s, expected):
    """Counted in the PTX: with dP^T's k-steps over head_dim (or dV's N) the counts would differ."""
    assert wgmma_widths(ptx_of(s)) == collections.Counter(expected)


@pytest.mark.parametrize("fields, message", [
    ({"head_dim": 192, "head_dim_v": 128, "block_n": 128},
     (r"head_dim=192, head_dim_v=128: a bwd_sm90_kvq kernel with block_n=128 takes head dims up to 128 "
      r"\(each consumer thread would hold dV and dK, 160 fp32\)")),
    ({"head_dim": 64, "head_dim_v": 192, "block_n": 128}, "head_dim_v=192: .* takes head dims up to 128"),
    ({"head_dim": 128, "head_dim_v": 64, "block_m": 128, "block_n": 128}, r"would hold 224 fp32 accumulators \(dV, dK, S\^T, dP\^T\)"),
    ({"head_dim": 192, "head_dim_v": 128, "block_m": 128, "block_n": 64},
     r"head_dim=192, head_dim_v=128: needs 257096 bytes of shared memory \(K and Q tiles of 192 columns, V and dO tiles of 128\)"),
    ({"head_dim": 128, "head_dim_v": 256, "block_m": 128, "block_n": 64}, "head_dim_v=256: needs .* bytes of shared memory"),
    ({"head_dim": 96, "head_dim_v": 128, "block_n": 128, "variants": ("softcap", "alibi")},  # both padded to 128
     "head_dim=96, head_dim_v=128: .* needs 16 registers more than its 192 fp32 accumulators"),
])
def test_refuses_what_cannot_fit(fields, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(**{"kind": "bwd_sm90_kvq", "block_m": 64, **fields})


def test_fits_both_layouts_where_registers_and_shared_memory_allow():
    for head_dim, head_dim_v in ((128, 64), (64, 128), (96, 128), (32, 64)):
        for kind in ("bwd_sm90_kvq", "bwd_sm90_kv"):
            for block_n in (64, 128):
                spec(kind, head_dim, head_dim_v, block_n)
    for head_dim, head_dim_v in ((192, 128), (256, 128), (128, 256), (256, 64), (64, 256)):
        for kind in ("bwd_sm90_kvq", "bwd_sm90_kv"):
            s = spec(kind, head_dim, head_dim_v, 64)
            assert s.family.split(s)
    three = spec("bwd_sm90_kvq", 192, 128, 64, num_stages=3)  # dO tiles of 128 columns: three stages fit
    assert three.family.do_stages(three) == 3


def test_a_spec_without_head_dim_v_renders_none_of_it():
    for block_n in (64, 128):
        source = render(KernelSpec(kind="bwd_sm90_kvq", head_dim=128, block_m=64, block_n=block_n, varlen=True))
        assert not any(word in source for word in ("HEAD_DIM_V", "DV_PAD", "DO_TILE_BYTES", "Side<", "dv_row"))
        assert "i64 dkv_row, i64 dkv_head" in source


@pytest.mark.parametrize("s", [s for s in COMPILED if s.varlen], ids=lambda s: s.name)
def test_parameter_list_matches_the_compiled_kernel(s):
    """dK's and dV's own strides (varlen) in the family's list, from which the host packing is made,
    in the order and types NVRTC laid the kernel's parameters out."""
    entry = re.search(rf"\.entry {s.name}\((.*?)\)", ptx_of(s), re.DOTALL).group(1)
    compiled = re.findall(r"\.param (\.align \d+ \.b8|\.\w+)(?: \.ptr[^ ]*)? (\w+?)(\[\d+\])?,?\n", entry)
    kinds = {"ptr": ".u64", "i64": ".u64", "int": ".u32", "float": ".f32"}
    params = s.family.params(s).params
    assert [(ptype, size) for ptype, _, size in compiled] == [
        (kinds[p.kind], "") if p.kind != "tensormap" else (".align 64 .b8", "[128]") for p in params
    ]
    assert [p.value for p in params if p.name in ("dk_row", "dk_head", "dv_row", "dv_head")] == [
        "dk_stride[0]", "dk_stride[1]", "dv_stride[0]", "dv_stride[1]"]
