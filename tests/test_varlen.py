"""attention_varlen without a GPU: the varlen spec field, its kernels (rendering, NVRTC with no
spills, parameter lists against the PTX, launch packing and plans), the statistics layout, the
reference against naive attention per sequence, and the input errors."""

import math
import random
import re

import pytest
import torch
from test_launch import PTX_TYPES, driver, stub_kernels, stub_tensor_maps, unpack  # noqa: F401  (fixtures)

import flashgen
from flashgen import plans, reference, tuning
from flashgen.compile import compile_ptx, compile_source
from flashgen.families import STATS_PAD
from flashgen.families import hopper
from flashgen.families.backward import padded_varlen
from flashgen.kernels import Kernel
from flashgen.reference import attention_varlen as reference_varlen
from flashgen.reference import naive_attention
from flashgen.render import render
from flashgen.spec import SMEM_LIMIT, KernelSpec, SpecError
from sweeps import group, sweep

# Every spec attention_varlen runs on the H200, and on sm_80 for the head dims test_compile covers.
SHIPPED = tuning.shipped_varlen_specs("sm_90a") + tuning.shipped_varlen_specs("sm_80", head_dims=(64, 128, 256))
SHIPPED += [tuning.fp8_values_spec(128, "sm_90a", varlen=True)]  # the FP8 forward's first step over packed V
FIXED = tuning.shipped_specs("sm_90a") + tuning.shipped_specs("sm_80", head_dims=(64, 128))


# ---- the spec field ------------------------------------------------------------------------------


def test_varlen_is_a_spec_field_named_only_when_set():
    spec = KernelSpec(head_dim=64, causal=True, varlen=True)
    assert spec.name == "fwd_d64_m128_n64_bf16_causal_w4_s2_sm90a_varlen"
    assert spec.replace(varlen=False).name == "fwd_d64_m128_n64_bf16_causal_w4_s2_sm90a"
    assert KernelSpec.from_json(spec.canonical()) == spec and spec.ident != spec.replace(varlen=False).ident
    with pytest.raises(SpecError, match="varlen=1: must be True or False"):
        KernelSpec(head_dim=64, varlen=1)


def test_the_varlen_hopper_forward_runs_one_tile_per_cta():
    with pytest.raises(SpecError, match="varlen=True, persistent=True"):
        KernelSpec(head_dim=128, block_m=128, block_n=128, kind="fwd_sm90", varlen=True, persistent=True)


def test_mma_families_do_not_take_persistent():
    """They have no persistent schedule: the field would name a second spec for one kernel."""
    with pytest.raises(SpecError, match="a fwd kernel does not use persistent"):
        KernelSpec(head_dim=64, persistent=True)


def test_shipped_varlen_specs_cover_every_family_on_both_targets():
    assert len(set(SHIPPED)) == len(SHIPPED) and all(spec.varlen for spec in SHIPPED)
    no_varlen = {"decode", "decode_paged", "append_paged", "combine", "merge", "merge_fp32",  # the serving kernels have their own
                 "block_mask"}  # user mask rules take fixed-length batches
    assert {spec.kind for spec in SHIPPED} == set(flashgen.families.KINDS) - no_varlen
    assert not any(spec.persistent for spec in SHIPPED)


def test_varlen_table_entries_change_no_fixed_length_choice():
    """The varlen entries of the tuning table match only varlen problems; where they are absent a
    varlen kernel takes the fixed-length tiles."""
    assert not any(spec.varlen for spec in FIXED)
    fixed = tuning.backward_specs(64, "bf16", False, "sm_80", deterministic=True)
    varlen = tuning.backward_specs(64, "bf16", False, "sm_80", deterministic=True, varlen=True)
    assert fixed[0].block_m == 128 and varlen[0].block_m == 64  # bwd_kv: the varlen entry's first tile
    causal = tuning.backward_specs(64, "bf16", True, "sm_80", deterministic=True)
    assert tuning.backward_specs(64, "bf16", True, "sm_80", deterministic=True, varlen=True) == [
        spec.replace(varlen=True) for spec in causal]  # no varlen entry: the same tiles
    hopper = tuning.backward_specs(64, "bf16", True, "sm_90a", deterministic=False)
    assert tuning.backward_specs(64, "bf16", True, "sm_90a", deterministic=False, varlen=True) == [
        spec.replace(varlen=True) for spec in hopper]  # the Hopper backward takes varlen as it is
    entry = next(e for e in tuning.table()["entries"] if e.get("varlen"))
    assert tuning._matches(entry, {**entry, "arch": "sm_90a", "dtype": "bf16", "causal": False, "bucket": "short", "varlen": True})
    assert not tuning._matches(entry, {**entry, "arch": "sm_90a", "dtype": "bf16", "causal": False, "bucket": "short", "varlen": False})


# ---- rendering -------------------------------------------------------------------------------------

TRACES = ("cu_seqlens", "q_start", "k_start", "total_q", "total_k", "_varlen", "stats_rows", "q_rows", "k_rows")


@pytest.mark.parametrize("spec", FIXED[::7], ids=lambda spec: spec.name)
def test_a_fixed_length_spec_renders_no_trace_of_varlen(spec):
    source = render(spec)
    assert not [trace for trace in TRACES if trace in source]
    assert "block.rows(" in source or spec.kind.startswith(("fwd_sm90", "bwd_sm90"))  # TMA coordinates instead


