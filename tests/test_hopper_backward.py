"""The sm_90a backward family without a GPU: its specs, the Hopper instructions in what NVRTC
emits, and the dQ accumulator's layout (the kernel's staging and TMA boxes, read back by the plan). Both
layouts: block_n=128 (each consumer warpgroup owns 64 keys, head dims up to 128) and the split
block_n=64 (the warpgroups share 64 keys, one computing dV and the other dK; up to 256)."""

import collections
import re

import pytest
import torch

from flashgen import tuning
from flashgen.compile import compile_ptx, compile_source
from flashgen.modifiers import MaskMod, ScoreMod
from flashgen.render import render
from flashgen.spec import SMEM_LIMIT, KernelSpec, SpecError
from sweeps import group, sweep

SPECS = [tuning.tuned_spec(kind, d, "bf16", causal, "sm_90a")
         for kind, d, causal in (("bwd_sm90_kvq", 64, False), ("bwd_sm90_kvq", 128, True), ("bwd_sm90_kv", 96, True))]
# softcap at d = 64 takes block_m = 64: one dQ piece a step, each warpgroup adding its own keys' share
SPECS += tuning.backward_specs(64, "bf16", True, "sm_90a", False, variant=("softcap",))
# Every split spec the tables ship (d = 192 and 256, both dtypes, masks and modes), and d = 136, the
# smallest head dim the split layout serves by default.
SPLIT_SPECS = [spec for spec in tuning.shipped_specs("sm_90a") if spec.kind.startswith("bwd_sm90") and spec.head_dim > 128]
SPLIT_SPECS += [tuning.tuned_spec(kind, 136, "fp16", causal, "sm_90a")
                for kind, causal in (("bwd_sm90_kvq", False), ("bwd_sm90_kv", True))]


def test_the_tables_run_the_split_layout_above_head_dim_128():
    assert len(SPLIT_SPECS) == 2 * 2 * 2 * 2 + 2
    for spec in SPLIT_SPECS:
        assert spec.block_n == 64 and spec.block_m == 64 and spec.family.split(spec)
    for head_dim in (136, 192, 256):
        for deterministic in (False, True):
            kinds = [s.kind for s in tuning.backward_specs(head_dim, "bf16", True, "sm_90a", deterministic)]
            assert kinds == (["bwd_sm90_kv", "bwd_q"] if deterministic else ["bwd_sm90_kvq"])
    assert all(s.block_n == 128 for d in (64, 128) for s in tuning.backward_specs(d, "bf16", True, "sm_90a", False))


@pytest.mark.parametrize("spec", sweep(SPECS + SPLIT_SPECS, by=lambda spec: (*group(spec), "softcap" in spec.variants)))
def test_holds_the_hopper_instructions(spec):
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in (
        "wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",  # lse and delta rows
        "cp.async.bulk.tensor.4d.global.shared::cta",  # dK and dV
        "setmaxnreg.inc.sync.aligned.u32", "setmaxnreg.dec.sync.aligned.u32", "mbarrier.try_wait.parity",
    ):
        assert instruction in ptx, instruction
    reduces = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group" in ptx
    assert reduces == (spec.kind == "bwd_sm90_kvq")  # dQ by TMA reduction, or not at all
    assert "mma.sync" not in ptx and "ld.local" not in ptx
    assert not re.search(r"\s(atom|red)\.", ptx)  # no element-wise atomics


@pytest.mark.parametrize("spec", sweep(SPECS + SPLIT_SPECS, by=lambda spec: (*group(spec), "softcap" in spec.variants)))
def test_compiles_without_spills_or_wgmma_serialization(spec):
    # The consumers' code runs under setmaxnreg.inc 240 (two of them and the producer's 24 fill the
    # register file): no spill means their accumulators fit that budget.
    source = render(spec)
    assert "setmaxnreg_inc<240>();" in source and "setmaxnreg_dec<24>();" in source
    binary = compile_source(spec, source)
    assert binary.resources.spills == 0 and binary.resources.stack_frame == 0, binary.log
    assert "serialized" not in binary.log and "setmaxnreg" not in binary.log, binary.log


