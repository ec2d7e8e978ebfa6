"""The transformers hook without a GPU: with the CPU oracle in place of the kernels, a padded batch
comes out as each row's real tokens attended alone, a model's sliding window and softcap reach the
kernels as FlashAttention's window_size / softcap, and a small random Gemma-2 (softcap, alternating
sliding-window layers, GQA) gives transformers' own eager logits and gradients on left- and
right-padded batches (that one needs transformers)."""

from types import SimpleNamespace

import pytest
import torch

from flashgen import reference
from flashgen.integrations import transformers as hook
from flashgen.reference import naive_attention


def oracle_attention(q, k, v, *, causal=False, scale=None, return_lse=False, deterministic=False,
                     window_size=(-1, -1), softcap=0.0, learnable_sink=None):
    return naive_attention(q, k, v, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                           learnable_sink=learnable_sink)


def oracle_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                  causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None):
    """attention_varlen's semantics with the variants: naive attention of each sequence alone."""
    if (tuple(window_size), softcap, learnable_sink) == ((-1, -1), 0.0, None):
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=softmax_scale, causal=causal)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(len(starts_q) - 1):
        q_b, k_b, v_b = (t[s[b]:s[b + 1]].transpose(0, 1)[None] for t, s in ((q, starts_q), (k, starts_k), (v, starts_k)))
        o = naive_attention(q_b, k_b, v_b, causal=causal, scale=softmax_scale, window_size=window_size, softcap=softcap,
                            learnable_sink=learnable_sink)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def oracle(monkeypatch):
    """The CPU oracle in place of the kernels; returns the list of the varlen calls' (cu_q, cu_k,
    max_q, max_k, variant keywords)."""
    calls = []

    def varlen(*args, **kwargs):
        calls.append((*args[3:7], {key: kwargs[key] for key in ("window_size", "softcap", "learnable_sink") if key in kwargs}))
        return oracle_varlen(*args, **kwargs)

    monkeypatch.setattr(hook, "_kernels", lambda: (oracle_attention, varlen))
    return calls


MODULE = SimpleNamespace(training=False, is_causal=True)


def qkv(batch=2, heads=4, kv_heads=2, length=7, d=16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, h, length, d, generator=gen) for h in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_attends_each_row_s_real_tokens_alone(oracle, side):
    q, k, v = qkv()
    lengths = [7, 4]
    mask = torch.zeros(2, 7, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    if side == "left":
        mask = mask.flip(1)
    out, weights = hook.attention_forward(MODULE, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (2, 7, 4, 16)
    for row in range(2):
        keep = mask[row]
        alone = naive_attention(q[row:row + 1, :, keep], k[row:row + 1, :, keep], v[row:row + 1, :, keep], causal=True, scale=0.25)
        torch.testing.assert_close(out[row, keep], alone[0].transpose(0, 1), atol=1e-6, rtol=0)
        assert torch.equal(out[row, ~keep], torch.zeros_like(out[row, ~keep]))  # padded query rows
    (cu_q, cu_k, max_q, max_k, variants), = oracle
    assert variants == {}  # a plain model: the plain kernels
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 7, 11] and (max_q, max_k) == (7, 7)


def test_no_mask_runs_attention_and_packed_sequences_run_varlen_directly(oracle):
    q, k, v = qkv(batch=1)
    out, _ = hook.attention_forward(MODULE, q, k, v, None)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True).transpose(1, 2))
    cu = torch.tensor([0, 3, 7])
    out, _ = hook.attention_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    expected = reference.attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), cu.int(), cu.int(), 4, 4, causal=True)
    torch.testing.assert_close(out[0], expected)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_sliding_window_and_softcap_reach_the_kernels_and_count_real_tokens(oracle, side):
    """sliding_window=3: a query sees itself and 2 keys before it (transformers' masks), i.e.
    FlashAttention's window_size=(2, 0) with causal; in a padded row the window counts real tokens."""
    q, k, v = qkv()
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0], mask[1, :4] = True, True
    if side == "left":
        mask = mask.flip(1)
    out, _ = hook.attention_forward(MODULE, q, k, v, mask, scaling=0.25, sliding_window=3, softcap=2.0)
    for row in range(2):
        keep = mask[row]
        q_r, k_r, v_r = (t[row:row + 1, :, keep] for t in (q, k, v))
        n = int(keep.sum())
        scores = torch.matmul(q_r, k_r.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
        scores = 2.0 * torch.tanh(scores / 2.0)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        scores = scores.masked_fill(~((j <= i) & (j > i - 3)), float("-inf"))  # kv_idx > q_idx - sliding_window
        alone = torch.matmul(scores.softmax(-1), v_r.repeat_interleave(2, 1))
        torch.testing.assert_close(out[row, keep], alone[0].transpose(0, 1), atol=1e-6, rtol=0)
    (*_, variants), = oracle
    assert variants == {"window_size": (2, 0), "softcap": 2.0}


def per_sequence(q, k, v, cu, causal=True):
    """Each packed sequence (cu over the length) of one row attended alone: (length, heads, d)."""
    starts = cu.tolist()
    return torch.cat([naive_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=causal)[0].transpose(0, 1)
                      for a, b in zip(starts, starts[1:])])


