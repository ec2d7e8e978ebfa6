"""User rules with no GPU: their checks, their identity (the source, not the tensors' values), the
code they render, the block mask lists, and the shipped example rules' twins against the built-ins."""

import sys
from pathlib import Path

import pytest
import torch

from flashgen import MaskMod, ScoreMod, modifiers, tuning
from flashgen.blockmask import BlockMasks
from flashgen.reference import naive_attention
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import rules  # noqa: E402


def test_the_source_names_the_tensors_and_dtypes_not_their_values():
    a = ScoreMod("score + t[h]", lambda *x: x[0], grad="1.f", tensors={"t": torch.zeros(4)})
    b = ScoreMod("score + t[h]", lambda *x: x[0], grad="1.f", tensors={"t": torch.ones(9)})
    c = ScoreMod("score + t[h]", lambda *x: x[0], grad="1.f", tensors={"t": torch.ones(4, dtype=torch.int32)})
    assert a.source == b.source != c.source
    spec = tuning.forward_spec(64, "bf16", False, "sm_90a", 4096, variant=(("score_mod", a.source),))
    other = tuning.forward_spec(64, "bf16", False, "sm_90a", 4096, variant=(("score_mod", c.source),))
    assert spec.name != other.name and "smod" in spec.name and spec.ident != other.ident


@pytest.mark.parametrize("cuda", ["", "a; b", "{x}", "score // comment", 3,
                                  "score\n#define fast_exp2(x) (1.f)\n", "score # x", "score \\\n + 1", "score <% %>"])
def test_a_bad_expression_is_refused(cuda):
    """One expression on one line: a newline or '#' would let preprocessor lines into the kernel
    (a #define that rewrites the softmax compiles, and computes something else)."""
    with pytest.raises(ValueError, match="score_mod"):
        ScoreMod(cuda, lambda *x: x[0])
    with pytest.raises(ValueError, match="score_mod grad"):
        ScoreMod("score", lambda *x: x[0], grad=cuda or "x; y")


@pytest.mark.parametrize("name", ["score", "q_idx", "1x", "for", "a-b", "float", "grad", "NEG_INF", "__x", "_x", "mod"])
def test_a_bad_tensor_name_is_refused(name):
    """Names of the rule's arguments, C++ keywords and types, the kernel's own names: refused here,
    not as an NVRTC error."""
    with pytest.raises(ValueError, match="tensor name"):
        MaskMod("true", lambda *x: True, tensors={name: torch.zeros(1)})


@pytest.mark.parametrize("flag, cuda", [("per_batch", "b == 0"), ("per_head", "h % 2 == 0 && q_idx >= kv_idx")])
def test_a_mask_rule_that_reads_what_it_says_it_ignores_is_refused(flag, cuda):
    with pytest.raises(ValueError, match=f"reads {cuda[0]} while {flag}=False"):
        MaskMod(cuda, lambda *x: True, **{flag: False})
    assert MaskMod("q_idx >= kv_idx", lambda *x: True, **{flag: False}).source  # (kv_idx, q_idx are not b or h)


@pytest.mark.parametrize("field, source", [
    ("score_mod", '{"cuda":"score","tensors":[]}'),  # no grad key
    ("score_mod", '{"cuda":"score","grad":"","tensors":[["x","float; int evil"]]}'),
    ("score_mod", '{"cuda":"score\\n#define x","grad":"","tensors":[]}'),
    ("mask_mod", '{"cuda":"true","per_batch":1,"per_head":true,"tensors":[]}'),
    ("mask_mod", '{"cuda":"true","per_batch":true,"per_head":true,"tensors":["x"]}'),
])
def test_a_hand_written_source_is_checked_like_a_made_one(field, source):
    """A spec field's source goes through the checks ScoreMod and MaskMod run, whoever wrote it."""
    with pytest.raises(SpecError, match=f"{field}: .* is not a modifier's source"):
        KernelSpec(head_dim=64, **{field: source})


def test_a_tensor_of_an_unsupported_dtype_is_refused():
    with pytest.raises(TypeError, match="dtype"):
        MaskMod("true", lambda *x: True, tensors={"t": torch.zeros(1, dtype=torch.complex64)})