@pytest.mark.parametrize("head_dim, kind, do_stages, kilobytes", [
    (256, "bwd_sm90_kvq", 1, 219), (256, "bwd_sm90_kv", 2, 211), (192, "bwd_sm90_kvq", 2, 203), (192, "bwd_sm90_kv", 2, 163),
])
def test_split_layout_fits_shared_memory(head_dim, kind, do_stages, kilobytes):
    """K, V, num_stages Q tiles, as many dO tiles as fit (at most num_stages), P^T in fp32, and for
    dQ the dS^T tile and one 16 KB piece per warpgroup."""
    spec = tuning.tuned_spec(kind, head_dim, "bf16", True, "sm_90a")
    layout = spec.family.smem(spec)
    assert spec.family.do_stages(spec) == do_stages and -(-layout.size // 1024) == kilobytes
    assert layout.size <= SMEM_LIMIT["sm_90a"]
    pad = spec.family.head_dim_pad(spec)
    assert layout.regions[3].bytes == do_stages * 64 * pad * 2  # dO
    assert next(r.bytes for r in layout.regions if r.name == "p") == 64 * 64 * 4
    assert ("dq" in layout.offsets) == (kind == "bwd_sm90_kvq")


def test_split_layout_renders_only_in_split_specs():
    """A block_n=128 spec has no trace of the split layout's handshakes; a split spec has them, and
    its dQ-less kind has no dS^T handshake."""
    kvq = tuning.tuned_spec("bwd_sm90_kvq", 256, "bf16", True, "sm_90a")
    kv = tuning.tuned_spec("bwd_sm90_kv", 256, "bf16", True, "sm_90a")
    plain = tuning.tuned_spec("bwd_sm90_kvq", 128, "bf16", True, "sm_90a")
    assert all(word in render(kvq) for word in ("BAR_P_FULL", "BAR_DS_FULL", "DO_STAGES = 1", "dv_side"))
    assert "BAR_P_FULL" in render(kv) and "BAR_DS_FULL" not in render(kv) and "tma_reduce_add_4d(&dq_map" not in render(kv)
    assert not any(word in render(plain) for word in ("BAR_P_", "DO_STAGES", "dv_side", "SMEM_P "))


# The three-consumer layout (block_n=96), not yet in the tables: both kinds, V as wide as q, narrower
# by a chunk and by two, causal, varlen with a window, fp16.
TRIO_SPECS = [KernelSpec(kind=kind, head_dim=head_dim, head_dim_v=head_dim_v, block_m=64, block_n=96, num_stages=2, **fields)
              for kind, head_dim, head_dim_v, fields in (
                  ("bwd_sm90_kvq", 192, 128, {"causal": True}), ("bwd_sm90_kvq", 192, 0, {}),
                  ("bwd_sm90_kv", 192, 128, {"causal": True}), ("bwd_sm90_kvq", 160, 64, {"dtype": "fp16"}),
                  ("bwd_sm90_kvq", 192, 128, {"causal": True, "varlen": True, "variants": ("window",)}))]


@pytest.mark.parametrize("spec", TRIO_SPECS, ids=lambda spec: spec.name)
def test_trio_layout_compiles_without_spills_or_serialization(spec):
    """Three consumers of 160 registers beside the producer's 24 (the register file), no spill, no
    serialized wgmma; every product counted at its width: S and dP at N = 32 (k-steps over q's and
    v's head dims), dV^T at N = 32 (four 16-query steps per d_v chunk), dK^T at N = 96 (four), dQ at
    N = 64 (six 16-key steps); P, dS, dK^T and dV^T leave through transposing matrix stores."""
    source = render(spec)
    assert "setmaxnreg_inc<160>();" in source and "setmaxnreg_dec<24>();" in source
    assert "constexpr int NUM_CONSUMERS = 3;" in source and spec.family.threads(spec) == 512
    binary = compile_source(spec, source)
    assert binary.resources.spills == 0 and binary.resources.stack_frame == 0, binary.log
    assert "serialized" not in binary.log and "setmaxnreg" not in binary.log, binary.log
    ptx = compile_ptx(spec, source).decode()
    pad, v_pad = spec.family.head_dim_pad(spec), spec.family.d_v_pad(spec)
    widths = collections.Counter(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.", ptx))
    expected = {32: pad // 16 + v_pad // 16 + 4 * (v_pad // 64), 96: 4}
    if spec.kind == "bwd_sm90_kvq":
        expected[64] = 6
    assert widths == collections.Counter(expected)
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "ld.local" not in ptx
    assert spec.family.smem(spec).size <= SMEM_LIMIT["sm_90a"]


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=128), "must be 129 to 192"),
    (dict(head_dim=256), "must be 129 to 192"),
    (dict(head_dim=192, head_dim_v=256), "head_dim_v at most 192"),
    (dict(head_dim=192, block_m=128), "block_n=96 runs 64 query rows"),
    (dict(head_dim=192, variants=("softcap",)), "no score piece"),
    (dict(head_dim=192, mask_mod=MaskMod("q_idx >= kv_idx", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).source), "no mask rule"),
])
def test_trio_layout_refuses_what_it_does_not_run(fields, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(**{"block_m": 64, "block_n": 96, "kind": "bwd_sm90_kvq", **fields})


SCORE_RULE = ScoreMod("score * 0.5f", lambda score, b, h, q_idx, kv_idx: score * 0.5, grad="0.5f")
MASK_RULE = MaskMod("q_idx >= kv_idx", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=192), "head dims up to 128"),
    (dict(head_dim=128, block_m=128), "192 fit"),
    (dict(head_dim=64, block_n=96), "block_n=96"),
    (dict(head_dim=256, block_n=64, num_stages=3), "needs 256088 bytes of shared memory"),
    (dict(head_dim=192, block_n=64, block_m=128), "needs 281672 bytes of shared memory"),
    (dict(head_dim=64, arch="sm_80"), "needs sm_90a"),
    (dict(head_dim=64, block_m=96), "block_m=96"),
    (dict(head_dim=64, block_m=128, variants=("softcap",)), "needs 16 registers more than its 192"),
    (dict(head_dim=128, score_mod=SCORE_RULE.source), "needs 16 registers more than its 192"),
    (dict(head_dim=128, variants=("softcap", "alibi")), "needs 16 registers more than its 192"),
    (dict(head_dim=64, block_n=64, score_mod=ScoreMod("score", lambda score, b, h, q_idx, kv_idx: score).source),
     "needs the rule's gradient"),
])
def test_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(**{"block_m": 64, "block_n": 128, "kind": "bwd_sm90_kvq", **fields})


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_score_variants_run_the_split_layout_and_windows_keep_theirs(head_dim):
    """softcap and score rules take the Hopper backward at every head dim, in both modes. Softcap
    alone (its tanh in place under dP^T) takes the block_n=128 layout with 64 queries a step up to
    d = 128; beside ALiBi, and score rules, take it at d = 64 (block_m=64, where the registers leave
    room) and the split one above; a window or ALiBi alone keeps the plain tiles; a mask rule takes
    the block_n=128 layout up to d = 128, with the plain tiles' 128 queries a step at d = 64 (its
    per-element test is a bit mask made before the exponentials, so it fits beside them)."""
    plain = tuning.backward_specs(head_dim, "bf16", True, "sm_90a", False)[0]
    for deterministic in (False, True):
        capped = tuning.backward_specs(head_dim, "bf16", True, "sm_90a", deterministic, variant=("softcap",))[0]
        assert capped.kind == ("bwd_sm90_kv" if deterministic else "bwd_sm90_kvq")
        assert capped.family.split(capped) == (head_dim > 128) and capped.block_m == 64
    for variant in (("window", "softcap", "alibi"), (("score_mod", SCORE_RULE.source),)):
        for deterministic in (False, True):
            first = tuning.backward_specs(head_dim, "bf16", True, "sm_90a", deterministic, variant=variant)[0]
            assert first.kind == ("bwd_sm90_kv" if deterministic else "bwd_sm90_kvq")
            assert first.family.split(first) == (head_dim > 64) and first.block_m == {64: 64, 128: 128, 256: 64}[head_dim]
    for variant in (("window",), ("alibi",), ("window", "alibi")):
        chosen = tuning.backward_specs(head_dim, "bf16", True, "sm_90a", False, variant=variant)[0]
        assert (chosen.kind, chosen.block_m, chosen.block_n) == (plain.kind, plain.block_m, plain.block_n)
    for deterministic in (False, True):
        rule = tuning.backward_specs(head_dim, "bf16", True, "sm_90a", deterministic, variant=(("mask_mod", MASK_RULE.source),))
        assert rule[0].kind == ("bwd_sm90_kv" if deterministic else "bwd_sm90_kvq")
        assert (rule[0].block_m, rule[0].block_n) == ((128 if head_dim == 64 else 64, 128) if head_dim <= 128 else (64, 64))
        if head_dim == 64:
            assert (rule[0].block_m, rule[0].block_n) == (plain.block_m, plain.block_n)
        assert [s.kind for s in rule[1:]] == (["bwd_q"] if deterministic else [])


