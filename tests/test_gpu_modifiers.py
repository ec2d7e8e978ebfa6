"""GPU tier: user rules (ScoreMod, MaskMod) forward and backward against the fp32 oracle running their
Python twins, by the numerics rule; the rules written for the examples (ALiBi and a sliding window as
rules, document masking, prefix-LM, a T5-style bias) equal to the built-ins where there is one."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import check_by_the_numerics_rule, outputs_and_grads

import flashgen
from flashgen import MaskMod, ScoreMod
from flashgen.reference import naive_attention

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import rules  # noqa: E402  (the shipped examples: examples/rules.py)

pytestmark = pytest.mark.gpu


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def twin(rule):
    """The oracle's form of a rule: its Python twin."""
    return None if rule is None else rule.python


def check(q, k, v, causal=False, score_mod=None, mask_mod=None, grad=True, deterministic=False, **variant):
    """flashgen with the rules against the oracle running their Python twins, by the numerics rule."""
    ours = outputs_and_grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, score_mod=score_mod, mask_mod=mask_mod,
                                                                deterministic=deterministic, **variant), q, k, v, grad)
    oracle = dict(causal=causal, score_mod=twin(score_mod), mask_mod=twin(mask_mod), **variant)
    exact = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, **oracle), q, k, v, grad)
    low = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, upcast=False, **oracle), q, k, v, grad)
    check_by_the_numerics_rule(ours, exact, low, q.dtype)
    return ours


def alibi_rule(slopes):
    return rules.alibi(slopes)


def document_rule(doc):
    return rules.documents(doc)


def prefix_rule(prefix):
    return rules.prefix_lm(prefix)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_alibi_as_a_rule_equals_the_reference_and_the_builtin(head_dim, dtype):
    q, k, v = make_qkv(2, 4, 2, 333, 333, head_dim, dtype)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 4) for i in range(4)], device="cuda")
    ours = check(q, k, v, causal=True, score_mod=alibi_rule(slopes))
    builtin = flashgen.attention(q, k, v, causal=True, alibi_slopes=slopes)
    assert (ours[0].float() - builtin.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("seqlen", (200, 1000))
def test_sliding_window_as_a_rule_equals_the_builtin(seqlen):
    q, k, v = make_qkv(1, 2, 2, seqlen, seqlen, 64, torch.bfloat16)
    ours = check(q, k, v, causal=True, mask_mod=rules.sliding_window(64))
    builtin = flashgen.attention(q, k, v, causal=True, window_size=(64, 0))
    assert (ours[0].float() - builtin.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("deterministic", [False, True])
def test_document_masking_over_a_packed_batch(deterministic):
    """Documents of different lengths packed in each row: no token sees another document."""
    q, k, v = make_qkv(2, 4, 1, 700, 700, 64, torch.bfloat16, seed=2)
    lengths = [[100, 250, 350], [7, 600, 93]]
    doc = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths], device="cuda", dtype=torch.int32)
    check(q, k, v, causal=True, mask_mod=document_rule(doc), deterministic=deterministic)


def test_prefix_lm():
    q, k, v = make_qkv(2, 2, 2, 300, 300, 128, torch.float16, seed=3)
    check(q, k, v, mask_mod=prefix_rule(77))


def test_t5_relative_bias_table():
    rule = rules.relative_bias(torch.randn(4, 255, device="cuda"))
    q, k, v = make_qkv(1, 4, 2, 257, 300, 64, torch.bfloat16, seed=4)
    check(q, k, v, score_mod=rule)


def test_the_rules_example_runs():
    rules.main([])  # no arguments: not pytest's command line


def test_a_nonlinear_score_rule_and_its_gradient():
    """score_mod = 10 tanh(score / 10) is softcap written as a rule: its gradient is 1 - tanh^2."""
    rule = ScoreMod("10.f * tanhf(score / 10.f)", lambda score, b, h, q_idx, kv_idx: 10 * torch.tanh(score / 10),
                    grad="1.f - tanhf(score / 10.f) * tanhf(score / 10.f)")
    q, k, v = make_qkv(2, 2, 2, 300, 300, 64, torch.bfloat16, seed=5)
    q = q * 3
    ours = check(q, k, v, causal=True, score_mod=rule)
    builtin = flashgen.attention(q, k, v, causal=True, softcap=10.0)
    assert (ours[0].float() - builtin.float()).abs().max().item() < 3e-2


