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
Kept lists are copies in memory of their own (workspace.keep), never a CUDA-graph pool's, and
lists made during a capture are never kept (they hold their values only when the graph runs).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import kernels, runtime, workspace
from .spec import KernelSpec

_kept: OrderedDict = OrderedDict()  # key -> (lists, weak references to the rule's tensors)
KEEP = 64


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
    """The block masks of one call: mask rule (a MaskMod), causal and window of the kernels, and the
    shape (batch, heads, seqlen_q, seqlen_k)."""

    def __init__(self, rule, causal: bool, window: tuple[int, int], batch: int, heads: int, seqlen_q: int,
                 seqlen_k: int, device: torch.device, arch: str):
        self.rule, self.causal, self.window, self.arch = rule, causal, window, arch
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
            tensors = self.rule.arguments()
            capturing = self.device.type == "cuda" and bool(runtime.capture_of(runtime._current_stream(self.device.index)))
            # a graph captured with a tensor rule makes its lists at each replay, from the tensors then
            key = None if tensors and capturing else (
                self.rule.source, self.causal, self.window, self.batches, self.heads, self.seqlen_q, self.seqlen_k,
                self.device, shape, tuple((id(t), t._version) for t in tensors))
            kept = _kept.get(key) if key else None
            # an id names the same tensor only while it lives: the weak references say it does
            if kept is not None and all(ref() is t for ref, t in zip(kept[1], tensors)):
                lists = kept[0]
                _kept.move_to_end(key)
            else:
                lists = self._make(block_m, block_n, key_major)
                if key and not capturing:  # (lists made in a capture hold their values only when the graph runs)
                    lists = Lists(*(workspace.keep(t) for t in (lists.count, lists.index, lists.state)), lists.batch_stride,
                                  lists.head_stride)
                    _kept[key] = (lists, tuple(weakref.ref(t) for t in tensors))
                    while len(_kept) > KEEP:
                        _kept.popitem(last=False)
            self._lists[shape] = lists
        return lists

    def states(self, block_m: int, block_n: int) -> torch.Tensor:
        """[B', H', M, N] uint8: 0 no kept key, 1 some, 2 all (of the positions inside the sequences)."""
        spec = KernelSpec(head_dim=8, kind="block_mask", block_m=block_m, block_n=block_n, causal=self.causal,
                          window=self.window != (-1, -1), mask_mod=self.rule.source, arch=self.arch)
        rows, cols = -(-self.seqlen_q // block_m), -(-self.seqlen_k // block_n)
        states = torch.empty(self.batches, self.heads, rows, cols, dtype=torch.uint8, device=self.device)
        kernel = kernels.get(spec)
        values = dict(states=states, seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, batches=self.batches, heads=self.heads,
                      window_left=self.window[0], window_right=self.window[1], mask_mod_tensors=self.rule.arguments())
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
    _kept.clear()
