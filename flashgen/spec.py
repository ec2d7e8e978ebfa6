"""The DSL: a KernelSpec names every choice that changes the generated code.

A spec validates itself when it is built, so a spec that exists is one the templates can render and
the kernel can run. Its `name` is readable and unique (every field appears in it); `canonical()` is
the stable serialization that the cache key hashes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

# fwd: O and the log-sum-exp. Backward kernels are named by the gradients they write: key-major
# kernels (one block per key tile) write dK and/or dV in registers and, with a "q", add dQ with
# atomics; bwd_q is query-major (one block per query tile) and writes dQ deterministically.
KINDS = ("fwd", "bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v", "bwd_q")
KEY_MAJOR = ("bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v")
# Backward kernels read the log-sum-exp and delta from buffers padded to whole tiles of this size.
STATS_PAD = 128
DTYPES = ("fp16", "bf16")
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (2, 3)
# Largest dynamic shared memory one block may opt in to, per target (CUDA programming guide).
SMEM_LIMIT = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_87": 163 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_90a": 227 * 1024,
}
ARCHS = tuple(SMEM_LIMIT)
# fp32 accumulators (S tile + O tile) one thread may hold and still fit in 255 registers with room
# for addresses and fragments; past this the compiler spills.
MAX_ACCUMULATORS = 192


class SpecError(ValueError):
    """A KernelSpec field holds a value the generator cannot build or the kernel cannot run."""


def arch_for_capability(major: int, minor: int) -> str:
    """The target flashgen compiles for on a GPU of this compute capability."""
    arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    if arch not in SMEM_LIMIT:
        raise SpecError(
            f"compute capability {major}.{minor} is not supported: flashgen targets "
            f"{', '.join(ARCHS)} (tensor-core mma.sync needs sm_80 or newer)"
        )
    return arch


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of an attention kernel.

    head_dim:   d of q, k and v; a multiple of 8 from 8 to 256 (padded to 16 inside the kernel).
    block_m:    query rows per block (fwd, bwd_q) or per step (key-major backward); a multiple of 16.
    block_n:    key rows per step (fwd, bwd_q) or per block (key-major backward); a multiple of 16.
                Each warp owns block_m / num_warps query rows (fwd, bwd_q) or block_n / num_warps
                key rows (key-major backward): 16 or 32.
    dtype:      "fp16" or "bf16" for q, k, v and o; accumulation is always fp32.
    causal:     bottom-right aligned causal mask (query i sees keys j <= i + Tk - Tq).
    num_warps:  warps per block.
    num_stages: tiles in flight in shared memory (2 or 3).
    arch:       compile target, e.g. "sm_90a" (H100/H200) or "sm_80" (A100).
    kind:       which kernel: "fwd", or a backward kernel (see KINDS).
    """

    head_dim: int
    block_m: int = 128
    block_n: int = 64
    dtype: str = "bf16"
    causal: bool = False
    num_warps: int = 4
    num_stages: int = 2
    arch: str = "sm_90a"
    kind: str = "fwd"

    def __post_init__(self):
        _check_int("head_dim", self.head_dim)
        if self.head_dim % 8 or not 8 <= self.head_dim <= 256:
            raise SpecError(f"head_dim={self.head_dim}: must be a multiple of 8 in [8, 256]")
        if self.kind not in KINDS:
            raise SpecError(f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if not isinstance(self.causal, bool):
            raise SpecError(f"causal={self.causal!r}: must be True or False")
        if self.arch not in SMEM_LIMIT:
            raise SpecError(f"arch={self.arch!r}: must be one of {', '.join(ARCHS)}")
        _check_int("num_warps", self.num_warps)
        if self.num_warps not in NUM_WARPS:
            raise SpecError(f"num_warps={self.num_warps}: must be one of {NUM_WARPS}")
        _check_int("num_stages", self.num_stages)
        if self.num_stages not in NUM_STAGES:
            raise SpecError(f"num_stages={self.num_stages}: must be one of {NUM_STAGES}")
        _check_int("block_m", self.block_m)
        _check_int("block_n", self.block_n)
        if self.block_m % 16 or not 16 <= self.block_m <= 256:
            raise SpecError(f"block_m={self.block_m}: must be a multiple of 16 in [16, 256]")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise SpecError(f"block_n={self.block_n}: must be a multiple of 16 in [16, 256]")
        owned = "block_n" if self.key_major else "block_m"
        if getattr(self, owned) % self.num_warps or self.rows_per_warp not in (16, 32):
            raise SpecError(
                f"{owned}={getattr(self, owned)} with num_warps={self.num_warps}: in a {self.kind} "
                f"kernel each warp owns {owned} / num_warps rows, which must be 16 or 32 "
                f"({owned} in {{{16 * self.num_warps}, {32 * self.num_warps}}})"
            )
        if self.kind != "fwd" and STATS_PAD % self.block_m:
            raise SpecError(f"block_m={self.block_m}: a backward kernel needs a divisor of {STATS_PAD}")
        if self.accumulators > MAX_ACCUMULATORS:
            raise SpecError(
                f"block_m={self.block_m}, block_n={self.block_n}, head_dim={self.head_dim}, "
                f"num_warps={self.num_warps}: each thread would hold {self.accumulators} fp32 "
                f"accumulators; at most {MAX_ACCUMULATORS} fit in registers "
                f"(use smaller tiles, or more warps for the same tiles)"
            )
        limit = SMEM_LIMIT[self.arch]
        if self.smem_bytes > limit:
            raise SpecError(
                f"block_m={self.block_m}, block_n={self.block_n}, num_stages={self.num_stages}, "
                f"head_dim={self.head_dim}: needs {self.smem_bytes} bytes of shared memory, "
                f"more than the {limit} a block may use on {self.arch}"
            )

    # ---- derived layout: what the template and the launcher both need --------------------------

    @property
    def head_dim_pad(self) -> int:
        """head_dim rounded up to the mma k-step of 16; the pad columns are zero-filled."""
        return -(-self.head_dim // 16) * 16

    @property
    def smem_stride(self) -> int:
        """Elements per shared-memory row: 16 extra bytes make ldmatrix rows hit distinct banks."""
        return self.head_dim_pad + 8

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def key_major(self) -> bool:
        return self.kind in KEY_MAJOR

    @property
    def grads(self) -> str:
        """The gradients a backward kernel writes: letters of "kvq"."""
        return self.kind.removeprefix("bwd_") if self.kind != "fwd" else ""

    @property
    def prep_lanes(self) -> int:
        """Lanes per query row in the backward's prep kernel (128 threads a block): the row's
        16-byte chunks, rounded up to a power of two."""
        return 1 << (self.head_dim // 8 - 1).bit_length()

    @property
    def rows_per_warp(self) -> int:
        return (self.block_n if self.key_major else self.block_m) // self.num_warps

    @property
    def wgmma(self) -> bool:
        """Whether the kernel uses Hopper's warpgroup MMA: key-major backward kernels on sm_90a
        whose warps own 16 keys each, so that 4 warps form a warpgroup over 64 keys. Their
        shared-memory tiles are stored as 8 x 8 core matrices instead of padded rows."""
        return self.arch == "sm_90a" and self.key_major and self.num_warps % 4 == 0 and self.rows_per_warp == 16

    @property
    def accumulators(self) -> int:
        """fp32 registers per thread held across the inner loop (see the templates)."""
        tiles = self.rows_per_warp // 16
        if self.kind == "fwd":  # S and O
            return tiles * (self.head_dim_pad + self.block_n) // 2
        if self.kind == "bwd_q":  # S, dP and dQ
            return tiles * (self.head_dim_pad // 2 + self.block_n)
        scores = 1 + ("k" in self.grads or "q" in self.grads)  # S^T, and dP^T when dS is needed
        outputs = ("k" in self.grads) + ("v" in self.grads)  # dK, dV
        return tiles * (outputs * self.head_dim_pad + scores * self.block_m) // 2

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel, from the layout in its template."""
        row = self.smem_stride * 2
        if self.kind == "fwd":  # Q, then num_stages (K, V) tile pairs
            return (self.block_m + 2 * self.num_stages * self.block_n) * row
        if self.kind == "bwd_q":  # Q, dO, then num_stages (K, V) tile pairs
            return (2 * self.block_m + 2 * self.num_stages * self.block_n) * row
        # K, V, num_stages (Q, dO, lse, delta) tiles, and dS^T for the dQ product; at the end dK
        # and dV are staged in padded rows over the K and V tiles (and beyond, for core-matrix tiles)
        tile_row = self.head_dim_pad * 2 if self.wgmma else row
        size = (2 * self.block_n + 2 * self.num_stages * self.block_m) * tile_row
        size += self.num_stages * 2 * self.block_m * 4
        if "q" in self.grads:
            size += self.block_n * (self.block_m + 8) * 2
        return max(size, 2 * self.block_n * row)

    # ---- naming and serialization -----------------------------------------------------------

    @property
    def name(self) -> str:
        """Readable, unique and a valid C identifier: the kernel's symbol and file stem."""
        mask = "causal" if self.causal else "full"
        return (
            f"{self.kind}_d{self.head_dim}_m{self.block_m}_n{self.block_n}_{self.dtype}_{mask}"
            f"_w{self.num_warps}_s{self.num_stages}_{self.arch.replace('_', '')}"
        )

    def canonical(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_name(cls, name: str) -> KernelSpec:
        match = _NAME.fullmatch(name)
        if not match:
            raise SpecError(f"kernel name {name!r} does not have the form of a KernelSpec.name")
        g = match.groupdict()
        return cls(
            kind=g["kind"],
            head_dim=int(g["d"]),
            block_m=int(g["m"]),
            block_n=int(g["n"]),
            dtype=g["dtype"],
            causal=g["mask"] == "causal",
            num_warps=int(g["w"]),
            num_stages=int(g["s"]),
            arch="sm_" + g["arch"],
        )

    @classmethod
    def from_json(cls, text: str) -> KernelSpec:
        return cls(**json.loads(text))

    def replace(self, **changes) -> KernelSpec:
        return dataclasses.replace(self, **changes)


_NAME = re.compile(
    r"(?P<kind>[a-z]+(?:_[a-z]+)*?)_d(?P<d>\d+)_m(?P<m>\d+)_n(?P<n>\d+)_(?P<dtype>fp16|bf16)_(?P<mask>causal|full)"
    r"_w(?P<w>\d+)_s(?P<s>\d+)_sm(?P<arch>\d+a?)"
)


def _check_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{field}={value!r}: must be an int")
