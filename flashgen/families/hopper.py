"""The sm_90a forward (FlashAttention-3's design): Q, K and V tiles loaded by the tensor memory
accelerator (TMA) into 128-byte-swizzled shared memory through an mbarrier pipeline, one producer
warpgroup and two or three consumer warpgroups (setmaxnreg moves registers to the consumers), S =
QK^T and O += PV on warpgroup MMA (wgmma), the softmax of one key tile under the next tile's QK^T,
and ping-pong between the consumer warpgroups. O leaves through shared memory with a TMA store.
"""

from __future__ import annotations

import math

from .. import variants
from ..params import Param, Params, pointer, scalar, strides, tensor, tensormap
from ..smem import Region, SmemLayout
from ..spec import SMEM_LIMIT, KernelSpec, SpecError
from .base import Family, block_mask_lists, check_rules_fixed_length
from .forward import PACKED, forward_outputs_and_sizes

# Registers a consumer thread may hold in accumulators (S, O, and P packed), by consumer
# warpgroups: setmaxnreg gives each 240 (two consumers) or 160 (three) registers.
MAX_ACCUMULATORS = {2: 200, 3: 128}
# ... with FP8 inputs, the variants' registers included (calibrated the same way: d = 256 at 128 x
# 128, 208 of them, compiles without spills, and with a sink's 2 more; with a window's 8 it spilled)
MAX_ACCUMULATORS_FP8 = {2: 210, 3: 128}
# The same with each consumer's rows of Q held as S = Q K^T's register operand (a quarter of the
# padded head dim a thread): calibrated on the CPU compile sweep (128 x 144 at d = 128 and 128 x 192
# at d = 64 compile without spills, the next block_n up spills). Three consumers have no room.
MAX_WITH_Q = {2: 208, 3: 0}
# setmaxnreg's split of 512 registers a thread slot, by consumer warpgroups: the producer keeps
# (24 or 32) what TMA issue needs and the consumers take the rest. The paged forward's producer
# gathers small pages and keeps 48, so each of its two consumers gives up PAGED_GIVES.
REGISTERS = {2: {"producer": 24, "consumer": 240}, 3: {"producer": 32, "consumer": 160}}
PAGED_GIVES = 8
# What a user rule takes beside them (its tensors' addresses, the values its expression holds per
# element), and each built-in variant once a rule is on (its declaration's registers): calibrated on the
# CPU compile sweep (tests/test_variants.py), past which the kernels spilled.
RULE_MARGINS = {"mask_mod": 12, "score_mod": 20}


def tensor_map_helper() -> dict:
    """The packers' TMA descriptor encoder (runtime.tensor_map), imported when a packer is made:
    the CLI imports the families and must not pay for torch."""
    from ..runtime import tensor_map

    return {"tensor_map": tensor_map}


def page_rows(cache, block_n: int) -> int:
    """Rows of a paged cache one TMA load takes: the largest count that divides both the page size
    and the key tile (both multiples of 16), so no load crosses a page or a tile's end."""
    return math.gcd(cache.shape[1], block_n)


# Page sizes the paged forward gathers with the producer warpgroup's cp.async instead of TMA boxes
# (16 and 32 can: powers of two whose whole pages a key tile holds, which keeps the gather's page
# arithmetic to shifts and masks). None by default: on an H100 (29th session, d = 128, 16-row
# pages) the gathers reached 0.68-0.72x packed keys against TMA's 0.73-0.76x; the gathers of
# cdc059d (one multiply-add a row) and TMA from four warps (d204134) are not measured yet
# (.ci/gx_experiment.sh times them side by side).
GATHER_PAGES: tuple[int, ...] = ()
GATHERABLE = (16, 32)


def page_gather(cache, block_n: int) -> int:
    """1 where the paged forward gathers K and V with cp.async (small pages), 0 where TMA loads them."""
    page = cache.shape[1]
    return int(page in GATHER_PAGES and block_n % page == 0)


_sm_counts: dict[int, int] = {}


def _sm_count(t) -> int:
    """Streaming multiprocessors of the tensor's GPU: the persistent grid's size."""
    count = _sm_counts.get(t.device.index)
    if count is None:
        import torch

        count = _sm_counts[t.device.index] = torch.cuda.get_device_properties(t.device).multi_processor_count
    return count


