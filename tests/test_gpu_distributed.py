"""GPU tier: ring_attention and ulysses_attention through NCCL with flashgen's kernels, world size 1
(one GPU: the ring is one step, no send; the all-to-alls exchange nothing), against the oracle by
the numerics rule, forward and backward, causal with zigzag shards and not; and, where the machine
has two GPUs, two ranks against one process's attention."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import check_by_the_numerics_rule

import flashgen
from flashgen import distributed, reference

pytestmark = pytest.mark.gpu


def _problem(seqlen, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 8, seqlen, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, seqlen, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, d_o


def _grads(fn, tensors, d_o):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(d_o)
    return [out.detach(), *(t.grad for t in leaves)]


def _check(rank, world, seqlen, causal, parallel=distributed.ring_attention):
    """This rank's shard (ring or Ulysses) against the oracle's whole sequence, by the numerics rule."""
    q, k, v, d_o = _problem(seqlen)
    ours = _grads(lambda *t: parallel(*t, causal=causal), [distributed.shard(t, rank, world) for t in (q, k, v)],
                  distributed.shard(d_o, rank, world))
    exact, low = (_grads(lambda q, k, v: reference.naive_attention(q, k, v, causal, upcast=up), (q, k, v), d_o)
                  for up in (True, False))
    # the rows this rank holds; dK/dV: the whole sequence's gradients at this rank's keys
    check_by_the_numerics_rule(ours, [distributed.shard(t, rank, world) for t in exact],
                               [distributed.shard(t, rank, world) for t in low], torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_of_one_rank_through_nccl(causal):
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        try:
            _check(0, 1, 2048, causal)
            _check(0, 1, 2048, causal, distributed.ulysses_attention)
            _check_varlen(0, 1, causal)
            q, k, v, _ = _problem(512, seed=1)
            o, lse = distributed.ring_attention(q, k, v, causal=causal, return_lse=True)
            want, want_lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
            torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-4)
            # fp32 inputs under autocast, softcap and a sink, the deterministic backward: as attention() on one GPU
            sink = torch.linspace(-1.0, 3.0, 8, device="cuda")
            leaves = [t.float().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = distributed.ring_attention(*leaves[:3], causal=causal, softcap=30.0, learnable_sink=leaves[3],
                                                 deterministic=True)
            out.float().square().sum().backward()
            plain = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
            want = flashgen.attention(*plain[:3], causal=causal, softcap=30.0, learnable_sink=plain[3], deterministic=True)
            want.float().square().sum().backward()
            torch.testing.assert_close(out, want, rtol=0, atol=2e-2)
            for got, ref in zip(leaves, plain):
                torch.testing.assert_close(got.grad.float(), ref.grad.float(), rtol=2e-2, atol=2e-2)
        finally:
            dist.destroy_process_group()


def _check_varlen(rank, world, causal):
    """This rank's shard of packed documents through the ring against the oracle, by the numerics rule."""
    lengths = [512 * world, 2048 * world, 64 * world]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(cu[-1], 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(cu[-1], 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    ours = _grads(lambda *t: distributed.ring_attention_varlen(*t, cu, max(lengths), causal=causal),
                  [distributed.shard_varlen(t, cu, rank, world) for t in (q, k, v)], distributed.shard_varlen(d_o, cu, rank, world))
    exact, low = (_grads(lambda q, k, v: reference.attention_varlen(q, k, v, cu_t, cu_t, max(lengths), max(lengths), causal=causal,
                                                                   upcast=up), (q, k, v), d_o) for up in (True, False))
    check_by_the_numerics_rule(ours, [distributed.shard_varlen(t, cu, rank, world) for t in exact],
                               [distributed.shard_varlen(t, cu, rank, world) for t in low], torch.bfloat16)


def _two_ranks(rank, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        for causal in (False, True):
            _check(rank, 2, 4096, causal)
            _check(rank, 2, 4096, causal, distributed.ulysses_attention)
            _check_varlen(rank, 2, causal)
    finally:
        dist.destroy_process_group()


def test_ring_attention_over_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_two_ranks, args=(os.path.join(tmp, "rendezvous"),), nprocs=2)