def test_the_rule_renders_as_a_struct_with_its_tensors():
    rule = rules.documents(torch.zeros(2, 10, dtype=torch.int32))
    text = modifiers.struct("mask_mod", rule.source)
    assert "const int* __restrict__ doc;" in text and "doc[b * 10 + q_idx] == doc[b * 10 + kv_idx]" in text
    # both forward families build rules: the Hopper one for long queries, mma.sync for short ones
    for seqlen_q, kind in ((4096, "fwd_sm90"), (64, "fwd")):
        spec = tuning.forward_spec(64, "bf16", True, "sm_90a", seqlen_q, variant=(("mask_mod", rule.source),))
        source = render(spec)
        assert "const int* __restrict__ mmod_doc" in source and "struct BlockMask" in source and "rule.hides" in source
        assert spec.kind == kind


def test_the_hopper_forward_walks_the_block_mask_lists():
    """Producer and consumers take a rule's key tiles from the lists; a plain spec keeps the mask's range."""
    rule = rules.prefix_lm(100)
    spec = tuning.forward_spec(128, "bf16", False, "sm_90a", 4096, variant=(("mask_mod", rule.source),))
    source = render(spec)
    assert spec.kind == "fwd_sm90" and "t.n_tiles = blocks.tiles(m_block);" in source
    assert "__ldg(listed + n_tiles - 1 - it)" in source and "tl.full(n0 / BLOCK_N)" in source
    plain = render(spec.replace(mask_mod=""))
    assert "BlockMask" not in plain and "rule" not in plain.split("extern \"C\"")[1]
    assert "t.n_tiles = mask.key_end(t.m0, BLOCK_M, BLOCK_N) - t.n_begin;" in plain


def test_rules_the_hopper_forward_has_no_registers_for_fall_back_to_mma_sync():
    """Every rule and variant at once at d = 256: no Hopper tile shape fits them; mma.sync runs it."""
    fields = ("window", "softcap", "alibi", ("mask_mod", rules.prefix_lm(3).source),
              ("score_mod", rules.relative_bias(torch.zeros(2, 9)).source))
    assert tuning.forward_spec(256, "bf16", True, "sm_90a", 4096, variant=fields).kind == "fwd"
    assert tuning.forward_spec(128, "bf16", True, "sm_90a", 4096, variant=fields).kind == "fwd_sm90"
    with pytest.raises(SpecError, match="for the rules and variants"):
        KernelSpec(kind="fwd_sm90", head_dim=64, block_m=192, block_n=112, arch="sm_90a", score_mod=fields[4][1])


def test_a_score_rule_without_gradient_has_no_backward():
    rule = ScoreMod("score * 2.f", lambda s, *x: 2 * s)
    with pytest.raises(Exception, match="gradient"):
        tuning.backward_specs(64, "bf16", False, "sm_90a", False, variant=(("score_mod", rule.source),))


def test_the_block_mask_lists_listed_tiles_first_in_order(monkeypatch):
    states = torch.tensor([[[[0, 2, 1, 0], [1, 0, 0, 2]]]], dtype=torch.uint8)  # 1 x 1 x 2 query tiles x 4 key tiles
    masks = BlockMasks(rules.prefix_lm(1), False, (), {}, 1, 1, 128, 256, torch.device("cpu"), "sm_90a")
    monkeypatch.setattr(masks, "states", lambda block_m, block_n: states)
    rows = masks.get(64, 64, key_major=False)
    assert rows.count.tolist() == [[[2, 2]]]
    assert rows.index[0, 0, 0, :2].tolist() == [1, 2] and rows.index[0, 0, 1, :2].tolist() == [0, 3]
    cols = masks.get(64, 64, key_major=True)
    assert cols.count.tolist() == [[[1, 1, 1, 1]]]
    assert cols.index[0, 0, :, 0].tolist() == [1, 0, 0, 1] and cols.state[0, 0, 1].tolist() == [2, 0]
    assert (rows.batch_stride, rows.head_stride) == (0, 0)  # prefix-LM ignores b and h


