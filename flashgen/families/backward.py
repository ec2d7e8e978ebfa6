"""The backward (FlashAttention-2's algorithm), in three families:

- BackwardPrep (bwd_prep): delta = rowsum(dO * O) and the base-2 log-sum-exp, per query row; and
  zeros in the fp32 dQ sum that a backward kernel adds into, so that it needs no launch of its own.
- KeyMajorBackward (bwd_kvq, bwd_kv, bwd_kq, bwd_k, bwd_v): one block per BLOCK_N keys walks the
  query tiles, writes dK and/or dV, and with a "q" adds dQ into an fp32 buffer with atomics. On
  sm_90a, blocks whose warps own 16 keys run their products on warpgroup MMA (wgmma).
- QueryMajorBackward (bwd_q): one block per BLOCK_M query rows writes dQ deterministically.
"""

from __future__ import annotations

from .. import variants
from ..axes import TARGETS
from ..params import Params, pointer, scalar, strides, tensor
from ..smem import Region, SmemLayout
from ..spec import KernelSpec, SpecError
from .base import Family, MmaTiles, check_backward_rule
from .forward import PACKED, sequences

# The prep writes lse and delta into buffers padded to whole tiles of this many rows, so the
# backward kernels read them without bounds checks.
STATS_PAD = 128