def test_the_hopper_backward_walks_a_mask_rules_lists_per_key_tile():
    """Steps come from the key-major lists (per query head of the group: a rule may read h); the
    rule's per-element test runs in tiles the lists do not mark full (in the block_n=128 layout into
    a bit mask first); a plain spec has none of it."""
    spec = tuning.backward_specs(128, "bf16", False, "sm_90a", False, variant=(("mask_mod", MASK_RULE.source),))[0]
    source = render(spec)
    assert "for (int g = 0; g < kv_group; ++g) steps += listed(kv_head * kv_group + g).tiles(n_block);" in source
    assert source.count("locate(step, head, m0);") == 2  # the producer and the consumers
    assert "const bool partial = !listed(head).full(n_block, m0 / BLOCK_M) || n0 + cw * 64 + 64 > seqlen_k;" in source
    # a bit per score, made before the exponentials and tested among them (keys past the end too)
    assert "if (mask.outside(query, key) | rule.hides(batch, head, query, key)) kept[nt / 8] &= ~(1u << (nt % 8 * 4 + e));" in source
    assert "if (!(kept[nt / 8] >> (nt % 8 * 4 + e) & 1)) p = 0.f;" in source
    assert "bm_count" in spec.family.params(spec).signature()
    split = render(spec.replace(block_m=128, block_n=64))
    assert split.count("locate(step, head, m0);") == 2 and split.count("rule.hides(") == 1  # the P^T side tests
    plain = render(spec.replace(mask_mod=""))
    assert "locate" not in plain and "rule" not in plain.split('extern "C"')[1] and "BlockMask" not in plain