def test_example_rules_equal_the_builtins_in_the_oracle():
    q, k, v = (torch.randn(2, 4, 70, 16, dtype=torch.float64) for _ in range(3))
    slopes = torch.rand(4)  # fp32, as FlashAttention takes them
    a = naive_attention(q, k, v, causal=True, score_mod=rules.alibi(slopes).python, return_lse=True)
    b = naive_attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    torch.testing.assert_close(a, b)
    a = naive_attention(q, k, v, causal=True, mask_mod=rules.sliding_window(9).python, return_lse=True)
    b = naive_attention(q, k, v, causal=True, window_size=(9, 0), return_lse=True)
    torch.testing.assert_close(a, b)


def test_rule_tensors_on_another_device_are_refused():
    from flashgen.api import call_variant

    rule = rules.documents(torch.zeros(1, 8, dtype=torch.int32))
    q = torch.zeros(1, 1, 8, 64, device="meta")
    with pytest.raises(ValueError, match="mask_mod"):
        call_variant(q, q, False, mask_mod=rule)
    with pytest.raises(TypeError, match="score_mod"):
        call_variant(q, q, False, score_mod=lambda *x: x)


def test_block_mask_lists_are_kept_by_tensor_identity_and_version(monkeypatch):
    """Kept across calls while the rule's tensors are the same, unchanged tensors; an in-place write
    (its version moves) or another tensor makes new lists."""
    from flashgen import blockmask
    from flashgen.modifiers import Rule

    made = []
    monkeypatch.setattr(BlockMasks, "_make", lambda self, *shape: made.append(shape) or some_lists())
    monkeypatch.setattr(blockmask, "_kept", blockmask.OrderedDict())
    doc = torch.zeros(1, 10, dtype=torch.int32)
    source = rules.documents(doc).source

    def lists(tensor):
        return BlockMasks(Rule(source, [tensor]), True, (), {}, 1, 1, 10, 10, torch.device("cpu"), "sm_90a").get(64, 64, False)

    first = lists(doc)
    assert lists(doc) is first and len(made) == 1
    doc[0, 5:] = 1  # in place: a new version
    assert lists(doc) is not first and len(made) == 2
    other = doc.clone()
    assert lists(other) is not first and len(made) == 3


def some_lists():
    from flashgen.blockmask import Lists

    return Lists(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                 torch.full((1, 1, 1, 1), 2, dtype=torch.uint8), 0, 0)


def test_kept_block_mask_lists_are_copies_of_their_own_and_a_capture_keeps_none(monkeypatch):
    """What is kept across calls is copied into memory of its own (workspace.keep: no CUDA-graph
    pool's); lists made while a graph is captured hold their values only when it runs, so they
    are that call's alone, even for a rule without tensors."""
    import threading

    from flashgen import blockmask, workspace
    from flashgen.modifiers import Rule

    made = []
    monkeypatch.setattr(BlockMasks, "_make", lambda self, *shape: made.append(some_lists()) or made[-1])
    monkeypatch.setattr(blockmask, "_kept", blockmask.OrderedDict())
    copied_on = []
    real_keep = workspace.keep
    monkeypatch.setattr(workspace, "keep", lambda t: copied_on.append(threading.get_ident()) or real_keep(t))
    prefix = rules.prefix_lm(3).source  # a rule without tensors

    def lists(device="cpu"):
        return BlockMasks(Rule(prefix, []), False, (), {}, 1, 1, 10, 10, torch.device(device), "sm_90a").get(64, 64, False)

    kept = lists()
    assert len(copied_on) == 3 and kept is not made[0] and torch.equal(kept.count, made[0].count)
    assert kept.count.data_ptr() != made[0].count.data_ptr() and lists() is kept
    from flashgen import runtime

    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setattr(runtime, "capture_of", lambda stream, device: 7)  # a capture under way on that stream
    in_graph = lists("cuda")  # (nothing runs on the device: _make is stubbed)
    assert in_graph is made[-1] and len(blockmask._kept) == 1 and len(copied_on) == 3


