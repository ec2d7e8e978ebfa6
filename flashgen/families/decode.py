"""Serving kernels: attention of a few query rows over a KV cache (flash-decoding), and the merge of
partial attention states by their log-sum-exp.

- DecodeAttention (decode, decode_paged): one block per (query-row tile x key split, KV head,
  sequence). The query heads that share a KV head and the query tokens are packed into the block's
  rows (GQA/MQA: each K/V byte is read once), keys stream through a cp.async pipeline of
  `num_stages` tiles, and the warps split each tile's keys between them (a decode has too few rows
  to give every warp its own). New keys and values are appended to the cache in place by the block
  whose key range holds them, and read straight from the new tensors, so no block waits for
  another's writes. With one split the block writes o (and lse); with more it writes its normalized
  partial output and log-sum-exp (fp32), and the last of a row tile's split blocks to finish (an
  atomic count in flashgen/workspace.py's buffers says which) merges them into o and lse. With
  varlen (decode_paged only) it serves flash_attn_varlen_func's block_table: packed sequences of
  queries (cu_seqlens_q) over their pages of a paged cache (cu_seqlens_k), nothing appended.
  With kv_dtype "e4m3" the cache is FP8 with a descale per (sequence, KV head): its tiles stream
  in at a byte an element and are widened exactly, in registers as a decode block's warp reads
  them (to fp16, the type its products then run in: bf16 queries are rounded to fp16 under a
  power of two a row), or to the queries' type in shared memory by a 64-row block
  (widens_in_shared); the scores take k_descale and the output v_descale, and appended keys are
  stored divided by their descale, rounded and saturated (and read the same way by the attention
  that appends them).
- MergeStates (merge) and MergeStatesFp32 (merge_fp32): o = sum_s exp(lse_s - lse) o_s with
  lse = log sum_s exp(lse_s), per row, for two states of any float dtype (merge_attention_states).
"""

from __future__ import annotations

import functools

from .. import variants
from ..params import Param, Params, pointer, scalar, tensor
from ..smem import Region, SmemLayout
from ..axes import TARGETS
from ..spec import ELEMENT_TYPES, SMEM_LIMIT, KernelSpec, SpecError
from .base import Family, MmaTiles

MAX_SPLITS = 128  # splits of one (sequence, KV head): the merge's weights and the scratch stay small
PAGE_SIZES = tuple(range(16, 257, 16))  # paged caches: page sizes multiples of 16 from 16 to 256


@functools.cache
def fast_divisor(divisor: int) -> tuple[int, int]:
    """(magic, shift) such that n // divisor == (umulhi(n, magic) + n) >> shift for every
    0 <= n < 2**31 (the round-up method of Granlund and Montgomery, 1994): the kernel divides
    key positions by the page size without an integer division."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor={divisor}: must be in [1, 2**31)")
    shift = (divisor - 1).bit_length()  # ceil(log2(divisor))
    magic = (2**32 * (2**shift - divisor)) // divisor + 1
    return magic, shift


FP8_REGISTER_FLOOR = 128  # registers an FP8-cache decode thread keeps at least (the widened operands take more)


def _occupancy(spec: KernelSpec, threads: int, smem: int) -> int:
    """Blocks of this size one SM holds at once, by shared memory and threads (each block also
    takes 1 KiB of shared memory for the system; the SM has 1 KiB more than a block may use); with
    an FP8 cache no more than leave each thread FP8_REGISTER_FLOOR registers (the launch bounds ask
    ptxas for this many blocks: the small e4m3 stages would otherwise leave it too few, and it
    would spill, as at d = 80)."""
    by_smem = (SMEM_LIMIT[spec.arch] + 1024) // (smem + 1024)
    by_threads = (1536 if spec.arch in ("sm_86", "sm_87", "sm_89") else 2048) // threads  # 48 warps below sm_80/90
    by_registers = 65536 // (threads * FP8_REGISTER_FLOOR) if spec.kv_dtype else 16
    return max(1, min(by_smem, by_threads, by_registers, 16))


def new_rows() -> list[Param]:
    """The keys and values to append, [batch, seqlen_new, kv_heads, d] (or none: strides 0)."""
    params = []
    for name in ("k", "v"):
        params.append(Param(f"{name}_new", "const elem_t* __restrict__", "ptr", f"0 if {name} is None else {name}.data_ptr()", name))
        params += [Param(f"{name}_new_{dim}", "i64", "i64", f"{name}_strides[{i}]", name) for i, dim in enumerate(("batch", "row", "head"))]
    return params


def cache_tensors(paged: bool) -> list[Param]:
    """The K and V caches, written in place: [batch, capacity, kv_heads, d] or paged [num_pages,
    page_size, kv_heads, d], of the cache's element type (cache_t)."""
    dims = ("page" if paged else "batch", "row", "head")
    return [*tensor("k_cache", const=False, elem="cache_t", dims=dims), *tensor("v_cache", const=False, elem="cache_t", dims=dims)]