@pytest.mark.parametrize("kind, fields", [
    ("bwd_sm90_kvq", dict(block_m=64, block_n=128)), ("bwd_sm90_kvq", dict(block_m=128, block_n=64)),
    ("bwd_sm90_kv", dict(block_m=64, block_n=128)), ("bwd_kvq", None), ("bwd_kv", None), ("bwd_q", None),
])
def test_no_backward_lets_the_keys_past_the_end_overflow(kind, fields):
    """Even a plain non-causal backward: keys past seqlen_k read as zeros, so S = 0 and P =
    exp2(-lse), which is inf for a row whose scores are all below about -88 (inf * 0 K = NaN in dQ;
    in fp16 dS overflows already near -15). The Hopper kernels test the elements of the tile that
    crosses seqlen_k; the mma.sync ones, short of registers, cap P's exponent at 0 (P <= 1)."""
    spec = KernelSpec(kind=kind, head_dim=64, **fields) if fields else tuning.tuned_spec(kind, 64, "bf16", False, "sm_80")
    source = render(spec).split('extern "C"')[1]
    if kind.startswith("bwd_sm90"):
        assert "> seqlen_k;" in source and "mask.outside(" in source and "mask.hides(" not in source
    else:
        assert "fast_exp2(fminf(" in source and "fast_exp2(s" not in source
    binary = compile_source(spec, render(spec))
    assert binary.resources.spills == 0, binary.log


def test_the_split_layout_hands_the_score_derivative_over():
    """With softcap (a derivative) warpgroup 1 hands P^T d(logit)/d(s) to warpgroup 2, tile by tile
    once warpgroup 2 has released the last step's (the P_EMPTY mbarrier); with ALiBi (derivative 1) it
    hands P^T itself; a plain spec renders no score piece. The block_n=128 layout puts the derivative
    into dS^T in the pass that makes P^T, after both score products; with softcap alone, tanh, P^T
    and P^T (1 - u^2) are made between the two waits, P^T leaving as dV's operand there."""
    base = KernelSpec(kind="bwd_sm90_kvq", head_dim=128, block_m=64, block_n=64, causal=True)
    capped, alibi = render(base.replace(variants=("softcap",))), render(base.replace(variants=("alibi",)))
    assert "handed[e] = p * grad;" in capped and "struct Score" in capped
    assert capped.index("if (step > 0) mbar_wait(smem + BAR_P_EMPTY, (step - 1) & 1);") < capped.index("handed[e] = p * grad;")
    assert capped.index("mbar_arrive(smem + BAR_P_FULL);") > capped.index("handed[e] = p * grad;")
    assert "mbar_wait(smem + BAR_P_FULL, step & 1);" in capped and "BAR_P_FREE" not in capped
    assert "handed" not in alibi and "score.at_distance(s[nt][e], distance0 + float(nt * 8 + (e & 1) - (e / 2) * 8), unused)" in alibi
    assert "Score" not in render(base) and "softcap" not in render(base) and "alibi" not in render(base)
    def before_scores(source):
        return source.split("for (int step = 0;")[2].split("const float* lse_t")[0]

    ruled = render(base.replace(block_n=128, head_dim=64, score_mod=SCORE_RULE.source))
    assert "dp[nt][e] = p * grad * (dp[nt][e]" in ruled
    assert "wgmma_wait<0>" in before_scores(ruled) and "wgmma_wait<1>" not in before_scores(ruled)
    whole = render(base.replace(block_n=128, variants=("softcap",)))
    step = whole.split("for (int step = 0;")[2]
    assert "dp[nt][e] = p * grad * (dp[nt][e]" not in whole and "grad = 1.f - u * u;" in whole
    assert (step.index("wgmma_wait<1>") < step.index("s[nt][e] = p * grad;") < step.index("p_a[nt / 2][(nt % 2) * 2] = pack2(")
            < step.index("finish_before_wait(s);") < step.index("wgmma_wait<0>")
            < step.index("dp[nt][e] = s[nt][e] * (dp[nt][e] - (e & 1 ? dlt.y : dlt.x));"))
    assert "a_operand(p_a[kk]" not in step  # P^T left as dV's operand before the wait


