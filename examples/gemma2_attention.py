"""A Gemma-2-style attention layer in plain PyTorch on flashgen.attention: logit soft-capping on
every layer, a sliding window on every other one (local layers), grouped-query attention, rotary
embeddings, and the scale 1/sqrt(query_pre_attn_scalar) rather than 1/sqrt(head_dim).

    python examples/gemma2_attention.py                       # Gemma-2 2B's attention shapes, T=8192
    python examples/gemma2_attention.py --length 2048 --window 512 --softcap 20

The variants are FlashAttention's keywords of flashgen.attention: softcap=50.0 makes the scores
50 * tanh(scores / 50); window_size=(window - 1, 0) with causal=True lets a query see itself and
the window - 1 keys before it (Gemma-2's sliding window of 4096), and key tiles outside the window
are never visited. The script checks the layers' output and gradients against the same layers on
flashgen.reference's attention in fp32, by the numerics rule (the error is at most 2x, 3x for
gradients, that of the same computation in bf16).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn as nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not

import flashgen  # noqa: E402
from flashgen.reference import naive_attention  # noqa: E402


def rotate(x, positions, base=10000.0):
    """Rotary position embedding of x (B, H, T, d) at positions (T,), half-split as in Gemma/Llama."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Gemma2Attention(nn.Module):
    """One attention layer: q/k/v/o projections, GQA, rotary, softcap; a sliding window if local."""

    def __init__(self, hidden=2304, heads=8, kv_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 softcap=50.0, window=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = query_pre_attn_scalar ** -0.5
        self.softcap, self.window = softcap, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, attend=flashgen.attention):
        batch, length, _ = x.shape
        positions = torch.arange(length, device=x.device)
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, positions), rotate(k, positions)
        # (B, H, T, d) with fewer key/value heads: GQA without repeating them
        window = (self.window - 1, 0) if self.window else (-1, -1)
        o = attend(q, k, v, causal=True, scale=self.scale, softcap=self.softcap, window_size=window)
        return self.o_proj(o.transpose(1, 2).reshape(batch, length, -1))


def reference(upcast):
    """flashgen.reference's attention with attention()'s keywords: fp32 (upcast) or in the inputs' dtype."""
    def attend(q, k, v, **kwargs):
        return naive_attention(q, k, v, upcast=upcast, **kwargs)
    return attend


def output_and_grads(layers, x, attend, d_out):
    """The stacked layers' output and the gradients of x and of every weight, flat."""
    x = x.detach().clone().requires_grad_(True)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    out = x
    for layer in layers:
        out = out + layer(out, attend)
    out.backward(d_out.to(out.dtype))
    grads = torch.cat([x.grad.flatten()] + [p.grad.flatten() for layer in layers for p in layer.parameters()])
    return out.detach().float(), grads.float()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=4096, help="the local layers' sliding window")
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--hidden", type=int, default=2304)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit(f"{parser.prog} needs an NVIDIA GPU (sm_80+); PyTorch sees none on this machine")

    torch.manual_seed(0)
    shape = dict(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 query_pre_attn_scalar=args.head_dim, softcap=args.softcap)
    # a local layer, then a global one, as Gemma-2 alternates them
    layers = [Gemma2Attention(**shape, window=args.window), Gemma2Attention(**shape)]
    low = [layer.to("cuda", torch.bfloat16) for layer in layers]
    exact = [copy.deepcopy(layer).float() for layer in low]
    x = torch.randn(args.batch, args.length, args.hidden, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)  # one input and one output gradient for the three runs (the fp32 one upcasts them)

    ours = output_and_grads(low, x, flashgen.attention, d_out)
    lowp = output_and_grads(low, x, reference(upcast=False), d_out)
    ref = output_and_grads(exact, x.float(), reference(upcast=True), d_out)
    result = {}
    for name, mine, lo, r, factor in zip(("output", "gradients"), ours, lowp, ref, (2, 3)):
        error, bound = (mine - r).abs().max().item(), factor * (lo - r).abs().max().item() + 1e-5
        result[name] = (error, bound)
        print(f"{name:9s}: max |flashgen - fp32 reference| {error:.3e}  (bound {factor} x bf16 reference's {bound:.3e})")
        assert error <= bound, f"{name}: flashgen's error {error:.3e} exceeds the bound {bound:.3e}"
    print(f"Gemma-2 attention (softcap {args.softcap:g}, window {args.window} on the local layer), "
          f"B={args.batch} T={args.length}: matches flashgen.reference")
    return result


if __name__ == "__main__":
    main()