def test_rules_with_variants_gqa_and_odd_lengths():
    q, k, v = make_qkv(2, 8, 2, 129, 511, 96, torch.bfloat16, seed=6)
    slopes = torch.rand(2, 8, device="cuda") * 0.1
    doc = torch.randint(0, 3, (2, 511), device="cuda", dtype=torch.int32).sort(dim=1).values
    rule = MaskMod("doc[b * 511 + q_idx + 382] == doc[b * 511 + kv_idx]",
                   lambda b, h, q_idx, kv_idx: doc[b, q_idx + 382] == doc[b, kv_idx], tensors={"doc": doc}, per_head=False)
    check(q, k, v, causal=True, mask_mod=rule, window_size=(300, -1), softcap=20.0, alibi_slopes=slopes)


def test_the_block_mask_skips_empty_tiles_and_is_kept_for_index_rules():
    from flashgen import blockmask

    blockmask.clear()
    q, k, v = make_qkv(1, 2, 2, 1024, 1024, 64, torch.bfloat16)
    rule = prefix_rule(64)
    flashgen.attention(q, k, v, mask_mod=rule)
    assert len(blockmask._kept) == 1  # a rule over indices alone: its lists are kept for the shape
    lists = next(iter(blockmask._kept.values())).lists
    # causal-like rule with a 64-key prefix: fewer than all tiles are listed, the diagonal ones partial
    assert lists.count.sum().item() < lists.count.numel() * lists.index.shape[-1]
    assert (lists.state == 2).any() and (lists.state == 1).any() and (lists.state == 0).any()
    flashgen.attention(q, k, v, mask_mod=rule)
    assert len(blockmask._kept) == 1


def test_a_tensor_rules_lists_are_kept_until_its_tensor_changes():
    from flashgen import blockmask

    blockmask.clear()
    q, k, v = make_qkv(1, 2, 2, 300, 300, 64, torch.bfloat16)
    doc = torch.zeros(1, 300, dtype=torch.int32, device="cuda")
    rule = document_rule(doc)
    flashgen.attention(q, k, v, mask_mod=rule)
    kept = dict(blockmask._kept)
    flashgen.attention(q, k, v, mask_mod=rule)
    assert blockmask._kept == kept  # the same tensor, unchanged: no new lists
    doc[0, 100:] = 1
    out = flashgen.attention(q, k, v, mask_mod=rule)
    assert len(blockmask._kept) == 2 * len(kept)  # its version moved: new lists, and the output sees them
    assert (out.float() - naive_attention(q, k, v, mask_mod=rule.python).float()).abs().max().item() < 2e-2


def test_a_rule_whose_tensor_changes_is_never_stale():
    q, k, v = make_qkv(1, 2, 2, 300, 300, 64, torch.bfloat16)
    doc = torch.zeros(1, 300, dtype=torch.int32, device="cuda")
    rule = document_rule(doc)
    first = flashgen.attention(q, k, v, mask_mod=rule)
    doc[0, 150:] = 1  # in place: the next call's block mask must see it
    second = flashgen.attention(q, k, v, mask_mod=rule)
    ref = naive_attention(q, k, v, mask_mod=rule.python)
    assert (second.float() - ref.float()).abs().max().item() < 2e-2
    assert not torch.equal(first, second)


def test_torch_compile_fullgraph_and_cuda_graph_with_rules():
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    rule = prefix_rule(32)
    slopes = torch.tensor([0.1, 0.2], device="cuda")
    score = alibi_rule(slopes)

    @torch.compile(fullgraph=True)
    def block(q, k, v):
        return flashgen.attention(q, k, v, mask_mod=rule, score_mod=score)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = block(*leaves)
    out.sum().backward()
    ref = naive_attention(q, k, v, mask_mod=rule.python, score_mod=score.python)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert all(t.grad is not None and not t.grad.isnan().any() for t in leaves)

    flashgen.attention(q, k, v, mask_mod=rule, score_mod=score)  # warm: compiled, lists kept
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashgen.attention(q, k, v, mask_mod=rule, score_mod=score)
    graph.replay()
    torch.cuda.synchronize()
    assert (captured.float() - ref.float()).abs().max().item() < 2e-2


