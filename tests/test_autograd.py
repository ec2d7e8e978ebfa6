"""attention()'s and attention_varlen()'s eager autograd without a GPU: the kernels' places taken by
stand-ins (o = q, and a backward that hands d_o back as dq), so what is checked is the plumbing:
a double backward is refused rather than silently cut, a tensor a variant reads (ALiBi slopes, a
rule's tensors) changed in place between forward and backward is an error, as for q, and a score
rule refuses the grid slices of more than 65,535 batches or heads."""

import math

import pytest
import torch

from flashgen import MaskMod, ScoreMod, inputs, ops, plans, tuning, variants
from flashgen.kernels import Kernel


@pytest.fixture
def stand_ins(monkeypatch):
    def forward(q, k, v, *args, **kwargs):  # (lse in each layout's shape: (batch, heads, seq), or (heads, total))
        return q.detach().clone(), torch.zeros(q.shape[:-1] if q.dim() == 4 else (q.shape[1], q.shape[0]))

    def backward(d_o, q, k, v, o, lse, d_lse, cu_seqlens_q, *args):  # (a learned variant's gradient: the prep's sum)
        given = ops.learned(args[7:])  # (after cu_seqlens_k, the lengths, causal, scale, deterministic, kernel)
        delta = (d_o * o).sum(-1) if cu_seqlens_q is None else (d_o * o).sum(-1).t()
        learned_grad = None if given is None else variants.GRADIENTS[given[0]](given[1], delta, lse, cu_seqlens_q)
        return d_o.clone(), torch.zeros_like(k), torch.zeros_like(v), learned_grad

    monkeypatch.setattr(ops, "forward_impl", forward)
    monkeypatch.setattr(ops, "backward_impl", backward)


def leaves(*shape):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3)]


def attend(q, k, v, variant=()):
    return ops._EagerAttention.apply(q, k, v, None, None, 0, 0, False, 1.0, "", False, *variant)


def attend_varlen(q, k, v, variant=()):
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return ops._EagerAttention.apply(q, k, v, cu, cu, q.shape[0], q.shape[0], False, 1.0, "", False, *variant)


