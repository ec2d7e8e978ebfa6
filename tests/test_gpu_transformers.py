"""GPU tier: a small random Llama (GQA) from transformers with flashgen's attention hook, on right-
and left-padded batches: logits and gradients against the same model on transformers' own SDPA
attention, by the bf16 rule of test_gpu_generate.py: the error against an fp32 copy of the model is
at most 2x (logits; 3x for gradients, the numerics rule's factor) the bf16 model's + 1e-5. The bf16
model runs transformers' eager attention: its SDPA path gives NaN gradients on a left-padded batch
(the padded query rows see no key), which would make the bound NaN (seen on the H200, torch 2.11)."""

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

LENGTHS = [37, 64, 5, 50]  # one row unpadded, one of five tokens


def small_llama(attn_implementation, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def padded_batch(side, vocab=512, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    ids = torch.randint(0, vocab, (len(LENGTHS), width), generator=gen)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, width - n:] = 1
    labels = torch.randint(0, vocab, ids.shape, generator=gen)
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
def test_padded_batch_matches_transformers(side):
    import flashgen.integrations.transformers as fg_hf

    name = fg_hf.register()
    ours = small_llama(name)
    eager = small_llama("eager")
    eager.load_state_dict(ours.state_dict())
    exact = copy.deepcopy(small_llama("sdpa")).float()
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
        assert error <= bound, f"{side}-padded {what}: max |flashgen - fp32| {error:.4g} > {factor} x |bf16 - fp32| {bound:.4g}"


def test_a_model_with_a_sliding_window_is_refused_by_name():
    import flashgen.integrations.transformers as fg_hf
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, sliding_window=8, attn_implementation=fg_hf.register())
    model = MistralForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 32), device="cuda")
    with pytest.raises(ValueError, match="this model sets sliding_window"):
        model(input_ids=ids)
    model(input_ids=ids[:, :8])  # no longer than the window: no window at all, and it runs