def padded(seqlen_q: int) -> int:
    return -(-seqlen_q // STATS_PAD) * STATS_PAD


def padded_varlen(total_q: int, batch: int) -> int:
    """Rows per head of a varlen call's statistics: each sequence starts on a whole tile at
    (cu_seqlens_q[b] + b * STATS_PAD) rounded down to one (block_info's stats_rows), so its rows and
    their padding end before total_q + batch * STATS_PAD; rounded up to a whole tile, so that every
    head's rows start 16-byte aligned."""
    return padded(total_q + batch * STATS_PAD)


class BackwardPrep(Family):
    """With a variant that learns (variants.for_prep: a sink) the prep also sums its gradient over
    each block's rows into `learned_grad` ([batch or sequences, heads, grid x], one partial per
    block, every block writing its own: the host's sum over the last dim is deterministic)."""

    kinds = ("bwd_prep",)
    template = "attention_bwd_prep.cu.j2"
    fields = ("head_dim", "dtype", "arch", "varlen", "variants")
    arguments = ("o", "d_o", "lse", "d_lse", "delta", "lse_log2", "dq_accum", "learned_grad", "cu_seqlens_q", "max_seqlen_q",
                 *variants.ARGUMENTS)

    def threads(self, spec: KernelSpec) -> int:
        return 128

    @staticmethod
    def lanes(spec: KernelSpec) -> int:
        """Lanes per query row: the row's 16-byte chunks, rounded up to a power of two."""
        return 1 << (spec.head_dim // 8 - 1).bit_length()

    def rows_per_block(self, spec: KernelSpec) -> int:
        return self.threads(spec) // self.lanes(spec)

    def learned_grad_shape(self, spec: KernelSpec, values: dict) -> tuple[int, int, int]:
        """The shape of a call's learned_grad: (batch or sequences, heads, blocks along the rows)."""
        if spec.varlen:
            return values["cu_seqlens_q"].shape[0] - 1, values["o"].shape[1], -(-values["max_seqlen_q"] // STATS_PAD) * (
                STATS_PAD // self.rows_per_block(spec))
        batch, heads, seqlen_q = values["o"].shape[:3]
        return batch, heads, padded(seqlen_q) // self.rows_per_block(spec)

    def params(self, spec: KernelSpec) -> Params:
        learned = [pointer("learned_grad", "float*"), *variants.params(spec)] if spec.variants else []
        if spec.varlen:
            return Params(self.arguments, [
                *tensor("o", dims=PACKED), *tensor("d_o", dims=PACKED),
                pointer("lse", "const float*"),  # [heads, total_q]
                pointer("d_lse", "const float*", optional=True),  # the same layout, or null
                pointer("delta", "float*"), pointer("lse_log2", "float*"),  # [heads, padded_q]
                *zeroed_sum(),
                pointer("cu_seqlens_q", "const int*"),
                scalar("total_q", "int", "o.shape[0]"),
                scalar("padded_q", "int", "delta.shape[1]"),
                *learned,
            ])
        return Params(self.arguments, [
            *tensor("o"), *tensor("d_o"),
            pointer("lse", "const float*"),  # [batch, heads, seqlen_q]
            pointer("d_lse", "const float*", optional=True),  # the same layout, or null
            pointer("delta", "float*"), pointer("lse_log2", "float*"),  # [batch, heads, padded_q]
            *zeroed_sum(),
            scalar("seqlen_q", "int", "o.shape[2]"),
            scalar("padded_q", "int", "delta.shape[2]"),
            scalar("heads", "int", "o.shape[1]"),
            *learned,
        ])

    def grid(self, spec: KernelSpec) -> str:
        rows = self.rows_per_block(spec)
        if spec.varlen:  # the padded rows of the longest sequence, heads, sequences
            return f"(-(-max_seqlen_q // {STATS_PAD}) * {STATS_PAD // rows}, o.shape[1], cu_seqlens_q.shape[0] - 1)"
        return f"(delta.shape[2] // {rows}, o.shape[1], o.shape[0])"

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "lanes": self.lanes(spec), "stats_pad": STATS_PAD, "keys": False}


def zeroed_sum() -> list:
    """The fp32 dQ sum the plan's backward kernel adds into (contiguous, in its family's layout; None
    when no kernel does), which the prep's blocks fill with zeros between them."""
    return [pointer("dq_accum", "float*", optional=True),
            scalar("dq_accum_size", "i64", "0 if dq_accum is None else dq_accum.numel()")]


class _BackwardTiles(MmaTiles):
    def check(self, spec: KernelSpec) -> None:
        super().check(spec)
        check_backward_rule(spec)
        if STATS_PAD % spec.block_m:
            raise SpecError(f"block_m={spec.block_m}: a backward kernel needs a divisor of {STATS_PAD}")

    def params_common(self, spec: KernelSpec):
        if spec.varlen:
            return [
                *(p for name in ("q", "k", "v", "d_o") for p in tensor(name, dims=PACKED)),
                pointer("lse_log2", "const float*"), pointer("delta", "const float*"),  # [heads, padded_q]
            ]
        return [
            *tensor("q"), *tensor("k"), *tensor("v"), *tensor("d_o"),
            pointer("lse_log2", "const float*"), pointer("delta", "const float*"),  # [batch, heads, padded_q]
        ]

    def scalars(self, spec: KernelSpec):
        if spec.varlen:
            lengths = [*sequences(), scalar("padded_q", "int", "delta.shape[1]")]
        else:
            lengths = [
                scalar("seqlen_q", "int", "q.shape[2]"),
                scalar("seqlen_k", "int", "k.shape[2]"),
                scalar("padded_q", "int", "delta.shape[2]"),
            ]
        return [
            *lengths,
            scalar("kv_group", "int", "q.shape[1] // k.shape[1]"),
            scalar("scale", "float"),
            scalar("scale_log2", "float", variants.scale_log2(spec)),
            *variants.params(spec, (spec.block_m, spec.block_n, self.owner == "block_n")),
        ]

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "stats_pad": STATS_PAD}


class KeyMajorBackward(_BackwardTiles):
    kinds = ("bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v")
    template = "attention_bwd.cu.j2"
    owner = "block_n"
    arguments = ("q", "k", "v", "d_o", "lse_log2", "delta", "dk", "dv", "dq_accum", "scale", "cu_seqlens_q", "cu_seqlens_k",
                 "max_seqlen_k", *variants.ARGUMENTS)
    tune_space = {"block_m": (16, 32, 64, 128), "block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}

    def check(self, spec: KernelSpec) -> None:
        super().check(spec)
        if spec.block_m // 2 > 32 * spec.num_warps:  # each thread loads two rows' statistics per query tile
            raise SpecError(
                f"block_m={spec.block_m} with num_warps={spec.num_warps}: a {spec.kind} kernel loads a query tile's "
                f"statistics with one thread per two rows, so block_m must be at most {64 * spec.num_warps}"
            )

    @staticmethod
    def grads(spec: KernelSpec) -> str:
        """The gradients the kernel writes: letters of "kvq"."""
        return spec.kind.removeprefix("bwd_")

    @staticmethod
    def wgmma(spec: KernelSpec) -> bool:
        """Hopper's warpgroup MMA: on sm_90a, when warps own 16 keys each, so that 4 warps form a
        warpgroup over 64 keys. Its shared-memory tiles are stored as 8 x 8 core matrices."""
        return TARGETS[spec.arch].wgmma and spec.num_warps % 4 == 0 and spec.block_n // spec.num_warps == 16

    def accumulators(self, spec: KernelSpec) -> int:
        grads = self.grads(spec)
        scores = 1 + ("k" in grads or "q" in grads)  # S^T, and dP^T when dS is needed
        widths = ("k" in grads) * spec.head_dim_pad + ("v" in grads) * spec.d_v_pad  # dK, dV
        return self.rows_per_warp(spec) // 16 * (widths + scores * spec.block_m) // 2

    def smem(self, spec: KernelSpec) -> SmemLayout:
        # Core-matrix tiles (wgmma) have no padding; dK and dV are staged in padded rows either way.
        tile_row = self.row_pad(spec) * 2 if self.wgmma(spec) else self.row_bytes(spec)
        regions = [
            Region("k", spec.block_n * tile_row), Region("v", spec.block_n * tile_row),
            Region("q", spec.num_stages * spec.block_m * tile_row), Region("do", spec.num_stages * spec.block_m * tile_row),
            Region("stats", spec.num_stages * 2 * spec.block_m * 4),
        ]
        if "q" in self.grads(spec):
            regions.append(Region("ds", spec.block_n * (spec.block_m + 8) * 2))
        outputs = len(self.grads(spec).replace("q", ""))
        return SmemLayout(regions, overlays=[Region("stage", outputs * spec.block_n * self.row_bytes(spec))])

    def params(self, spec: KernelSpec) -> Params:
        grads = self.grads(spec)
        # dK and dV share one layout (both are allocated like k), passed once as dkv_*; with a head
        # dim of its own dV has its own strides (dv_*).
        dims = {"dims": PACKED} if spec.varlen else {}
        outputs = [pointer(name, "elem_t*") for name in ("dk", "dv") if name[1] in grads]
        outputs += strides("dkv", outputs[0].name, **dims)
        if spec.head_dim_v and "k" in grads and "v" in grads:
            outputs += strides("dv", "dv", **dims)
        if "q" in grads:  # zeroed; [batch, heads, seqlen_q, head_dim] or, varlen, [total_q, heads, head_dim]
            outputs.append(pointer("dq_accum", "float*"))
        return Params(self.arguments, [
            *self.params_common(spec), *outputs, *self.scalars(spec), scalar("kv_heads", "int", "k.shape[1]"),
        ])

    def grid(self, spec: KernelSpec) -> str:
        if spec.varlen:  # key tiles of the longest sequence, key/value heads, sequences
            return f"(-(-max_seqlen_k // {spec.block_n}), k.shape[1], cu_seqlens_k.shape[0] - 1)"
        return f"(-(-k.shape[2] // {spec.block_n}), k.shape[1], k.shape[0])"

    def context(self, spec: KernelSpec) -> dict:
        grads = self.grads(spec)
        dq_rows, dq_pairs = dq_item(spec)
        return {
            **super().context(spec),
            "has_dk": "k" in grads,
            "has_dv": "v" in grads,
            "has_dq": "q" in grads,
            "need_dp": "k" in grads or "q" in grads,
            # each gradient's product: its accumulator, the fp32 tile it is multiplied from, the shared-memory
            # B operand, its head dim, n8 tiles and padded width, and the strides it is stored with
            "gemms": [gemm for gemm in self.gemms(spec) if gemm["acc"][1] in grads],
            "grads_text": " and ".join({"k": "dK", "v": "dV"}[g] for g in grads if g != "q"),
            "wgmma": self.wgmma(spec),  # also stores the shared-memory tiles as wgmma's core matrices
            "dq_rows": dq_rows,
            "dq_pairs": dq_pairs,
        }


    @classmethod
    def gemms(cls, spec: KernelSpec) -> list[dict]:
        """dV += P^T dO and dK += dS^T Q. dK and dV share one layout (passed once as dkv_*) unless
        v has a head dim of its own."""
        dv_strides = "dv" if spec.head_dim_v and "k" in cls.grads(spec) else "dkv"
        return [
            {"acc": "dv", "src": "s", "smem_tile": "do_tile", "dim": "HEAD_DIM_V", "tiles": "DV_TILES", "pad": spec.d_v_pad,
             "strides": dv_strides, "text": "dV += P^T dO"},
            {"acc": "dk", "src": "dp", "smem_tile": "q_tile", "dim": "HEAD_DIM", "tiles": "D_TILES", "pad": spec.head_dim_pad,
             "strides": "dkv", "text": "dK += dS^T Q"},
        ]

    # ---- the dQ accumulator (kinds with a "q"): q's shape, fp32, read back as it is ---------------

    def dq_accum_shape(self, spec: KernelSpec, values: dict) -> tuple:
        return tuple(values["q"].shape)

    def dq_from_accum(self, spec: KernelSpec, accum, dq) -> None:
        dq.copy_(accum)


def dq_item(spec: KernelSpec) -> tuple[int, int]:
    """The key-major dQ product's work item, (m16 query tiles, n16 head-dim pairs): the shape that
    keeps the busiest warp's mma count lowest, then its operand loads, within 32 fp32
    accumulators per thread."""
    row_tiles, pairs = spec.block_m // 16, spec.head_dim_pad // 16

    def cost(item):
        rows, cols = item
        per_warp = -(-(row_tiles // rows) * (pairs // cols) // spec.num_warps)
        return per_warp * rows * cols, per_warp * (rows + cols)

    shapes = [(r, c) for r in (1, 2, 4) for c in (1, 2, 3, 4) if not row_tiles % r and not pairs % c and r * c <= 4]
    return min(shapes, key=cost)


class QueryMajorBackward(_BackwardTiles):
    kinds = ("bwd_q",)
    template = "attention_bwd_q.cu.j2"
    owner = "block_m"
    arguments = ("q", "k", "v", "d_o", "lse_log2", "delta", "dq", "scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                 *variants.ARGUMENTS)
    tune_space = {"block_m": (32, 64, 128), "block_n": (32, 64), "num_warps": (2, 4), "num_stages": (2,)}

    def accumulators(self, spec: KernelSpec) -> int:
        return self.rows_per_warp(spec) // 16 * (spec.head_dim_pad // 2 + spec.block_n)  # S, dP and dQ

    def smem(self, spec: KernelSpec) -> SmemLayout:
        row = self.row_bytes(spec)
        tiles = spec.num_stages * spec.block_n * row
        return SmemLayout([
            Region("q", spec.block_m * row), Region("do", spec.block_m * row), Region("k", tiles), Region("v", tiles),
        ])

    def params(self, spec: KernelSpec) -> Params:
        if spec.varlen:  # the statistics' rows come from block_info: no head count needed
            return Params(self.arguments, [
                *self.params_common(spec), *tensor("dq", const=False, dims=PACKED), *self.scalars(spec),
            ])
        return Params(self.arguments, [
            *self.params_common(spec), *tensor("dq", const=False), *self.scalars(spec), scalar("heads", "int", "q.shape[1]"),
        ])

    def grid(self, spec: KernelSpec) -> str:
        if spec.varlen:  # query tiles of the longest sequence, heads, sequences
            return f"(-(-max_seqlen_q // {spec.block_m}), q.shape[1], cu_seqlens_q.shape[0] - 1)"
        return f"(-(-q.shape[2] // {spec.block_m}), q.shape[1], q.shape[0])"
