"""User rules for flashgen.attention: common attention patterns written as ScoreMod / MaskMod, each a
CUDA expression compiled into the kernel and a Python twin the oracle runs.

    python examples/rules.py      # (GPU) runs every rule and checks it against flashgen.reference

The rules see the scaled score `score`, the batch `b`, the query head `h` and the positions `q_idx`,
`kv_idx`; tensors are read by name, flat. Two of them (ALiBi, a sliding window) have built-in
equivalents (alibi_slopes=, window_size=), which main() compares them with.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not

from flashgen import MaskMod, ScoreMod  # noqa: E402


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi for queries and keys of one length: score - slope[h] * |q_idx - kv_idx| (BLOOM, MPT)."""
    return ScoreMod("score - slope[h] * fabsf(float(q_idx - kv_idx))",
                    lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs(),
                    grad="1.f", tensors={"slope": slopes})


def sliding_window(size: int) -> MaskMod:
    """Each query sees itself and the `size` keys before it (with causal=True: Mistral's window)."""
    return MaskMod(f"q_idx - kv_idx <= {size}", lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= size,
                   per_batch=False, per_head=False)


def documents(doc_ids: torch.Tensor) -> MaskMod:
    """Document masking over a packed batch: doc_ids (batch, length) int32; a token sees only tokens of
    its own document."""
    length = doc_ids.shape[1]
    return MaskMod(f"doc[b * {length} + q_idx] == doc[b * {length} + kv_idx]",
                   lambda b, h, q_idx, kv_idx: doc_ids[b, q_idx] == doc_ids[b, kv_idx],
                   tensors={"doc": doc_ids}, per_head=False)


def prefix_lm(prefix: int) -> MaskMod:
    """Prefix-LM: the first `prefix` tokens are seen by all (bidirectional), the rest causally."""
    return MaskMod(f"kv_idx < {prefix} || kv_idx <= q_idx", lambda b, h, q_idx, kv_idx: (kv_idx < prefix) | (kv_idx <= q_idx),
                   per_batch=False, per_head=False)


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A T5-style learned relative-position bias: table (heads, 2 * D - 1) fp32 over clipped distances
    q_idx - kv_idx in [-(D - 1), D - 1]. (Its gradient into the table is not computed: no gradient
    flows into a rule's tensors.)"""
    heads, buckets = table.shape
    reach = (buckets - 1) // 2
    return ScoreMod(f"score + bias[h * {buckets} + min(max(q_idx - kv_idx + {reach}, 0), {buckets - 1})]",
                    lambda score, b, h, q_idx, kv_idx: score + table[h, (q_idx - kv_idx + reach).clamp(0, buckets - 1)],
                    grad="1.f", tensors={"bias": table})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit(f"{parser.prog} needs an NVIDIA GPU (sm_80+); PyTorch sees none on this machine")
    import flashgen
    from flashgen.reference import naive_attention

    torch.manual_seed(0)
    batch, heads, length, head_dim = 2, 4, 1024, 64
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda", dtype=torch.int32), length // 4).repeat(batch, 1)
    cases = {
        "alibi": (dict(causal=True, score_mod=alibi(slopes)), dict(causal=True, alibi_slopes=slopes)),
        "sliding window": (dict(causal=True, mask_mod=sliding_window(256)), dict(causal=True, window_size=(256, 0))),
        "documents": (dict(causal=True, mask_mod=documents(doc_ids)), None),
        "prefix-LM": (dict(mask_mod=prefix_lm(100)), None),
        "T5 bias": (dict(causal=True, score_mod=relative_bias(torch.randn(heads, 255, device="cuda"))), None),
    }
    for name, (rules, builtin) in cases.items():
        out = flashgen.attention(q, k, v, **rules)
        oracle = {key: getattr(value, "python", value) for key, value in rules.items()}
        ref = naive_attention(q, k, v, **oracle)
        error = (out.float() - ref.float()).abs().max().item()
        line = f"{name:15s} max |out - reference| = {error:.2e}"
        if builtin is not None:
            line += f", vs the built-in {(out.float() - flashgen.attention(q, k, v, **builtin).float()).abs().max().item():.2e}"
        print(line)
        assert error < 2e-2, name


if __name__ == "__main__":
    main()