@pytest.fixture
def stub_cuda_lists(monkeypatch):
    """BlockMasks on a "cuda" device with nothing run: lists stubbed, keep a clone, the stream a
    number, and a capture under way while capture[0] is set."""
    import types

    from flashgen import blockmask, runtime, workspace

    made = []
    capture = [0]
    monkeypatch.setattr(BlockMasks, "_make", lambda self, *shape: made.append(some_lists()) or made[-1])
    monkeypatch.setattr(blockmask, "_kept", blockmask.OrderedDict())
    monkeypatch.setattr(blockmask, "_captured", {})
    monkeypatch.setattr(workspace, "keep", lambda t: t.clone())
    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setattr(runtime, "capture_of", lambda stream, device: capture[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
    return made, capture


def test_kept_lists_a_capture_reads_are_never_dropped(stub_cuda_lists):
    """An eager warm-up keeps a tensor-less rule's lists; the capture after it records their
    addresses, so neither KEEP newer shapes nor clear() may free them while the graph can replay."""
    import gc
    import weakref

    from flashgen import blockmask
    from flashgen.modifiers import Rule

    made, capture = stub_cuda_lists
    prefix = Rule(rules.prefix_lm(3).source, [])

    def lists(seqlen=128):
        return BlockMasks(prefix, False, (), {}, 1, 1, seqlen, seqlen, torch.device("cuda:0"), "sm_90a").get(64, 64, False)

    warm = lists()
    capture[0] = 7
    in_graph = lists()
    capture[0] = 0
    assert in_graph is warm
    alive = weakref.ref(in_graph.index)
    del warm, in_graph
    made.clear()
    for n in range(blockmask.KEEP):
        lists(129 + n)
    blockmask.clear()
    gc.collect()
    assert alive() is not None


def test_lists_of_inference_tensors_are_made_each_call(monkeypatch):
    """An inference tensor has no version counter (reading it raises): its lists cannot be kept."""
    from flashgen import blockmask
    from flashgen.modifiers import Rule

    made = []
    monkeypatch.setattr(BlockMasks, "_make", lambda self, *shape: made.append(shape) or some_lists())
    monkeypatch.setattr(blockmask, "_kept", blockmask.OrderedDict())
    with torch.inference_mode():
        doc = torch.zeros(1, 10, dtype=torch.int32)
    rule = Rule(rules.documents(doc).source, [doc])
    for _ in range(2):
        BlockMasks(rule, True, (), {}, 1, 1, 10, 10, torch.device("cpu"), "sm_90a").get(64, 64, False)
    assert len(made) == 2 and not blockmask._kept


def test_a_dead_rule_tensor_drops_its_lists_and_a_rebound_one_makes_new(monkeypatch):
    from flashgen import blockmask
    from flashgen.modifiers import Rule

    made = []
    monkeypatch.setattr(BlockMasks, "_make", lambda self, *shape: made.append(shape) or some_lists())
    monkeypatch.setattr(blockmask, "_kept", blockmask.OrderedDict())
    source = rules.documents(torch.zeros(1, 10, dtype=torch.int32)).source

    def lists(tensor):
        return BlockMasks(Rule(source, [tensor]), True, (), {}, 1, 1, 10, 10, torch.device("cpu"), "sm_90a").get(64, 64, False)

    doc = torch.zeros(1, 10, dtype=torch.int32)
    first = lists(doc)
    doc.data = torch.ones(1, 10, dtype=torch.int32)  # no version change: the address tells
    assert lists(doc) is not first and len(made) == 2
    assert len(blockmask._kept) == 2
    del doc
    assert not blockmask._kept  # both entries read the dead tensor


def test_a_non_contiguous_rule_tensor_gives_the_same_copy_while_unchanged():
    """The ops take contiguous tensors; a view's copy is reused until the view changes, so the
    lists kept by tensor identity match from call to call (a new copy each call made new lists,
    three kept copies and a sync each, in every layer)."""
    buf = torch.zeros(2, 16, dtype=torch.int32)
    rule = rules.documents(buf[:, :10])
    first = rule.arguments()[0]
    assert first.is_contiguous() and rule.arguments()[0] is first
    buf[1, 3] = 1  # a write through the base moves the view's version too
    again = rule.arguments()[0]
    assert again is not first and again[1, 3] == 1
    assert rules.documents(buf).arguments()[0] is buf  # contiguous: the tensor itself
