"""The sm_90a backward (FlashAttention-3's design): one CTA owns BLOCK_N keys of a key/value head
and walks the query tiles of every query head that shares it. A producer warp loads K and V once
and streams Q, dO and their (lse, delta) rows through an mbarrier pipeline with the tensor memory
accelerator; two consumer warpgroups run all five products on warpgroup MMA: S^T = K Q^T and
dP^T = V dO^T from shared memory, dV += P^T dO and dK += dS^T Q with P^T and dS^T straight from
registers, and dQ = dS K from dS^T tiles in shared memory. The warpgroups add dQ in 64 x 64 pieces
into a row-major fp32 buffer with TMA reductions (cp.reduce.async.bulk.tensor, over a tensor map
of the buffer), so reading the sum back into dq is one contiguous copy. dK and dV leave through
shared memory with TMA stores.

Three ways to split the work between the consumer warpgroups, chosen by block_n:

- block_n=128 (head dims up to 128): each warpgroup owns 64 of the keys and runs the score, dV and
  dK products for them, holding dV and dK (head_dim_pad / 2 fp32 each per thread) and S^T, dP^T.
  dQ is summed over all 128 keys before it leaves: both warpgroups write dS^T to shared memory, meet
  at a named barrier, and each computes one 64 x 64 piece of the step's dQ tile from both dS^T
  tiles and the whole K tile. Summing per warpgroup instead (64 keys) moved twice the bytes through
  L2's reductions: 88 % of L2's throughput at d = 128 under ncu against 50 %, 3-12 % slower
  (BENCHMARKS.md). With one piece a step (block_m=64 at head dims up to 64: softcap and user rules)
  each warpgroup does add its own 64 keys' share: taking turns on the piece put the products on a
  path that depends on the warpgroup, which ptxas serializes (7-13 % slower rule backwards).
- block_n=64 (any head dim up to 256; what the tables pick above 128): the two warpgroups share the
  block's 64 keys and split the products by gradient. The first computes S^T, P^T and dV += P^T dO;
  the second dP^T, dS^T = P^T (dP^T - delta) and dK += dS^T Q. So each thread holds one gradient,
  64 x head_dim_pad (head_dim_pad / 2 fp32: 128 at d = 256), and one 64 x BLOCK_M score tile
  (32 at BLOCK_M = 64), where holding both gradients would take head_dim_pad, all of the 240
  registers setmaxnreg gives at d = 256. P^T passes from the first warpgroup to the second through
  shared memory in fp32, in the accumulator's fragment order (thread t reads back exactly what
  thread t of the other warpgroup wrote, so dS comes from the same fp32 P as with block_n=128),
  with mbarriers as the handshake (P_FULL / P_EMPTY; named barriers DS_FULL / DS_FREE for the dS^T
  tile the second warpgroup writes for dQ, which the first reads only through wgmma). The dQ pieces
  (64 queries x 64 columns) alternate between the warpgroups; each stages one piece at a time
  (16 KB) for its TMA reductions.
  Why this split: the register file bounds the keys per block, since dK and dV of BLOCK_N keys take
  2 * BLOCK_N * head_dim fp32 registers in the CTA (32 K of the 64 K at d = 256, BLOCK_N = 64);
  FlashAttention-3 too runs 64 x 80 at d = 256 and 64 x 96 with three warpgroups at d = 192. It
  splits head-dim columns instead (each warpgroup holds half of both dK^T and dV^T), which needs P
  and dS in shared memory as operands of both warpgroups; splitting by gradient keeps P^T and dS^T
  register operands of their products (as with block_n=128) and the score products at N = BLOCK_M,
  and only P^T crosses between the warpgroups.
  The shared-memory bound (227 KB): K and V (64 x head_dim_pad each), num_stages Q tiles and as
  many dO tiles as still fit (at most num_stages: one at d = 256, where FlashAttention-3 too keeps
  one dO stage), P^T (64 x BLOCK_M fp32), and for dQ the dS^T tile and the two 16 KB pieces. At
  d = 256, BLOCK_M = 64, num_stages = 2: 64 + 64 + 32 + 16 + 8 + 32 KB = 216 KB, 218 KB with the
  statistics, barriers and alignment; at d = 192: 48 + 48 + 48 + 16 + 8 + 32 = 200 KB (two dO stages).
- block_n=96 (head dims of three chunks, 129 to 192, with d_v up to 192: the `trio` layout;
  what the tables pick at d = 192): three consumer warpgroups share the block's 96 keys and split
  the head-dim columns, as FlashAttention-3 does at d = 192. Warpgroup w computes S and dP (rows
  are queries, not keys) for its 32 keys, P and dS from them, and writes both rounded into shared
  [96 keys][64 queries] tiles with transposing matrix stores. It runs dV^T += dO^T P for its own 32
  keys (every column of d_v: no warpgroup idles where d_v has fewer chunks than q) as soon as its P
  is written, and once all three have written dS (a named barrier), dK^T += Q^T dS for its 64
  head-dim columns over all 96 keys and dQ = dS K for the same 64 columns: one 64 x 64 piece a
  step, summed over 96 keys before its TMA reduction. Why: at 64 keys a block the dQ
  reductions and the Q/dO loads move 88 KB through L2 per 64 x 64 step at d = 192 / d_v = 128, about
  3.8 TB/s at the split layout's 295 TFLOPS (causal 8k, H100), and would need about 6 TB/s at
  cuDNN's 480; 96 keys cut that per flop by a third. Each thread holds 64 x 96 of dK^T (48 fp32),
  d_v x 32 of dV^T (32 at d_v = 128), its 64 x 32 S and dP tiles (16 each) and, transiently, its
  dQ piece (32): within the 160 registers setmaxnreg gives each of three consumers beside a
  24-register producer. Shared memory at d = 192 / d_v = 128: K 36 KB, V 24, two Q and two dO
  stages 80, P and dS 24, three dQ pieces 48: 214 KB. No score piece or mask rule yet (the split
  layout takes those).

V's head dim of its own (head_dim_v, spec.d_v; DeepSeek's 192 / 128): q, k, dq, dk have head_dim,
v, dO, dv have d_v. V and dO tiles are d_v_pad / 64 chunks (dV is staged in V's), dP^T = V dO^T
runs its k-steps over d_v_pad and dV += P^T dO has N = d_v_pad, while S^T, dK (N = head_dim_pad)
and dQ (its pieces and fp32 sum) keep head_dim. A consumer thread of the block_n=128 layout holds
head_dim_pad / 2 + d_v_pad / 2 fp32 of dK and dV (both pads at most 128); in the split layout the
wider of the two gradients bounds the registers, and each warpgroup runs its own instance of the
consumer code, the two sides' products differing in size.

Kinds: bwd_sm90_kvq writes dK, dV and dQ; bwd_sm90_kv writes dK and dV (deterministic mode: dQ
then comes from the query-major bwd_q pass, in a fixed order).

Varlen (attention_varlen's packed sequences): the tensor maps see the packed tensors as a batch of
one and each sequence's rows at its offset (block_info). A tile past a sequence's end loads the
next sequence's rows: its queries add nothing (their lse is +inf from the prep, so P = 0), its keys
are masked like the causal diagonal, and its dK and dV rows leave as plain stores of the rows
inside the sequence. dQ sums into the statistics' padded rows ([heads, padded_q], every sequence
on whole tiles: (1, heads, padded_q, head_dim_pad)), which bwd_dq_sm90 reads back into the packed dq.
"""

