"""Rendering: one kernel symbol per spec, and only the code paths the spec runs."""

import jinja2
import pytest

from flashgen.render import _environment, render
from flashgen.spec import KernelSpec


def test_kernel_symbol_is_the_spec_name():
    spec = KernelSpec(head_dim=64, causal=True)
    source = render(spec)
    assert f'extern "C" __global__ void __launch_bounds__(NUM_THREADS)\n{spec.name}(\n' in source
    assert "constexpr int HEAD_DIM = 64;" in source
    assert "constexpr int BLOCK_M = 128;" in source


def test_the_signature_is_the_familys_parameter_list():
    spec = KernelSpec(head_dim=64)
    source = render(spec)
    assert f"{spec.name}(\n{spec.family.params(spec).signature()})\n{{" in source
    assert "    const elem_t* __restrict__ q, i64 q_batch, i64 q_head, i64 q_row,\n" in source
    assert "    float* __restrict__ lse,\n" in source


def test_shared_memory_offsets_come_from_the_familys_layout():
    spec = KernelSpec(head_dim=64, block_m=128, block_n=64, num_stages=3)
    layout = spec.family.smem(spec)
    source = render(spec)
    row = (64 + 8) * 2
    assert layout.offsets == {"q": 0, "k": 128 * row, "v": 128 * row + 3 * 64 * row}
    assert f"constexpr int SMEM_V = {128 * row + 3 * 64 * row}, SMEM_V_BYTES = {3 * 64 * row};" in source
    assert f"constexpr int SMEM_BYTES = {layout.size};" in source and spec.smem_bytes == layout.size
    assert "static_assert(SMEM_Q_BYTES == BLOCK_M * ROW_BYTES" in source


def test_causal_keeps_the_diagonal_logic_and_full_drops_it():
    causal = render(KernelSpec(head_dim=64, causal=True))
    full = render(KernelSpec(head_dim=64, causal=False))
    assert "diag(seqlen_k_ - seqlen_q_)" in causal
    assert "return key > row + diag;" in causal
    assert "diag" not in full
    assert "return key >= seqlen_k;" in full  # only keys past the end are masked


def test_head_dims_are_padded_to_the_mma_k_step():
    assert "constexpr int HEAD_DIM_PAD = 48;" in render(KernelSpec(head_dim=40))
    assert "constexpr int HEAD_DIM_PAD = 64;" in render(KernelSpec(head_dim=64))


def test_dtype_selects_the_mma_type():
    fp16 = render(KernelSpec(head_dim=64, dtype="fp16"))
    bf16 = render(KernelSpec(head_dim=64, dtype="bf16"))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in fp16
    assert "cvt.rn.f16x2.f32" in fp16
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in bf16
    assert "cvt.rn.bf16x2.f32" in bf16
    assert ".bf16" not in fp16
    assert ".f16" not in bf16


def wgmma(spec):
    return spec.family.context(spec)["wgmma"]


def test_warpgroup_mma_only_where_the_spec_says():
    hopper = KernelSpec(head_dim=64, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq", causal=True)
    assert wgmma(hopper)
    source = render(hopper)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in source  # S^T, dP^T: N = block_m
    assert "fence.proxy.async.shared::cta" in source and "tile_offset" in source
    assert "red.global.add.v2.f32" in source  # dQ, two columns a reduction
    wide = KernelSpec(head_dim=96, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq")
    assert "m64n96k16" in render(wide)  # dV and dK: N = the padded head dim
    for plain in (
        KernelSpec(head_dim=64, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq", arch="sm_80"),  # no wgmma
        KernelSpec(head_dim=64, block_m=32, block_n=128, num_warps=4, kind="bwd_kvq"),  # 32 keys a warp
        KernelSpec(head_dim=64, block_m=64, block_n=64, num_warps=2, kind="bwd_v"),  # not a whole warpgroup
        KernelSpec(head_dim=64),  # the forward
    ):
        assert not wgmma(plain), plain.name
        assert "wgmma" not in render(plain) and "mma.sync" in render(plain)
    assert "red.global.add" not in render(KernelSpec(head_dim=64, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq", arch="sm_80"))


def test_dq_work_items_balance_the_warps_then_reuse_operands():
    from flashgen.families.backward import dq_item

    # (m16 query tiles, n16 head-dim pairs) per item: every warp gets work first, then larger items
    assert dq_item(KernelSpec(head_dim=64, block_m=128, block_n=128, num_warps=8, kind="bwd_kvq")) == (2, 2)
    assert dq_item(KernelSpec(head_dim=64, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq")) == (1, 2)
    assert dq_item(KernelSpec(head_dim=80, block_m=64, block_n=128, num_warps=8, kind="bwd_kvq")) == (1, 1)


def test_undefined_variable_is_an_error():
    with pytest.raises(jinja2.UndefinedError, match="nope"):
        _environment().from_string("{{ nope }}").render()


def test_the_hopper_forward_renders_tma_wgmma_and_the_shared_pieces():
    spec = KernelSpec(head_dim=128, block_m=128, block_n=128, causal=True, kind="fwd_sm90")
    source = render(spec)
    for piece in (
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
        "setmaxnreg.inc.sync.aligned", "mbarrier.try_wait.parity", "const __grid_constant__ CUtensorMap q_map",
        "struct Mask", "softmax_update(s, row_max, row_sum, scale_log2, alpha)", "softmax_finish(o,",
        f"__launch_bounds__(NUM_THREADS, 1)\n{spec.name}(",
    ):
        assert piece in source, piece
    assert spec.num_threads == 384 and spec.smem_bytes == spec.family.smem(spec).size
