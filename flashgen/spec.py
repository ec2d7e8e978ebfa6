"""The DSL: a KernelSpec names every choice that changes the generated code.

A spec is a plain frozen value. It checks its fields' types and ranges when it is built and asks its
kernel family (flashgen.families) whether the family can build it, so a spec that exists is one
the templates can render and the kernel can run. It is known by a readable `name` (the fields its
family uses) plus a hash of its canonical serialization (`ident`); nothing ever parses a name back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass

from .axes import ELEMENT_TYPES, OUTPUT_TYPES, TARGETS

DTYPES = tuple(ELEMENT_TYPES)
# Largest dynamic shared memory one block may opt in to, per target (flashgen.axes.TARGETS).
SMEM_LIMIT = {arch: target.smem_per_block for arch, target in TARGETS.items()}
ARCHS = tuple(TARGETS)
HEAD_DIM_RULE = "a multiple of 8 in [8, 256]"
ROTARY_STYLES = ("interleaved", "halves")  # FlashAttention's rotary_interleaved True / False


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


def check_head_dim(head_dim, field: str = "head_dim") -> None:
    """The head dims every family takes (the input check and the CLI use it too)."""
    check_int(field, head_dim)
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise SpecError(f"{field}={head_dim}: must be {HEAD_DIM_RULE}")


def check_modifier(field: str, source) -> None:
    """A modifier field holds "" or a modifier's source (flashgen.modifiers)."""
    if not isinstance(source, str):
        raise SpecError(f"{field}={source!r}: must be a modifier's source text (or \"\")")
    if source:
        from . import modifiers

        try:
            modifiers.validate(field, source)
        except (ValueError, TypeError, KeyError) as error:
            raise SpecError(f"{field}: {source[:60]!r} is not a modifier's source (use ScoreMod/MaskMod(...).source): {error}")