def test_the_mma_forward_finds_its_sequence_and_exits_past_its_end():
    source = render(KernelSpec(head_dim=64, causal=True, varlen=True))
    for piece in (
        "const BlockInfo block = block_info(cu_seqlens_q, cu_seqlens_k, total_q, total_k);",
        "if (block.tile >= m_blocks) return;",
        "const int m0 = (m_blocks - 1 - block.tile) * BLOCK_M;",
        "k += block.k_rows(k_row, k_head, block.head / kv_group);",
        "q + block.q_rows(q_row, q_head, block.head) + m0 * q_row",
        "lse + i64(block.head) * total_q + block.q_start",
        "const elem_t* __restrict__ q, i64 q_row, i64 q_head,",
        "min(max(__ldg(cu_seqlens + batch), 0), total)",  # offsets clamped into the tensors
    ):
        assert piece in source, piece
    assert "block.rows(" not in source and "q_batch" not in source


def test_the_hopper_forward_offsets_its_maps_and_clips_partial_tiles():
    spec = KernelSpec(head_dim=128, block_m=128, block_n=128, causal=True, kind="fwd_sm90", varlen=True)
    source = render(spec)
    for piece in (
        "block.k_start + n0, tl.kv_head, 0,",  # K and V: the sequence's rows of a batch of one
        "block.q_start + tl.m0, tl.head, 0,",
        "if (block.tile >= num_m_blocks) return;",
        "if (wg_rows > 0 && wg_rows < 64) {",  # a partial tile: plain stores, rows before the end only
        "store_rows<HEAD_DIM_V>(o_ptr + block.q_rows(o_row, o_head, tl.head) + i64(wg_row) * o_row, o_row, o_s,",
        "if (r < rows)",
        "if (wg_rows >= 64) {",  # only whole tiles go through TMA
        "block.q_start + wg_row, tl.head, 0);",
        "elem_t* __restrict__ o_ptr, i64 o_row, i64 o_head,",
    ):
        assert piece in source, piece


def test_the_backward_kernels_read_statistics_by_sequence():
    prep = render(tuning.backward_prep(64, "bf16", "sm_90a", varlen=True))
    assert "block.stats_rows(block.head, padded_q) + row" in prep and "block_info(cu_seqlens_q, total_q)" in prep
    assert f"(seqlen_q + {STATS_PAD} - 1) / {STATS_PAD} * {STATS_PAD})" in prep  # past its padded rows
    kvq = render(tuning.tuned_spec("bwd_kvq", 128, "bf16", True, "sm_90a").replace(varlen=True))
    assert "block.stats_rows(head, padded_q) + m0 + chunk * 4" in kvq and "if (n0 >= seqlen_k) return;" in kvq
    assert "dq_accum + (i64(block.q_start + row) * q_heads + head) * HEAD_DIM" in kvq and "dst + row8 + j * 8" in kvq
    dq = render(tuning.tuned_spec("bwd_q", 128, "bf16", True, "sm_90a").replace(varlen=True))
    assert "block.stats_rows(block.head, padded_q) + m0" in dq and "if (block.tile >= m_blocks) return;" in dq


@pytest.mark.parametrize("head_dim, block_n", [(128, 128), (256, 64)])  # the two layouts
def test_the_hopper_backward_offsets_its_maps_masks_the_next_sequence_and_clips_partial_tiles(head_dim, block_n):
    spec = KernelSpec(head_dim=head_dim, block_m=64, block_n=block_n, kind="bwd_sm90_kvq", varlen=True)
    source = render(spec)
    fixed = render(spec.replace(varlen=False))
    for piece in (
        "if (n0 >= seqlen_k) return;",  # past the sequence's end
        "&k_map, c * 64, block.k_start + n0, kv_head, 0, smem + BAR_KV);",  # a batch of one, at the sequence's rows
        "&q_map, c * 64, block.q_start + m0, head, 0, q_full);",
        "const i64 stats_row = block.stats_rows(head, padded_q) + m0;",
        "const int dq_row = int(block.stats_rows(0, padded_q)) + m0",  # dQ in the statistics' rows
        "store_rows<HEAD_DIM>(",  # its rows inside the sequence leave as plain stores
        "elem_t* __restrict__ dk, elem_t* __restrict__ dv,\n    i64 dkv_row, i64 dkv_head,",
    ):
        assert piece in source and piece not in fixed, piece
    assert "const int dq_row = m0 + " in fixed and "dq_row, head, batch);" in fixed and "dq_row, head, 0);" in source
    # a key tile that crosses the end is partial: the next sequence's keys (varlen), or the zeros past
    # the tensor (fixed length), are masked
    for piece in ("> seqlen_k;", "mask.outside(m0 + col + (e & 1), key0 + (e / 2) * 8)) p = 0.f;"):
        assert piece in source and piece in fixed, piece