HOPPER_NEEDS = ("tma", "wgmma", "setmaxnreg")  # what the Hopper families' kernels use (flashgen.axes)


class HopperForward(Family):
    kinds = ("fwd_sm90",)
    needs = HOPPER_NEEDS
    template = "attention_fwd_sm90.cu.j2"
    dtypes = ("fp16", "bf16", "e4m3")
    fields = ("head_dim", "head_dim_v", "block_m", "block_n", "dtype", "out_dtype", "causal", "num_stages", "arch", "persistent",
              "exp2_fma", "varlen", "paged",
              *variants.EVERYWHERE, "score_mod", "mask_mod")
    arguments = ("q", "k", "v", "o", "lse", "scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "block_table",
                 "k_new", "v_new", "seqlen_new", "q_descale", "k_descale", "v_descale", *variants.ARGUMENTS)
    forward = True
    tune_space = {"block_m": (128, 192), "block_n": (64, 80, 96, 112, 128, 144, 160, 176), "num_stages": (2, 3),
                  "persistent": (False, True)}
    tune_knobs = {"exp2_fma": (1, 2, 3)}

    @staticmethod
    def consumers(spec: KernelSpec) -> int:
        return spec.block_m // 64

    @staticmethod
    def head_dim_pad(spec: KernelSpec) -> int:
        """Head dims are padded to whole 128-byte chunks (64 16-bit or 128 FP8 elements): one TMA
        box, one swizzle row."""
        cols = spec.element.chunk_cols
        return -(-spec.head_dim // cols) * cols

    @staticmethod
    def d_v_pad(spec: KernelSpec) -> int:
        """V's and O's head dim, padded to O's 128-byte chunks (an FP8 forward's V is transposed:
        its padded head dim is the rows of its tiles)."""
        cols = spec.output_element.chunk_cols
        return -(-spec.d_v // cols) * cols

    def check(self, spec: KernelSpec) -> None:
        if spec.block_m not in (128, 192):
            raise SpecError(f"block_m={spec.block_m}: must be 128 or 192 (two or three consumer warpgroups of 64 rows)")
        if spec.block_n % 16 or not 16 <= spec.block_n <= 256:
            raise SpecError(f"block_n={spec.block_n}: must be a multiple of 16 in [16, 256]")
        if spec.num_stages not in (2, 3, 4):
            raise SpecError(f"num_stages={spec.num_stages}: must be one of (2, 3, 4)")
        check_rules_fixed_length(spec)
        if spec.element.bytes == 1:
            # FP8: V comes transposed (keys contiguous, the K-major operand wgmma needs for 8-bit
            # types) in one 128-byte-swizzled box of 128 keys a tile; fixed-length sequences only
            if spec.head_dim % 16 or spec.d_v % 16:
                raise SpecError(f"dtype={spec.dtype!r}, {spec.dims_text}: FP8 head dims are multiples of 16 "
                                "(TMA reads rows of whole 16 bytes)")
            if spec.block_n != 128:
                raise SpecError(f"dtype={spec.dtype!r}, block_n={spec.block_n}: an FP8 forward runs block_n=128 "
                                "(one 128-byte row of transposed V a head-dim row)")
            if spec.paged:
                raise SpecError(f"dtype={spec.dtype!r}: the FP8 forward reads packed or fixed-length keys, not pages (paged=False)")
        if spec.paged and not spec.varlen:
            raise SpecError("paged=True: the paged Hopper forward takes packed sequences (varlen=True)")
        if spec.paged and spec.block_m != 128:
            raise SpecError(f"paged=True, block_m={spec.block_m}: the paged Hopper forward runs block_m=128 (its "
                            "producer warpgroup gathers small pages with the registers a third consumer would take)")
        if spec.varlen and spec.persistent:
            raise SpecError("varlen=True, persistent=True: the varlen Hopper forward runs one tile per CTA (persistent=False)")
        held = self.accumulators(spec)
        limit = (MAX_ACCUMULATORS_FP8 if spec.element.bytes == 1 else MAX_ACCUMULATORS)[self.consumers(spec)] - (PAGED_GIVES if spec.paged else 0)
        if spec.element.bytes == 1:  # (FP8's limit is its plain kernel's: a variant's registers come on top)
            held += sum(d.registers for d in variants.on(spec) if not d.rule)
        if held > limit:
            fix = "(FP8 tiles are 128 keys wide: at this head dim, block_m=128 or fewer variants)" if spec.element.bytes == 1 \
                else "(use a smaller block_n)"
            raise SpecError(
                f"block_m={spec.block_m}, block_n={spec.block_n}, {spec.dims_text}{''.join(f', {v}' for v in spec.variants)}: "
                f"each consumer thread would hold {held} registers of accumulators; at most {limit} fit {fix}"
            )
        rules = [rule for rule in RULE_MARGINS if getattr(spec, rule)]
        if rules:
            on = [d for d in variants.on(spec) if not d.rule]
            margin = sum(RULE_MARGINS[rule] for rule in rules) + sum(d.registers for d in on)
            if held + margin > limit:
                raise SpecError(
                    f"block_m={spec.block_m}, block_n={spec.block_n}, {spec.dims_text} with "
                    f"{', '.join(rules + [d.name for d in on])}: each consumer thread would hold {held} registers of accumulators and "
                    f"{margin} for the rules and variants; at most {limit} fit (use a smaller block_n, or block_m=128)"
                )

    def accumulators(self, spec: KernelSpec) -> int:
        """Registers a consumer thread holds in S, O and P (packed: 2 or 4 a register)."""
        return spec.block_n // 2 + self.d_v_pad(spec) // 2 + spec.block_n * spec.element.bytes // 8

    def q_in_registers(self, spec: KernelSpec) -> bool:
        """Whether each consumer keeps its rows of Q in registers (a quarter of the padded head dim
        a thread) as S = Q K^T's register operand: where they fit beside the accumulators and what
        the variants take, and no user rule runs (its values live beside S)."""
        if spec.score_mod or spec.mask_mod or spec.element.bytes == 1:  # (FP8: Q's fragments are another layout)
            return False
        held = self.accumulators(spec) + self.head_dim_pad(spec) // 4 + sum(d.registers for d in variants.on(spec))
        return held <= MAX_WITH_Q[self.consumers(spec)] - (PAGED_GIVES if spec.paged else 0)

    def registers(self, spec: KernelSpec) -> dict:
        """setmaxnreg's counts: {"producer": ..., "consumer": ...} registers a thread."""
        split = dict(REGISTERS[self.consumers(spec)])
        if spec.paged:  # block_m = 128: two consumers
            split = {"producer": split["producer"] + 2 * PAGED_GIVES, "consumer": split["consumer"] - PAGED_GIVES}
        return split

    def threads(self, spec: KernelSpec) -> int:
        return 128 * (self.consumers(spec) + 1)

    def smem(self, spec: KernelSpec) -> SmemLayout:
        # tiles of [rows][64] elements, 128 bytes a row: Q and K head_dim_pad / 64 of them, V and O d_v_pad / 64
        row_bytes = spec.element.bytes  # (a 128-byte chunk holds 128 // row_bytes elements of a row)
        q_tile, o_tile = self.head_dim_pad(spec) * row_bytes * spec.block_m, self.d_v_pad(spec) * spec.output_element.bytes * spec.block_m
        rest = [
            Region("k", spec.num_stages * self.head_dim_pad(spec) * row_bytes * spec.block_n, align=1024),
            # V's tile: block_n rows of d_v_pad elements (FP8: d_v_pad rows of block_n keys), the same bytes
            Region("v", spec.num_stages * self.d_v_pad(spec) * row_bytes * spec.block_n, align=1024),
            Region("bar", 8 * (2 + 4 * spec.num_stages), align=8),  # mbarriers
        ]
        if spec.persistent:
            # O staged apart from Q, where it fits, so the next tile's Q loads during this one's store
            with_o = SmemLayout([Region("q", q_tile, align=1024), *rest, Region("o", o_tile, align=1024)])
            if with_o.size <= SMEM_LIMIT[spec.arch]:
                return with_o
        return SmemLayout([Region("q", max(q_tile, o_tile), align=1024), *rest])  # O staged over Q

    def params(self, spec: KernelSpec) -> Params:
        # Fixed-length (B, H, T, d) tensors, or packed (total, H, d) ones seen as a batch of one; with
        # `paged`, k and v are (num_pages, page_size, heads_kv, d) caches, seen as (pages, heads_kv,
        # page_size, d), page_rows rows a box.
        kv_view, kv_rows = ("{}.transpose(1, 2)", f"page_rows(k, {spec.block_n})") if spec.paged else ("{}", spec.block_n)
        # FP8: v is V transposed, (B, H_kv, d_v, keys) (varlen: (1, H_kv, d_v, keys), each sequence's
        # keys from a multiple of 16) with each 16 keys in the order P's registers hold them (the
        # fp8_v kernel writes it, Fp8Values): one box of 128 keys by d_v_pad rows a tile
        v_map = f"tensor_map(v, {self.d_v_pad(spec)}, 128)" if spec.element.bytes == 1 else f"tensor_map({kv_view.format('v')}, {kv_rows})"
        maps = [
            tensormap("q_map", f"tensor_map(q, {spec.block_m})"),
            tensormap("k_map", f"tensor_map({kv_view.format('k')}, {kv_rows})"),
            tensormap("v_map", v_map),
            tensormap("o_map", "tensor_map(o, 64)"),
        ]
        # FP8: the descales (fp32 (B, H_kv), contiguous; null: 1), FlashAttention-3's
        descales = [pointer(name, "const float*", optional=True) for name in ("q_descale", "k_descale", "v_descale")] \
            if spec.element.bytes == 1 else []
        if not spec.varlen:
            return Params(self.arguments, [
                *maps, *descales, *forward_outputs_and_sizes(spec),
                *([scalar("num_tiles", "int", self._tiles(spec))] if spec.persistent else []),
            ])
        # partial O tiles leave through plain clipped stores (o_ptr: `o` is the accumulator there)
        clipped = [Param("o_ptr", "out_elem_t* __restrict__", "ptr", "o.data_ptr()", "o"), *strides("o", "o", dims=PACKED)]
        # sequence b's key position pos is row pos % page_size of page block_table[b][pos / page_size]
        # and past the pages, the new keys of an append that had no place in them: k_new, v_new
        # (batch, seqlen_new, heads_kv, d), or none (seqlen_new 0: the caches stand in for the maps)
        pages = [
            pointer("block_table", "const int*"), scalar("table_stride", "i64", "block_table.stride(0)"),
            scalar("max_blocks", "int", "block_table.shape[1]"), scalar("num_pages", "int", "k.shape[0]"),
            scalar("page_size", "int", "k.shape[1]"),
            scalar("page_rows", "int", f"page_rows(k, {spec.block_n})"),
            tensormap("k_new_map", f"tensor_map((k if k_new is None else k_new).transpose(1, 2), page_rows(k, {spec.block_n}))"),
            tensormap("v_new_map", f"tensor_map((v if v_new is None else v_new).transpose(1, 2), page_rows(k, {spec.block_n}))"),
            scalar("seqlen_new", "int"),
            # the gathers' addresses: the caches (num_pages, page_size, heads_kv, d) and the new keys
            # (batch, seqlen_new, heads_kv, d; the caches stand in without an append)
            scalar("page_gather", "int", f"page_gather(k, {spec.block_n})"),
            *tensor("k_cache", value="k", dims=("page", "row", "head")),
            *tensor("v_cache", value="v", dims=("page", "row", "head")),
            *tensor("k_new", value="(k if k_new is None else k_new)", dims=("batch", "row", "head")),
            *tensor("v_new", value="(v if v_new is None else v_new)", dims=("batch", "row", "head")),
        ] if spec.paged else []
        return Params(self.arguments, [*maps, *descales, *clipped, *pages, *forward_outputs_and_sizes(spec)])

    def helpers(self, spec: KernelSpec) -> dict:
        return {**super().helpers(spec), **tensor_map_helper(), "sm_count": _sm_count, "page_rows": page_rows,
                "page_gather": page_gather}

    @staticmethod
    def _tiles(spec: KernelSpec) -> str:
        return f"-(-q.shape[2] // {spec.block_m}) * q.shape[1] * q.shape[0]"

    def grid(self, spec: KernelSpec) -> str:
        if spec.varlen:  # tiles of the longest sequence, heads, sequences
            return f"(-(-max_seqlen_q // {spec.block_m}), q.shape[1], cu_seqlens_q.shape[0] - 1)"
        if spec.persistent:  # one block per SM (fewer if there are fewer tiles), each walking tiles
            return f"(min({self._tiles(spec)}, sm_count(q)), 1, 1)"
        return f"(-(-q.shape[2] // {spec.block_m}), q.shape[1], q.shape[0])"

    def context(self, spec: KernelSpec) -> dict:
        registers = self.registers(spec)
        context = {**super().context(spec), "wgmma": True, "q_in_regs": self.q_in_registers(spec),
                   "producer_regs": registers["producer"], "consumer_regs": registers["consumer"],
                   "head_dim_pad": self.head_dim_pad(spec), "d_v_pad": self.d_v_pad(spec),
                   "chunk_cols": spec.element.chunk_cols, "mma_k": spec.element.mma_k}
        if spec.mask_mod:
            context.update(block_mask_lists(key_major=False))
        return context


class Fp8Values(Family):
    """fp8_v: the FP8 forward's V as its kernel reads it, from V in attention's (or
    attention_varlen's packed) layout: (B, H_kv, d_v, keys_pad) e4m3, keys contiguous (wgmma takes
    8-bit operands K-major only), keys_pad = keys in whole 16s, each 16 keys in
    flashgen.ops.FP8_KEY_ORDER (the order a thread's registers hold P in), zeros past the keys.
    Varlen: (1, H_kv, d_v, width), sequence b's keys from position 16 (ceil(cu_seqlens_k[b] / 16) + b)
    and zeros up to the next sequence's (flashgen.reference.fp8_values_varlen says the layout in
    PyTorch). One block per 64 positions of a (batch, KV head) row (varlen: of the packed width,
    each 16 found in its sequence by a binary search over cu_seqlens_k): its threads load the 64
    keys' rows with 16-byte loads into shared memory, then each writes 32 positions of one output
    row (two 16-byte stores). Every position of the output is written."""

    kinds = ("fp8_v",)
    template = "fp8_values.cu.j2"
    fields = ("head_dim", "arch", "varlen")  # (it moves bytes: no element type)
    arguments = ("v_keys", "v", "cu_seqlens_k")  # V as given (keys-major), V as the FP8 forward reads it
    POSITIONS = 64  # output positions (keys) a block writes per row

    def check(self, spec: KernelSpec) -> None:
        if spec.head_dim % 16:
            raise SpecError(f"head_dim={spec.head_dim}: an fp8_v kernel moves V's rows in 16-byte pieces (a multiple of 16)")

    def threads(self, spec: KernelSpec) -> int:
        return 256

    def smem(self, spec: KernelSpec) -> SmemLayout:
        return SmemLayout([Region("tile", self.POSITIONS * (spec.head_dim + 16), align=16)])

    def params(self, spec: KernelSpec) -> Params:
        # src: v_keys (B, H_kv, keys, d_v) or packed (total_k, H_kv, d_v); dst: v, contiguous
        dst = [Param("dst", "unsigned char* __restrict__", "ptr", "v.data_ptr()"), scalar("width", "int", "v.shape[-1]")]
        if spec.varlen:
            return Params(self.arguments, [
                *tensor("src", elem="unsigned char", dims=PACKED, value="v_keys"), *dst,
                pointer("cu_seqlens_k", "const int*"),
                scalar("sequences", "int", "cu_seqlens_k.shape[0] - 1"),
                scalar("total_k", "int", "v_keys.shape[0]"),
            ])
        return Params(self.arguments, [
            *tensor("src", elem="unsigned char", value="v_keys"), *dst,
            scalar("keys", "int", "v_keys.shape[2]"),
        ])

    def grid(self, spec: KernelSpec) -> str:  # (varlen: every position of the packed width; a block finds its sequences)
        return f"(-(-v.shape[-1] // {self.POSITIONS}), v_keys.shape[1], {'1' if spec.varlen else 'v_keys.shape[0]'})"

    def context(self, spec: KernelSpec) -> dict:
        from ..ops import FP8_KEY_ORDER

        return {**super().context(spec), "positions": self.POSITIONS, "key_order": FP8_KEY_ORDER}
