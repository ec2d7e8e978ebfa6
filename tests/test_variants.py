"""The attention variants with no GPU: the checks and the normalization of their arguments, the
specs that carry them, code that holds each variant only when its spec asks, and every family that
builds them compiling them without spills."""

import re

import pytest
import torch

from flashgen import tuning, variants
from flashgen.modifiers import MaskMod, ScoreMod
from flashgen.compile import compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError
from sweeps import group, sweep
from test_launch import driver, stub_kernels  # noqa: F401  (fixtures)


def make(causal=False, batch=2, heads=4, **keywords):
    return variants.make(variants.Call(causal, batch, heads, torch.device("cpu")), **keywords)


def test_plain_arguments_are_no_variant():
    assert make() == variants.PLAIN and make().fields == ()
    assert make(causal=True) == variants.PLAIN  # causal alone is the causal mask, not a window
    assert make(causal=True, window_size=(-1, 7)) == variants.PLAIN  # causal caps the right side


def test_causal_caps_the_window_at_the_diagonal():
    chosen = make(causal=True, window_size=(128, 64))
    assert chosen.args == {"window_left": 128, "window_right": 0} and chosen.fields == ("window",)


def test_each_variant_sets_its_field():
    slopes = torch.ones(4)
    assert make(window_size=(-1, 3)).fields == ("window",)
    assert make(softcap=30.0).fields == ("softcap",)
    assert make(alibi_slopes=slopes).fields == ("alibi",)
    assert make(window_size=(5, 5), softcap=1.0, alibi_slopes=slopes).fields == ("window", "softcap", "alibi")


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (-2, 0), (0, -5), ("a", 1), (1.5, 2), (1 << 30, 0), None])
def test_a_bad_window_is_refused_by_name(window):
    with pytest.raises(ValueError, match="window_size"):
        make(window_size=window)


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan")])
def test_a_bad_softcap_is_refused_by_name(softcap):
    with pytest.raises(ValueError, match="softcap"):
        make(softcap=softcap)


@pytest.mark.parametrize("slopes, error", [
    (torch.ones(4, dtype=torch.float16), TypeError),
    (torch.ones(3), ValueError),
    (torch.ones(2, 3), ValueError),
    (torch.ones(1, 2, 4), ValueError),
    (torch.ones(8)[::2], ValueError),
    ([1.0] * 4, TypeError),
])
def test_bad_slopes_are_refused_by_name(slopes, error):
    with pytest.raises(error, match="alibi_slopes"):
        make(alibi_slopes=slopes)


def test_slopes_per_batch_and_head_are_taken_and_read_as_batch_and_head():
    per_batch, per_head = torch.ones(2, 4), torch.ones(4)
    assert make(alibi_slopes=per_batch).args["alibi_slopes"].shape == (2, 4)
    assert make(alibi_slopes=per_head).args["alibi_slopes"].stride() == (0, 1)  # (sliced like q; one row of slopes)


def test_every_variant_travels_through_the_ops_by_its_declared_arguments():
    """The op schemas hold each declaration's arguments: a variant added to the registry reaches the
    kernels with no op written anew."""
    from flashgen import ops

    schema = str(ops.attention_fwd._opoverload._schema)
    for name, kind, _ in variants.OP_ARGS:
        assert f"{kind} {name}" in schema
    chosen = make(window_size=(5, 2), softcap=3.0, alibi_slopes=torch.ones(4))
    assert variants.Variant.from_op_args(chosen.op_args()) == chosen
    assert variants.Variant.from_op_args(variants.PLAIN_ARGS) == variants.PLAIN and variants.PLAIN.op_args() == ()
    for keyword in variants.KEYWORDS:
        assert keyword in str(ops.attention_with_kvcache_op._opoverload._schema)


# ---- specs and code ----------------------------------------------------------------------------

MMA_KINDS = ("fwd", "bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v", "bwd_q")


def test_the_name_says_which_variants_a_kernel_has():
    spec = KernelSpec(head_dim=64, causal=True, variants=("window", "softcap", "alibi"))
    assert spec.name.endswith("_causal_w4_s2_sm90a_window_softcap_alibi")
    assert KernelSpec(head_dim=64).name.endswith("_sm90a")


def test_families_that_do_not_build_a_variant_refuse_it():
    with pytest.raises(SpecError, match="window"):
        KernelSpec(head_dim=64, kind="bwd_prep", variants=("window",))


