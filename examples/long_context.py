"""Train a small byte-level transformer on one sequence of 256k tokens split across the GPUs it is
given, with flashgen.distributed.ring_attention (context parallelism): each GPU holds a zigzag
shard of the sequence, and the keys and values travel around the ring.

    torchrun --nproc-per-node 8 examples/long_context.py             # 256k tokens over 8 GPUs, 30 steps
    torchrun --nproc-per-node 2 examples/long_context.py --tokens 65536 --steps 10
    python examples/long_context.py --tokens 16384                   # one GPU: a ring of one

The task needs the whole context: the sequence is random bytes whose second half repeats the
first, so the loss on the second half can only fall by attending across the whole sequence (half
of it away, on other GPUs). Positions are rotary (from each token's place in the whole sequence);
the parameters are the same on every GPU and their gradients are averaged over the group.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # flashgen from this checkout, installed or not


def rotate(x, positions, base=10000.0):
    """Rotary embedding of x (batch, heads, rows, d) at the given absolute positions (rows,)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() * base ** (-torch.arange(half, device=x.device) / half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, positions):
        from flashgen import distributed

        rows = x.shape[1]
        q, k, v = self.qkv(self.norm1(x)).view(1, rows, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions), rotate(k, positions)
        attended = distributed.ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(1, rows, -1))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, layers, dim, heads):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens, positions):
        x = self.embed(tokens)[None]
        for block in self.blocks:
            x = block(x, positions)
        return self.norm(x)[0] @ self.embed.weight.t()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=262144, help="the sequence's length (a multiple of 2 x GPUs)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit(f"{parser.prog} needs an NVIDIA GPU (sm_80+); PyTorch sees none on this machine")
    from flashgen import distributed

    if "RANK" in os.environ:  # torchrun
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:  # one GPU: a ring of one
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tempfile.mkdtemp(), 'rendezvous')}", rank=0,
                                world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same parameters and sequence on every GPU
    first = torch.randint(0, 256, (args.tokens // 2,), device="cuda")
    sequence = torch.cat([first, first])
    targets = torch.roll(sequence, -1)
    tokens, labels, positions = (distributed.shard(t, rank, world, dim=0) for t in (sequence, targets,
                                                                                     torch.arange(args.tokens, device="cuda")))
    second_half = positions >= args.tokens // 2  # where copying is possible
    model = Model(args.layers, args.dim, args.heads).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, positions)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        losses[~second_half].mean().add(losses[second_half].mean()).backward()
        for p in model.parameters():  # (the same parameters on every GPU: average their gradients)
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        halves = torch.stack([losses[~second_half].mean(), losses[second_half].mean()]).detach()
        dist.all_reduce(halves)
        if rank == 0:
            first_loss, second_loss = (halves / world).tolist()
            print(f"step {step:3d}: loss {first_loss:.3f} on the first half (random: {math.log(256):.3f}), "
                  f"{second_loss:.3f} on the second (a copy of the first), {args.tokens / seconds / 1e3:.0f}k tokens/s "
                  f"over {world} GPU(s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