@pytest.mark.parametrize("call, shape", [(attend, (1, 2, 5, 8)), (attend_varlen, (5, 2, 8))], ids=["attention", "varlen"])
def test_a_double_backward_is_refused_not_cut(stand_ins, call, shape):
    q, k, v = leaves(*shape)
    o, _ = call(q, k, v)
    (dq,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
    assert torch.allclose(dq, 2 * q)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        (dq.sum() + q.sum()).backward()


@pytest.mark.parametrize("call, shape", [(attend, (1, 2, 5, 8)), (attend_varlen, (5, 2, 8))], ids=["attention", "varlen"])
def test_a_variant_tensor_changed_in_place_before_the_backward_is_an_error(stand_ins, call, shape):
    q, k, v = leaves(*shape)
    slopes, table = torch.ones(1, 2), torch.zeros(4)
    named = {"alibi_slopes": slopes, **({"score_mod": "unused", "score_mod_tensors": [table]} if call is attend else {})}
    variant = variants.Variant(named).op_args()  # (the ops' positional variant arguments)
    o, _ = call(q, k, v, variant)
    o.sum().backward(retain_graph=True)  # untouched: fine
    (slopes if call is attend_varlen else table).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_a_score_rule_refuses_the_grid_slices():
    rule = ScoreMod("score + b", lambda score, b, h, q_idx, kv_idx: score + b, grad="1.f")
    spec = tuning.forward_spec(64, "bf16", False, "sm_90a", 512, variant=(("score_mod", rule.source),))
    plan = plans.Plan((plans.Launch(Kernel(spec, b"")),))
    with pytest.raises(ValueError, match="score_mod with batch=65536, heads=1: a call of more than 65535 batches"):
        plan.run(-1, {"q": torch.empty(65536, 1, 1, 64)})


def test_a_mask_rule_refuses_the_grid_slices_too():
    rule = MaskMod("b == 0 || q_idx >= kv_idx", lambda b, h, q_idx, kv_idx: (b == 0) | (q_idx >= kv_idx), per_head=False)
    spec = tuning.forward_spec(64, "bf16", False, "sm_90a", 512, variant=(("mask_mod", rule.source),))
    plan = plans.Plan((plans.Launch(Kernel(spec, b"")),))
    with pytest.raises(ValueError, match="mask_mod with batch=2, heads=70000: a call of more than 65535"):
        plan.run(-1, {"q": torch.empty(2, 70000, 1, 64)})


def test_more_than_65535_query_heads_on_one_kv_head_is_a_named_error():
    values = {"q": torch.empty(1, 70000, 1, 8), "k": torch.empty(1, 1, 1, 8)}
    with pytest.raises(ValueError, match="70000 query heads on 1 key/value heads: at most 65535"):
        list(plans.slices(values))


def test_an_expanded_input_is_copied_for_the_kernels():
    """A stride of 0 (an expanded k for MQA, or a gradient that arrives expanded over heads) never
    reaches a TMA tensor map, which takes none: such a tensor is copied; others are read in place."""
    k = torch.zeros(2, 1, 64, 64).expand(2, 8, 64, 64)
    assert inputs.aligned(k) is not k and inputs.aligned(k).stride() == (8 * 64 * 64, 64 * 64, 64, 1)
    d_o = torch.zeros(2, 64, 64)[:, None].expand(2, 8, 64, 64)  # (B, H, T, d), stride 0 over heads
    assert inputs.aligned(d_o).stride()[1] == 64 * 64
    packed = torch.zeros(100, 1, 64).expand(100, 4, 64)
    assert inputs.aligned(packed).stride() == (4 * 64, 64, 1)
    view = torch.zeros(2, 64, 8, 64).transpose(1, 2)  # (B, T, H, d) seen as (B, H, T, d): in place
    assert inputs.aligned(view) is view


@pytest.mark.parametrize("call, shape", [(attend, (2, 4, 5, 8)), (attend_varlen, (5, 4, 8))], ids=["attention", "varlen"])
def test_a_sink_gets_its_gradient_from_the_forward_s_lse_and_the_backward_s_delta(stand_ins, call, shape):
    """The kernels' backward needs nothing of a sink (the forward's lse holds it): its gradient is
    variants' formula over the forward's lse and the backward's delta (which the prep sums, here
    the stand-in), in the sink's slot of the op's inputs, summed over the batch by autograd (the op
    takes it as (batch, heads))."""
    q, k, v = leaves(*shape)
    sink = torch.tensor([1.0, -2.0, 0.5, 3.0], requires_grad=True)
    batch = q.shape[0] if call is attend else 1
    o, lse = call(q, k, v, variants.Variant({"learnable_sink": sink.expand(batch, 4)}).op_args())
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    o.backward(d_o)
    cu = None if call is attend else torch.tensor([0, q.shape[0]], dtype=torch.int32)
    delta = (d_o * o.detach()).sum(-1) if cu is None else (d_o * o.detach()).sum(-1).t()
    want = variants.GRADIENTS["learnable_sink"](sink.detach().expand(batch, 4), delta, lse, cu).sum(0)
    assert sink.grad is not None and torch.allclose(sink.grad, want)


@pytest.mark.parametrize("packed", [False, True])
def test_rows_that_see_no_key_get_a_sink_s_logit_as_their_lse(packed):
    """No keys at all: O = 0 and lse -inf, or the sink's logit where a sink is given (the oracle's
    rule), with no kernel launched."""
    sink = torch.tensor([1.5, -2.0])
    q = torch.randn(3, 2, 8) if packed else torch.randn(1, 2, 3, 8)
    k = torch.zeros(0, 2, 8) if packed else torch.zeros(1, 2, 0, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32) if packed else None
    for given, want in ((None, torch.full((2, 3), -math.inf)), (sink, sink[:, None].expand(2, 3))):
        variant = variants.Variant({"learnable_sink": given.expand(1, 2)}).op_args() if given is not None else ()
        o, lse = ops.forward_impl(q, k, k, cu, cu, 3, False, 1.0, "", True, *variant)
        assert torch.equal(o, torch.zeros_like(q)) and torch.equal(lse, want if packed else want[None])