def picks(variant=()):
    """Every family that builds the variants, as the tables pick it for `variant`: the mma.sync
    kinds, the Hopper forward (one tile per CTA, persistent, varlen) and the decode kernels."""
    hopper = tuning.forward_spec(64, "bf16", True, "sm_90a", 4096, variant=variant)
    return [*(tuning.tuned_spec(kind, 64, "bf16", True, "sm_80", variant) for kind in MMA_KINDS),
            hopper, hopper.replace(persistent=True), tuning.forward_spec(64, "bf16", True, "sm_90a", 4096, True, variant),
            tuning.decode_spec(64, "bf16", "sm_90a", False, 1, variant), tuning.decode_spec(128, "fp16", "sm_80", True, 40, variant)]


HOPPER = picks()[len(MMA_KINDS)]


@pytest.mark.parametrize("spec", picks(), ids=lambda spec: spec.name)
def test_a_plain_spec_renders_no_trace_of_the_variants(spec):
    source = render(spec)
    for word in ("window_", "sliding", "softcap", "alibi", "tanh", "struct Score", "slope", "last_first", "sink"):
        assert word not in source, word


@pytest.mark.parametrize("which", range(len(picks())), ids=[spec.name for spec in picks()])
def test_each_variant_renders_only_its_own_code(which):
    window, softcap, alibi = (render(picks((field,))[which]) for field in ("window", "softcap", "alibi"))
    assert "int window_left, int window_right" in window and "tanh" not in window and "alibi" not in window
    assert "tanh.approx.f32" in softcap and "softcap_scale" in softcap and "window_" not in softcap and "alibi" not in softcap
    assert "alibi_slopes" in alibi and "tanh" not in alibi and "window_" not in alibi
    assert re.search(r"Mask mask\((seqlen_q|q_len), seqlen_k, window_left, window_right\);", window)  # (q_len: a decode kernel's)


SINK_PICKS = [tuning.forward_spec(64, "bf16", True, "sm_90a", 4096, variant=("sink",)),
              tuning.forward_spec(128, "bf16", False, "sm_90a", 4096, True, ("window", "sink")),  # (varlen)
              tuning.forward_spec(64, "bf16", False, "sm_90a", 4096, variant=("sink",)),  # (persistent)
              tuning.forward_spec(64, "bf16", True, "sm_90a", 64, variant=("sink",)),  # (mma.sync, short queries)
              tuning.forward_spec(128, "fp16", True, "sm_80", 4096, variant=("alibi", "sink")),
              tuning.decode_spec(128, "bf16", "sm_90a", False, 1, ("sink",)),
              tuning.decode_spec(64, "bf16", "sm_90a", True, 40, ("window", "sink"), varlen=True)]