def descales() -> list[Param]:
    """An FP8 cache's descales, fp32 [batch, kv_heads] (FlashAttention-3's): the true key or value
    is the stored one times its sequence's and KV head's descale."""
    return [*tensor("k_descale", elem="float", dims=("batch", "head")), *tensor("v_descale", elem="float", dims=("batch", "head"))]


def check_fp8_cache(spec: KernelSpec) -> None:
    """An FP8 cache needs the target's FP8 conversions and rows of whole 16-byte chunks."""
    if not TARGETS[spec.arch].fp8:
        raise SpecError(f"kv_dtype={spec.kv_dtype!r} on {spec.arch}: an FP8 cache needs a target with FP8 conversions "
                        f"({', '.join(a for a, t in TARGETS.items() if t.fp8)})")
    if spec.head_dim % 16:
        raise SpecError(f"kv_dtype={spec.kv_dtype!r} with head_dim={spec.head_dim}: an FP8 cache's rows are whole 16-byte "
                        f"chunks, so head_dim must be a multiple of 16")


def cache_context(spec: KernelSpec) -> dict:
    """The template's name for the cache's storage type (the base context's kv_fp8 says whether it is FP8)."""
    return {"cache_storage": spec.cache_element.storage}


def pages() -> list[Param]:
    """A paged cache's block table and page size (kv_cache.cuh.j2's KvCache)."""
    return [
        pointer("block_table", "const int*"),  # [batch, max_blocks] int32
        scalar("block_table_batch", "i64", "block_table.stride(0)"),
        scalar("num_pages", "int"),
        scalar("page_size", "int"),
        scalar("page_shift", "int", "page_divisor[1]"),  # fast_divisor(page_size)
        scalar("page_magic", "i64", "page_divisor[0]"),
    ]


def lengths() -> list[Param]:
    """Each sequence's cached keys, and where appends stop."""
    return [
        pointer("cache_seqlens", "const int*", optional=True),  # [batch] int32, or null: cache_len
        scalar("cache_seqlens_stride", "i64"),
        scalar("cache_len", "int"),
        scalar("capacity", "int"),  # keys a sequence's cache holds at most
        scalar("seqlen_new", "int"),
    ]


