"""Context parallelism without GPUs: ring_attention's schedule over the gloo backend in several CPU
processes, the blocks computed by the oracle (distributed.REFERENCE: the same ring, the kernels
swapped), against single-process attention over the whole sequence, forward and backward: causal
and not, zigzag and contiguous shards, GQA, softcap and a sink; ulysses_attention the same way
(with the oracle's attention), windows and ALiBi included; and the sharding helpers."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashgen import distributed, reference

CASES = [  # (causal, zigzag, heads, kv_heads, softcap, sink)
    (True, True, 4, 2, 0.0, False), (True, False, 4, 4, 0.0, False), (False, True, 2, 1, 0.0, False),
    (False, False, 4, 2, 0.0, False), (True, True, 4, 2, 20.0, True), (False, True, 4, 1, 0.0, True),
]


def _worker(rank, world, path, seqlen):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for causal, zigzag, heads, kv_heads, softcap, with_sink in CASES:
            gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + int(causal))
            q = torch.randn(2, heads, seqlen, 16, generator=gen)
            k, v = (torch.randn(2, kv_heads, seqlen, 16, generator=gen) for _ in range(2))
            d_o = torch.randn(q.shape, generator=gen)
            sink = torch.linspace(-1.0, 2.0, heads) if with_sink else None
            # the whole sequence in one process
            leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if with_sink else [])
            want, want_lse = reference.naive_attention(*leaves[:3], causal, softcap=softcap, return_lse=True,
                                                       learnable_sink=leaves[3] if with_sink else None)
            want.backward(d_o)
            # this rank's shard through the ring
            mine = [distributed.shard(t, rank, world, zigzag).clone().requires_grad_() for t in (q, k, v)]
            ring_sink = sink.clone().requires_grad_() if with_sink else None
            out, lse = distributed.ring_attention(*mine, causal=causal, softcap=softcap, learnable_sink=ring_sink,
                                                  zigzag=zigzag, return_lse=True, kernels=distributed.REFERENCE)
            out.backward(distributed.shard(d_o, rank, world, zigzag))
            case = f"causal={causal} zigzag={zigzag} heads={heads}:{kv_heads} softcap={softcap} sink={with_sink}, rank {rank}"
            close = dict(rtol=1e-4, atol=2e-5, msg=lambda m: f"{case}: {m}")
            torch.testing.assert_close(out, distributed.shard(want.detach(), rank, world, zigzag), **close)
            torch.testing.assert_close(lse, distributed.shard(want_lse.detach(), rank, world, zigzag), **close)
            for got, leaf in zip(mine, leaves):
                torch.testing.assert_close(got.grad, distributed.shard(leaf.grad, rank, world, zigzag), **close)
            if with_sink:  # each rank's rows' share, summed over the group
                dist.all_reduce(ring_sink.grad)
                torch.testing.assert_close(ring_sink.grad, leaves[3].grad, **close)
    finally:
        dist.destroy_process_group()


ULYSSES = [  # (causal, zigzag, heads, kv_heads, keywords)
    (True, True, 4, 2, {}), (False, False, 4, 4, {"softcap": 10.0}), (True, True, 4, 2, {"window_size": (5, 0)}),
    (False, True, 6, 2, {"alibi_slopes": "slopes"}), (True, False, 4, 2, {"learnable_sink": "sink", "window_size": (7, 0)}),
]


def _ulysses_worker(rank, world, path, seqlen):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for causal, zigzag, heads, kv_heads, keywords in ULYSSES:
            gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
            q = torch.randn(2, heads, seqlen, 16, generator=gen)
            k, v = (torch.randn(2, kv_heads, seqlen, 16, generator=gen) for _ in range(2))
            d_o = torch.randn(q.shape, generator=gen)
            learned = {}
            if keywords.get("alibi_slopes"):
                keywords = {**keywords, "alibi_slopes": torch.linspace(0.05, 0.5, heads)}
            if keywords.get("learnable_sink"):
                learned = {"learnable_sink": torch.linspace(-1.0, 2.0, heads)}
                keywords = {k_: v_ for k_, v_ in keywords.items() if k_ != "learnable_sink"}
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            whole_learned = {name: t.clone().requires_grad_() for name, t in learned.items()}
            want = reference.naive_attention(*leaves, causal, **keywords, **whole_learned)
            want.backward(d_o)
            mine = [distributed.shard(t, rank, world, zigzag).clone().requires_grad_() for t in (q, k, v)]
            mine_learned = {name: t.clone().requires_grad_() for name, t in learned.items()}
            out = distributed.ulysses_attention(*mine, causal=causal, zigzag=zigzag, attend=reference.naive_attention,
                                                **keywords, **mine_learned)
            out.backward(distributed.shard(d_o, rank, world, zigzag))
            case = f"ulysses causal={causal} zigzag={zigzag} heads={heads}:{kv_heads} {sorted(keywords)}, rank {rank}"
            close = dict(rtol=1e-4, atol=2e-5, msg=lambda m: f"{case}: {m}")
            torch.testing.assert_close(out, distributed.shard(want.detach(), rank, world, zigzag), **close)
            for got, leaf in zip(mine, leaves):
                torch.testing.assert_close(got.grad, distributed.shard(leaf.grad, rank, world, zigzag), **close)
            for name, t in mine_learned.items():  # each rank's share of the heads, summed over the group
                dist.all_reduce(t.grad)
                torch.testing.assert_close(t.grad, whole_learned[name].grad, **close)
        with pytest.raises(ValueError, match="score_mod with ulysses_attention: a rule would see each rank's heads numbered"):
            distributed.ulysses_attention(*(torch.zeros(1, 2, 8, 16) for _ in range(3)), score_mod=lambda s, b, h, q, k: s)
        with pytest.raises(ValueError, match="k has 1 heads: ulysses_attention gives each of the 2 ranks a share"):
            distributed.ulysses_attention(*(torch.zeros(1, h, 8, 16) for h in (2, 1, 1)))
    finally:
        dist.destroy_process_group()


def test_ulysses_attention_matches_attention_over_the_whole_sequence():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ulysses_worker, args=(2, os.path.join(tmp, "rendezvous"), 24), nprocs=2)


def _varlen_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        lengths = [4 * world, 10 * world, 2 * world, 0]  # (and an empty document)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        for causal, softcap, with_sink in [(True, 0.0, False), (False, 0.0, True), (True, 15.0, True)]:
            gen = torch.Generator().manual_seed(int(causal) + 7)
            q = torch.randn(cu[-1], 4, 16, generator=gen)
            k, v = (torch.randn(cu[-1], 2, 16, generator=gen) for _ in range(2))
            d_o = torch.randn(q.shape, generator=gen)
            sink = torch.linspace(-1.0, 2.0, 4) if with_sink else None
            leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if with_sink else [])
            cu_t = torch.tensor(cu, dtype=torch.int32)
            want, want_lse = reference.attention_varlen(*leaves[:3], cu_t, cu_t, max(lengths), max(lengths), causal=causal,
                                                        softcap=softcap, learnable_sink=leaves[3] if with_sink else None,
                                                        return_lse=True)
            want.backward(d_o)
            mine = [distributed.shard_varlen(t, cu, rank, world).clone().requires_grad_() for t in (q, k, v)]
            ring_sink = sink.clone().requires_grad_() if with_sink else None
            out, lse = distributed.ring_attention_varlen(*mine, cu, max(lengths), causal=causal, softcap=softcap,
                                                         learnable_sink=ring_sink, return_lse=True,
                                                         kernels=distributed.REFERENCE_VARLEN)
            out.backward(distributed.shard_varlen(d_o, cu, rank, world))
            case = f"varlen causal={causal} softcap={softcap} sink={with_sink}, rank {rank}"
            close = dict(rtol=1e-4, atol=2e-5, msg=lambda m: f"{case}: {m}")
            torch.testing.assert_close(out, distributed.shard_varlen(want.detach(), cu, rank, world), **close)
            torch.testing.assert_close(lse, distributed.shard_varlen(want_lse.detach().t(), cu, rank, world).t(), **close)
            for got, leaf in zip(mine, leaves):
                torch.testing.assert_close(got.grad, distributed.shard_varlen(leaf.grad, cu, rank, world), **close)
            if with_sink:
                dist.all_reduce(ring_sink.grad)
                torch.testing.assert_close(ring_sink.grad, leaves[3].grad, **close)
        with pytest.raises(ValueError, match="window_size with ring_attention_varlen: .* ulysses_attention takes every variant"):
            distributed.ring_attention_varlen(*(torch.zeros(3, 1, 16) for _ in range(3)), cu, 8, window_size=(4, 0))
        with pytest.raises(ValueError, match="max_seqlen=5: the longest document has .* not a rank's share of it"):
            distributed.ring_attention_varlen(*mine, cu, 5)
        odd = 2 * world + 1
        with pytest.raises(ValueError, match=f"document 1 has {odd} tokens: sharding packed documents over {world} ranks"):
            distributed.ring_attention_varlen(*(torch.zeros(3, 1, 16) for _ in range(3)), [0, 4 * world, 4 * world + odd], odd)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_over_packed_documents(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_varlen_worker, args=(world, os.path.join(tmp, "rendezvous")), nprocs=world)


def test_packed_shards_put_back_in_order_give_the_documents():
    cu = [0, 8, 8, 20]
    x = torch.arange(20)
    shards = [distributed.shard_varlen(x, cu, rank, 2) for rank in range(2)]
    assert shards[0].tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]  # of each document, chunks 0 and 3 of four
    assert torch.equal(distributed.unshard_varlen(shards, cu), x)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_attention_matches_attention_over_the_whole_sequence(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), 12 * world), nprocs=world)


def test_shards_put_back_in_order_give_the_sequence():
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    for world, zigzag in [(3, True), (4, False), (2, True)]:
        shards = [distributed.shard(x, rank, world, zigzag) for rank in range(world)]
        assert torch.equal(distributed.unshard(shards, zigzag), x)
    assert distributed.shard(x, 0, 3, True)[0, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of six


def test_uneven_and_bad_shards_are_refused_by_name():
    with pytest.raises(ValueError, match="zigzag sharding over 4 ranks needs a multiple of 8"):
        distributed.shard(torch.zeros(1, 1, 12, 8), 0, 4)
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group first"):
        distributed.ring_attention(*(torch.zeros(1, 1, 4, 8) for _ in range(3)))
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group first"):
        distributed.ulysses_attention(*(torch.zeros(1, 1, 4, 8) for _ in range(3)))