@pytest.mark.parametrize("spec", SINK_PICKS, ids=lambda spec: spec.name)
def test_a_sink_joins_the_softmax_finish_of_every_forward_and_the_split_merge(spec):
    source = render(spec)
    assert "const float* __restrict__ learnable_sink" in source and "int sink_batch_stride" in source
    assert "sink_log2" in source and "fmaxf(shift, sink_log2)" in source  # the max takes the sink in first
    if spec.kind.startswith("decode"):  # once across splits: in the finish when unsplit, else in the merge
        assert "splits > 1 ? NEG_INF" in source and "total += fast_exp2((sink - mx) * LOG2E);" in source
    else:
        assert "softmax_finish(" in source and ", sink_log2);" in source
    assert any(spec.persistent for spec in SINK_PICKS) and any(spec.varlen for spec in SINK_PICKS)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_the_backward_prep_sums_a_sink_s_gradient_per_block(varlen):
    """The prep has the sink (the backward's other kernels do not): each block sums its rows'
    -exp(sink - lse) * delta into its own slot of learned_grad, which the plan allocates per call
    as (batch or sequences, heads, the grid's x) and the op sums in a fixed order; it compiles
    without spills, and without a sink the prep has none of it."""
    from flashgen import plans

    prep = tuning.backward_prep(128, "bf16", "sm_90a", varlen, ("window", "sink"))
    assert prep.variants == ("sink",) and prep == tuning.backward_prep(128, "bf16", "sm_90a", varlen).replace(variants=("sink",))
    source = render(prep)
    assert "const float* __restrict__ learnable_sink" in source and "float* __restrict__ learned_grad" in source
    assert "sink_term = -exp2f((sink - l) * LOG2E) * dot;" in source and "write_block_sum(sink_term, learned_grad);" in source
    assert ("block_partial(learned_grad) = 0.f;" in source) == varlen  # (a block past its sequence writes a 0)
    assert "learned_grad" not in render(tuning.backward_prep(128, "bf16", "sm_90a", varlen))
    binary = compile_source(prep, render(prep))
    assert binary.resources.spill_stores == binary.resources.spill_loads == 0, binary.resources
    # the grid's x, in the plan's buffer: 8 rows a block at d = 128 (16 lanes a row)
    values = {"o": torch.empty(300, 4, 128), "cu_seqlens_q": torch.tensor([0, 100, 300]), "max_seqlen_q": 200} if varlen \
        else {"o": torch.empty(2, 4, 300, 128)}
    assert prep.family.learned_grad_shape(prep, values) == ((2, 4, 256 // 8) if varlen else (2, 4, 384 // 8))
    assert [s.name for s in plans._learned_grad(prep)] == ["learned_grad"] and plans._learned_grad(prep.replace(variants=())) == []


def test_the_hopper_forward_scores_each_tile_and_masks_per_warpgroup():
    source = render(HOPPER.replace(variants=("window", "softcap", "alibi")))
    assert "Score(softcap_scale, alibi_slopes[i64(tl.batch) * alibi_batch_stride + tl.head] * alibi_scale" in source
    for it in ("0", "it"):  # the scores, then the mask, at step 0 and in the loop
        assert f"score_tile({it});\n{' ' * 20}mask_tile({it});" in source
    assert "mask.partial(m0 + cw * 64, n0, 64, BLOCK_N)" in source  # this warpgroup's rows decide
    persistent = render(HOPPER.replace(variants=("window",), persistent=True))
    assert "tile_info(last_first ? num_m_blocks - 1 - mb : mb," in persistent


def test_alibi_distances_stay_in_float():
    """No int-to-float conversion per element of a tile: the lane's first distance, less constants.
    Where a warp's rows see the whole tile on one side of their diagonal (under causal, always), an
    element pays one FFMA: the distance's part common to a row goes to the softmax as an offset."""
    for causal in (True, False):
        source = render(HOPPER.replace(variants=("alibi",), causal=causal))
        tile = source.split("DEVICE void tile(")[1].split("\n    }")[0]
        assert "abs(row" not in tile and "one_sided(s, " in tile
        assert ("fabsf(first + float((e / 2) * 8 - nt * 8 - (e & 1)))" in tile) == (not causal)
        assert "s[nt][e] = fmaf(side_slope, float(nt * 8 + (e & 1)), s[nt][e]);" in source
        assert "softmax_update(s, row_max, row_sum, scale_log2, alpha, offset);" in source
        assert "scale_log2, alpha);" not in source
        assert "mx = fmaxf(row_max[h], mx + offset[h]);" in source


def test_the_backward_multiplies_the_caps_derivative_into_ds_and_alibi_does_not():
    softcap, alibi = (render(tuning.tuned_spec("bwd_kvq", 64, "bf16", False, "sm_80", (field,))) for field in ("softcap", "alibi"))
    assert "* grad;" in softcap
    assert "grad" not in alibi.split("struct Score")[1].split("\n};")[1]


def test_softcap_changes_the_softmax_scale_the_host_passes():
    plain = KernelSpec(head_dim=64)
    capped = plain.replace(variants=("softcap",))
    value = {p.name: p.value for p in capped.family.params(capped).params}
    assert value["scale_log2"] == "softcap * LOG2E" and value["softcap_scale"] == "scale / softcap"
    assert {p.name: p.value for p in plain.family.params(plain).params}["scale_log2"] == "scale * LOG2E"


@pytest.mark.parametrize("spec", [KernelSpec(head_dim=64, kind="fwd", variants=("window",)), HOPPER.replace(variants=("window",)),
                                  tuning.decode_spec(64, "bf16", "sm_90a", True, 1).replace(variants=("window",))],
                         ids=lambda spec: spec.name)
def test_the_window_bounds_are_packed_as_the_kernel_takes_them(spec):
    pack = spec.family.packer(spec)
    assert {"window_left", "window_right"} <= set(pack.arguments)
    assert variants.window_bound(-1) == variants.UNBOUNDED and variants.window_bound(7) == 7


def test_the_tables_fall_back_to_the_family_that_builds_the_variant():
    hopper = tuning.forward_spec(128, "bf16", True, "sm_90a", 4096)
    for field in variants.FIELDS:
        chosen = tuning.forward_spec(128, "bf16", True, "sm_90a", 4096, variant=(field,))
        assert chosen.variants == (field,)
        assert chosen.kind == (hopper.kind if tuning.takes(hopper.kind, (field,)) else "fwd")
        for spec in tuning.backward_specs(128, "bf16", True, "sm_90a", False, variant=(field,)):
            assert spec.variants == ((field,) if variants.BY_NAME[field].backward else ())  # (a sink: the forward's lse holds it)


@pytest.mark.parametrize("head_dim", tuning.TEST_HEAD_DIMS)
def test_on_hopper_variant_calls_run_the_hopper_forward(head_dim):
    """Long queries on sm_90a, packed or not; short ones take the mma.sync forward, as plain calls do."""
    for varlen in (False, True):
        for causal in (False, True):
            assert tuning.forward_spec(head_dim, "fp16", causal, "sm_90a", 4096, varlen, ALL).kind == "fwd_sm90"
            assert tuning.forward_spec(head_dim, "fp16", causal, "sm_90a", 64, varlen, ALL).kind == "fwd"


ALL = ("window", "softcap", "alibi")
DOC = MaskMod("doc[q_idx] == doc[kv_idx]", lambda b, h, q_idx, kv_idx: q_idx >= 0, tensors={"doc": torch.zeros(4, dtype=torch.int32)},
              per_head=False)
BIAS = ScoreMod("score + bias[h * 255 + min(max(q_idx - kv_idx + 127, 0), 254)]", lambda score, b, h, q_idx, kv_idx: score,
                grad="1.f", tensors={"bias": torch.zeros(4, 255)})
RULES = (("mask_mod", DOC.source), ("score_mod", BIAS.source))


def variant_picks(arch, head_dim, causal, fields, varlen=False):
    """The tables' kernels for a variant call: the forward for long and short queries (on sm_90a
    the Hopper and the mma.sync forward), and the backward in both modes."""
    return [*(tuning.forward_spec(head_dim, "bf16", causal, arch, t, varlen, fields) for t in (4096, 64)),
            *(s for det in (False, True) for s in tuning.backward_specs(head_dim, "bf16", causal, arch, det, varlen, fields))]


# The tables' picks with every variant (and both rules) on, the most registers, on both targets
# (every head dim on sm_90a; on sm_80 64, 128 and 256); on sm_90a also with each one alone at the common head dims; packed
# sequences (varlen) with every variant on; the Hopper forward's persistent form of its picks
# (`flashgen tune` may choose it), causal.
VARIANT_SPECS = list(dict.fromkeys(
    spec
    for arch in ("sm_90a", "sm_80")
    for head_dim in tuning.TEST_HEAD_DIMS
    if arch == "sm_90a" or head_dim in (64, 128, 256)  # sm_80 at 256: the mma.sync backward's d > 128 kinds
    for causal, fields, varlen in (
        (True, ALL + RULES, False), (True, ALL, True),
        *(((True, ALL, False), (False, ALL, False), *((False, (f,), False) for f in ALL + RULES))
          if arch == "sm_90a" and head_dim in (64, 128) else ((True, ALL, False), (False, ALL, False)) if arch == "sm_90a" else ()),
    )
    for spec in variant_picks(arch, head_dim, causal, fields, varlen)
))
VARIANT_SPECS += [spec.replace(persistent=True) for spec in VARIANT_SPECS
                  if spec.kind == "fwd_sm90" and spec.causal and not spec.varlen]
# Gemma-2-style layers (softcap beside a window) and softcap over packed sequences, at the head dims
# around where the Hopper backward's block_n = 128 layout stops having registers for them.
VARIANT_SPECS += list(dict.fromkeys(
    spec
    for head_dim in (64, 96, 128)
    for causal in (False, True)
    for fields, varlen in ((("window", "softcap"), False), (("softcap",), True))
    for spec in variant_picks("sm_90a", head_dim, causal, fields, varlen)
    if spec not in VARIANT_SPECS
))
# Sinks on every family that builds them (the softmax finish of each forward, the decode merge).
VARIANT_SPECS += [spec for spec in SINK_PICKS if spec not in VARIANT_SPECS]
# The decode kernels with every variant on: contiguous and paged caches, both row counts.
VARIANT_SPECS += list(dict.fromkeys(
    tuning.decode_spec(head_dim, "bf16", arch, paged, rows, ALL)
    for arch in ("sm_90a", "sm_80")
    for head_dim in tuning.TEST_HEAD_DIMS
    if arch == "sm_90a" or head_dim in (64, 128)
    for paged in (False, True)
    for rows in tuning.DECODE_BLOCK_M
))
# And packed sequences over a paged cache (attention_varlen's block_table), the same way.
VARIANT_SPECS += list(dict.fromkeys(
    tuning.decode_spec(head_dim, "bf16", arch, True, rows, fields, varlen=True)
    for arch, fields, head_dims in (("sm_90a", ALL, tuning.TEST_HEAD_DIMS), ("sm_90a", (), (128,)), ("sm_80", (), (128,)))
    for head_dim in head_dims
    for rows in tuning.DECODE_BLOCK_M
))
# And with rotary embedding (a style for each cache layout): beside every variant on the H200, and
# alone at d = 128 on both targets.
VARIANT_SPECS += list(dict.fromkeys(
    tuning.decode_spec(head_dim, "bf16", arch, paged, rows, fields, rotary="interleaved" if paged else "halves")
    for arch, fields, head_dims in (("sm_90a", ALL, tuning.TEST_HEAD_DIMS), ("sm_90a", (), (128,)), ("sm_80", (), (128,)))
    for head_dim in head_dims
    for paged in (False, True)
    for rows in tuning.DECODE_BLOCK_M
))


def test_the_sweep_holds_every_family_that_builds_variants():
    kinds = {spec.kind for spec in VARIANT_SPECS}
    assert {"fwd_sm90", "decode", "decode_paged", *MMA_KINDS} <= kinds
    assert {spec.kind for spec in VARIANT_SPECS if spec.varlen} >= {"fwd_sm90", "fwd", "bwd_kvq", "bwd_q"}
    assert any(spec.persistent for spec in VARIANT_SPECS)


@pytest.mark.parametrize("spec", sweep(VARIANT_SPECS, by=lambda spec: (*group(spec), bool(spec.score_mod or spec.mask_mod),
                                                                      "sink" in spec.variants)))
def test_variant_kernels_compile_without_spills(spec):
    binary = compile_source(spec, render(spec))
    assert binary.resources.spills == 0 and binary.resources.stack_frame == 0, binary.log
    assert "serialized" not in binary.log, binary.log  # no wgmma made to wait for the one before it


# ---- every call's variants reach the packers of the kernels they pick ------------------------------

PREFIX = MaskMod("kv_idx < 3 || kv_idx <= q_idx", lambda b, h, q_idx, kv_idx: (kv_idx < 3) | (kv_idx <= q_idx),
                 per_batch=False, per_head=False)
CALLS = {
    "window, one side": dict(window_size=(-1, 30)), "window, the other": dict(window_size=(40, -1)),
    "softcap": dict(softcap=5.0), "alibi": dict(alibi_slopes=torch.ones(4)), "score rule alone": dict(score_mod=BIAS),
    "mask rule with no tensors, and a window": dict(mask_mod=PREFIX, window_size=(50, 0)),
    "everything": dict(window_size=(50, 7), softcap=5.0, alibi_slopes=torch.ones(2, 4), score_mod=BIAS, mask_mod=DOC),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keywords", CALLS.values(), ids=CALLS)
def test_every_call_variant_reaches_the_packers_of_the_kernels_it_picks(driver, stub_kernels, monkeypatch, keywords, causal):
    """What the GPU tier found once (every call of these failed): each kernel's packer finds every
    named value its parameters read, a variant's value when off included (a score rule's unit reads
    the cap), and a window with one unbounded side travels with both sides. sm_80's kernels (no
    tensor maps), forward and backward, stubbed driver."""
    from flashgen import api, ops, plans, runtime

    monkeypatch.setitem(plans._arch, -1, "sm_80")
    monkeypatch.setitem(runtime._contexts, None, None)  # (a block mask's launch names the CPU device by its index, None)
    q = torch.zeros(2, 4, 100, 64, dtype=torch.bfloat16)
    chosen = api.call_variant(q, q, causal, **keywords)
    o, lse = ops.forward_impl(q, q, q, None, None, 0, causal, 0.125, "", True, *chosen.op_args())
    ops.backward_impl(q, q, q, q, o, lse, None, None, None, 0, 0, causal, 0.125, True, "", *chosen.op_args())
    assert len(driver.launches) >= 4  # forward, prep, the key-major and the query-major pass (and a block mask's)


def test_a_plain_call_s_keywords_make_no_call_and_others_are_checked():
    """The public functions' one cheap test for plain calls (serving, varlen): every keyword at its
    default is PLAIN without building the Call; anything else goes through make's checks."""
    def never():
        raise AssertionError("a plain call built its Call")

    assert variants.make_if_given(never, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None) \
        is variants.PLAIN
    call = lambda: variants.Call(True, 2, 4, torch.device("cpu"), keys=100)  # noqa: E731
    assert variants.make_if_given(call, window_size=(8, 0), softcap=0.0).args == {"window_left": 8, "window_right": 0}
    assert variants.make_if_given(call, softcap=0).args == {}  # (an int 0: checked, and off)
    with pytest.raises(ValueError, match="softcap"):
        variants.make_if_given(call, softcap=-1.0)
