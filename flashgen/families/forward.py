"""The mma.sync forward (FlashAttention-2's design): one block per BLOCK_M query rows, K and V
streamed through shared memory with cp.async, every warp owning 16 or 32 rows. Runs on sm_80 and
newer."""

from __future__ import annotations

from .. import variants
from ..params import Param, Params, pointer, scalar, tensor
from ..smem import Region, SmemLayout
from ..spec import KernelSpec
from .base import MmaTiles


def forward_outputs_and_sizes(spec: KernelSpec) -> list[Param]:
    """What every forward kernel takes after its inputs: the optional lse, the lengths (varlen: the
    sequences' offsets and the packed totals), the head counts, the softmax scale in base 2 (the
    softmax runs in base 2), and the values of the spec's variants."""
    scale_log2 = scalar("scale_log2", "float", variants.scale_log2(spec))
    if spec.varlen:
        return [
            pointer("lse", "float*", optional=True),  # [heads, total_q] fp32, or null
            *sequences(),
            scalar("kv_group", "int", f"q.shape[1] // k.shape[{2 if spec.paged else 1}]"),  # (a paged cache's heads: dim 2)
            scale_log2, *variants.params(spec, (spec.block_m, spec.block_n, False)),
        ]
    return [
        pointer("lse", "float*", optional=True),  # [batch, heads, seqlen_q] fp32, or null
        scalar("seqlen_q", "int", "q.shape[2]"),
        scalar("seqlen_k", "int", "k.shape[2]"),
        scalar("heads", "int", "q.shape[1]"),
        scalar("kv_group", "int", "q.shape[1] // k.shape[1]"),
        scale_log2, *variants.params(spec, (spec.block_m, spec.block_n, False)),
    ]


def sequences() -> list[Param]:
    """Where a varlen call's sequences are: int32 [batch + 1] offsets into the packed queries and
    keys, and the packed lengths (templates/block_info.cuh.j2 clamps every offset to them)."""
    return [
        pointer("cu_seqlens_q", "const int*"), pointer("cu_seqlens_k", "const int*"),
        scalar("total_q", "int", "q.shape[0]"), scalar("total_k", "int", "k.shape[0]"),
    ]


PACKED = ("row", "head")  # the strides of a packed (total, heads, d) tensor, in order


class MmaForward(MmaTiles):
    kinds = ("fwd",)
    template = "attention_fwd.cu.j2"
    owner = "block_m"
    arguments = ("q", "k", "v", "o", "lse", "scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", *variants.ARGUMENTS)
    forward = True
    tune_space = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
    builtins_free = True  # the forward's tiles hold every built-in variant without spilling (tests/test_variants.py)

    def accumulators(self, spec: KernelSpec) -> int:
        return self.rows_per_warp(spec) // 16 * (spec.d_v_pad + spec.block_n) // 2  # S and O

    def smem(self, spec: KernelSpec) -> SmemLayout:
        row = self.row_bytes(spec)
        tiles = spec.num_stages * spec.block_n * row
        return SmemLayout([Region("q", spec.block_m * row), Region("k", tiles), Region("v", tiles)])

    def params(self, spec: KernelSpec) -> Params:
        dims = {"dims": PACKED} if spec.varlen else {}
        return Params(self.arguments, [
            *tensor("q", **dims), *tensor("k", **dims), *tensor("v", **dims), *tensor("o", const=False, **dims),
            *forward_outputs_and_sizes(spec),
        ])

    def grid(self, spec: KernelSpec) -> str:
        if spec.varlen:  # tiles of the longest sequence, heads, sequences
            return f"(-(-max_seqlen_q // {spec.block_m}), q.shape[1], cu_seqlens_q.shape[0] - 1)"
        return f"(-(-q.shape[2] // {spec.block_m}), q.shape[1], q.shape[0])"
