"""Block masks: which tiles of (queries x keys) hold a key a mask rule keeps, listed the way the
attention kernels walk them.

A kernel with a mask_mod visits, for its row of tiles (a query tile in the forward and the dQ pass,
a key tile in the key-major backward), only the tiles the lists name, and tests positions only in
tiles that are not full. The states come from the block_mask kernel (flashgen.families.blockmask),
the lists from two torch ops on them. `BlockMasks` is one call's: it makes the lists of a tile
shape when a kernel first asks and keeps them for the call's other kernels. Across calls the lists
are kept too, by everything they depend on: the rule's source and the shape, and for a rule that
reads tensors, each tensor's identity and PyTorch's version counter (which every in-place write
through PyTorch moves), so a changed tensor makes new lists; a CUDA graph captured with such a rule
makes its own at each replay, from what the tensors hold then. (A write that bypasses
PyTorch, from a kernel of one's own, is not seen: call flashgen.blockmask.clear() after one.)
Kept lists are copies in memory of their own (workspace.keep), never a CUDA-graph pool's; lists
made during a capture are never kept (they hold their values only when the graph runs), and kept
lists a capture reads are never dropped. A rule tensor's death drops its lists; inference tensors
(no version counter) get new lists each call.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import kernels, runtime, workspace
from .spec import KernelSpec

KEEP = 64  # lists kept across calls, the least recently used dropped first
_kept: OrderedDict = OrderedDict()  # key -> _Kept
_captured: dict = {}  # key -> _Kept: lists a captured CUDA graph reads, kept while the process lives
_lock = threading.RLock()  # (reentrant: a weak reference's callback may run inside it, from the GC)


@dataclass
class _Kept:
    lists: "Lists"
    streams: set  # the streams that have read the lists (their memory waits for each before reuse)
    refs: list  # weak references to the rule's tensors: a tensor's death drops the entry


def _forget(key) -> None:
    with _lock:
        _kept.pop(key, None)


@dataclass(frozen=True)
class Lists:
    """The tiles of each row of tiles: count [B', H', rows], index and state [B', H', rows, width]
    (int32, int32, uint8). A (batch, head) pair's lists are number b * batch_stride + h * head_stride
    (0 where the rule ignores b or h)."""

    count: torch.Tensor
    index: torch.Tensor
    state: torch.Tensor
    batch_stride: int
    head_stride: int


class BlockMasks:
    """The block masks of one call: mask rule (a MaskMod), causal and the built-in mask variants of
    the kernels (their names, and their values by argument name: a window's bounds), and the shape
    (batch, heads, seqlen_q, seqlen_k)."""

    def __init__(self, rule, causal: bool, masks: tuple[str, ...], mask_values: dict, batch: int, heads: int,
                 seqlen_q: int, seqlen_k: int, device: torch.device, arch: str):
        self.rule, self.causal, self.masks, self.mask_values, self.arch = rule, causal, masks, mask_values, arch
        self.batches = batch if rule.per_batch else 1
        self.heads = heads if rule.per_head else 1
        if self.batches * self.heads > 65535:
            raise ValueError(
                f"a mask_mod over {self.batches} batches x {self.heads} heads: at most 65,535 (batch, head) pairs "
                f"(say per_batch=False or per_head=False if the rule ignores b or h)"
            )
        self.seqlen_q, self.seqlen_k, self.device = seqlen_q, seqlen_k, device
        self._lists: dict = {}

    def get(self, block_m: int, block_n: int, key_major: bool) -> Lists:
        """The lists for tiles of block_m queries x block_n keys, per query tile (or per key tile)."""
        shape = (block_m, block_n, key_major)
        lists = self._lists.get(shape)
        if lists is None:
            lists = self._lists[shape] = self._kept_or_made(shape)
        return lists

    def _kept_or_made(self, shape) -> Lists:
        tensors = list(self.rule.tensors.values())  # the caller's tensors (arguments() may copy them)
        stream = runtime._current_stream(self.device.index) if self.device.type == "cuda" else 0
        capturing = bool(stream and runtime.capture_of(stream, self.device.index))
        # a graph captured with a tensor rule makes its lists at each replay, from the tensors then;
        # an inference tensor has no version counter to tell a write, so its lists are made each call
        if tensors and (capturing or any(t.is_inference() for t in tensors)):
            return self._make(*shape)
        key = (self.rule.source, self.causal, self.masks, tuple(self.mask_values.items()), self.batches, self.heads,
               self.seqlen_q, self.seqlen_k,
               self.device, shape, tuple((id(t), t.data_ptr(), t._version) for t in tensors))
        with _lock:
            kept = _kept.get(key)
            # an id names the same tensor only while it lives: the weak references say it does
            if kept is not None and not all(ref() is t for ref, t in zip(kept.refs, tensors)):
                kept = None
            if kept is not None:
                _kept.move_to_end(key)
                if capturing:  # the graph reads these lists at every replay: never let them go
                    _captured[key] = kept
        if kept is not None:
            lists, streams = kept.lists, kept.streams
            if stream not in streams:  # memory read on another stream waits for it before reuse
                for t in (lists.count, lists.index, lists.state):
                    t.record_stream(torch.cuda.ExternalStream(stream, device=self.device))
                streams.add(stream)
            return lists
        lists = self._make(*shape)
        if capturing:  # (lists made in a capture hold their values only when the graph runs)
            return lists
        lists = Lists(*(workspace.keep(t) for t in (lists.count, lists.index, lists.state)), lists.batch_stride,
                      lists.head_stride)
        if self.device.type == "cuda":  # the copies are done before a call on any other stream reads them
            torch.cuda.current_stream(self.device).synchronize()
        with _lock:
            _kept[key] = _Kept(lists, {stream}, [weakref.ref(t, lambda _, key=key: _forget(key)) for t in tensors])
            while len(_kept) > KEEP:
                _kept.popitem(last=False)
        return lists

    def states(self, block_m: int, block_n: int) -> torch.Tensor:
        """[B', H', M, N] uint8: 0 no kept key, 1 some, 2 all (of the positions inside the sequences)."""
        spec = KernelSpec(head_dim=8, kind="block_mask", block_m=block_m, block_n=block_n, causal=self.causal,
                          variants=self.masks, mask_mod=self.rule.source, arch=self.arch)
        rows, cols = -(-self.seqlen_q // block_m), -(-self.seqlen_k // block_n)
        states = torch.empty(self.batches, self.heads, rows, cols, dtype=torch.uint8, device=self.device)
        kernel = kernels.get(spec)
        values = dict(states=states, seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, batches=self.batches, heads=self.heads,
                      mask_mod_tensors=self.rule.arguments(), **self.mask_values)
        kernel.launch(self.device.index, values)
        return states

    def _make(self, block_m: int, block_n: int, key_major: bool) -> Lists:
        states = self.states(block_m, block_n)
        if key_major:
            states = states.transpose(2, 3).contiguous()
        listed = states > 0
        count = listed.sum(dim=3, dtype=torch.int32)
        index = torch.sort((~listed).to(torch.uint8), dim=3, stable=True).indices.to(torch.int32)  # listed first, ascending
        return Lists(count, index, states, self.heads if self.batches > 1 else 0, 1 if self.heads > 1 else 0)


def clear() -> None:
    """Forget the kept lists (after a write to a rule's tensors that PyTorch does not see). Lists a
    captured graph reads stay: only rules without tensors are kept for graphs, and theirs never change."""
    with _lock:
        _kept.clear()
