"""Context parallelism on torch.distributed: attention over a sequence sharded across ranks.

ulysses_attention (DeepSpeed-Ulysses): an all-to-all turns sequence shards of every head into
the whole sequence of a share of the heads, flashgen.attention runs there (every variant, since
each rank sees whole rows), and a second all-to-all turns the output back. It moves q, k, v and
o once each (4 x the shard's bytes per rank, whatever the world size) where the ring moves K and V
world - 1 times, but needs heads_kv to be a multiple of the world size.

ring_attention: each rank keeps its shard of the queries; the key/value shards travel around the
ring (torch.distributed point-to-point sends, which run while the current block computes), and
each rank merges its blocks' partial outputs by their log-sum-exp. The backward runs the ring
again: each block's gradients come from the row's whole output and lse (the blocks' shares add
up), and dK/dV travel with their key/value block until they are back at its owner.

Sharding: `shard` cuts a sequence into 2 x world chunks and gives rank r chunks r and
2 x world - 1 - r (zigzag: under a causal mask every rank then does the same work), or one
contiguous chunk each (zigzag=False); `unshard` puts the gathered shards back in order.

The block computations are swappable (BlockKernels): flashgen's kernels on a GPU, the oracle's
(flashgen.reference) anywhere, which is how the ring is tested on CPUs with the gloo backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BlockKernels:
    """One block of attention and its gradients, SDPA's layout:
    forward(q, k, v, causal, scale, softcap, sink) -> (o, lse (batch, heads, seqlen_q) fp32);
    backward(d_o, q, k, v, o, lse, causal, scale, softcap, deterministic) -> (dq, dk, dv), P from the
    given lse and delta from the given o (the whole row's: see flashgen.reference.attention_backward)."""

    forward: Callable
    backward: Callable


def _flashgen_forward(q, k, v, causal, scale, softcap, sink):
    from . import api

    return api.call(q, k, v, causal, scale, True, True, softcap=softcap, learnable_sink=sink)


def _flashgen_backward(d_o, q, k, v, o, lse, causal, scale, softcap, deterministic):
    from . import api, ops

    variant = api.call_variant(q, k, causal, softcap=softcap).op_args() if softcap else ()
    dq, dk, dv, _ = ops.backward_impl(d_o.contiguous(), q, k, v, o, lse, None, None, None, 0, 0, causal, scale, deterministic,
                                      "", *variant)
    return dq, dk, dv


FLASHGEN = BlockKernels(_flashgen_forward, _flashgen_backward)


def _reference_forward(q, k, v, causal, scale, softcap, sink):
    from . import reference

    return reference.naive_attention(q, k, v, causal, scale, softcap=softcap, learnable_sink=sink, return_lse=True)


def _reference_backward(d_o, q, k, v, o, lse, causal, scale, softcap, deterministic):
    from . import reference

    return reference.attention_backward(d_o, q, k, v, o, lse, causal, scale, softcap)


REFERENCE = BlockKernels(_reference_forward, _reference_backward)


# ---- sharding ------------------------------------------------------------------------------------


def chunks_of(rank: int, world: int, zigzag: bool) -> tuple[int, ...]:
    """The sequence chunks rank `rank` holds, in order: (r, 2 world - 1 - r) of 2 world chunks with
    zigzag, else (r,) of world chunks."""
    return (rank, 2 * world - 1 - rank) if zigzag else (rank,)


def _check_divisible(seqlen: int, world: int, zigzag: bool, name: str) -> int:
    parts = 2 * world if zigzag else world
    if seqlen % parts:
        raise ValueError(f"{name} has {seqlen} positions along the sequence: {'zigzag ' if zigzag else ''}sharding over "
                         f"{world} ranks needs a multiple of {parts}")
    return seqlen // parts


def shard(x: torch.Tensor, rank: int, world: int, zigzag: bool = True, dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of a whole sequence (dim: the sequence's, 2 in SDPA's layout)."""
    size = _check_divisible(x.shape[dim], world, zigzag, "the tensor")
    return torch.cat([x.narrow(dim, c * size, size) for c in chunks_of(rank, world, zigzag)], dim)


def unshard(shards: list[torch.Tensor], zigzag: bool = True, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard, in rank order (an all_gather's list)."""
    world = len(shards)
    pieces = [None] * (2 * world if zigzag else world)
    for rank, part in enumerate(shards):
        for piece, c in zip(part.chunk(len(chunks_of(rank, world, zigzag)), dim), chunks_of(rank, world, zigzag)):
            pieces[c] = piece
    return torch.cat(pieces, dim)


# ---- the ring ------------------------------------------------------------------------------------


def _relation(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How a query chunk sees a key chunk: all of it, causally (the same positions), or none."""
    if not causal or k_chunk < q_chunk:
        return "all"
    return "causal" if k_chunk == q_chunk else "none"


class _Ring:
    """One rank's view of the ring: its neighbours, and sends of a list of tensors to the next rank
    while the same shapes arrive from the previous one."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else (self.rank - 1) % self.world

    def start(self, tensors):
        """Send `tensors` on and receive their successors; returns (requests, received)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(requests, received):
        for request in requests:
            request.wait()
        return received


def _merge(o, lse, o_block, lse_block):
    """Two partial states of the same rows merged by their log-sum-exp (fp32; rows that saw
    nothing in either keep lse -inf and o 0)."""
    new = torch.logaddexp(lse, lse_block)
    seen = new > -torch.inf
    weight, weight_block = (torch.where(seen, torch.exp(x - new), 0.0)[..., None] for x in (lse, lse_block))
    return o * weight + o_block.float() * weight_block, new


def _split(x, parts):
    return x.chunk(parts, dim=2) if parts > 1 else (x,)


def _forward(ring: _Ring, q, k, v, causal, scale, softcap, sink, zigzag, kernels: BlockKernels):
    mine = chunks_of(ring.rank, ring.world, zigzag)
    q_parts = _split(q, len(mine))
    outs = [torch.zeros(*p.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device) for p in q_parts]
    lses = [torch.full(p.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device) for p in q_parts]
    kv = (k, v)
    for step in range(ring.world):
        pending = ring.start(kv) if step < ring.world - 1 else None
        source = (ring.rank - step) % ring.world
        theirs = chunks_of(source, ring.world, zigzag)
        k_parts, v_parts = _split(kv[0], len(theirs)), _split(kv[1], len(theirs))
        for i, a in enumerate(mine):
            for j, b in enumerate(theirs):
                relation = _relation(a, b, causal)
                if relation == "none":
                    continue
                # the sink joins each row once: in its rank's own first block (always visible)
                with_sink = sink if step == 0 and j == (i if causal else 0) else None
                o_block, lse_block = kernels.forward(q_parts[i], k_parts[j], v_parts[j], relation == "causal", scale, softcap,
                                                     with_sink)
                outs[i], lses[i] = _merge(outs[i], lses[i], o_block, lse_block)
        if pending is not None:
            kv = tuple(ring.finish(*pending))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def _backward(ring: _Ring, d_o, q, k, v, o, lse, causal, scale, softcap, zigzag, deterministic, kernels: BlockKernels):
    mine = chunks_of(ring.rank, ring.world, zigzag)
    parts = len(mine)
    q_parts, o_parts, d_o_parts, lse_parts = _split(q, parts), _split(o, parts), _split(d_o, parts), _split(lse, parts)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_parts = _split(dq, parts)
    kv, arriving = (k, v), None
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        theirs = chunks_of(source, ring.world, zigzag)
        k_parts, v_parts = _split(kv[0], len(theirs)), _split(kv[1], len(theirs))
        # this rank's share of the block's dK/dV; the ranks before it add theirs in transit
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        dk_parts, dv_parts = _split(dkv[0], len(theirs)), _split(dkv[1], len(theirs))
        pending = ring.start(kv) if step < ring.world - 1 else None  # (the next block's K/V, under this one's work)
        for i, a in enumerate(mine):
            for j, b in enumerate(theirs):
                relation = _relation(a, b, causal)
                if relation == "none":
                    continue
                dq_block, dk_block, dv_block = kernels.backward(d_o_parts[i], q_parts[i], k_parts[j], v_parts[j], o_parts[i],
                                                                lse_parts[i], relation == "causal", scale, softcap,
                                                                deterministic)
                dq_parts[i].add_(dq_block)
                dk_parts[j].add_(dk_block)
                dv_parts[j].add_(dv_block)
        # dK/dV travel on with their block (what the ranks before added arrived during this step's
        # work); after the last step they reach the block's owner
        if arriving is not None:
            for mine_sum, theirs_sum in zip(dkv, ring.finish(*arriving)):
                mine_sum.add_(theirs_sum)
        arriving = ring.start(dkv)
        if pending is not None:
            kv = tuple(ring.finish(*pending))
    dk, dv = ring.finish(*arriving)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, group, causal, scale, softcap, zigzag, deterministic, kernels):
        ring = _Ring(group)
        o, lse = _forward(ring, q, k, v, causal, scale, softcap, sink, zigzag, kernels)
        ctx.save_for_backward(q, k, v, o, lse, sink)
        ctx.settings = (group, causal, scale, softcap, zigzag, deterministic, kernels)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_lse):
        if d_lse is not None:
            raise NotImplementedError("ring_attention's lse takes no gradient (use it as a value, as merge weights do)")
        q, k, v, o, lse, sink = ctx.saved_tensors
        group, causal, scale, softcap, zigzag, deterministic, kernels = ctx.settings
        if d_o is None:
            d_o = torch.zeros_like(o)
        dq, dk, dv = _backward(_Ring(group), d_o, q, k, v, o, lse, causal, scale, softcap, zigzag, deterministic, kernels)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:  # this rank's rows' share: sum it over the group as any gradient
            delta = (d_o.float() * o.float()).sum(-1)
            d_sink = -(torch.exp(sink.float()[None, :, None] - lse) * delta).sum((0, 2))
        return dq, dk, dv, d_sink, None, None, None, None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = False, scale: float | None = None, softcap: float = 0.0,
                   learnable_sink: torch.Tensor | None = None, zigzag: bool = True, return_lse: bool = False,
                   deterministic: bool = False, kernels: BlockKernels = FLASHGEN):
    """Attention over a sequence sharded across the ranks of `group` (torch.distributed; None: the
    default group), in SDPA's layout: q (batch, heads, seqlen_shard, d), k, v (batch, heads_kv,
    seqlen_shard, d), this rank's shard (`shard`: zigzag by default, which `causal` needs for every
    rank to do the same work; zigzag=False takes contiguous shards). Every rank calls it with
    shards of one shape. Returns this rank's rows of the output (and with return_lse their fp32
    log-sum-exp); differentiable in q, k, v and learnable_sink (a sink's gradient is this rank's
    rows' share: sum it over the group like any replicated parameter's).

    Only the KV heads travel (GQA sends heads_kv of them). softcap and learnable_sink as in
    flashgen.attention; a window or ALiBi needs positions across shards and is refused by name.
    The ring fixes the order of the merges and of the gradients' sums; with deterministic=True the
    blocks' backward kernels are the deterministic ones too (attention()'s flag), and reruns are
    bitwise identical."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention runs over torch.distributed: call torch.distributed.init_process_group first")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen_shard, head_dim), this rank's shard")
    if k.shape[2] != q.shape[2] or v.shape[2] != k.shape[2]:
        raise ValueError(f"q, k and v must hold one shard of the sequence: seqlen_shard {q.shape[2]}, {k.shape[2]}, "
                         f"{v.shape[2]}")
    parts = 2 if zigzag else 1
    if q.shape[2] % parts:
        raise ValueError(f"a zigzag shard holds two chunks of one length: seqlen_shard={q.shape[2]} must be even")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, lse = _RingAttention.apply(q, k, v, learnable_sink, group, bool(causal), scale, float(softcap), bool(zigzag),
                                  bool(deterministic), kernels)
    return (o, lse) if return_lse else o