def test_the_varlen_hopper_backward_reads_its_dq_back_with_a_kernel(driver, stub_kernels, stub_tensor_maps):  # noqa: F811
    heads, d = 2, 128
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32)
    q = packed(cu, heads, d)
    forward = KernelSpec(head_dim=d, block_m=128, block_n=128, kind="fwd_sm90", varlen=True, causal=True).canonical()
    plan = plans.backward_varlen(-1, d, torch.bfloat16, True, False, forward)
    assert [k.spec.kind for k in plan.kernels] == ["bwd_prep", "bwd_sm90_kvq", "bwd_dq_sm90"]
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    values = dict(q=q, k=q, v=q, o=q, d_o=q, lse=torch.zeros(heads, len(q)), d_lse=None, dq=dq, dk=dk, dv=dv, dq_accum=None,
                  scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=257, max_seqlen_k=257)
    plan.run(-1, values)
    padded_q = padded_varlen(len(q), 3)
    assert values["dq_accum"].shape == (1, heads, padded_q, d) and values["delta"].shape == (heads, padded_q)
    main, reader = (unpack(k.spec, launch["params"]) for k, launch in zip(plan.kernels[1:], driver.launches[1:]))
    assert driver.launches[1]["grid"] == (-(-257 // 128), heads, 3)  # key tiles of the longest sequence
    accum = values["dq_accum"].data_ptr()
    assert reader["dq_accum"] == accum and main["dq_map"] == accum.to_bytes(8, "little") * 15 + (64).to_bytes(8, "little")
    assert reader["dq"] == dq.data_ptr() and reader["padded_q"] == padded_q and reader["total_q"] == len(q)
    prep = unpack(plan.kernels[0].spec, driver.launches[0]["params"])  # which writes the sum's zeros, all of it
    assert prep["dq_accum"] == accum and prep["dq_accum_size"] == values["dq_accum"].numel()
    assert driver.launches[2]["grid"] == (-(-257 // 64), heads, 3)  # 64-row pieces of the longest sequence
    with pytest.raises(SpecError, match="varlen=False: a bwd_dq_sm90 kernel reads back the varlen layout only"):
        KernelSpec(head_dim=d, kind="bwd_dq_sm90")


# ---- NVRTC ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", sweep(SHIPPED))
def test_shipped_varlen_spec_compiles_without_spills(spec):
    binary = compile_source(spec, render(spec))
    res = binary.resources
    assert 0 < res.registers <= 255, binary.log
    assert res.spills == 0 and res.stack_frame == 0, binary.log
    assert "setmaxnreg" not in binary.log and "serialized" not in binary.log, binary.log
    assert spec.smem_bytes + res.static_smem <= SMEM_LIMIT[spec.arch]


ONE_OF_EACH_KIND = [
    KernelSpec(head_dim=64, causal=True, varlen=True),
    KernelSpec(head_dim=96, block_m=128, block_n=128, causal=True, kind="fwd_sm90", varlen=True),
    tuning.backward_prep(96, "fp16", "sm_90a", varlen=True),
    *(tuning.tuned_spec(kind, 128, "bf16", True, "sm_90a").replace(varlen=True) for kind in ("bwd_kvq", "bwd_kv", "bwd_q")),
    *(tuning.tuned_spec(kind, 256, "bf16", False, "sm_90a").replace(varlen=True) for kind in ("bwd_v", "bwd_kq")),
    tuning.tuned_spec("bwd_kvq", 64, "bf16", False, "sm_80").replace(varlen=True),
    *(tuning.tuned_spec(kind, d, "bf16", True, "sm_90a").replace(varlen=True) for kind, d in (("bwd_sm90_kvq", 128), ("bwd_sm90_kv", 256))),
    KernelSpec(head_dim=80, dtype="fp16", kind="bwd_dq_sm90", varlen=True),
]


@pytest.mark.parametrize("spec", ONE_OF_EACH_KIND, ids=lambda spec: spec.name)
def test_parameter_list_matches_the_compiled_kernel(spec):
    ptx = compile_ptx(spec, render(spec)).decode()
    entry = re.search(rf"\.entry {spec.name}\((.*?)\)", ptx, re.S).group(1)
    compiled = re.findall(r"\.param (\.align \d+ \.b8|\.\w+)(?: \.ptr[^ ]*)? (\w+?)(\[\d+\])?,?\n", entry)
    params = spec.family.params(spec).params
    assert [(ptype, size) for ptype, _, size in compiled] == [
        (PTX_TYPES[p.kind], "") if p.kind != "tensormap" else (".align 64 .b8", "[128]") for p in params
    ]


@pytest.mark.parametrize("head_dim", [128, 256])  # the two layouts
def test_the_hopper_backward_still_holds_the_hopper_instructions(head_dim):
    spec = tuning.tuned_spec("bwd_sm90_kvq", head_dim, "bf16", True, "sm_90a").replace(varlen=True)
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in ("wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier",
                        "cp.async.bulk.tensor.4d.global.shared::cta", "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile",
                        "setmaxnreg.inc", "ld.shared.v4.u32"):  # (the last: a tail tile's plain stores of dK and dV)
        assert instruction in ptx, instruction
    assert "ld.local" not in ptx and "mma.sync" not in ptx


def test_the_hopper_forward_still_holds_the_hopper_instructions():
    spec = KernelSpec(head_dim=128, block_m=128, block_n=128, causal=True, kind="fwd_sm90", varlen=True)
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in ("wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.4d.global.shared::cta", "setmaxnreg.inc", "ld.shared.v4.u32"):
        assert instruction in ptx, instruction
    assert "ld.local" not in ptx


# ---- launches and plans (the driver is stubbed) -------------------------------------------------------


def packed(cu, heads, d, dtype=torch.bfloat16):
    return torch.zeros(cu[-1], heads, d, dtype=dtype)


def test_forward_launch_packs_offsets_totals_and_the_grid(driver):  # noqa: F811
    spec = KernelSpec(head_dim=64, block_m=128, causal=True, varlen=True)
    cu_q, cu_k = torch.tensor([0, 300, 300, 317], dtype=torch.int32), torch.tensor([0, 200, 250, 260], dtype=torch.int32)
    qkv = torch.zeros(317, 3, 4, 64, dtype=torch.bfloat16)  # a packed qkv projection: strided views
    q, k, v = qkv[:, 0], qkv[:260, 1, :2], qkv[:260, 2, :2]
    o, lse = torch.empty(317, 4, 64, dtype=torch.bfloat16), torch.empty(4, 317)
    Kernel(spec, b"").launch(-1, dict(q=q, k=k, v=v, o=o, lse=lse, scale=0.125, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300))
    (launch,) = driver.launches
    assert launch["grid"] == (3, 4, 3)  # tiles of the longest sequence, heads, sequences
    values = unpack(spec, launch["params"])
    assert values == pytest.approx({
        "q": q.data_ptr(), "q_row": 3 * 4 * 64, "q_head": 64, "k": k.data_ptr(), "k_row": 3 * 4 * 64, "k_head": 64,
        "v": v.data_ptr(), "v_row": 3 * 4 * 64, "v_head": 64, "o": o.data_ptr(), "o_row": 4 * 64, "o_head": 64,
        "lse": lse.data_ptr(), "cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_k": cu_k.data_ptr(),
        "total_q": 317, "total_k": 260, "kv_group": 2, "scale_log2": 0.125 * LOG2E,
    })


LOG2E = 1.4426950408889634


VARLEN_BACKWARD_KINDS = {  # (arch, deterministic) -> the kernels the plan runs
    ("sm_80", False): ["bwd_prep", "bwd_kvq"], ("sm_80", True): ["bwd_prep", "bwd_kv", "bwd_q"],
    ("sm_90a", False): ["bwd_prep", "bwd_sm90_kvq", "bwd_dq_sm90"], ("sm_90a", True): ["bwd_prep", "bwd_sm90_kv", "bwd_q"],
}


@pytest.mark.parametrize("arch, deterministic", VARLEN_BACKWARD_KINDS)
def test_backward_plan_scratch_is_laid_out_by_sequence(driver, stub_kernels, stub_tensor_maps, arch, deterministic):  # noqa: F811
    heads, d = 3, 64
    cu = torch.tensor([0, 70_000, 70_001, 70_100], dtype=torch.int32)  # more rows than a grid's y or z
    q = packed(cu, heads, d)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    forward = KernelSpec(head_dim=d, causal=True, varlen=True, arch=arch).canonical()
    plan = plans.backward_varlen(-1, d, torch.bfloat16, True, deterministic, forward)
    values = dict(q=q, k=q, v=q, o=q, d_o=q, lse=torch.zeros(heads, len(q)), d_lse=None, dq=dq, dk=dk, dv=dv, dq_accum=None,
                  scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70_000, max_seqlen_k=70_000)
    plan.run(-1, values)
    assert plan.whole and len(driver.launches) == len(plan.kernels)  # one launch each: no slices
    assert values["delta"].shape == values["lse_log2"].shape == (heads, padded_varlen(len(q), 3))
    prep = driver.launches[0]
    rows_per_block = 128 // 8
    assert prep["grid"] == (-(-70_000 // STATS_PAD) * STATS_PAD // rows_per_block, heads, 3)
    main = unpack(plan.kernels[1].spec, driver.launches[1]["params"])
    assert main["padded_q"] == values["delta"].shape[1] and main["total_q"] == len(q)
    kinds = [spec.kind for spec in (k.spec for k in plan.kernels)]
    assert kinds == VARLEN_BACKWARD_KINDS[arch, deterministic]
    assert all(spec.varlen for spec in (k.spec for k in plan.kernels))
    if not deterministic and arch == "sm_80":  # the key-major sum is laid out like q and cast at the end
        assert values["dq_accum"].shape == q.shape and isinstance(plan.steps[-1], plans.Convert)


def stats_rows(cu: list[int], pad: int = STATS_PAD) -> list[range]:
    """block_info's stats_rows in Python: sequence b's padded statistics rows."""
    return [range((a + b * pad) // pad * pad, (a + b * pad) // pad * pad + -(-(c - a) // pad) * pad)
            for b, (a, c) in enumerate(zip(cu, cu[1:]))]


@pytest.mark.parametrize("seed", range(20))
def test_statistics_rows_of_sequences_are_disjoint_and_inside_the_buffer(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 17, 127, 128, 129, 1000, rng.randrange(300)]) for _ in range(rng.randrange(1, 12))]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    rows = stats_rows(cu)
    size = padded_varlen(cu[-1], len(lengths))
    assert size % STATS_PAD == 0
    for a, b in zip(rows, rows[1:]):
        assert a.stop <= b.start
    assert all(r.start % STATS_PAD == 0 and r.stop <= size for r in rows)
    # Offsets the kernel clamped out of any order still land inside the buffer.
    wild = sorted(min(max(rng.randrange(-5, cu[-1] + 5), 0), cu[-1]) for _ in cu)
    assert all(r.stop <= size for r in stats_rows(wild))


# ---- the reference -------------------------------------------------------------------------------------


def varlen_inputs(lengths_q, lengths_k, heads=4, kv_heads=2, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, d, generator=gen, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, d, generator=gen, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, d, generator=gen, dtype=dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_is_naive_attention_of_each_sequence(causal):
    lengths_q, lengths_k = [1, 17, 13, 0, 40, 5], [3, 9, 13, 7, 0, 30]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lengths_q, lengths_k)
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=0.3, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))]
        ref, ref_lse = naive_attention(*one, causal=causal, scale=0.3, return_lse=True)
        torch.testing.assert_close(out[rows], ref[0].transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], atol=1e-6, rtol=0)
    # A sequence with no keys (and, causal, a query before its sequence's first key) sees nothing.
    assert torch.equal(out[cu_q[4]:cu_q[5]], torch.zeros_like(out[cu_q[4]:cu_q[5]]))
    assert torch.isneginf(lse[:, cu_q[4]:cu_q[5]]).all()


def test_reference_causal_is_bottom_right_in_each_sequence():
    """Query i of a sequence sees key j iff j <= i + len_k - len_q. With equal scores each output
    is the mean of the values a row sees; value j is the key's packed index."""
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs([3, 2], [4, 5], heads=1, kv_heads=1, d=8)
    q = torch.zeros_like(q)
    v = torch.arange(len(k), dtype=torch.float32)[:, None, None].expand(v.shape).contiguous()
    out = reference_varlen(q, k, v, cu_q, cu_k, 3, 5, causal=True)
    # sequence 0: 3 queries on keys 0..3 see 0..1, 0..2, 0..3; sequence 1: 2 queries on keys 4..8 see 4..7, 4..8
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([0.5, 1.0, 1.5, 5.5, 6.0]))


