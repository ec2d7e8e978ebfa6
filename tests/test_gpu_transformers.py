"""GPU tier: small random transformers models with flashgen's attention hook, on right- and
left-padded batches: a Llama (GQA), a Mistral (GQA, a sliding window shorter than the rows, on
every layer) and a Gemma-2 (GQA, logit softcap, sliding-window and full layers alternating, scale
1/sqrt(query_pre_attn_scalar)). Logits and gradients are checked against the same model in fp32
by the bf16 rule of test_gpu_generate.py: the error against the fp32 model is at most 2x (logits;
3x for gradients, the numerics rule's factor) the bf16 model's + 1e-5. The bf16 model runs
transformers' eager attention: its SDPA path gives NaN gradients on a left-padded batch (the padded
query rows see no key), which would make the bound NaN (seen on the H200, torch 2.11). The fp32
model runs SDPA, or eager for Gemma-2 (transformers' SDPA path refuses a softcap)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

LENGTHS = [37, 64, 5, 50]  # one row unpadded, one of five tokens
WINDOW = 16  # shorter than every row but the shortest
VOCAB = 512


def small_model(kind, attn_implementation, seed=0):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, attention_dropout=0.0,
                  attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=WINDOW))
    else:
        config = transformers.Gemma2Config(**{**common, "num_hidden_layers": 4}, sliding_window=WINDOW, query_pre_attn_scalar=64,
                                           attn_logit_softcapping=10.0, final_logit_softcapping=None)
        assert config.layer_types == ["sliding_attention", "full_attention"] * 2
        model = transformers.Gemma2ForCausalLM(config)
    if kind == "gemma2":  # scores in the cap's range (near 0, where the default init keeps them, tanh is the identity)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 6
                layer.self_attn.k_proj.weight *= 6
    return model.to(device="cuda", dtype=torch.bfloat16)


def padded_batch(side, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), width), generator=gen)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, width - n:] = 1
    labels = torch.randint(0, VOCAB, ids.shape, generator=gen)
    return ids.cuda(), mask.cuda(), labels.cuda()


def run(model, ids, mask, labels):
    """Logits at the real tokens, and every parameter's gradient of the loss over them, flat."""
    model.zero_grad(set_to_none=True)
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # each row's real tokens count from 0
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    real = mask.bool()
    torch.nn.functional.cross_entropy(logits[real], labels[real]).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return logits[real].detach(), grads


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_padded_batch_matches_transformers(kind, side):
    import flashgen.integrations.transformers as fg_hf

    name = fg_hf.register()
    ours = small_model(kind, name)
    assert ours.config._attn_implementation == name
    eager = small_model(kind, "eager")
    eager.load_state_dict(ours.state_dict())
    exact = small_model(kind, "eager" if kind == "gemma2" else "sdpa").float()
    exact.load_state_dict(ours.state_dict())
    batch = padded_batch(side)
    logits, grads = run(ours, *batch)
    low_logits, low_grads = run(eager, *batch)
    ref_logits, ref_grads = run(exact, *batch)
    assert not ref_grads.isnan().any() and not low_grads.isnan().any()
    assert not logits.isnan().any() and not grads.isnan().any()
    for what, mine, low, ref, factor in (("logits", logits, low_logits, ref_logits, 2), ("gradients", grads, low_grads, ref_grads, 3)):
        error = (mine - ref).abs().max().item()
        bound = factor * (low - ref).abs().max().item() + 1e-5
        assert error <= bound, f"{kind} {side}-padded {what}: max |flashgen - fp32| {error:.4g} > {factor} x |bf16 - fp32| {bound:.4g}"


def test_a_model_no_longer_than_its_window_runs_the_plain_kernels(monkeypatch):
    """Rows no longer than the sliding window: no window at all (transformers' flash path says
    the same): the kernels get no variant keyword, and the logits match eager's by the same rule."""
    import flashgen
    import flashgen.integrations.transformers as fg_hf

    seen = []

    def recording(fn):
        def call(*args, **kwargs):
            seen.append(sorted(set(kwargs) & {"window_size", "softcap", "alibi_slopes"}))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(fg_hf, "_kernels", lambda: (recording(flashgen.attention), recording(flashgen.attention_varlen)))
    ours = small_model("mistral", fg_hf.register())
    eager = small_model("mistral", "eager")
    eager.load_state_dict(ours.state_dict())
    exact = small_model("mistral", "sdpa").float()
    exact.load_state_dict(ours.state_dict())
    ids = torch.randint(0, VOCAB, (2, WINDOW), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.no_grad():
        mine, low, ref = (m(input_ids=ids).logits.float() for m in (ours, eager, exact))
    assert seen == [[]] * ours.config.num_hidden_layers
    assert (mine - ref).abs().max() <= 2 * (low - ref).abs().max() + 1e-5
    seen.clear()
    with torch.no_grad():
        ours(input_ids=torch.cat([ids, ids], dim=1))  # longer than the window: the window reaches the kernels
    assert seen == [["window_size"]] * ours.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_sequences_packed_by_position_ids_match_each_sequence_alone(kind):
    """The rows of a padded batch flattened into one, marked only by position_ids (a collator's
    flattening): each sequence's logits are the model's on that sequence alone (fp32 eager or SDPA),
    by the same bf16 rule against the bf16 eager model on it alone."""
    import flashgen.integrations.transformers as fg_hf

    ours = small_model(kind, fg_hf.register())
    eager = small_model(kind, "eager")
    eager.load_state_dict(ours.state_dict())
    exact = small_model(kind, "eager" if kind == "gemma2" else "sdpa").float()
    exact.load_state_dict(ours.state_dict())
    ids, mask, _ = padded_batch("right")
    flat = ids[mask.bool()][None]
    positions = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
    with torch.no_grad():
        logits = ours(input_ids=flat, position_ids=positions).logits.float()
        alone = [[m(input_ids=ids[row:row + 1, :n], position_ids=torch.arange(n, device="cuda")[None]).logits.float()
                  for row, n in enumerate(LENGTHS)]
                 for m in (eager, exact)]
    low, ref = (torch.cat(parts, 1) for parts in alone)
    error = (logits - ref).abs().max().item()
    bound = 2 * (low - ref).abs().max().item() + 1e-5
    assert error <= bound, f"{kind} packed: max |flashgen - fp32| {error:.4g} > 2 x |bf16 - fp32| {bound:.4g}"