def check_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{field}={value!r}: must be an int")


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """One specialization of an attention kernel, built by keyword (fields will be added). Which
    fields a kernel uses depends on its kind (see its family in flashgen.families); the others
    stay at their defaults.

    head_dim:   d of q and k (and of v unless head_dim_v says otherwise); a multiple of 8 from 8 to
                256 (padded to 16 inside the kernel).
    head_dim_v: d of v and of the output when it differs from q's (DeepSeek's 192 / 128, say); 0 = head_dim.
    block_m:    query rows per block (fwd, bwd_q) or per step (key-major backward); a multiple of 16.
    block_n:    key rows per step (fwd, bwd_q) or per block (key-major backward); a multiple of 16.
    dtype:      "fp16" or "bf16" for q, k, v and o, or "e4m3" (FP8, Hopper forward) for q, k and v;
                accumulation is always fp32.
    out_dtype:  the output's type where it is not dtype's: "bf16" or "fp16" for an FP8 forward
                ("" = dtype).
    kv_dtype:   the KV cache's element type where it is not dtype's: "e4m3" for an FP8 cache read
                with a descale per (sequence, KV head) and appended to with it (decode kernels;
                "" = dtype).
    causal:     bottom-right aligned causal mask (query i sees keys j <= i + Tk - Tq).
    num_warps:  warps per block.
    num_stages: tiles in flight in shared memory (2 or 3).
    arch:       compile target, e.g. "sm_90a" (H100/H200) or "sm_80" (A100).
    kind:       which kernel: "fwd", a backward piece, or the backward's prep (see families.KINDS).
    persistent: one block per SM walking the tiles (the longest causal rows first) instead of one
                block per tile (Hopper forward).
    exp2_fma:   of every 8 exponentials of the softmax, how many run as a polynomial on the FMA pipes
                instead of the multi-function unit (0 to 8; Hopper forward): that unit does an
                eighth as much per clock and bounds the softmax at d = 64 or with softcap's tanh.
    varlen:     packed sequences of different lengths (flash_attn_varlen_func's layout): tensors are
                (total_tokens, heads, d) and each sequence's rows are found through cu_seqlens
                (templates/block_info.cuh.j2); blocks past a sequence's end exit at once.
    paged:      with varlen, k and v are a paged cache (num_pages, page_size, heads_kv, d) that a
                block table maps each sequence's key positions into (Hopper forward: chunked
                prefill over a paged cache); the decode kernels' paged form is their kind instead.

    variants:   the attention variants the kernel has, by name (flashgen.variants.FIELDS; the
                registry there declares each); their values are kernel arguments, so one kernel
                serves every window, cap and slope.
    score_mod:  a user score rule, its source (flashgen.modifiers.ScoreMod.source; "" = none).
    mask_mod:   a user mask rule, its source (MaskMod.source); the kernels then visit the key tiles a
                block mask lists (flashgen.blockmask) and skip the empty ones.
    rotary:     rotary embedding of q and of the appended keys (decode kernels; flash_attn_with_kvcache's
                rotary_cos / rotary_sin): "interleaved" rotates dimension pairs (2j, 2j + 1) (GPT-J),
                "halves" pairs j and j + rotary_dim / 2 (GPT-NeoX); "" = none.
    """

    head_dim: int
    head_dim_v: int = 0
    block_m: int = 128
    block_n: int = 64
    dtype: str = "bf16"
    out_dtype: str = ""
    kv_dtype: str = ""
    causal: bool = False
    num_warps: int = 4
    num_stages: int = 2
    arch: str = "sm_90a"
    kind: str = "fwd"
    persistent: bool = False
    exp2_fma: int = 0
    varlen: bool = False
    paged: bool = False
    variants: tuple[str, ...] = ()
    score_mod: str = ""
    mask_mod: str = ""
    rotary: str = ""

    def __post_init__(self):
        from . import variants
        from .families import KINDS

        check_head_dim(self.head_dim)
        if self.head_dim_v:
            check_head_dim(self.head_dim_v, "head_dim_v")
            if self.head_dim_v == self.head_dim:  # one kernel, one name, for one shape
                object.__setattr__(self, "head_dim_v", 0)
        for field in ("block_m", "block_n", "num_warps", "num_stages", "exp2_fma"):
            check_int(field, getattr(self, field))
        if self.kind not in KINDS:
            raise SpecError(f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        if not 0 <= self.exp2_fma <= 8:
            raise SpecError(f"exp2_fma={self.exp2_fma}: must be in [0, 8] (exponentials of every 8 on the FMA pipes)")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.out_dtype == self.dtype:  # one kernel, one name
            object.__setattr__(self, "out_dtype", "")
        if self.out_dtype and self.out_dtype not in OUTPUT_TYPES:
            raise SpecError(f"out_dtype={self.out_dtype!r}: must be one of {', '.join(OUTPUT_TYPES)} (or \"\": dtype's)")
        if not ELEMENT_TYPES[self.dtype].output and not self.out_dtype:
            raise SpecError(f"dtype={self.dtype!r}: kernels do not write {self.dtype}; name the output's type "
                            f"(out_dtype: one of {', '.join(OUTPUT_TYPES)})")
        if self.kv_dtype == self.dtype:  # one kernel, one name
            object.__setattr__(self, "kv_dtype", "")
        if self.kv_dtype and (self.kv_dtype not in ELEMENT_TYPES or ELEMENT_TYPES[self.kv_dtype].output):
            scaled = [name for name, t in ELEMENT_TYPES.items() if not t.output]
            raise SpecError(f"kv_dtype={self.kv_dtype!r}: must be one of {', '.join(scaled)} (a cache stored with a "
                            f"descale), or \"\": dtype's")
        for field in ("causal", "persistent", "varlen", "paged"):
            if not isinstance(getattr(self, field), bool):
                raise SpecError(f"{field}={getattr(self, field)!r}: must be True or False")
        try:  # (a list, as JSON gives it, or names in any order: the registry's order, each once)
            object.__setattr__(self, "variants", variants.normalized(self.variants))
        except (TypeError, ValueError) as error:
            raise SpecError(str(error)) from None
        for field in ("score_mod", "mask_mod"):
            check_modifier(field, getattr(self, field))
        if self.rotary not in ("", *ROTARY_STYLES):
            raise SpecError(f"rotary={self.rotary!r}: must be \"\" (none) or one of {', '.join(ROTARY_STYLES)}")
        if self.arch not in SMEM_LIMIT:
            raise SpecError(f"arch={self.arch!r}: must be one of {', '.join(ARCHS)}")
        self.family.validate(self)

    @property
    def family(self):
        """The kernel family that builds this spec (flashgen.families)."""
        from .families import family

        return family(self.kind)

    @property
    def head_dim_pad(self) -> int:
        """head_dim rounded up to the mma k-step of 16; the pad columns are zero-filled."""
        return -(-self.head_dim // 16) * 16

    @property
    def element(self):
        """q's, k's and v's element type (flashgen.axes.ElementType)."""
        return ELEMENT_TYPES[self.dtype]

    @property
    def output_element(self):
        """The output's element type."""
        return ELEMENT_TYPES[self.out_dtype or self.dtype]

    @property
    def cache_element(self):
        """The KV cache's element type (a decode kernel's; dtype's unless kv_dtype says otherwise)."""
        return ELEMENT_TYPES[self.kv_dtype or self.dtype]

    @property
    def d_v(self) -> int:
        """V's head dim (and the output's)."""
        return self.head_dim_v or self.head_dim

    @property
    def d_v_pad(self) -> int:
        return -(-self.d_v // 16) * 16

    @property
    def dims_text(self) -> str:
        """The head dims as an error message names them."""
        return f"head_dim={self.head_dim}" + (f", head_dim_v={self.head_dim_v}" if self.head_dim_v else "")

    @property
    def num_threads(self) -> int:
        return self.family.threads(self)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block, from the family's layout."""
        return self.family.smem(self).size

    # ---- identity ----------------------------------------------------------------------------

    @functools.cached_property
    def name(self) -> str:
        """Readable and a valid C identifier: the kernel's symbol and file stem. It holds the fields
        the family uses; `ident` adds a hash of everything."""
        return self.family.name(self)

    def canonical(self) -> str:
        """The stable serialization: what the cache key and `ident` hash, what the torch op carries."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def ident(self) -> str:
        """name + a hash of the canonical spec: unique even when a name cannot say everything."""
        return f"{self.name}-{hashlib.sha256(self.canonical().encode()).hexdigest()[:12]}"

    @classmethod
    def from_json(cls, text: str) -> KernelSpec:
        return cls(**json.loads(text))

    def replace(self, **changes) -> KernelSpec:
        return dataclasses.replace(self, **changes)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelSpec) if f.default is not dataclasses.MISSING}