def test_reference_is_differentiable_and_reads_gqa_heads():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs([5, 7], [6, 2], heads=4, kv_heads=2)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).square().sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0
    out = reference_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k)
    alone = reference_varlen(q.detach()[:, 2:3], k.detach()[:, 1:2], v.detach()[:, 1:2], cu_q, cu_k, max_q, max_k)
    torch.testing.assert_close(out[:, 2:3], alone)  # query heads 2, 3 read key/value head 1


@pytest.mark.parametrize("cu, message", [
    ([1, 3, 7], r"cu_seqlens_q\[0\] = 1: the offsets must start at 0"),
    ([0, 5, 3, 7], r"cu_seqlens_q must be non-decreasing; cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 5"),
    ([0, 3, 6], r"cu_seqlens_q\[-1\] = 6, but q has 7 rows"),
    ([0, 1, 7], r"max_seqlen_q=5, but a sequence has 6 rows"),
])
def test_reference_checks_the_values_attention_varlen_cannot_read(cu, message):
    q, k, v, _, cu_k, _, _ = varlen_inputs([3, 4], [3, 4])
    cu_q = torch.tensor(cu, dtype=torch.int32)
    cu_k = cu_k if len(cu) == 3 else torch.tensor([0, 2, 4, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        reference_varlen(q, k, v, cu_q, cu_k, 5, 7)


# ---- input errors (CPU tensors: every check before the device check) ----------------------------------


def inputs(**changes):
    base = dict(q=torch.zeros(30, 4, 64, dtype=torch.bfloat16), k=torch.zeros(20, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(20, 2, 64, dtype=torch.bfloat16), cu_seqlens_q=torch.tensor([0, 10, 30], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 20], dtype=torch.int32), max_seqlen_q=20, max_seqlen_k=15)
    return {**base, **changes}


BAD = [
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor, got list"),
    (dict(cu_seqlens_k=[0, 5, 20]), TypeError, "cu_seqlens_k must be a torch.Tensor, got list"),
    (dict(q=torch.zeros(1, 30, 4, 64, dtype=torch.bfloat16)), ValueError, r"q must have 3 dimensions \(total_q, heads, head_dim\): packed .* got shape \(1, 30, 4, 64\)"),
    (dict(k=torch.zeros(20, 128, dtype=torch.bfloat16)), ValueError, r"k must have 3 dimensions \(total_k, heads_kv, head_dim\)"),
    (dict(q=torch.zeros(30, 4, 64)), TypeError, "q has dtype torch.float32; flashgen supports torch.float16 and torch.bfloat16"),
    (dict(v=torch.zeros(20, 2, 64, dtype=torch.float16)), TypeError, "share one dtype; got q torch.bfloat16, k torch.bfloat16, v torch.float16"),
    (dict(v=torch.zeros(19, 2, 64, dtype=torch.bfloat16)), ValueError, r"k and v must have the same shape \(total_k, heads_kv\); got k \(20, 2\), v \(19, 2\)"),
    (dict(k=torch.zeros(20, 3, 64, dtype=torch.bfloat16), v=torch.zeros(20, 3, 64, dtype=torch.bfloat16)), ValueError, "q has 4 heads and k, v have 3: .* multiple"),
    (dict(k=torch.zeros(20, 2, 32, dtype=torch.bfloat16), v=torch.zeros(20, 2, 32, dtype=torch.bfloat16)), ValueError, "same head_dim; got q 64, k 32"),
    (dict(q=torch.zeros(30, 4, 100, dtype=torch.bfloat16), k=torch.zeros(20, 2, 100, dtype=torch.bfloat16), v=torch.zeros(20, 2, 100, dtype=torch.bfloat16)),
     ValueError, r"head_dim=100 is not supported: it must be a multiple of 8 in \[8, 256\]"),
    (dict(q=torch.zeros(30, 64, 4, dtype=torch.bfloat16).transpose(1, 2)), ValueError, "q's last dimension must be contiguous"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30])), TypeError, r"cu_seqlens_q must have dtype torch.int32, got torch.int64; cast with .to\(torch.int32\)"),
    (dict(cu_seqlens_k=torch.tensor([[0, 5, 20]], dtype=torch.int32)), ValueError, r"cu_seqlens_k must have shape \(batch \+ 1,\).* got shape \(1, 3\)"),
    (dict(cu_seqlens_q=torch.tensor([], dtype=torch.int32)), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 20], dtype=torch.int32)), ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same shape \(batch \+ 1,\); got cu_seqlens_q \(3,\), cu_seqlens_k \(2,\)"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q=-1: must be a non-negative int"),
    (dict(max_seqlen_k=15.0), ValueError, "max_seqlen_k=15.0: must be a non-negative int"),
    (dict(max_seqlen_k=True), ValueError, "max_seqlen_k=True: must be a non-negative int"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q=0 but q has 30 rows"),
    (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32), cu_seqlens_k=torch.tensor([0], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q holds no sequence \(shape \(1,\)\) but q has 30 rows"),
    (dict(cu_seqlens_q=torch.zeros(70_002, dtype=torch.int32), cu_seqlens_k=torch.zeros(70_002, dtype=torch.int32)), ValueError,
     "at most 65,535 sequences and 65,535 query heads a call"),
    (dict(k=torch.zeros(20, 2, 64, dtype=torch.bfloat16, device="meta")), ValueError, "must be on one device; got q cpu, k meta"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")), ValueError, "must be on one device; .* cu_seqlens_q meta"),
    ({}, ValueError, "flashgen.attention_varlen runs on NVIDIA GPUs: q, k, v, cu_seqlens_q, cu_seqlens_k.* are on cpu"),
]


@pytest.mark.parametrize("changes, error, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_input_raises_a_named_error(changes, error, message):
    with pytest.raises(error, match=message):
        flashgen.attention_varlen(**inputs(**changes))


@pytest.mark.parametrize("dropout_p", [0.1, -0.5, "0", True, None])
def test_dropout_is_refused_not_ignored(dropout_p):
    for fn in (flashgen.attention_varlen, reference.attention_varlen):
        with pytest.raises(ValueError, match=f"dropout_p={dropout_p!r}: flashgen computes exact attention without dropout; pass 0.0"):
            fn(**inputs(), dropout_p=dropout_p)


def test_flash_attn_varlen_funcs_argument_order():
    """dropout_p 0.0 by position or by name, then softmax_scale and causal by position, as callers of
    flash_attn_varlen_func write them."""
    args = inputs()
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    positional = [args[name] for name in names]
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        flashgen.attention_varlen(*positional, 0.0, 0.125, True)
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        flashgen.attention_varlen(*positional, dropout_p=0, softmax_scale=0.125, causal=True)
    q, k, v = (torch.randn(t.shape) for t in positional[:3])
    by_position = reference.attention_varlen(q, k, v, *positional[3:], 0.0, 0.125, True)
    assert torch.equal(by_position, reference.attention_varlen(q, k, v, *positional[3:], softmax_scale=0.125, causal=True))


def test_bad_softmax_scale_is_named():
    from flashgen.inputs import softmax_scale

    with pytest.raises(ValueError, match="softmax_scale=-1.0: must be a positive finite number"):
        softmax_scale(-1, 64)
    assert softmax_scale(None, 64) == 0.125 and math.isclose(softmax_scale(0.5, 64), 0.5)


def test_alignment_keeps_usable_packed_views_and_copies_the_rest():
    from flashgen.inputs import aligned

    qkv = torch.zeros(10, 3, 4, 64)
    view = qkv[:, 1]  # row stride 3 * 4 * 64: usable as is
    assert aligned(view) is view
    odd = torch.zeros(10, 4, 68)[..., :64]
    assert aligned(odd) is not odd and aligned(odd).is_contiguous()
    broadcast = torch.ones(10, 1, 1).expand(10, 4, 64)
    assert aligned(broadcast).stride(-1) == 1


# ---- the variants (window_size, softcap, alibi_slopes) ------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", [dict(window_size=(3, 2)), dict(window_size=(0, -1)), dict(softcap=2.0),
                                     dict(alibi_slopes="heads"), dict(alibi_slopes="batch"),
                                     dict(window_size=(5, 0), softcap=1.5, alibi_slopes="batch")], ids=str)
def test_reference_variants_are_naive_attention_of_each_sequence(variant, causal):
    """Aligned to each sequence's own end; per-sequence slopes are the sequence's row of (batch, heads)."""
    lengths_q, lengths_k = [1, 17, 13, 0, 9], [3, 9, 13, 7, 30]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lengths_q, lengths_k, seed=3)
    slopes = {"heads": torch.rand(4), "batch": torch.rand(5, 4)}
    variant = {**variant, **({"alibi_slopes": slopes[variant["alibi_slopes"]]} if "alibi_slopes" in variant else {})}
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, **variant)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))]
        mine = dict(variant)
        if "alibi_slopes" in mine and mine["alibi_slopes"].dim() == 2:
            mine["alibi_slopes"] = mine["alibi_slopes"][b]
        ref, ref_lse = naive_attention(*one, causal=causal, **mine, return_lse=True)
        torch.testing.assert_close(out[rows], ref[0].transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[:, rows], ref_lse[0], atol=1e-6, rtol=0)


