"""Context parallelism on several GPUs of one host (issue 45's multi-GPU run): correctness of the
ring (zigzag, causal) and of Ulysses against one GPU at T = 32k; the ring's forward + backward
throughput at T = 128k to 1M (causal, d = 128, bf16, 16 heads of which 8 KV) against one GPU's rate
at the per-rank length and against the communication floor (the K/V bytes of a step over the
measured point-to-point bandwidth); memory per GPU. Run on N GPUs:

    PYTHONPATH=. torchrun --nproc-per-node N .ci/cp_bench.py [--seqlens 131072,262144,524288,1048576]

Rank 0 prints a Markdown table; everything goes to stdout.
"""

import argparse
import os

import torch
import torch.distributed as dist

import flashgen
from flashgen import bench, distributed

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def time_ms(fn):
    """flashgen bench's timer (median GPU time), fewer rounds: the steps are long, and the ranks
    keep in step through the ring's own sends."""
    return bench.time_ms(fn, warmup=1, rep=5)


def problem(seqlen, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v


def fwd_bwd(fn, tensors):
    return bench.training_step(fn, tensors)


def causal_flops(seqlen):  # forward + backward (2.5x the forward), causal: half the pairs
    return 3.5 * 4 * HEADS * seqlen * seqlen * HEAD_DIM / 2


def correctness(rank, world):
    """Ring and Ulysses at T = 32k against flashgen.attention on one GPU: their max differences."""
    q, k, v = problem(32768, seed=1)
    whole = flashgen.attention(q, k, v, causal=True)
    mine = [distributed.shard(t, rank, world) for t in (q, k, v)]
    rows = []
    for name, fn in (("ring", distributed.ring_attention), ("ulysses", distributed.ulysses_attention)):
        out = fn(*mine, causal=True)
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.contiguous())
        rows.append((name, (distributed.unshard(gathered).float() - whole.float()).abs().max().item()))
    return rows


def p2p_bandwidth(nbytes):
    """GB/s of one ring step's send and receive of `nbytes` between neighbours."""
    world, rank = dist.get_world_size(), dist.get_rank()
    send = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    recv = torch.empty_like(send)

    def step():
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return nbytes / time_ms(step) / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="131072,262144,524288,1048576")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [f"Context parallelism, {world} x {torch.cuda.get_device_name()}, causal, d = {HEAD_DIM}, {HEADS}:{KV_HEADS} heads, bf16"]
    for name, err in correctness(rank, world):
        lines.append(f"- {name} at T = 32k against one GPU: max |difference| {err:.3e}")
    lines += ["", "| T | per rank | ring ms | TFLOPS / GPU | one GPU causal / full at T/world | vs world x one GPU (causal, full) | "
              "K/V step floor ms | peak memory GiB |", "|---|---|---|---|---|---|---|---|"]
    for seqlen in (int(t) for t in args.seqlens.split(",")):
        per_rank = seqlen // world
        q, k, v = problem(seqlen, seed=2) if seqlen <= 262144 else (None, None, None)
        if q is None:  # (a 1M-token problem on every rank: make only this rank's shard)
            q, k, v = problem(per_rank, seed=2 + rank)
            mine = [q, k, v]
        else:
            mine = [distributed.shard(t, rank, world).contiguous() for t in (q, k, v)]
            del q, k, v
        torch.cuda.reset_peak_memory_stats()
        ring_ms = time_ms(fwd_bwd(lambda q, k, v: distributed.ring_attention(q, k, v, causal=True), mine))
        peak = torch.cuda.max_memory_allocated() / 2**30
        rate = causal_flops(seqlen) / world / ring_ms / 1e9
        single = problem(per_rank, seed=3)
        one_causal = causal_flops(per_rank) / time_ms(fwd_bwd(lambda q, k, v: flashgen.attention(q, k, v, causal=True), single)) / 1e9
        one_full = 2 * causal_flops(per_rank) / time_ms(fwd_bwd(lambda q, k, v: flashgen.attention(q, k, v), single)) / 1e9
        # the floor: K/V sent world - 1 times forward and again backward, dK/dV (fp32: twice the
        # bytes) world times, each send at the measured neighbour bandwidth
        step_bytes = 2 * KV_HEADS * per_rank * HEAD_DIM * 2
        floor = (2 * (world - 1) + 2 * world) * step_bytes / p2p_bandwidth(step_bytes) / 1e6
        lines.append(f"| {seqlen // 1024}k | {per_rank // 1024}k | {ring_ms:.1f} | {rate:.0f} | {one_causal:.0f} / {one_full:.0f} | "
                     f"{rate / one_causal:.2f}, {rate / one_full:.2f} | {floor:.1f} | {peak:.1f} |")
        del mine, single
        torch.cuda.empty_cache()
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