def test_sequences_packed_by_position_ids_alone_attend_each_alone(oracle):
    """A collator's flattening marks sequences only by position_ids restarting (transformers' flash
    path reads them there): each attends alone. One increasing run, or a decoding step, is one."""
    q, k, v = qkv(batch=1)
    out, _ = hook.attention_forward(MODULE, q, k, v, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    torch.testing.assert_close(out[0], per_sequence(q, k, v, torch.tensor([0, 3, 7])))
    (cu_q, cu_k, max_q, max_k, _), = oracle
    assert cu_q.tolist() == cu_k.tolist() == [0, 3, 7] and cu_q.dtype == torch.int32 and (max_q, max_k) == (4, 4)
    for run in (torch.arange(7)[None], torch.arange(5, 12)[None]):
        out, _ = hook.attention_forward(MODULE, q, k, v, None, position_ids=run)
        torch.testing.assert_close(out, naive_attention(q, k, v, causal=True).transpose(1, 2))
    assert len(oracle) == 1


def test_packed_sequences_of_several_rows_are_flattened(oracle):
    q, k, v = qkv(batch=2)
    cu = torch.tensor([0, 3, 7, 10, 14])  # two sequences in each row of 7
    out, _ = hook.attention_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    flat = [t.transpose(1, 2).reshape(1, 14, t.shape[1], 16).transpose(1, 2) for t in (q, k, v)]
    torch.testing.assert_close(out.reshape(14, 4, 16), per_sequence(*flat, cu))


@pytest.mark.parametrize("seqlen_q", [1, 3, 9])
def test_cross_attention_keeps_every_query_row(oracle, seqlen_q):
    """A non-causal call with other lengths than the keys' (a decoder over an encoder's padded
    states): every query row attends to its row's real keys; none is dropped for the keys' padding."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, seqlen_q, 16, generator=gen)
    k, v = (torch.randn(2, 2, 5, 16, generator=gen) for _ in range(2))
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])  # the encoder's second row right-padded
    out, _ = hook.attention_forward(SimpleNamespace(training=False, is_causal=False), q, k, v, mask, is_causal=False)
    for row in range(2):
        keep = mask[row]
        alone = naive_attention(q[row:row + 1], k[row:row + 1, :, keep], v[row:row + 1, :, keep])
        torch.testing.assert_close(out[row], alone[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_a_static_cache_s_empty_slots_are_cut(oracle):
    """A mask shorter than the keys is a static cache's: its first slots hold the tokens, the rest
    are empty (transformers' flash path cuts the keys to the mask)."""
    q, k, v = qkv(length=7)
    q = q[:, :, -2:]  # a step of 2 queries over 5 tokens so far, in a cache of 7 slots
    mask = torch.tensor([[True] * 5, [False, True, True, True, True]])
    out, _ = hook.attention_forward(MODULE, q, k, v, mask)
    for row in range(2):
        keep = mask[row]
        alone = naive_attention(q[row:row + 1], k[row:row + 1, :, :5][:, :, keep], v[row:row + 1, :, :5][:, :, keep], causal=True)
        torch.testing.assert_close(out[row], alone[0].transpose(0, 1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("v_head_dim", [8, 32])
def test_values_of_another_head_dim(monkeypatch, v_head_dim):
    """V narrower than q and k (MLA) or wider goes to the kernels as it is (they take a head dim of
    V's own), with the default scale q's head dim's."""
    seen = []

    def attention(q, k, v, **keywords):
        seen.append((q.shape[-1], v.shape[-1]))
        return oracle_attention(q, k, v, **keywords)

    monkeypatch.setattr(hook, "_kernels", lambda: (attention, oracle_varlen))
    q, k, _ = qkv(batch=1)
    v = torch.randn(1, 2, 7, v_head_dim, generator=torch.Generator().manual_seed(5))
    out, _ = hook.attention_forward(MODULE, q, k, v, None)
    assert seen == [(16, v_head_dim)]  # nothing padded
    scores = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 16**-0.5
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.matmul(scores.softmax(-1), v.repeat_interleave(2, 1)).transpose(1, 2)
    assert out.shape == (1, 7, 4, v_head_dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_settings_that_change_nothing_pass(monkeypatch):
    """A window at least as long as the keys is no window, and softcap 0 or None is none: such a
    model runs on the plain kernels (no variant keyword reaches them)."""
    seen = record(monkeypatch)
    q, k, v = qkv(batch=1)
    out, _ = hook.attention_forward(MODULE, q, k, v, None, sliding_window=7, softcap=0.0)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True).transpose(1, 2))
    hook.attention_forward(MODULE, q, k, v, None, sliding_window=None, softcap=None)
    assert seen == [{}, {}]


@pytest.mark.parametrize("causal, window", [(True, (2, 0)), (False, (2, 2))])
def test_the_window_is_flash_attention_s_of_transformers_flash_path(monkeypatch, causal, window):
    """transformers' flash path: window_size = (sliding_window - 1, sliding_window - 1), which
    FlashAttention caps at right = 0 when causal (and which bidirectional models such as ModernBERT
    size their sliding_window for)."""
    seen = record(monkeypatch)
    q, k, v = qkv(batch=1)
    hook.attention_forward(SimpleNamespace(training=False, is_causal=causal), q, k, v, None, sliding_window=3, softcap=50.0)
    assert seen == [{"window_size": window, "softcap": 50.0}]


def record(monkeypatch):
    """attention() and attention_varlen() as the oracle, recording the variant keywords of each call."""
    seen = []

    def attention(q, k, v, **kwargs):
        seen.append({key: kwargs[key] for key in ("window_size", "softcap") if key in kwargs})
        return oracle_attention(q, k, v, **kwargs)

    def varlen(*args, **kwargs):
        seen.append({key: kwargs[key] for key in ("window_size", "softcap") if key in kwargs})
        return oracle_varlen(*args, **kwargs)

    monkeypatch.setattr(hook, "_kernels", lambda: (attention, varlen))
    return seen


# ---- a small random Gemma-2 against transformers' eager attention --------------------------------

LENGTHS = [24, 17, 5]  # one row unpadded, one shorter than the window


def small_gemma2(attn_implementation, **settings):
    """Gemma-2's attention, small: logit softcap, sliding-window and full layers alternating (a window
    of 8, shorter than the rows), GQA (4 query heads on 2), scale 1/sqrt(query_pre_attn_scalar)
    != 1/sqrt(head_dim). The query/key weights are scaled up so that the scores reach the cap's
    range (at the default init they stay near 0, where tanh is the identity)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**{**dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=None, attention_dropout=0.0, attn_implementation=attn_implementation), **settings})
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 6
            layer.self_attn.k_proj.weight *= 6
    return model


def padded_batch(side, vocab=128):
    gen = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    if side == "left":
        mask = mask.flip(1)
    return torch.randint(0, vocab, mask.shape, generator=gen), mask, torch.randint(0, vocab, mask.shape, generator=gen)


def logits_and_grads(model, ids, mask, labels):
    """Logits at the real tokens, and every parameter's gradient of the loss over them, flat."""
    model.zero_grad(set_to_none=True)
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # each row's real tokens count from 0
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.nn.functional.cross_entropy(logits[real], labels[real]).backward()
    return logits[real].detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_gemma2_matches_transformers_eager_on_a_padded_batch(oracle, side):
    pytest.importorskip("transformers")
    name = hook.register()
    ours = small_gemma2(name)
    assert ours.config._attn_implementation == name  # transformers took the registered name
    assert ours.config.layer_types == ["sliding_attention", "full_attention"] * 2
    eager = small_gemma2("eager")
    batch = padded_batch(side)
    logits, grads = logits_and_grads(ours, *batch)
    ref_logits, ref_grads = logits_and_grads(eager, *batch)
    # fp32 on both sides: the same computation up to the order of the sums
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert {tuple(sorted(v)) for *_, v in oracle} == {("softcap", "window_size"), ("softcap",)}
    # and the settings matter here: without the window, or without the cap, the logits move far
    for settings in (dict(sliding_window=64), dict(attn_logit_softcapping=None)):
        other, _ = logits_and_grads(small_gemma2("eager", **settings), *batch)
        assert (other - ref_logits).abs().max() > 1000 * 1e-5, settings


def test_a_gemma2_on_sequences_packed_by_position_ids_gives_each_sequence_s_own_logits(oracle):
    """Three sequences flattened into one row, marked only by position_ids (what transformers'
    DataCollatorWithFlattening gives): as on transformers' flash path, each attends to itself
    alone, so its logits are eager's on that sequence by itself."""
    pytest.importorskip("transformers")
    name = hook.register()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    eager = small_gemma2("eager")
    with torch.no_grad():
        ours = small_gemma2(name)(input_ids=ids, position_ids=positions).logits
        starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
        alone = torch.cat([eager(input_ids=ids[:, a:b], position_ids=positions[:, a:b]).logits for a, b in zip(starts, starts[1:])], 1)
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert len(oracle) > 0 and all(cu_q.tolist() == starts for cu_q, *_ in oracle[-4:])


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_gemma2_generates_as_transformers_eager_does_with_a_cache(oracle, side):
    """Greedy generation over a padded batch with a dynamic cache: every decoding step (one query
    over the cache, its padding masked) gives eager's logits."""
    pytest.importorskip("transformers")
    name = hook.register()
    ids, mask, _ = padded_batch(side)
    if side == "right":  # generation pads on the left; a right-padded batch decodes from its longest row
        ids, mask = ids[:1, :LENGTHS[0]], mask[:1, :LENGTHS[0]]
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ours = small_gemma2(name).generate(input_ids=ids, attention_mask=mask, **options)
        eager = small_gemma2("eager").generate(input_ids=ids, attention_mask=mask, **options)
    assert torch.equal(ours.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, eager.logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


# ---- a small random gpt-oss (attention sinks, alternating sliding-window layers) ---------------------


def small_gpt_oss(attn_implementation):
    """gpt-oss' attention, small: a learned sink per query head, sliding-window (8) and full layers
    alternating, GQA (4 query heads on 2). The sinks are set far from 0 so that they matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                          attn_implementation=attn_implementation)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    return model


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_gpt_oss_with_sinks_matches_transformers_eager_on_a_padded_batch(oracle, side):
    """s_aux reaches the kernels as learnable_sink: logits and every gradient (the sinks' too) are
    eager's, and without the sinks they would not be."""
    pytest.importorskip("transformers")
    name = hook.register()
    ours, eager = small_gpt_oss(name), small_gpt_oss("eager")
    batch = padded_batch(side)
    logits, grads = logits_and_grads(ours, *batch)
    ref_logits, ref_grads = logits_and_grads(eager, *batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    sinks = [layer.self_attn.sinks.grad for layer in ours.model.layers]
    assert all(grad is not None and grad.abs().max() > 0 for grad in sinks)
    assert all("learnable_sink" in keywords for *_, keywords in oracle)
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(-100.0)  # (no sink at all)
    other, _ = logits_and_grads(eager, *batch)
    assert (other - ref_logits).abs().max() > 1000 * 1e-5