VARIANT_ERRORS = [
    (dict(window_size=(1, 2, 3)), ValueError, "window_size=.*: must be \\(left, right\\)"),
    (dict(window_size=(-2, 0)), ValueError, "window_size=\\(-2, 0\\)"),
    (dict(softcap=-1.0), ValueError, "softcap=-1.0: must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap=nan"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes has shape \(3,\); it must be \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"alibi_slopes has shape \(3, 4\); it must be \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes has dtype torch.float16; it must be torch.float32"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes is on meta, the inputs on cpu"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("changes, error, message", VARIANT_ERRORS, ids=[m[:40] for _, _, m in VARIANT_ERRORS])
def test_bad_variants_raise_named_errors(changes, error, message):
    """Before the device check (CPU tensors), in attention_varlen and in its reference; the batch
    of (batch, heads) slopes is the number of sequences."""
    with pytest.raises(error, match=message):
        flashgen.attention_varlen(**inputs(), **changes)
    with pytest.raises(error, match=message):
        reference_varlen(**inputs(), **changes)


def test_good_variants_reach_the_device_check():
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        flashgen.attention_varlen(**inputs(), window_size=(8, 0), softcap=3.0, alibi_slopes=torch.ones(2, 4), causal=True)


def test_variant_plans_pick_the_variant_kernels_and_pack_their_values(driver, stub_kernels, monkeypatch):  # noqa: F811
    """Forward (short: the mma.sync kernel) and backward plans of a variant call carry its fields;
    each kernel gets the window's bounds (unbounded: 1 << 30), the cap's scale and the slopes with
    their per-sequence stride."""
    from flashgen import variants

    monkeypatch.setitem(plans._arch, -1, "sm_90a")
    cu = torch.tensor([0, 40, 60], dtype=torch.int32)
    q = packed(cu, 4, 64)
    slopes = torch.ones(2, 4)
    forward = plans.forward_varlen(-1, 64, torch.bfloat16, True, 40, "", ("window", "softcap", "alibi"))
    (spec,) = [kernel.spec for kernel in forward.kernels]
    assert (spec.kind, spec.varlen, spec.variants) == ("fwd", True, ("window", "softcap", "alibi"))
    values = dict(q=q, k=q, v=q, o=torch.empty_like(q), lse=None, scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40,
                  window_left=16, window_right=-1, softcap=5.0, alibi_slopes=slopes)
    forward.run(-1, values)
    got = unpack(spec, driver.launches[0]["params"])
    assert (got["window_left"], got["window_right"]) == (16, variants.UNBOUNDED)
    assert got["softcap_scale"] == pytest.approx(0.125 / 5.0) and got["scale_log2"] == pytest.approx(5.0 * LOG2E)
    assert got["alibi_slopes"] == slopes.data_ptr() and got["alibi_batch_stride"] == 4 and got["alibi_scale"] == pytest.approx(0.2)
    backward = plans.backward_varlen(-1, 64, torch.bfloat16, True, False, spec.canonical(), ("window", "alibi"))
    assert all(k.spec.variants == ("window", "alibi") for k in backward.kernels
               if k.spec.kind not in ("bwd_prep", "bwd_dq_sm90"))  # (the prep and the dQ reader read no scores)
    assert [k.spec.kind for k in backward.kernels] == ["bwd_prep", "bwd_sm90_kvq", "bwd_dq_sm90"]
    long = plans.forward_varlen(-1, 64, torch.bfloat16, True, 4000, "", ("window",)).kernels[0].spec
    assert long.kind == "fwd_sm90" and long.varlen and "window" in long.variants


# ---- a paged KV cache (flash_attn_varlen_func's block_table): the decode kernels' varlen form -----


def paged_problem(seed=0, page=16):
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32), torch.tensor([0, 10, 14, 54, 54], dtype=torch.int32)
    q = torch.randn(9, 4, 16, generator=gen)
    k_cache, v_cache = (torch.randn(14, page, 2, 16, generator=gen) for _ in range(2))
    table = torch.randperm(14, generator=gen)[:12].view(4, 3).to(torch.int32)
    return q, k_cache, v_cache, cu_q, cu_k, table


@pytest.mark.parametrize("causal", [False, True])
def test_reference_over_pages_is_varlen_over_the_gathered_keys(causal):
    """Sequence b's keys are the first len_k(b) positions of its pages in table order; a length past
    the table's capacity is clamped to it, and a page outside the cache reads as zeros."""
    q, k_cache, v_cache, cu_q, cu_k, table = paged_problem()
    table[2, 2] = 99  # sequence 2's third page is no page: zero keys and values there
    cu_k_long = cu_k.clone()
    cu_k_long[3:] += 20  # sequence 2 asks for 60 keys of a 48-key table: clamped to 48
    for lengths, clamp in ((cu_k, False), (cu_k_long, True)):
        out, lse = reference.attention_varlen(q, k_cache, v_cache, cu_q, lengths, 5, 60, softmax_scale=0.3, causal=causal,
                                              block_table=table, return_lse=True)
        keys, values, cu_gathered = [], [], [0]
        for b, n in enumerate((lengths[1:] - lengths[:-1]).tolist()):
            n = min(n, 48)
            pos = torch.arange(n)
            pages = table[b, pos // 16].long()
            valid = (pages < 14)[:, None, None]
            keys.append(torch.where(valid, k_cache[pages.clamp(max=13), pos % 16], 0.0))
            values.append(torch.where(valid, v_cache[pages.clamp(max=13), pos % 16], 0.0))
            cu_gathered.append(cu_gathered[-1] + n)
        expected, expected_lse = reference.attention_varlen(
            q, torch.cat(keys), torch.cat(values), cu_q, torch.tensor(cu_gathered, dtype=torch.int32), 5, 60, softmax_scale=0.3,
            causal=causal, return_lse=True)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
        assert clamp == (cu_gathered[3] - cu_gathered[2] == 48)


def paged_inputs(**changes):
    base = dict(q=torch.zeros(9, 4, 64, dtype=torch.bfloat16), k=torch.zeros(14, 16, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(14, 16, 2, 64, dtype=torch.bfloat16), cu_seqlens_q=torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 10, 14, 54, 54], dtype=torch.int32), max_seqlen_q=5, max_seqlen_k=40,
                block_table=torch.zeros(4, 3, dtype=torch.int32))
    return {**base, **changes}


PAGED_BAD = [
    (dict(k=torch.zeros(20, 2, 64, dtype=torch.bfloat16), v=torch.zeros(20, 2, 64, dtype=torch.bfloat16)), ValueError,
     r"k must have 4 dimensions \(num_blocks, page_size, heads_kv, head_dim\): a paged cache, with block_table"),
    (dict(block_table=[[0]]), TypeError, "block_table must be a torch.Tensor, got list"),
    (dict(block_table=torch.zeros(4, 3, dtype=torch.int64)), TypeError, "block_table must have dtype torch.int32, got torch.int64"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"block_table must be \(batch, max_blocks_per_sequence\) with batch 4"),
    (dict(k=torch.zeros(14, 24, 2, 64, dtype=torch.bfloat16), v=torch.zeros(14, 24, 2, 64, dtype=torch.bfloat16)), ValueError,
     r"page_size=24 \(k.shape\[1\]\) is not supported"),
    (dict(v=torch.zeros(14, 16, 2, 32, dtype=torch.bfloat16)), ValueError, "v has head_dim=32 and q 64: attention_varlen with a block_table takes v with q's head dim"),
    (dict(k=torch.zeros(14, 16, 3, 64, dtype=torch.bfloat16), v=torch.zeros(14, 16, 3, 64, dtype=torch.bfloat16)), ValueError,
     "q has 4 heads and k, v have 3"),
    (dict(k=torch.zeros(14, 16, 2, 68, dtype=torch.bfloat16)[..., :64], v=torch.zeros(14, 16, 2, 68, dtype=torch.bfloat16)[..., :64]),
     ValueError, r"k must have 16-byte aligned rows .*: a paged cache is read in place"),
    (dict(q=torch.zeros(9, 4, 64, dtype=torch.bfloat16, requires_grad=True)), ValueError,
     "attention_varlen with a block_table computes no gradients"),
    (dict(block_table=torch.zeros(4, 3, dtype=torch.int32, device="meta")), ValueError, "must be on one device; .* block_table meta"),
    ({}, ValueError, "flashgen.attention_varlen runs on NVIDIA GPUs: q, k, v, cu_seqlens_q, cu_seqlens_k.* are on cpu"),
]


@pytest.mark.parametrize("changes, error, message", PAGED_BAD, ids=[m[:40] for _, _, m in PAGED_BAD])
def test_paged_input_errors_are_named(changes, error, message):
    with pytest.raises(error, match=message):
        flashgen.attention_varlen(**paged_inputs(**changes))


def test_a_paged_call_without_gradients_reaches_the_device_check():
    with torch.no_grad(), pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        flashgen.attention_varlen(**paged_inputs(q=torch.zeros(9, 4, 64, dtype=torch.bfloat16, requires_grad=True)))


def test_long_chunks_over_a_paged_cache_pick_the_hopper_forward_reading_pages():
    spec = tuning.paged_forward_spec(128, "bf16", True, "sm_90a", 2048, ("window",))
    assert spec.kind == "fwd_sm90" and spec.varlen and spec.paged and spec.variants == ("window",)
    assert tuning.paged_forward_spec(128, "bf16", True, "sm_90a", 64) is None  # short chunks: the decode kernels
    assert tuning.paged_forward_spec(128, "bf16", True, "sm_80", 4096) is None  # no Hopper forward there
    # it takes the block table and, past the pages, an append's new keys (seqlen_new of them)
    names = [param.name for param in spec.family.params(spec).params]
    assert {"block_table", "page_rows", "k_new_map", "v_new_map", "seqlen_new"} <= set(names)
    assert not {"block_table", "k_new_map"} & {p.name for p in spec.replace(paged=False).family.params(spec.replace(paged=False)).params}
    binary = compile_source(spec, render(spec))
    assert binary.resources.spill_stores == 0
    # pages of 16 or 32 rows that a key tile holds whole are gathered by cp.async, others loaded by TMA
    assert {"page_gather", "k_cache", "k_cache_page", "v_new", "v_new_head"} <= set(names)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hopper, "GATHER_PAGES", hopper.GATHERABLE)
        gathers = {(page, block_n): hopper.page_gather(torch.empty(2, page, 1, 8), block_n)
                   for page in (16, 32, 48, 64, 256) for block_n in (80, 128)}
    assert {key for key, gather in gathers.items() if gather} == {(16, 80), (16, 128), (32, 128)}
    ptx = compile_ptx(spec, render(spec)).decode()
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx and "cp.async.cg.shared.global" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # the consumers' fence before wgmma reads gathered tiles
    with pytest.raises(SpecError, match="paged=True: the paged Hopper forward takes packed sequences"):
        spec.replace(varlen=False)