def test_rule_lists_outlive_reduce_overhead_graphs_and_captures():
    """Block-mask lists are kept across calls: those first made under torch.compile's CUDA graphs
    (mode="reduce-overhead", whose warm-up allocates into the graphs' pool) or inside a capture
    (whose values exist only once the graph runs) must not be what a later call reads. Two
    shapes' graphs in turn, then a graph captured first and an eager call after it, all equal the
    eager results of a fresh process's lists."""
    from flashgen import blockmask

    blockmask.clear()
    rule = prefix_rule(40)
    shapes = [make_qkv(1, 2, 2, 300, 300, 64, torch.bfloat16, seed=1), make_qkv(2, 2, 2, 200, 200, 64, torch.bfloat16, seed=2)]
    compiled = torch.compile(lambda q, k, v: flashgen.attention(q, k, v, mask_mod=rule).float() + 1, mode="reduce-overhead")
    for round_ in range(3):
        for q, k, v in shapes:
            got = compiled(q, k, v).clone()
            ref = naive_attention(q, k, v, mask_mod=rule.python).float() + 1
            assert (got - ref).abs().max().item() < 2e-2, f"round {round_}"
    blockmask.clear()
    q, k, v = make_qkv(1, 2, 2, 260, 260, 64, torch.bfloat16, seed=3)
    flashgen.attention(q, k, v, mask_mod=prefix_rule(41))  # the kernels, loaded off the graph
    blockmask.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashgen.attention(q, k, v, mask_mod=prefix_rule(41))
    eager = flashgen.attention(q, k, v, mask_mod=prefix_rule(41))  # before any replay
    graph.replay()
    torch.cuda.synchronize()
    ref = naive_attention(q, k, v, mask_mod=prefix_rule(41).python)
    assert (eager.float() - ref.float()).abs().max().item() < 2e-2
    assert (captured.float() - ref.float()).abs().max().item() < 2e-2


def test_a_rule_without_gradient_runs_forward_only():
    rule = ScoreMod("score * 0.5f", lambda score, b, h, q_idx, kv_idx: score * 0.5)
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, torch.bfloat16)
    check(q, k, v, score_mod=rule, grad=False)
    with pytest.raises(Exception, match="grad"):
        flashgen.attention(q.requires_grad_(), k, v, score_mod=rule).sum().backward()


def per_head_band(heads):
    """A per-head rule: head h sees the keys within 40 (h + 1) positions of the query, so the query
    heads that share a KV head walk different tile lists."""
    return MaskMod("abs(q_idx - kv_idx) < 40 * (h + 1)", lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 40 * (h + 1))


@pytest.mark.parametrize("head_dim, block_n", [(64, 128), (128, 128), (128, 64)], ids=["d64", "d128", "d128-split"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_a_per_head_rule_over_gqa_groups_on_the_hopper_kernels(head_dim, block_n, deterministic):
    """The Hopper backward locates each step in its own head's list (the heads of a group differ)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels need sm_90a")
    from flashgen import tuning

    kind = "bwd_sm90_kv" if deterministic else "bwd_sm90_kvq"
    entry = {"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
             "variant": True, "tiles": [{"block_m": 64, "block_n": block_n, "num_stages": 2}]}
    q, k, v = make_qkv(2, 8, 2, 700, 900, head_dim, torch.bfloat16, seed=head_dim + block_n)
    rule = per_head_band(8)
    with tuning.override([entry]):
        fwd = tuning.forward_spec(head_dim, "bf16", False, "sm_90a", 700, variant=(("mask_mod", rule.source),))
        bwd = tuning.backward_specs(head_dim, "bf16", False, "sm_90a", deterministic, variant=(("mask_mod", rule.source),))
        assert fwd.kind == "fwd_sm90" and (bwd[0].kind, bwd[0].block_n) == (kind, block_n)
        check(q, k, v, mask_mod=rule, deterministic=deterministic)
        check(q, k, v, causal=True, mask_mod=rule, deterministic=deterministic)


def test_a_rule_on_the_persistent_hopper_forward():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels need sm_90a")
    from flashgen import tuning

    entry = {"kind": "fwd_sm90", "arch": "sm_90a", "head_dim": 128, "dtype": "*", "causal": "*", "bucket": "*",
             "variant": True, "tiles": [{"block_m": 128, "block_n": 128, "num_stages": 2, "persistent": True}]}
    q, k, v = make_qkv(3, 4, 2, 1000, 1000, 128, torch.bfloat16, seed=11)
    doc = torch.randint(0, 4, (3, 1000), device="cuda", dtype=torch.int32).sort(dim=1).values
    with tuning.override([entry]):
        rule = document_rule(doc)
        assert tuning.forward_spec(128, "bf16", True, "sm_90a", 1000, variant=(("mask_mod", rule.source),)).persistent
        check(q, k, v, causal=True, mask_mod=rule, grad=False)
        check(q, k, v, causal=True, mask_mod=per_head_band(4), score_mod=rules.relative_bias(torch.randn(4, 255, device="cuda")),
              grad=False)