def _staged_piece(piece: torch.Tensor) -> torch.Tensor:
    """A 64 x 64 fp32 dQ piece as the template's stage_dq leaves it in shared memory (as floats):
    thread t = 32 warp + lane holds rows 16 warp + lane / 4 (+ 8) and columns 8 nt + 2 (lane % 4)
    (+ 1) of n8 tile nt, and writes each pair at box nt / 4, 128-byte row r, 16-byte chunk
    (2 (nt % 4) + (lane % 4) / 2) ^ (r % 8), 8 bytes in for odd lanes."""
    smem = torch.full((2 * 64 * 32,), float("nan"))
    for t in range(128):
        warp, lane = t // 32, t % 32
        for nt in range(8):
            for half in range(2):
                r = warp * 16 + lane // 4 + 8 * half
                chunk = (nt % 4) * 2 + (lane % 4) // 2
                at = ((nt // 4) * 8192 + r * 128 + ((chunk ^ (r % 8)) * 16) + (lane & 1) * 8) // 4
                col = nt * 8 + (lane % 4) * 2
                smem[at: at + 2] = piece[r, col: col + 2]
    return smem


def _tma_box(smem: torch.Tensor, box: int) -> torch.Tensor:
    """The [64 rows][32 fp32] box a TMA reduction reads from a 128-byte-swizzled buffer: element
    (r, c) at 16-byte chunk (c / 4) ^ (r % 8) of row r."""
    r, c = torch.arange(64)[:, None], torch.arange(32)[None]
    return smem[(box * 8192 + r * 128 + (((c // 4) ^ (r % 8)) * 16) + (c % 4) * 4) // 4]


def _kernel_accumulator(spec, dq: torch.Tensor) -> torch.Tensor:
    """What the kernel's staging and TMA reductions leave in dq_accum for a given (B, H, T, d) dQ:
    every 64 x 64 piece of each query tile staged (stage_dq) and its two boxes added at rows
    m0 + 64 pm, columns 64 pd and 64 pd + 32 (reduce_dq)."""
    family = spec.family
    batch, heads, seqlen_q, head_dim = dq.shape
    pad = family.head_dim_pad(spec)
    accum = torch.zeros(family.dq_accum_shape(spec, {"q": dq}))
    full = torch.zeros(accum.shape)
    full[:, :, :seqlen_q, :head_dim] = dq
    for b in range(batch):
        for h in range(heads):
            for row in range(0, accum.shape[2], 64):
                for col in range(0, pad, 64):
                    smem = _staged_piece(full[b, h, row: row + 64, col: col + 64])
                    for box in range(2):
                        accum[b, h, row: row + 64, col + 32 * box: col + 32 * box + 32] += _tma_box(smem, box)
    return accum


@pytest.mark.parametrize("head_dim, block_m, block_n, seqlen_q", [
    (64, 128, 128, 256), (128, 64, 128, 100), (96, 64, 128, 65), (32, 128, 128, 1), (256, 64, 64, 100), (136, 64, 64, 129),
])
def test_dq_accumulator_reads_back_in_row_and_column_order(head_dim, block_m, block_n, seqlen_q):
    spec = KernelSpec(head_dim=head_dim, block_m=block_m, block_n=block_n, kind="bwd_sm90_kvq")
    dq = torch.randn(2, 3, seqlen_q, head_dim)
    accum = _kernel_accumulator(spec, dq)
    got = torch.empty(2, 3, seqlen_q, head_dim, dtype=torch.bfloat16)
    spec.family.dq_from_accum(spec, accum, got)
    assert torch.equal(got, dq.to(torch.bfloat16))
    strided = torch.empty(2, seqlen_q, 3, head_dim, dtype=torch.bfloat16).transpose(1, 2)  # dq like a strided q
    spec.family.dq_from_accum(spec, accum, strided)
    assert torch.equal(strided, got)