# ---- Ulysses: all-to-all between sequence shards and head shards ---------------------------------


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single over dim 0 in equal parts, differentiable (its gradient is the same
    exchange, the other way)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _to_heads(x, group, world, zigzag):
    """(batch, heads, shard, ...) on every rank -> (batch, heads / world, whole sequence, ...): this
    rank's share of the heads over the whole sequence, in order."""
    batch, heads = x.shape[:2]
    parts = x.unflatten(1, (world, heads // world)).movedim(1, 0)  # (world, batch, heads / world, shard, ...)
    return unshard(list(_AllToAll.apply(parts, group).unbind(0)), zigzag)


def _to_sequence(x, group, world, zigzag):
    """The way back: (batch, heads / world, whole sequence, ...) -> (batch, heads, shard, ...)."""
    parts = torch.stack([shard(x, rank, world, zigzag) for rank in range(world)])  # (world, batch, heads / world, shard, ...)
    return _AllToAll.apply(parts, group).movedim(0, 1).flatten(1, 2)


def ulysses_attention(q, k, v, group=None, causal: bool = False, scale: float | None = None, zigzag: bool = True,
                      return_lse: bool = False, attend: Callable | None = None, **variant):
    """Attention over a sequence sharded across the ranks of `group` by all-to-all over heads
    (DeepSpeed-Ulysses), in SDPA's layout: q (batch, heads, seqlen_shard, d), k, v (batch, heads_kv,
    seqlen_shard, d), this rank's shard (`shard`; zigzag as ring_attention's, so one sharding serves
    both). heads and heads_kv must be multiples of the group's size. Each rank attends over the
    whole sequence for its share of the heads with flashgen.attention (`attend`: a function with
    its keywords, the oracle's in the CPU tests), so every variant keyword it takes applies
    (window_size, softcap, alibi_slopes of (heads,) or (batch, heads), learnable_sink; a sink's and
    the slopes' gradients are each rank's share of the heads: sum them over the group).
    Differentiable; returns this rank's rows (and with return_lse their fp32 log-sum-exp).

    Which to use: Ulysses moves 4 shard-sized tensors per rank (q, k, v there; o back) in two
    all-to-alls, the ring 2 x (world - 1) K/V shards in sends it overlaps with compute; Ulysses
    takes any variant and runs one long attention per rank (the kernels' best shape), the ring
    scales past heads_kv ranks. Prefer Ulysses while heads_kv >= world and the interconnect is
    all-to-all (NVLink within a node); the ring across nodes, or past heads_kv ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses_attention runs over torch.distributed: call torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] % world:
            raise ValueError(f"{name} has {t.shape[1]} heads: ulysses_attention gives each of the {world} ranks a share of the "
                             f"heads, so they must be a multiple of {world} (ring_attention takes any)")
    share = q.shape[1] // world
    heads = slice(rank * share, (rank + 1) * share)
    for name in ("alibi_slopes", "learnable_sink"):  # per-head values: this rank's share
        value = variant.get(name)
        if isinstance(value, torch.Tensor):
            variant[name] = value[..., heads]
    if attend is None:
        from .api import attention as attend
    q_h, k_h, v_h = (_to_heads(t, group, world, zigzag) for t in (q, k, v))
    o, lse = attend(q_h, k_h, v_h, causal=causal, scale=scale, return_lse=True, **variant)
    o = _to_sequence(o, group, world, zigzag)
    if not return_lse:
        return o
    return o, _to_sequence(lse[..., None], group, world, zigzag)[..., 0]