from __future__ import annotations

from .. import variants
from ..params import Params, pointer, scalar, strides, tensor, tensormap
from ..smem import Region, SmemLayout
from ..spec import SMEM_LIMIT, KernelSpec, SpecError
from .backward import STATS_PAD, padded_varlen
from .base import Family, block_mask_lists, check_backward_rule, check_rules_fixed_length
from .forward import PACKED, sequences
from .hopper import HOPPER_NEEDS, tensor_map_helper

# dQ tiles leave a warpgroup in pieces of 64 query rows x 64 head-dim columns, each staged as two
# TMA boxes of 64 rows x 32 fp32 (128 bytes, the widest a 128-byte swizzle takes) and added into
# the row-major fp32 sum by two TMA reductions.
PIECE = 64
DQ_BOX_COLUMNS = 32
TRIO_KEYS = 96  # block_n of the three-consumer layout (`trio`)
MAX_DQ_PIECES = 2  # block_n=128: a step's dQ tile, one piece per consumer warpgroup (or one piece, shared by keys)
# What a score with a derivative (softcap, a score rule) or a mask rule takes beside the
# accumulators in the block_n=128 layout: past 192 accumulators its kernels spilled (CPU compile
# sweep, tests/test_variants.py). ALiBi alone (derivative 1, its distances in float) fits the plain tiles.
SCORE_REGISTERS = 16


