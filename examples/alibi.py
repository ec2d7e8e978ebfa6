"""ALiBi (attention with linear biases, as in BLOOM and MPT) on flashgen.attention: no position
embeddings; each head h adds -slope[h] * (i - j) to the score of query i and key j, with one
slope per head from a geometric sequence, so heads look at different distances.

    python examples/alibi.py                      # 16 heads of 128, T=4096, causal
    python examples/alibi.py --heads 12 --length 1000 --per-batch

flashgen.attention takes FlashAttention's keyword: alibi_slopes, fp32 of shape (heads,) or
(batch, heads), adds -slope * |i + Tk - Tq - j| to the scaled scores; under causal masking that
is -slope * (i - j), ALiBi's bias. The bias is computed in the kernel: no (T, T) bias tensor is
ever formed. The script checks the output and gradients against flashgen.reference in fp32 and
against the bias written out by hand, by the numerics rule (the error is at most 2x, 3x for
gradients, that of the same computation in bf16).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not

import flashgen  # noqa: E402
from flashgen.reference import naive_attention  # noqa: E402


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes: 2^(-8 h / n) for h = 1..n with n the power of two at or below
    heads; for other head counts the odd steps of the next power of two's sequence fill the rest."""
    def geometric(n):
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][: heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def biased_attention(q, k, v, slopes, causal):
    """ALiBi written out: the (B, H, T, T) bias added to the scaled scores, in fp32."""
    q, k, v = q.float(), k.float(), v.float()
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    bias = -slopes.view(*slopes.shape[:-1], -1, 1, 1) * (i - j).abs()  # (H, T, T) or (B, H, T, T)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    if causal:
        scores = scores.masked_fill(j > i, float("-inf"))
    return scores.softmax(-1) @ v


def output_and_grads(attend, q, k, v, d_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(d_out.to(out.dtype))
    return out.detach().float(), torch.cat([t.grad.float().flatten() for t in leaves])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--bidirectional", action="store_true", help="no causal mask (the bias is then -slope * |i - j|)")
    parser.add_argument("--per-batch", action="store_true", help="slopes of shape (batch, heads): each sequence its own")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit(f"{parser.prog} needs an NVIDIA GPU (sm_80+); PyTorch sees none on this machine")
    causal = not args.bidirectional

    slopes = alibi_slopes(args.heads).cuda()
    if args.per_batch:
        slopes = torch.stack([slopes * (1 + 0.25 * b) for b in range(args.batch)])
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(args.batch, args.heads, args.length, args.head_dim, device="cuda", dtype=torch.bfloat16,
                                  generator=gen) for _ in range(4))

    # fp32 references in full fp32: TF32 matrix products (which another part of a program may allow)
    # would make the oracle and the bias written out by hand differ by far more than rounding
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _check(args, causal, slopes, q, k, v, d_out)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _check(args, causal, slopes, q, k, v, d_out) -> dict:
    ours = output_and_grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, alibi_slopes=slopes), q, k, v, d_out)
    low = output_and_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, alibi_slopes=slopes, upcast=False), q, k, v, d_out)
    exact = output_and_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, alibi_slopes=slopes), q, k, v, d_out)
    # the oracle against the bias written out by hand, both in fp32 throughout (leaves included, so
    # that neither output nor gradients are rounded to bf16)
    wide = [t.float() for t in (q, k, v)]
    oracle32 = output_and_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, alibi_slopes=slopes), *wide, d_out)
    by_hand = output_and_grads(lambda q, k, v: biased_attention(q, k, v, slopes, causal), *wide, d_out)
    result = {}
    for name, mine, lo, ref, ref32, hand, factor in zip(("output", "gradients"), ours, low, exact, oracle32, by_hand, (2, 3)):
        assert (ref32 - hand).abs().max() <= 1e-4 * ref32.abs().max(), f"{name}: the reference is not ALiBi written out"
        error, bound = (mine - ref).abs().max().item(), factor * (lo - ref).abs().max().item() + 1e-5
        result[name] = (error, bound)
        print(f"{name:9s}: max |flashgen - fp32 reference| {error:.3e}  (bound {factor} x bf16 reference's {bound:.3e})")
        assert error <= bound, f"{name}: flashgen's error {error:.3e} exceeds the bound {bound:.3e}"
    print(f"ALiBi, {args.heads} heads (slopes {slopes.flatten()[0]:.3g} .. {slopes.flatten()[-1]:.3g}), "
          f"{'causal' if causal else 'bidirectional'}, B={args.batch} T={args.length}: matches flashgen.reference")
    return result


if __name__ == "__main__":
    main()
