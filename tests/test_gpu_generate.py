"""examples/generate.py, the serving client: varlen prefill into a paged cache, decode in a CUDA
graph, each step's logits against the same model run by transformers."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


def _example():
    path = Path(__file__).parents[1] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page_size", [16, 64])
def test_every_step_matches_transformers(page_size):
    example = _example()
    model = example.small_llama(seed=1, layers=2)
    prompts = example.random_prompts(5, model.config.vocab_size, seed=page_size, shortest=1, longest=150)
    engine = example.PagedLlama(model, len(prompts), 150 + 24, page_size, seed=3)
    tokens, logits = engine.generate(prompts, 24)
    assert engine.graph is not None  # the decode steps ran as graph replays
    reference = example.reference_logits(copy.deepcopy(model).float(), prompts, tokens)
    low_precision = example.reference_logits(model, prompts, tokens)  # transformers' SDPA path, bf16
    error = (logits - reference).abs().max().item()
    bound = 2 * (low_precision - reference).abs().max().item() + 1e-5
    assert error <= bound, f"max |flashgen - fp32| {error:.4f} > 2 x |transformers bf16 - fp32| {bound:.4f}"
    assert (engine.cache_seqlens.cpu() == torch.tensor([len(p) + 23 for p in prompts], dtype=torch.int32)).all()