def _pointwise_grad(spec: KernelSpec) -> bool:
    """A score variant that is a function of the score alone, with a derivative (softcap's tanh)."""
    return any(d.score == "pointwise" and d.grad for d in variants.on(spec))


def capped_first(spec: KernelSpec) -> bool:
    """A pointwise score variant with a derivative (softcap) as the only score piece in the
    block_n=128 layout: while dP^T is computed, tanh and the exponentials turn S^T into P^T (1 - u^2)
    (u the capped value; its derivative folded in) and P^T leaves at once as dV's 16-bit operand,
    8 registers per 16 queries; once dP^T has landed, dS^T = S^T (dP^T - delta) as without a cap.
    No fp32 tile beside the accumulators is held."""
    scores = [d for d in variants.on(spec) if d.score]
    return len(scores) == 1 and scores[0].score == "pointwise" and scores[0].grad and spec.block_n == 128


class HopperBackward(Family):
    kinds = ("bwd_sm90_kvq", "bwd_sm90_kv")
    needs = HOPPER_NEEDS
    template = "attention_bwd_sm90.cu.j2"
    # Variants: sliding windows (the mask alone) in both layouts; softcap, ALiBi and score rules in the
    # split one (block_n=64), where the warpgroup that computes P^T applies the score piece and hands
    # P^T d(logit)/d(s) to the one that computes dS^T, and in the block_n=128 one: ALiBi and softcap
    # alone on any of its tiles (softcap's tanh in place under dP^T: capped_first), softcap with
    # other score pieces and score rules where the registers leave room (SCORE_REGISTERS: head dims
    # up to 64 with block_m=64), computing P^T and dS^T in one pass after both score products. Mask
    # rules in both: each key tile walks the query tiles its block mask lists (per key tile), testing
    # the rule per element in partial ones.
    fields = ("head_dim", "head_dim_v", "block_m", "block_n", "dtype", "causal", "num_stages", "arch", "varlen", *variants.EVERYWHERE,
              "score_mod", "mask_mod")
    arguments = ("q", "k", "v", "d_o", "lse_log2", "delta", "dk", "dv", "dq_accum", "scale", "cu_seqlens_q", "cu_seqlens_k",
                 "max_seqlen_k", *variants.ARGUMENTS)
    tune_space = {"block_m": (64, 128), "block_n": (64, 96, 128), "num_stages": (2, 3)}

    @staticmethod
    def head_dim_pad(spec: KernelSpec) -> int:
        """Whole 64-column (128-byte) chunks: one TMA box and one swizzle row each."""
        return -(-spec.head_dim // 64) * 64

    @staticmethod
    def d_v_pad(spec: KernelSpec) -> int:
        """V's head dim (dO's and dV's: spec.d_v) in whole 64-column chunks, as head_dim_pad is q's."""
        return -(-spec.d_v // 64) * 64

    @staticmethod
    def has_dq(spec: KernelSpec) -> bool:
        return spec.kind == "bwd_sm90_kvq"

    @staticmethod
    def split(spec: KernelSpec) -> bool:
        """block_n=64: the consumer warpgroups share the block's keys, one computing dV, one dK."""
        return spec.block_n == 64

    @staticmethod
    def trio(spec: KernelSpec) -> bool:
        """block_n=96: three consumer warpgroups share the block's keys, each taking 64 head-dim columns."""
        return spec.block_n == TRIO_KEYS

    @classmethod
    def consumers(cls, spec: KernelSpec) -> int:
        return 3 if cls.trio(spec) else 2

    def check(self, spec: KernelSpec) -> None:
        if spec.block_n not in (64, TRIO_KEYS, 128):
            raise SpecError(
                f"block_n={spec.block_n}: must be 128 (two consumer warpgroups of 64 keys), 64 (two consumer "
                f"warpgroups sharing 64 keys, one computing dV and the other dK) or 96 (three consumer warpgroups "
                f"sharing 96 keys, each computing 64 head-dim columns; head dims 129 to 192)"
            )
        if spec.block_m not in (64, 128) or STATS_PAD % spec.block_m:
            raise SpecError(f"block_m={spec.block_m}: must be 64 or 128 (query rows per step, whole dQ pieces)")
        if spec.num_stages not in (2, 3):
            raise SpecError(f"num_stages={spec.num_stages}: must be 2 or 3 (Q and dO tiles in flight)")
        check_backward_rule(spec)
        check_rules_fixed_length(spec)
        pad, v_pad = self.head_dim_pad(spec), self.d_v_pad(spec)  # Q, K, dK, dQ; V, dO, dV
        dims = f"head_dim={spec.head_dim}" + (f", head_dim_v={spec.head_dim_v}" if spec.head_dim_v else "")
        if self.trio(spec):
            self._check_trio(spec, pad, v_pad, dims)
        else:
            self._check_registers(spec, pad, v_pad, dims)
        # (validate says it for the others, in head_dim's words)
        if spec.head_dim_v and (size := self.smem(spec).size) > (limit := SMEM_LIMIT[spec.arch]):
            raise SpecError(
                f"block_m={spec.block_m}, block_n={spec.block_n}, num_stages={spec.num_stages}, {dims}: needs {size} "
                f"bytes of shared memory (K and Q tiles of {pad} columns, V and dO tiles of {v_pad}), more than the "
                f"{limit} a block may use on {spec.arch}"
            )

    def _check_registers(self, spec: KernelSpec, pad: int, v_pad: int, dims: str) -> None:
        """What the two-consumer layouts' accumulators (and a score piece's registers) leave room for."""
        if self.split(spec):
            # fp32 registers a consumer thread holds at once: its gradient (dV, v_pad / 2, or dK, pad / 2)
            # and its score tile (S^T or dP^T, block_m / 2). Both warpgroups get 240 registers: the
            # wider gradient bounds them.
            held, holds = max(pad, v_pad) // 2 + spec.block_m // 2, "dV or dK, and S^T or dP^T"
        else:
            if max(pad, v_pad) > 128:
                raise SpecError(
                    f"{dims}: a {spec.kind} kernel with block_n=128 takes head dims up to 128 "
                    f"(each consumer thread would hold dV and dK, {(pad + v_pad) // 2} fp32); block_n=64 takes up to 256"
                )
            # dV (v_pad / 2) and dK (pad / 2), S^T and dP^T (block_m / 2 each).
            held, holds = (pad + v_pad) // 2 + spec.block_m, "dV, dK, S^T, dP^T"
        # softcap's tanh over 128 queries a step (64 scores a thread) spilled at d = 64 (a mask rule's
        # test, branch-free since its `mask | rule`, fits: CPU compile sweep, tests/test_variants.py)
        wide_scores = _pointwise_grad(spec) and spec.block_m == 128
        # softcap's P^T operand held across the dP^T wait, beside a window's or varlen's per-element
        # tests: 8-32 bytes spilled at d = 96 and 128 (CPU compile sweep)
        masked_cap = capped_first(spec) and (any(d.mask and not d.rule for d in variants.on(spec)) or spec.varlen)
        score_tile = (_pointwise_grad(spec) and not capped_first(spec)) or spec.score_mod or masked_cap
        if (score_tile or wide_scores) and not self.split(spec) and held + SCORE_REGISTERS > 192:
            raise SpecError(
                f"block_m={spec.block_m}, {dims}: with a score_mod, softcap beside ALiBi, a window or varlen, or "
                f"(at block_m=128) softcap a block_n=128 "
                f"consumer thread needs {SCORE_REGISTERS} registers more than its {held} fp32 accumulators ({holds}), past "
                f"the 192 that fit; use block_m=64 (at head_dim <= 64) or block_n=64 (the split layout)"
            )
        if held > 192:
            raise SpecError(
                f"block_m={spec.block_m}, {dims}: a consumer thread would hold {held} fp32 "
                f"accumulators ({holds}); at most 192 fit in its 240 registers (use block_m=64)"
            )
        if self.has_dq(spec) and not self.split(spec) and spec.block_m * pad > MAX_DQ_PIECES * PIECE * PIECE:
            raise SpecError(
                f"block_m={spec.block_m}, head_dim={spec.head_dim}: the dQ tile of a step ({spec.block_m} x {pad}) "
                f"must be at most {MAX_DQ_PIECES} pieces of {PIECE} x {PIECE}, one per consumer warpgroup (use block_m=64)"
            )

    def _check_trio(self, spec: KernelSpec, pad: int, v_pad: int, dims: str) -> None:
        """The trio layout: q's head dim in three chunks (one a consumer), d_v in at most three, 64
        query rows a step, no score piece or mask rule."""
        if pad != 3 * PIECE or v_pad > 3 * PIECE:
            raise SpecError(f"block_n=96, {dims}: the three consumer warpgroups take one 64-column chunk of q's head "
                            f"dim each, so it must be 129 to 192 (and head_dim_v at most 192); use block_n=64")
        if spec.block_m != 64:
            raise SpecError(f"block_m={spec.block_m}: block_n=96 runs 64 query rows a step (use block_m=64)")
        if spec.score_mod or spec.mask_mod or any(d.score for d in variants.on(spec)):
            raise SpecError("block_n=96 takes no score piece (softcap, ALiBi, a score rule) and no mask rule yet; "
                            "use block_n=64, whose layout runs them")

    def threads(self, spec: KernelSpec) -> int:
        return 128 * (self.consumers(spec) + 1)

    def do_stages(self, spec: KernelSpec) -> int:
        """dO tiles in flight: num_stages, or with block_n=64 or 96 as many as fit next to num_stages Q
        tiles (one at head_dim 256: two would need 250 KB)."""
        if not (self.split(spec) or self.trio(spec)):
            return spec.num_stages
        limit = SMEM_LIMIT[spec.arch]
        return next((n for n in range(spec.num_stages, 1, -1) if self._layout(spec, n).size <= limit), 1)

    def smem(self, spec: KernelSpec) -> SmemLayout:
        return self._layout(spec, self.do_stages(spec))

    def _layout(self, spec: KernelSpec, do_stages: int) -> SmemLayout:
        chunks, v_chunks = self.head_dim_pad(spec) // 64, self.d_v_pad(spec) // 64  # Q and K's; V and dO's
        q_tile = chunks * spec.block_m * 128  # Q (dO: v_chunks): [chunk][BLOCK_M rows][64 columns], swizzled
        do_tile = v_chunks * spec.block_m * 128
        k_tile = chunks * spec.block_n * 128  # K (V: v_chunks); dK and dV are staged in them at the end
        v_tile = v_chunks * spec.block_n * 128
        stats = spec.block_m * 4
        regions = [
            Region("k", k_tile, align=1024), Region("v", v_tile, align=1024),
            Region("q", spec.num_stages * q_tile, align=1024), Region("do", do_stages * do_tile, align=1024),
            Region("lse", spec.num_stages * stats), Region("delta", do_stages * stats),
        ]
        if self.trio(spec):
            regions += [
                Region("p", spec.block_n * spec.block_m * 2, align=1024),  # P, rounded: [96 keys][64 queries]
                Region("ds", spec.block_n * spec.block_m * 2, align=1024),  # dS, the same
            ]
            if self.has_dq(spec):
                regions.append(Region("dq", self.consumers(spec) * PIECE * PIECE * 4, align=1024))  # one fp32 dQ piece each
            regions.append(Region("bar", 8 * (1 + 2 * spec.num_stages + 2 * do_stages), align=8))
            return SmemLayout(regions)
        if self.split(spec):
            regions.append(Region("p", 64 * spec.block_m * 4))  # P^T in fp32, from one warpgroup to the other
            if self.has_dq(spec):
                regions += [
                    Region("ds", 64 * spec.block_m * 2, align=1024),  # dS^T, [64 keys][BLOCK_M]
                    Region("dq", self.consumers(spec) * PIECE * PIECE * 4, align=1024),  # one fp32 dQ piece each
                ]
            regions.append(Region("bar", 8 * (3 + 2 * spec.num_stages + 2 * do_stages), align=8))  # and P^T's two
            return SmemLayout(regions)
        barriers = 1 + 4 * spec.num_stages
        if self.has_dq(spec):
            consumers = self.consumers(spec)
            regions += [
                Region("ds", consumers * 64 * spec.block_m * 2, align=1024),  # each warpgroup's dS^T, [64 keys][BLOCK_M]
                Region("dq", consumers * 2 * PIECE * PIECE * 4, align=1024),  # two fp32 dQ pieces of staging each
            ]
            barriers += 2  # each dS^T tile read by the other warpgroup's dQ product
        regions.append(Region("bar", 8 * barriers, align=8))
        return SmemLayout(regions)

    def params(self, spec: KernelSpec) -> Params:
        maps = [
            tensormap("q_map", f"tensor_map(q, {spec.block_m})"),
            tensormap("k_map", f"tensor_map(k, {spec.block_n})"),
            tensormap("v_map", f"tensor_map(v, {spec.block_n})"),
            tensormap("do_map", f"tensor_map(d_o, {spec.block_m})"),
            tensormap("dk_map", f"tensor_map(dk, {self.out_rows(spec)})"),
            tensormap("dv_map", f"tensor_map(dv, {self.out_rows(spec)})"),
        ]
        if self.has_dq(spec):  # the fp32 dQ sum (dq_accum_shape(); zeroed by the prep), added into through TMA reductions
            maps.append(tensormap("dq_map", f"tensor_map(dq_accum, {PIECE}, {DQ_BOX_COLUMNS})"))
        common = [
            scalar("kv_group", "int", "q.shape[1] // k.shape[1]"),
            scalar("scale", "float"),
            scalar("scale_log2", "float", variants.scale_log2(spec)),
            *variants.params(spec, (spec.block_m, spec.block_n, True)),  # a mask rule's lists: per key tile
        ]
        if spec.varlen:  # packed tensors; a sequence's last dK and dV rows may leave as plain stores
            # dK and dV share their strides (dkv_row, dkv_head) unless V's head dim is its own
            # (dk_row, dk_head and dv_row, dv_head then)
            dkv = [*strides("dk", "dk", dims=PACKED), *strides("dv", "dv", dims=PACKED)] if spec.head_dim_v else \
                strides("dkv", "dk", dims=PACKED)
            return Params(self.arguments, [
                *maps,
                pointer("dk", "elem_t*"), pointer("dv", "elem_t*"), *dkv,
                pointer("lse_log2", "const float*"), pointer("delta", "const float*"),  # [heads, padded_q]
                *sequences(),
                scalar("padded_q", "int", "delta.shape[1]"),
                *common,
            ])
        return Params(self.arguments, [
            *maps,
            pointer("lse_log2", "const float*"), pointer("delta", "const float*"),  # [batch, heads, padded_q]
            scalar("seqlen_q", "int", "q.shape[2]"),
            scalar("seqlen_k", "int", "k.shape[2]"),
            scalar("padded_q", "int", "delta.shape[2]"),
            *common,
        ])

    def out_rows(self, spec: KernelSpec) -> int:
        """Key rows of a dK or dV box: a warpgroup's 64 keys, or with block_n=96 the block's 96
        (warpgroup 0 stores dK's chunks, warpgroup 1 dV's)."""
        return spec.block_n if self.trio(spec) else 64

    def helpers(self, spec: KernelSpec) -> dict:
        return {**super().helpers(spec), **tensor_map_helper()}

    def grid(self, spec: KernelSpec) -> str:
        if spec.varlen:  # key tiles of the longest sequence, key/value heads, sequences
            return f"(-(-max_seqlen_k // {spec.block_n}), k.shape[1], cu_seqlens_k.shape[0] - 1)"
        return f"(-(-k.shape[2] // {spec.block_n}), k.shape[1], k.shape[0])"

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "wgmma": True, "has_dq": self.has_dq(spec), "stats_pad": STATS_PAD,
                "head_dim_pad": self.head_dim_pad(spec), "d_v_pad": self.d_v_pad(spec),
                "split": self.split(spec), "trio": self.trio(spec), "do_stages": self.do_stages(spec),
                "capped_first": capped_first(spec),
                # finish_before_wait after P^T: with a mask rule's per-element test ahead of the dP^T
                # wait too, bwd_sm90_kv spilled at d = 96 and 128 (CPU compile sweep; head_dim 64 or 32
                # beside head_dim_v 128 fits)
                "p_under_dp": not spec.mask_mod or self.head_dim_pad(spec) <= 64,
                **(block_mask_lists(key_major=True) if spec.mask_mod else {})}

    # ---- the dQ accumulator --------------------------------------------------------------------

    def dq_accum_shape(self, spec: KernelSpec, values: dict) -> tuple:
        """(batch, heads, rows, head_dim_pad), rows = seqlen_q in whole query tiles: a row-major fp32
        sum that whole 64 x 64 pieces are added into. Varlen: (1, heads, padded_q, head_dim_pad),
        the statistics' padded rows (each sequence at block_info's stats_rows)."""
        pad = self.head_dim_pad(spec)
        if spec.varlen:
            total_q, heads, _ = values["q"].shape
            return 1, heads, padded_varlen(total_q, values["cu_seqlens_q"].shape[0] - 1), pad
        batch, heads, seqlen_q, _ = values["q"].shape
        return batch, heads, -(-seqlen_q // spec.block_m) * spec.block_m, pad

    def dq_reader(self, spec: KernelSpec) -> KernelSpec | None:
        """Varlen: bwd_dq_sm90, since a sequence's rows sit at an offset of their own in the padded
        rows, which no view expresses; fixed length: None (dq_from_accum, one copy)."""
        if spec.varlen:
            return KernelSpec(kind="bwd_dq_sm90", head_dim=spec.head_dim, dtype=spec.dtype, arch=spec.arch, varlen=True)
        return None

    def dq_from_accum(self, spec: KernelSpec, accum, dq) -> None:
        """dq = the sum's rows and columns that are dq's, converted to its dtype."""
        dq.copy_(accum[:, :, : dq.shape[2], : dq.shape[3]])


class HopperDqReader(Family):
    """bwd_dq_sm90: the varlen Hopper backward's dQ sum ((1, heads, padded_q, head_dim_pad) fp32,
    row-major) read back into the packed dq ([total_q, heads, head_dim]) in its dtype. One block per
    64 rows of a sequence and query head; a thread reads 8 consecutive floats of a row (32 bytes)
    and writes them as one 16-byte store."""

    kinds = ("bwd_dq_sm90",)
    template = "attention_bwd_dq_sm90.cu.j2"
    fields = ("head_dim", "dtype", "arch", "varlen")
    arguments = ("dq_accum", "dq", "cu_seqlens_q", "max_seqlen_q")

    def check(self, spec: KernelSpec) -> None:
        if not spec.varlen:
            raise SpecError("varlen=False: a bwd_dq_sm90 kernel reads back the varlen layout only "
                            "(fixed-length sums are read back on the host, HopperBackward.dq_from_accum)")

    def threads(self, spec: KernelSpec) -> int:
        return 256

    def params(self, spec: KernelSpec) -> Params:
        return Params(self.arguments, [
            pointer("dq_accum", "const float*"),
            *tensor("dq", const=False, dims=PACKED),
            pointer("cu_seqlens_q", "const int*"),
            scalar("total_q", "int", "dq.shape[0]"),
            scalar("padded_q", "int", "dq_accum.shape[2]"),
        ])

    def grid(self, spec: KernelSpec) -> str:  # 64-row pieces of the longest sequence, heads, sequences
        return "(-(-max_seqlen_q // 64), dq.shape[1], cu_seqlens_q.shape[0] - 1)"

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "stats_pad": STATS_PAD, "keys": False,
                "head_dim_pad": HopperBackward.head_dim_pad(spec)}