class DecodeAttention(Family):
    kinds = ("decode", "decode_paged")
    template = "attention_decode.cu.j2"
    fields = ("head_dim", "block_m", "block_n", "dtype", "kv_dtype", "num_warps", "num_stages", "arch", "varlen",
              *variants.EVERYWHERE, "rotary")
    # The tensors, and the sizes attention_with_kvcache has read once already (the packing then
    # reads no shape twice): a decode step's host cost is mostly Python.
    arguments = ("q", "k_cache", "v_cache", "k", "v", "k_strides", "v_strides", "cache_seqlens", "cache_seqlens_stride",
                 "cache_len", "capacity", "cache_batch_idx", "cache_leftpad", "block_table", "num_pages", "page_size",
                 "page_divisor", "rotary_cos", "rotary_sin", "cu_seqlens_q", "cu_seqlens_k", "total_q", "o", "lse", "partials",
                 "counters", "batch", "seqlen_q", "heads", "kv_heads", "seqlen_new", "splits", "causal", "scale", "k_descale",
                 "v_descale", *variants.ARGUMENTS)

    @staticmethod
    def paged(spec: KernelSpec) -> bool:
        return spec.kind == "decode_paged"

    @staticmethod
    def warps_m(spec: KernelSpec) -> int:
        """Warps along the rows: each owns 16 of the block's rows."""
        return spec.block_m // 16

    def dependent_launch(self, spec: KernelSpec) -> bool:
        """Where the target has it, a programmatic dependent of the kernel before it (it waits for
        that grid before reading anything), so that its launch overlaps that kernel's end: a decode
        step is short enough (~10 us at 8k keys) to feel a launch's microsecond."""
        return TARGETS[spec.arch].dependent_launch

    def warps_n(self, spec: KernelSpec) -> int:
        """Warps along the keys: they share rows and split each key tile between them."""
        return spec.num_warps // self.warps_m(spec)

    def widens_in_shared(self, spec: KernelSpec) -> bool:
        """Where an FP8 cache's values are widened. With one warp along the rows (decode: at most
        16 packed rows) each value is read by one warp, which widens it in registers (to fp16) as it
        reads it (half the bytes through shared memory, no extra barrier). With more, every warp would widen
        every value of the tile: the block widens each tile once in shared memory instead."""
        return bool(spec.kv_dtype) and self.warps_m(spec) > 1

    @staticmethod
    def cache_row_bytes(spec: KernelSpec) -> int:
        """A cache tile row in the stages: the padded row, plus 16 bytes where that makes the row an
        odd number of 16-byte units, so that the 8 rows an ldmatrix reads fall in 8 bank groups (a
        16-bit row always takes them; an e4m3 row of an odd number of 16 dims needs none)."""
        row = spec.head_dim_pad * spec.cache_element.bytes
        return row + (16 if row // 16 % 2 == 0 else 0)

    def check(self, spec: KernelSpec) -> None:
        if spec.kv_dtype:
            check_fp8_cache(spec)
        if spec.varlen and not self.paged(spec):
            raise SpecError("varlen=True: a decode kernel takes packed sequences over a paged cache (kind decode_paged)")
        if spec.varlen and spec.rotary:
            raise SpecError(f"rotary={spec.rotary!r} with varlen=True: rotary embedding turns appended keys, and packed "
                            f"sequences append none")
        if spec.num_warps not in (1, 2, 4, 8):
            raise SpecError(f"num_warps={spec.num_warps}: must be one of (1, 2, 4, 8)")
        if not 2 <= spec.num_stages <= 8:
            raise SpecError(f"num_stages={spec.num_stages}: must be in [2, 8]")
        if spec.block_m % 16 or spec.block_m < 16 or spec.num_warps % (spec.block_m // 16):
            raise SpecError(
                f"block_m={spec.block_m} with num_warps={spec.num_warps}: a {spec.kind} kernel gives each warp 16 "
                f"rows, so block_m must be 16 times a divisor of num_warps"
            )
        warp_keys = spec.block_n // self.warps_n(spec) if spec.block_n % self.warps_n(spec) == 0 else 0
        if spec.block_n > 256 or warp_keys % 16 or not warp_keys:
            raise SpecError(
                f"block_n={spec.block_n} with block_m={spec.block_m}, num_warps={spec.num_warps}: the "
                f"{self.warps_n(spec)} warps that share rows split each key tile, and each needs a multiple of "
                f"16 keys (block_n at most 256)"
            )
        accumulators = (spec.head_dim_pad + warp_keys) // 2  # O and S per thread
        if accumulators > MmaTiles.max_accumulators:
            raise SpecError(
                f"block_n={spec.block_n}, head_dim={spec.head_dim}, num_warps={spec.num_warps}: each thread "
                f"would hold {accumulators} fp32 accumulators; at most {MmaTiles.max_accumulators} fit"
            )

    def smem(self, spec: KernelSpec) -> SmemLayout:
        row = MmaTiles.row_bytes(spec)
        stage = 2 * spec.block_n * self.cache_row_bytes(spec)  # a K tile, then a V tile, as the cache stores them
        # After the key loop the warps merge their rows' states through the same space: per warp
        # its 16 rows of fp32 O (pitch head_dim_pad + 8), then per warp its rows' max and sum.
        reduce = spec.num_warps * 16 * (spec.head_dim_pad + 8) * 4 + spec.num_warps * 16 * 2 * 4
        # Then, in the block that merges the splits: each row's weight of every split, and at
        # least one split's partial rows (fp32); it stages as many splits as the space holds.
        merge = spec.block_m * MAX_SPLITS * 4 + spec.block_m * spec.head_dim * 4
        # An FP8 cache's tiles, where the warps widen them in shared memory, into one K and V tile of q's type.
        wide = [Region("wide", 2 * spec.block_n * row)] if self.widens_in_shared(spec) else []
        return SmemLayout([Region("q", spec.block_m * row), Region("kv", spec.num_stages * stage), *wide],
                          overlays=[Region("reduce", reduce), Region("merge", merge)])

    def blocks_per_sm(self, spec: KernelSpec) -> int:
        return _occupancy(spec, self.threads(spec), spec.smem_bytes)

    def params(self, spec: KernelSpec) -> Params:
        paged = self.paged(spec)
        if paged:
            rows = pages()
        else:  # which row of the caches a sequence reads, and where its keys start there
            rows = [
                pointer("cache_batch_idx", "const int*", optional=True),  # [batch] int32, or null: row b
                scalar("cache_batches", "int", "k_cache.shape[0]"),
                pointer("cache_leftpad", "const int*", optional=True),  # [batch] int32, or null: 0
            ]
        if spec.varlen:  # packed sequences: q and o are (1, total_q, heads, d) views
            rows.append(Param("cu_seqlens_q", "const int* __restrict__", "ptr", "cu_seqlens_q.data_ptr()", "cu_seqlens"))
            rows.append(Param("cu_seqlens_k", "const int* __restrict__", "ptr", "cu_seqlens_k.data_ptr()", "cu_seqlens"))
            rows.append(scalar("total_q", "int"))
        rotary = []
        if spec.rotary:  # the tables [rotary_rows, rotary_dim / 2], contiguous
            rotary = [pointer("rotary_cos", "const elem_t*"), pointer("rotary_sin", "const elem_t*"),
                      scalar("rotary_dim", "int", "2 * rotary_cos.shape[1]"), scalar("rotary_rows", "int", "rotary_cos.shape[0]")]
        return Params(self.arguments, [
            *tensor("q", dims=("batch", "row", "head")),
            *cache_tensors(paged),
            *new_rows(),
            *rows,
            *rotary,
            *lengths(),
            *(descales() if spec.kv_dtype else []),
            *tensor("o", const=False, dims=("batch", "row", "head")),
            pointer("lse", "float*", optional=True),  # [batch, heads, seqlen_q], or null
            # With splits > 1: [splits, batch, heads, seqlen_q, head_dim] partial outputs, then
            # [splits, batch, heads, seqlen_q] their log-sum-exps (fp32); else null.
            pointer("partials", "float*", optional=True),
            # With splits > 1: [batch, kv_heads, row tiles] int32 counts of the splits done, zero
            # before the kernel and after it (flashgen/workspace.py); else null.
            pointer("counters", "int*", optional=True),
            scalar("seqlen_q", "int"),
            scalar("heads", "int"),
            scalar("kv_group", "int", "heads // kv_heads"),
            scalar("splits", "int"),
            scalar("causal", "int"),
            scalar("scale_log2", "float", variants.scale_log2(spec)),
            *variants.params(spec),
        ])

    def grid(self, spec: KernelSpec) -> str:
        return f"(-(-(seqlen_q * (heads // kv_heads)) // {spec.block_m}) * splits, kv_heads, batch)"

    def context(self, spec: KernelSpec) -> dict:
        return {
            **super().context(spec),
            "smem_stride": spec.head_dim_pad + 8,
            "blocks_per_sm": self.blocks_per_sm(spec),
            "paged": self.paged(spec),
            **cache_context(spec),
            "widen": ("shared" if self.widens_in_shared(spec) else "registers") if spec.kv_dtype else "",
            "p_offset": bool(spec.kv_dtype) and not self.widens_in_shared(spec),  # (fp16 P: kept out of its subnormals)
            "warps_m": self.warps_m(spec),
            "warps_n": self.warps_n(spec),
            "max_splits": MAX_SPLITS,
            # The mask piece's causal rule (a non-causal call puts every row at the last query), or
            # a variant's that holds it (a window's right side is 0 then).
            "causal": not any(d.holds_causal for d in variants.on(spec)),
        }


class KvAppend(Family):
    """append_paged: attention_with_kvcache's new keys and values stored into a paged cache on their
    own, ahead of the paged Hopper forward over a long chunk of queries (the decode kernel appends
    inside its own launch)."""

    kinds = ("append_paged",)
    template = "kv_append.cu.j2"
    fields = ("head_dim", "dtype", "arch")
    arguments = ("k_cache", "v_cache", "k", "v", "k_strides", "v_strides", "cache_seqlens", "cache_seqlens_stride",
                 "cache_len", "capacity", "block_table", "num_pages", "page_size", "page_divisor", "batch", "kv_heads",
                 "seqlen_new")
    MOST_BLOCKS = 64  # blocks per (KV head, sequence): each thread then copies several chunks

    def threads(self, spec: KernelSpec) -> int:
        return 256

    def params(self, spec: KernelSpec) -> Params:
        return Params(self.arguments, [
            *tensor("k_cache", const=False, dims=("page", "row", "head")),
            *tensor("v_cache", const=False, dims=("page", "row", "head")),
            *new_rows(),
            *pages(),
            *lengths(),
        ])

    def grid(self, spec: KernelSpec) -> str:
        chunks = spec.head_dim * ELEMENT_TYPES[spec.dtype].bytes // 16
        return f"(min(max(-(-seqlen_new * {chunks} // {self.threads(spec)}), 1), {self.MOST_BLOCKS}), kv_heads, batch)"

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "paged": True}


class MergeStates(Family):
    """merge: two attention states of {dtype} into one (merge_attention_states)."""

    kinds = ("merge",)
    template = "attention_combine.cu.j2"
    fields = ("head_dim", "dtype", "arch")
    arguments = ("o_a", "lse_a", "o_b", "lse_b", "o", "lse")

    def threads(self, spec: KernelSpec) -> int:
        return 128  # 4 warps, a row each

    def smem(self, spec: KernelSpec) -> SmemLayout:
        return SmemLayout([])

    def types(self, spec: KernelSpec) -> tuple[str, str]:
        """C types of the states read and of the output written."""
        return ("float", "float") if spec.kind == "merge_fp32" else ("elem_t", "elem_t")

    def params(self, spec: KernelSpec) -> Params:
        # Two states (..., d) with one layout (merge_attention_states makes sure): read as one
        # (2, ...) tensor whose split stride is the distance between them. o, lse: contiguous.
        in_type, out_type = self.types(spec)
        size = 4 if in_type == "float" else 2
        dims = ("x", "y", "z")
        return Params(self.arguments, [
            Param("parts", f"const {in_type}* __restrict__", "ptr", "o_a.data_ptr()", "parts"),
            Param("parts_split", "i64", "i64", f"(o_b.data_ptr() - o_a.data_ptr()) // {size}", "parts"),
            *[Param(f"parts_{d}", "i64", "i64", f"o_a_stride[{i}]", "parts") for i, d in enumerate(dims)],
            Param("parts_lse", "const float* __restrict__", "ptr", "lse_a.data_ptr()", "parts_lse"),
            Param("parts_lse_split", "i64", "i64", "(lse_b.data_ptr() - lse_a.data_ptr()) // 4", "parts_lse"),
            *[Param(f"parts_lse_{d}", "i64", "i64", f"lse_a_stride[{i}]", "parts_lse") for i, d in enumerate(dims)],
            Param("out", f"{out_type}* __restrict__", "ptr", "o.data_ptr()", "out"),
            *[Param(f"out_{d}", "i64", "i64", f"o_stride[{i}]", "out") for i, d in enumerate(dims)],
            Param("out_lse", "float* __restrict__", "ptr", "lse.data_ptr()", "out_lse"),
            *[Param(f"out_lse_{d}", "i64", "i64", f"lse.stride({i})", "out_lse") for i, d in enumerate(dims)],
            scalar("size_y", "int", "o.shape[1]"), scalar("size_z", "int", "o.shape[2]"),
            scalar("rows", "int", "o.shape[0] * o.shape[1] * o.shape[2]"),
        ])

    def grid(self, spec: KernelSpec) -> str:
        return f"(-(-(o.shape[0] * o.shape[1] * o.shape[2]) // {self.threads(spec) // 32}), 1, 1)"

    def context(self, spec: KernelSpec) -> dict:
        in_type, out_type = self.types(spec)
        return {**super().context(spec), "in_type": in_type, "out_type": out_type}


class MergeStatesFp32(MergeStates):
    """merge_fp32: two fp32 states into fp32 (the spec's dtype is unused)."""

    kinds = ("merge_fp32",)
    fields = ("head_dim", "arch")
