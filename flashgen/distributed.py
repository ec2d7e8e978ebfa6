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

ring_attention_varlen: the ring over packed documents (Transformer Engine's THD layout), each
document sharded on its own.

Sharding: `shard` cuts a sequence into 2 x world chunks and gives rank r chunks r and
2 x world - 1 - r (zigzag: under a causal mask every rank then does the same work), or one
contiguous chunk each (zigzag=False); `unshard` puts the gathered shards back in order;
`shard_varlen` and `unshard_varlen` do the same per document.

Every rank calls with the same shapes, in SDPA's layout (batch, heads, seq, d), not flash-attn's
(batch, seq, heads, d); on GPUs each process first selects its own (torch.cuda.set_device), as
NCCL needs.

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
    """One block of attention and its gradients, SDPA's layout; `variant` holds the variant
    keywords the block takes (flashgen.attention's, by name):
    forward(q, k, v, causal, scale, variant) -> (o, lse (batch, heads, seqlen_q) fp32);
    backward(d_o, q, k, v, o, lse, causal, scale, variant, deterministic) -> (dq, dk, dv), P from
    the given lse and delta from the given o (the whole row's: see flashgen.reference.attention_backward)."""

    forward: Callable
    backward: Callable


def _op_args(q, causal, variant: dict, sequences: int) -> tuple:
    """The ops' variant arguments of a block's variant keywords (none: plain)."""
    from . import variants

    if not variant:
        return ()
    return variants.make(variants.Call(causal, sequences, q.shape[1], q.device, keys=None), **variant).op_args()


def _flashgen_forward(q, k, v, causal, scale, variant):
    from . import api

    return api.call(q, k, v, causal, scale, True, True, **variant)


def _flashgen_backward(d_o, q, k, v, o, lse, causal, scale, variant, deterministic):
    from . import ops

    dq, dk, dv, _ = ops.backward_impl(d_o.contiguous(), q, k, v, o, lse, None, None, None, 0, 0, causal, scale, deterministic,
                                      "", *_op_args(q, causal, variant, q.shape[0]))
    return dq, dk, dv


FLASHGEN = BlockKernels(_flashgen_forward, _flashgen_backward)


def _reference_forward(q, k, v, causal, scale, variant):
    from . import reference

    return reference.naive_attention(q, k, v, causal, scale, return_lse=True, **variant)


def _reference_backward(d_o, q, k, v, o, lse, causal, scale, variant, deterministic):
    from . import reference

    return reference.attention_backward(d_o, q, k, v, o, lse, causal, scale, **variant)


REFERENCE = BlockKernels(_reference_forward, _reference_backward)


@dataclass(frozen=True)
class VarlenBlockKernels:
    """BlockKernels over packed sequences (flash_attn_varlen_func's layout: q (rows, heads, d), lse
    (heads, rows)), each sequence in q and in k, v at the same offsets cu_seqlens:
    forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, variant) -> (o, lse);
    backward(d_o, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, variant, deterministic)."""

    forward: Callable
    backward: Callable


def _flashgen_varlen_forward(q, k, v, cu, longest, causal, scale, variant):
    from .varlen import attention_varlen

    return attention_varlen(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=causal, return_lse=True, **variant)


def _flashgen_varlen_backward(d_o, q, k, v, o, lse, cu, longest, causal, scale, variant, deterministic):
    from . import ops

    dq, dk, dv, _ = ops.backward_impl(d_o.contiguous(), q, k, v, o, lse, None, cu, cu, longest, longest, causal, scale,
                                      deterministic, "", *_op_args(q, causal, variant, cu.shape[0] - 1))
    return dq, dk, dv


FLASHGEN_VARLEN = VarlenBlockKernels(_flashgen_varlen_forward, _flashgen_varlen_backward)


def _reference_varlen_forward(q, k, v, cu, longest, causal, scale, variant):
    from . import reference

    return reference.attention_varlen(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=causal, return_lse=True,
                                      **variant)


def _reference_varlen_backward(d_o, q, k, v, o, lse, cu, longest, causal, scale, variant, deterministic):
    from . import reference

    grads = [torch.zeros_like(t) for t in (q, k, v)]
    starts = cu.tolist()
    for a, b in zip(starts, starts[1:]):
        rows = [t[a:b].transpose(0, 1)[None] for t in (d_o, q, k, v, o)]
        for grad, part in zip(grads, reference.attention_backward(*rows, lse[None, :, a:b], causal, scale, **variant)):
            grad[a:b] = part[0].transpose(0, 1)
    return tuple(grads)


REFERENCE_VARLEN = VarlenBlockKernels(_reference_varlen_forward, _reference_varlen_backward)


def _ring_variant(function: str, given: dict) -> tuple[dict, dict]:
    """A ring's variant keywords, sorted by the registry's traits: (those every block takes: a
    pointwise score; those that join each row once, in its first block: a softmax state). A mask or a positional score (a window, ALiBi, a rule) needs each block's place in the
    whole sequence, which the blocks do not take: refused by name."""
    from . import variants

    by_keyword = {declaration.keyword: declaration for declaration in variants.REGISTRY}
    every, once = {}, {}
    for keyword, value in given.items():
        declaration = by_keyword.get(keyword)
        if declaration is None:
            raise TypeError(f"{function}() got an unexpected keyword argument {keyword!r}")
        if value is None or (not isinstance(value, torch.Tensor) and value == declaration.default):
            continue  # (off)
        if declaration.mask or declaration.score in ("positional", "rule"):
            raise ValueError(f"{keyword} with {function}: it needs each block's position in the whole sequence, which "
                             f"the ring's blocks do not take yet; ulysses_attention takes every variant")
        (once if declaration.state else every)[keyword] = value
    return every, once


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
    """Rank `rank`'s shard of a whole sequence (dim: the sequence's, 2 in SDPA's layout); rank and
    world are the group's (dist.get_rank(group), dist.get_world_size(group))."""
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


def _documents(cu_seqlens, world: int) -> list[int]:
    """The documents' offsets over the whole packed sequence, checked: each one's length a multiple
    of 2 x world (each rank holds two chunks of it, r and 2 x world - 1 - r)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError("cu_seqlens must be on the host (a list or a CPU tensor): the documents' lengths decide the "
                             "shards, so every rank knows them before the call")
        cu_seqlens = cu_seqlens.tolist()
    starts = [int(x) for x in cu_seqlens]
    if not starts or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {starts[:8]}")
    for d, (a, b) in enumerate(zip(starts, starts[1:])):
        if (b - a) % (2 * world):
            raise ValueError(f"document {d} has {b - a} tokens: sharding packed documents over {world} ranks needs each "
                             f"length a multiple of {2 * world} (pad it)")
    return starts


def shard_varlen(x: torch.Tensor, cu_seqlens, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of packed documents (x (total, ...), cu_seqlens their offsets): of each
    document, its chunks r and 2 x world - 1 - r of 2 x world, in document order (Transformer
    Engine's THD layout)."""
    starts = _documents(cu_seqlens, world)
    return torch.cat([shard(x[a:b], rank, world, True, dim=0) for a, b in zip(starts, starts[1:])])


def unshard_varlen(shards: list[torch.Tensor], cu_seqlens) -> torch.Tensor:
    """The packed documents from every rank's shard, in rank order."""
    world = len(shards)
    starts = _documents(cu_seqlens, world)
    local = [a // world for a in starts]
    return torch.cat([unshard([part[a:b] for part in shards], True, dim=0) for a, b in zip(local, local[1:])])


# ---- the ring ------------------------------------------------------------------------------------


def _relation(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How a query chunk sees a key chunk: all of it, causally (the same positions), or none."""
    if not causal or k_chunk < q_chunk:
        return "all"
    return "causal" if k_chunk == q_chunk else "none"


def _step(rank: int, source: int, world: int, zigzag: bool, causal: bool, whole: bool) -> list[tuple]:
    """The blocks of one ring step: (query part, key part, causal) with a part None (the rank's
    whole shard) or 0 / 1 (a zigzag shard's first or second chunk). `whole`: a shard's two chunks
    are one tensor the kernels take as one sequence (the fixed layout), so a step is one call:
    its own keys causally over the shard (chunk 2 world - 1 - r sees all of chunk r before it);
    an earlier rank's first chunk by every query; a later rank's keys by the second chunk alone.
    Otherwise (packed documents: a shard's chunks are two packed halves) chunk by chunk."""
    mine, theirs = chunks_of(rank, world, zigzag), chunks_of(source, world, zigzag)
    if whole and not causal:
        return [(None, None, False)]
    if whole and zigzag:
        if source == rank:
            return [(None, None, True)]
        return [(None, 0, False)] if source < rank else [(1, None, False)]
    blocks = []
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            relation = _relation(a, b, causal)
            if relation != "none":
                blocks.append((i if len(mine) > 1 else None, j if len(theirs) > 1 else None, relation == "causal"))
    return blocks


def _part(x, part, dim):
    """The rank's whole shard (part None) or one chunk of a zigzag shard (a view)."""
    return x if part is None else x.chunk(2, dim=dim)[part]


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
        """Send `tensors` on and receive their successors; returns (requests, received, sent): the
        sent tensors are held until finish, so no copy made here is freed while it is in flight."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received, sent

    @staticmethod
    def finish(requests, received, sent):
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


@dataclass(frozen=True)
class _Blocks:
    """The ring's view of a layout: the sequence's dimension of q, k, v and o (2 fixed, 0 packed),
    and one block's forward and backward with everything but the block's tensors bound. lse
    travels in o's row layout (o.shape[:-1]: (batch, heads, rows) fixed, (rows, heads) packed)."""

    dim: int
    whole: bool  # a shard's chunks are one sequence to the kernels (fixed), not two packed halves
    forward: Callable  # (q, k, v, causal, first: the row's first block) -> (o, lse in o's row layout)
    backward: Callable  # (d_o, q, k, v, o, lse in o's row layout, causal) -> (dq, dk, dv)


def _forward(ring: _Ring, q, k, v, causal, zigzag, blocks: _Blocks):
    dim = blocks.dim
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(ring.world):
        pending = ring.start(kv) if step < ring.world - 1 else None
        source = (ring.rank - step) % ring.world
        joined = set()  # (the query parts a softmax state, a sink, has joined: once per row, in its first block)
        for q_part, k_part, block_causal in _step(ring.rank, source, ring.world, zigzag, causal, blocks.whole):
            first = step == 0 and q_part not in joined
            joined.add(q_part)
            o_block, lse_block = blocks.forward(_part(q, q_part, dim), _part(kv[0], k_part, dim), _part(kv[1], k_part, dim),
                                                block_causal, first)
            o_rows, lse_rows = _part(out, q_part, dim), _part(lse, q_part, dim)
            merged_o, merged_lse = _merge(o_rows, lse_rows, o_block, lse_block)
            o_rows.copy_(merged_o)
            lse_rows.copy_(merged_lse)
        if pending is not None:
            kv = tuple(ring.finish(*pending))
    return out.to(q.dtype), lse


def _backward(ring: _Ring, d_o, q, k, v, o, lse, causal, zigzag, blocks: _Blocks):
    dim = blocks.dim
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, arriving = (k, v), None
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        # this rank's share of the block's dK/dV; the ranks before it add theirs in transit
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        pending = ring.start(kv) if step < ring.world - 1 else None  # (the next block's K/V, under this one's work)
        for q_part, k_part, block_causal in _step(ring.rank, source, ring.world, zigzag, causal, blocks.whole):
            dq_block, dk_block, dv_block = blocks.backward(
                *(_part(t, q_part, dim) for t in (d_o, q)), _part(kv[0], k_part, dim), _part(kv[1], k_part, dim),
                *(_part(t, q_part, dim) for t in (o, lse)), block_causal)
            _part(dq, q_part, dim).add_(dq_block)
            _part(dkv[0], k_part, dim).add_(dk_block)
            _part(dkv[1], k_part, dim).add_(dv_block)
        # dK/dV travel on with their block (what the ranks before added arrived during this step's
        # work); after the last step they reach the block's owner
        if arriving is not None:
            for mine_sum, theirs_sum in zip(dkv, ring.finish(*arriving)):
                mine_sum.add_(theirs_sum)
        arriving = ring.start(dkv) if ring.world > 1 else None  # (a ring of one: the block is this rank's own)
        if pending is not None:
            kv = tuple(ring.finish(*pending))
    dk, dv = ring.finish(*arriving) if arriving is not None else dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """The ring over a layout (`blocks`); its lse comes back in o's row layout. `learned` names
    the variant tensors that take a gradient (a sink), which follow as inputs."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, zigzag, blocks, learned, *tensors):
        o, lse = _forward(_Ring(group), q, k, v, causal, zigzag, blocks)
        ctx.save_for_backward(q, k, v, o, lse, *tensors)
        ctx.settings = (group, causal, zigzag, blocks, learned)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_lse):
        from . import variants

        if d_lse is not None:
            raise NotImplementedError("ring attention's lse takes no gradient (use it as a value, as merge weights do)")
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        group, causal, zigzag, blocks, learned = ctx.settings
        if d_o is None:
            d_o = torch.zeros_like(o)
        dq, dk, dv = _backward(_Ring(group), d_o, q, k, v, o, lse, causal, zigzag, blocks)
        # a learned value's gradient from this rank's rows (the registry's formula): sum it over the
        # group as any replicated parameter's
        delta = (d_o.float() * o.float()).sum(-1)  # (o's row layout, like lse)
        if blocks.dim == 0:  # packed: the formula's (heads, rows), one sequence of them
            delta, lse = delta.t(), lse.t()
        rows_of = lse.shape[0] if blocks.dim == 2 else 1
        grads = [variants.GRADIENTS[name](t.expand(rows_of, t.shape[-1]), delta, lse, None).sum(0) if needed else None
                 for name, t, needed in zip(learned, tensors, ctx.needs_input_grad[8:])]
        return dq, dk, dv, None, None, None, None, None, *grads


def _ring(q, k, v, group, causal, zigzag, blocks_of, every, once):
    """The ring's call, the variant sorted (_ring_variant), its learned tensors made inputs of the
    autograd function."""
    from . import variants

    learned = {name: value for name, value in once.items() if name in variants.GRADIENTS}
    blocks = blocks_of(every, once)
    return _RingAttention.apply(q, k, v, group, bool(causal), bool(zigzag), blocks, tuple(learned), *learned.values())


def _autocast(q, k, v):
    """Under torch.autocast, q, k, v in its dtype (the blocks' backward runs outside it), as
    flashgen.attention takes them."""
    from .ops import autocast_inputs

    return autocast_inputs(q, k, v)


def _check_ring(q, k, v, layout: str):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring attention runs over torch.distributed: call torch.distributed.init_process_group first")
    dims = 4 if layout == "fixed" else 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            shape = "(batch, heads, seqlen_shard, head_dim)" if dims == 4 else "(total_shard, heads, head_dim)"
            raise ValueError(f"{name} must be a {dims}-D tensor {shape}, this rank's shard")


def ring_attention(q, k, v, *, group=None, causal: bool = False, scale: float | None = None, zigzag: bool = True,
                   return_lse: bool = False, deterministic: bool = False, kernels: BlockKernels = FLASHGEN, **variant):
    """Attention over a sequence sharded across the ranks of `group` (torch.distributed; None: the
    default group), in SDPA's layout: q (batch, heads, seqlen_shard, d), k, v (batch, heads_kv,
    seqlen_shard, d), this rank's shard (`shard`: zigzag by default, which `causal` needs for every
    rank to do the same work; zigzag=False takes contiguous shards). Every rank calls it with
    shards of one shape. Returns this rank's rows of the output (and with return_lse their fp32
    log-sum-exp); differentiable in q, k, v and a learned variant value (a sink's gradient is this
    rank's rows' share: sum it over the group like any replicated parameter's).

    Only the KV heads travel (GQA sends heads_kv of them). The variant keywords are
    flashgen.attention's: those that act on each score alone or join the softmax's state apply (a
    soft cap, a sink); those that need each block's position in the whole sequence (a window,
    ALiBi, the rules) are refused by name (ulysses_attention takes them). The ring fixes the order of the merges and of the gradients' sums; with
    deterministic=True the blocks' backward kernels are the deterministic ones too (attention()'s
    flag), and reruns are bitwise identical."""
    _check_ring(q, k, v, "fixed")
    every, once = _ring_variant("ring_attention", variant)
    if k.shape[2] != q.shape[2] or v.shape[2] != k.shape[2]:
        raise ValueError(f"q, k and v must hold one shard of the sequence: seqlen_shard {q.shape[2]}, {k.shape[2]}, "
                         f"{v.shape[2]}")
    if zigzag and q.shape[2] % 2:
        raise ValueError(f"a zigzag shard holds two chunks of one length: seqlen_shard={q.shape[2]} must be even")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = _autocast(q, k, v)

    def blocks_of(every, once):
        return _Blocks(2, True, lambda q, k, v, causal, first: kernels.forward(q, k, v, causal, scale, {**every, **(once if first else {})}),
                       lambda d_o, q, k, v, o, lse, causal: kernels.backward(d_o, q, k, v, o, lse, causal, scale, every,
                                                                             bool(deterministic)))
    o, lse = _ring(q, k, v, group, causal, zigzag, blocks_of, every, once)
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


def ulysses_attention(q, k, v, *, group=None, causal: bool = False, scale: float | None = None, zigzag: bool = True,
                      return_lse: bool = False, attend: Callable | None = None, **variant):
    """Attention over a sequence sharded across the ranks of `group` by all-to-all over heads
    (DeepSpeed-Ulysses), in SDPA's layout: q (batch, heads, seqlen_shard, d), k, v (batch, heads_kv,
    seqlen_shard, d), this rank's shard (`shard`; zigzag as ring_attention's, so one sharding serves
    both). heads and heads_kv must be multiples of the group's size. Each rank attends over the
    whole sequence for its share of the heads with flashgen.attention (`attend`: a function with
    its keywords, the oracle's in the CPU tests), so every variant keyword it takes applies
    (per-head tensors, the heads their last dimension, are cut to this rank's share: a sink's and
    the slopes' gradients are each rank's share of the heads; sum them over the group).
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
    if zigzag and q.shape[2] % 2:
        raise ValueError(f"a zigzag shard holds two chunks of one length: seqlen_shard={q.shape[2]} must be even")
    from . import variants

    for declaration in variants.REGISTRY:
        if declaration.rule and variant.get(declaration.keyword) is not None:
            raise ValueError(f"{declaration.keyword} with ulysses_attention: a rule would see each rank's heads numbered "
                             f"from 0, not their place among all heads; not taken yet")
    share = q.shape[1] // world
    heads = slice(rank * share, (rank + 1) * share)
    for name, value in variant.items():  # per-head tensors (the heads their last dimension): this rank's share
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[-1] == q.shape[1]:
            variant[name] = value[..., heads]
    if attend is None:
        from .api import attention as attend
    q_h, k_h, v_h = (_to_heads(t, group, world, zigzag) for t in (q, k, v))
    o, lse = attend(q_h, k_h, v_h, causal=causal, scale=scale, return_lse=True, **variant)
    o = _to_sequence(o, group, world, zigzag)
    if not return_lse:
        return o
    return o, _to_sequence(lse[..., None], group, world, zigzag)[..., 0]


def ring_attention_varlen(q, k, v, cu_seqlens, max_seqlen: int, *, group=None, causal: bool = False, softmax_scale: float | None = None,
                          return_lse: bool = False, deterministic: bool = False,
                          kernels: VarlenBlockKernels = FLASHGEN_VARLEN, **variant):
    """ring_attention over packed documents sharded across the ranks (Transformer Engine's THD
    layout): q (total_shard, heads, d), k, v (total_shard, heads_kv, d), this rank's shard
    (`shard_varlen`: each document's chunks r and 2 x world - 1 - r); cu_seqlens the documents'
    offsets over the whole packed sequence, on the host (every rank passes the same), each length
    a multiple of 2 x world; max_seqlen the longest document's length. Attention stays within each
    document (causal: bottom-right within it); the variant keywords as ring_attention's. Returns
    this rank's rows (and with return_lse their fp32 lse, (heads, total_shard)); differentiable."""
    _check_ring(q, k, v, "packed")
    every, once = _ring_variant("ring_attention_varlen", variant)
    world = dist.get_world_size(group)
    starts = _documents(cu_seqlens, world)
    if q.shape[0] != starts[-1] // world or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]} rows: this rank's shard of {starts[-1]} "
                         f"packed tokens over {world} ranks has {starts[-1] // world}")
    longest = max(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 1 else 0
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen}: the longest document has {longest} tokens (max_seqlen is the whole "
                         f"sequence's longest document, not a rank's share of it)")
    longest //= 2 * world  # (a chunk of it: each rank holds two)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v = _autocast(q, k, v)
    # chunk-major order: every document's first chunk, then every document's second, so that the
    # ring's two halves are packed sequences of their own (offsets cu_seqlens / (2 x world))
    half = torch.tensor([a // (2 * world) for a in starts], dtype=torch.int32, device=q.device)
    order = torch.cat([torch.arange(a // world + h * (b - a) // (2 * world), a // world + (h + 1) * (b - a) // (2 * world))
                       for h in (0, 1) for a, b in zip(starts, starts[1:])]).to(q.device)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=q.device)

    def blocks_of(every, once):
        def forward(q, k, v, causal, first):
            o, lse = kernels.forward(q, k, v, half, longest, causal, scale, {**every, **(once if first else {})})
            return o, lse.t()

        return _Blocks(0, False, forward, lambda d_o, q, k, v, o, lse, causal: kernels.backward(
            d_o, q, k, v, o, lse.t().contiguous(), half, longest, causal, scale, every, bool(deterministic)))
    o, lse = _ring(*(t.index_select(0, order) for t in (q, k, v)), group, causal, True, blocks_of, every, once)
    o, lse = o.index_select(0, back), lse.index_select(0, back).t()
    return (o, lse) if return_lse else o
