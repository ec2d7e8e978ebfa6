"""The sm_90a backward family without a GPU: its specs, the Hopper instructions in what NVRTC
emits, and the dQ accumulator's layout (the kernel's fragment order, read back by the plan)."""

import re

import pytest
import torch

from flashgen import tuning
from flashgen.compile import compile_ptx, compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

SPECS = [tuning.tuned_spec(kind, d, "bf16", causal, "sm_90a")
         for kind, d, causal in (("bwd_sm90_kvq", 64, False), ("bwd_sm90_kvq", 128, True), ("bwd_sm90_kv", 96, True))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_holds_the_hopper_instructions(spec):
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in (
        "wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",  # lse and delta rows
        "cp.async.bulk.tensor.4d.global.shared::cta",  # dK and dV
        "setmaxnreg.inc.sync.aligned.u32", "setmaxnreg.dec.sync.aligned.u32", "mbarrier.try_wait.parity",
    ):
        assert instruction in ptx, instruction
    reduces = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert reduces == (spec.kind == "bwd_sm90_kvq")  # dQ by bulk reduction, or not at all
    assert "mma.sync" not in ptx and "ld.local" not in ptx
    assert not re.search(r"\s(atom|red)\.", ptx)  # no element-wise atomics


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_compiles_without_spills_or_wgmma_serialization(spec):
    binary = compile_source(spec, render(spec))
    assert binary.resources.spills == 0 and binary.resources.stack_frame == 0, binary.log
    assert "serialized" not in binary.log and "setmaxnreg" not in binary.log, binary.log


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=192), "head dims up to 128"),
    (dict(head_dim=128, block_m=128), "192 fit"),
    (dict(head_dim=64, block_n=64), "block_n=64"),
    (dict(head_dim=64, arch="sm_80"), "needs sm_90a"),
    (dict(head_dim=64, block_m=96), "block_m=96"),
])
def test_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(**{"block_m": 64, "block_n": 128, "kind": "bwd_sm90_kvq", **fields})


def _kernel_accumulator(spec, dq: torch.Tensor) -> torch.Tensor:
    """What the kernel's bulk reductions leave in dq_accum for a given (B, H, T, d) dQ, written the
    way the template stages it: per query tile and 64 x 64 piece, thread t = 32 warp + lane puts
    float4 j of its n8 tile nt at (nt * 128 + t) * 4 + j, holding row 16 warp + lane / 4 + 8 (j / 2)
    and column 8 nt + 2 (lane % 4) + j % 2 of the piece."""
    family = spec.family
    batch, heads, seqlen_q, head_dim = dq.shape
    pad = family.head_dim_pad(spec)
    accum = torch.zeros(family.dq_accum_shape(spec, dq.shape))
    tiles = -(-seqlen_q // spec.block_m)
    full = torch.zeros(batch, heads, tiles * spec.block_m, pad)
    full[:, :, :seqlen_q, :head_dim] = dq
    t = torch.arange(128)
    warp, lane = t // 32, t % 32
    j = torch.arange(4)
    for tile in range(tiles):
        for pm in range(spec.block_m // 64):
            for pd in range(pad // 64):
                piece = (tile * (spec.block_m // 64) + pm) * (pad // 64) + pd
                for nt in range(8):
                    rows = tile * spec.block_m + pm * 64 + (16 * warp + lane // 4)[:, None] + 8 * (j // 2)[None]
                    cols = pd * 64 + 8 * nt + (2 * (lane % 4))[:, None] + (j % 2)[None]
                    at = piece * 4096 + (nt * 128 + t)[:, None] * 4 + j[None]
                    accum[:, :, at.flatten()] = full[:, :, rows.flatten(), cols.flatten()]
    return accum


@pytest.mark.parametrize("head_dim, block_m, seqlen_q", [(64, 128, 256), (128, 64, 100), (96, 64, 65), (32, 128, 1)])
def test_dq_accumulator_reads_back_in_row_and_column_order(head_dim, block_m, seqlen_q):
    spec = KernelSpec(head_dim=head_dim, block_m=block_m, block_n=128, kind="bwd_sm90_kvq")
    dq = torch.randn(2, 3, seqlen_q, head_dim)
    accum = _kernel_accumulator(spec, dq)
    got = torch.empty(2, 3, seqlen_q, head_dim, dtype=torch.bfloat16)
    spec.family.dq_from_accum(spec, accum, got)
    assert torch.equal(got, dq.to(torch.bfloat16))
    strided = torch.empty(2, seqlen_q, 3, head_dim, dtype=torch.bfloat16).transpose(1, 2)  # dq like a strided q
    spec.family.dq_from_accum(spec, accum, strided)
    assert torch.equal(strided, got)
