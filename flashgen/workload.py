"""What a workload needs: every kernel spec the runtime can pick for it.

`flashgen build` makes a deployment's kernels from this list, so that a process under
FLASHGEN_NO_JIT never meets a kernel the build could not make. Each entry point's specs come from
the same functions its launch plans call (flashgen.tuning), over every value the plans key on
that is not in the workload's description: the query-length buckets, both backward modes, the
decode kernels' row buckets. Page sizes and split counts are kernel arguments, not spec fields:
one kernel serves every page size and every split count.

What a description cannot say (a user's score or mask rule, a hand-picked tile) is recorded
instead: run the application once with FLASHGEN_RECORD=FILE (flashgen.kernels writes each spec it
loads there) and build FILE with `flashgen build --from FILE`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from . import tuning
from .axes import ELEMENT_TYPES, OUTPUT_TYPES
from .spec import DTYPES, ROTARY_STYLES, KernelSpec, SpecError
from .variants import FIELDS as VARIANT_FIELDS

ENTRIES = ("attention", "varlen", "kvcache", "merge")
"""attention: flashgen.attention (and prebuilt kernels' modules); varlen: attention_varlen, packed
(and over a paged cache); kvcache: attention_with_kvcache; merge: merge_attention_states."""
LAYOUTS = ("contiguous", "paged")  # KV caches (kvcache), and packed keys or pages (varlen)
RECORD_ENV = "FLASHGEN_RECORD"  # a file: every spec a run loads is added to it (flashgen.kernels.record)


@dataclass(frozen=True)
class Workload:
    """A deployment's attention calls, as `flashgen build`'s options describe them.

    head_dims, dtypes, causal, archs: every combination is built. entries: the public functions
    called (ENTRIES). variants: each one a combination of variant fields (flashgen.variants.FIELDS) that
    calls use together, () for plain calls. layouts: the KV layouts of kvcache
    ("contiguous", "paged") and whether varlen reads a paged cache ("paged"). rotary: the rotary
    styles of kvcache calls ("" = none). backward: attention's and varlen's backward kernels, in
    both modes (deterministic or not). head_dim_v: V's head dim where the calls' V has one of its
    own (DeepSeek's 192 / 128), 0 where it has q's; attention and varlen take it, without a paged cache.
    kv_dtypes: the element types of the KV caches kvcache and paged varlen calls read ("" = the
    calls' dtype; "e4m3": an FP8 cache with descales).
    """

    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...] = ("bf16",)
    causal: tuple[bool, ...] = (False,)
    archs: tuple[str, ...] = ("sm_90a",)
    entries: tuple[str, ...] = ("attention",)
    variants: tuple[tuple[str, ...], ...] = ((),)
    layouts: tuple[str, ...] = LAYOUTS
    rotary: tuple[str, ...] = ("",)
    backward: bool = True
    head_dim_v: int = 0
    kv_dtypes: tuple[str, ...] = ("",)

    def __post_init__(self):
        for name, values, allowed in (("entries", self.entries, ENTRIES), ("layouts", self.layouts, LAYOUTS),
                                      ("rotary", self.rotary, ("", *ROTARY_STYLES))):
            unknown = [value for value in values if value not in allowed]
            if unknown:
                raise SpecError(f"{name}: {', '.join(map(repr, unknown))} not among {', '.join(map(repr, allowed))}")
        if self.head_dim_v:
            other = [entry for entry in self.entries if entry not in ("attention", "varlen")]
            if other or ("varlen" in self.entries and "paged" in self.layouts):
                raise SpecError(f"head_dim_v={self.head_dim_v}: V of its own head dim goes through attention and varlen over "
                                f"packed keys only (not {', '.join(other) or 'varlen over a paged cache'})")
        fp8 = [dtype for dtype in self.dtypes if dtype in DTYPES and not ELEMENT_TYPES[dtype].output]
        if fp8 and set(self.entries) - {"attention", "varlen"}:
            raise SpecError(f"dtypes {', '.join(fp8)}: FP8 inputs go through attention and varlen only (not "
                            f"{', '.join(sorted(set(self.entries) - {'attention', 'varlen'}))})")
        scaled = [name for name, t in ELEMENT_TYPES.items() if not t.output]
        unknown = [kv for kv in self.kv_dtypes if kv not in ("", *scaled)]
        if unknown:
            raise SpecError(f"kv_dtypes: {', '.join(map(repr, unknown))} not among '' (the calls' dtype), "
                            f"{', '.join(map(repr, scaled))}")
        for variant in self.variants:
            unknown = [field for field in variant if field not in VARIANT_FIELDS]
            if unknown:
                raise SpecError(f"variant {'+'.join(variant)}: {', '.join(unknown)} is not one of {', '.join(VARIANT_FIELDS)}")

    def specs(self) -> list[KernelSpec]:
        """Every spec the runtime picks for these calls, each once, in a stable order."""
        found: dict[KernelSpec, None] = {}
        for head_dim, dtype, causal, arch, variant in product(self.head_dims, self.dtypes, self.causal, self.archs,
                                                              dict.fromkeys(self.variants)):
            for entry in self.entries:
                found.update(dict.fromkeys(_ENTRY_SPECS[entry](self, head_dim, dtype, causal, arch, tuple(variant))))
        return list(found)


def _attention(workload: Workload, head_dim, dtype, causal, arch, variant, varlen=False) -> list[KernelSpec]:
    """The forward for short and long queries (plans.forward) and, with backward, its backward;
    FP8 inputs (e4m3): the FP8 forward for each output type (it has no backward)."""
    head_dim_v = workload.head_dim_v if workload.head_dim_v != head_dim else 0
    if dtype == "e4m3":  # (V laid out for its P V product first)
        return [tuning.fp8_values_spec(head_dim_v or head_dim, arch, varlen),
                *(tuning.fp8_forward_spec(head_dim, out, causal, arch, variant, head_dim_v, varlen) for out in OUTPUT_TYPES)]
    specs = [tuning.forward_spec(head_dim, dtype, causal, arch, seqlen_q, varlen, variant, head_dim_v)
             for seqlen_q in (tuning.SHORT_QUERY, tuning.SHORT_QUERY + 1)]
    return specs + (_backward(head_dim, dtype, causal, arch, variant, varlen, head_dim_v) if workload.backward else [])


def _backward(head_dim, dtype, causal, arch, variant, varlen, head_dim_v=0) -> list[KernelSpec]:
    """plans.backward's kernels in both modes: the prep, the tables' kernels, and the reader of a
    dQ sum where one runs."""
    specs = [tuning.backward_prep(head_dim_v or head_dim, dtype, arch, varlen, variant)]
    for deterministic in (False, True):
        picked = tuning.backward_specs(head_dim, dtype, causal, arch, deterministic, varlen, variant, head_dim_v)
        specs += picked + [reader for reader in (spec.family.dq_reader(spec) for spec in picked) if reader]
    return list(dict.fromkeys(specs))


def backward_of(forward: KernelSpec) -> list[KernelSpec]:
    """The backward kernels (both modes) that run after a forward kernel, for the same problem
    (none after a forward over a paged cache or of FP8 inputs: those calls take no gradients)."""
    if forward.paged or not forward.element.output:
        return []
    variant = (*forward.variants,
               *((rule, getattr(forward, rule)) for rule in ("score_mod", "mask_mod") if getattr(forward, rule)))
    return _backward(forward.head_dim, forward.dtype, forward.causal, forward.arch, variant, forward.varlen, forward.head_dim_v)


def _decode(head_dim, dtype, arch, paged, variant, rotary="", varlen=False, kv_dtype="") -> list[KernelSpec]:
    """plans.decode's kernels: one per row bucket (a block of 16 packed query rows, or of 64)."""
    return [tuning.decode_spec(head_dim, dtype, arch, paged, rows, variant, rotary, varlen, kv_dtype=kv_dtype)
            for rows in (tuning.DECODE_BLOCK_M[0], tuning.DECODE_BLOCK_M[0] + 1)]


def _varlen(workload: Workload, head_dim, dtype, causal, arch, variant) -> list[KernelSpec]:
    specs = _attention(workload, head_dim, dtype, causal, arch, variant, varlen=True)
    if dtype == "e4m3":  # (packed keys only: no FP8 paged cache yet)
        return specs
    if "paged" in workload.layouts:  # attention_varlen over a block table: the decode kernels' varlen form,
        for kv_dtype in workload.kv_dtypes:
            specs += _decode(head_dim, dtype, arch, True, variant, varlen=True, kv_dtype=kv_dtype)
        if "" in workload.kv_dtypes:  # and for long chunks over a 16-bit cache the Hopper forward
            specs += [spec for spec in [tuning.paged_forward_spec(head_dim, dtype, causal, arch, tuning.SHORT_QUERY + 1, variant)]
                      if spec]
    return specs


def _kvcache(workload: Workload, head_dim, dtype, causal, arch, variant) -> list[KernelSpec]:
    specs = [spec for layout, rotary, kv_dtype in product(workload.layouts, workload.rotary, workload.kv_dtypes)
             for spec in _decode(head_dim, dtype, arch, layout == "paged", variant, rotary, kv_dtype=kv_dtype)]
    prefill = tuning.paged_forward_spec(head_dim, dtype, causal, arch, tuning.SHORT_QUERY + 1, variant)
    if "paged" in workload.layouts and "" in workload.rotary and "" in workload.kv_dtypes and prefill:
        specs += [prefill, tuning.append_spec(head_dim, dtype, arch)]  # a long chunk over 16-bit pages (with an append)
    return specs


def _merge(workload: Workload, head_dim, dtype, causal, arch, variant) -> list[KernelSpec]:
    return [tuning.merge_spec("merge", head_dim, dtype, arch), tuning.merge_spec("merge_fp32", head_dim, dtype, arch)]


_ENTRY_SPECS = {"attention": _attention, "varlen": _varlen, "kvcache": _kvcache, "merge": _merge}


# ---- recorded specs ------------------------------------------------------------------------------


def read_recorded(path) -> list[KernelSpec]:
    """The specs a run wrote under FLASHGEN_RECORD (one canonical spec per line), each once; a bad
    line is an error naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise SpecError(f"{path}: cannot read the recorded kernels ({error.strerror or error})") from None
    specs: dict[KernelSpec, None] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            if not isinstance(fields, dict):
                raise ValueError(f"a {type(fields).__name__}, not an object")
            specs[KernelSpec(**fields)] = None
        except (ValueError, TypeError) as error:  # SpecError is a ValueError
            raise SpecError(f"{path}, line {number}: not a recorded kernel spec ({error})") from None
    if not specs:
        raise SpecError(f"{path} records no kernels: run the application with {RECORD_ENV}={path} first")
    return list(specs)


# ---- the command that builds a spec -------------------------------------------------------------


def describing(spec: KernelSpec) -> Workload | None:
    """The smallest workload whose build makes `spec`, or None when no description does (a user
    rule, a tile the tables do not pick, a piece of another spec's plan only)."""
    serving = {"decode": "kvcache", "decode_paged": "kvcache", "append_paged": "kvcache", "merge": "merge", "merge_fp32": "merge"}
    entry = {"fwd": "attention", "fwd_sm90": "attention", **serving}.get(spec.kind, "attention")  # (the backward pieces: attention's)
    if spec.varlen:
        entry = "varlen"
    variant = spec.variants
    if spec.head_dim_v and entry not in ("attention", "varlen"):  # (a piece no description holds)
        return None
    workload = Workload(head_dim_v=spec.head_dim_v,
        head_dims=(spec.head_dim,), dtypes=(spec.dtype,), causal=(spec.causal,), archs=(spec.arch,), entries=(entry,),
        variants=(variant,), layouts=("paged",) if spec.kind in ("decode_paged", "append_paged") or spec.paged else ("contiguous",),
        rotary=(spec.rotary,), backward=not spec.family.forward and spec.kind not in serving, kv_dtypes=(spec.kv_dtype,),
    )
    try:
        return workload if spec in workload.specs() else None
    except SpecError:
        return None


def command(spec: KernelSpec, out: str = "generated") -> str:
    """A `flashgen build` command line that makes `spec` into `out`: by the workload that holds it
    where one does, else by the spec itself."""
    workload = describing(spec)
    if workload is None:
        return f"flashgen build --out {shlex.quote(out)} --spec {shlex.quote(spec.canonical())}"
    return " ".join(["flashgen build", *options(workload), "--out", shlex.quote(out)])


def options(workload: Workload) -> list[str]:
    """`flashgen build`'s options for a workload (the defaults left out)."""
    words = ["--d", ",".join(map(str, workload.head_dims))]
    if workload.head_dim_v:
        words += ["--dv", str(workload.head_dim_v)]
    if workload.dtypes != ("bf16",):
        words += ["--dtype", ",".join(workload.dtypes)]
    if workload.causal != (False,):
        words += ["--causal", ",".join("yes" if c else "no" for c in workload.causal)]
    if workload.archs != ("sm_90a",):
        words += ["--arch", ",".join(workload.archs)]
    if workload.entries != ("attention",):
        words += ["--entry", ",".join(workload.entries)]
    for variant in workload.variants:
        if variant:
            words += ["--variant", ",".join(variant)]
    if workload.layouts != LAYOUTS and {"kvcache", "varlen"} & set(workload.entries):
        words += ["--kvcache", ",".join(workload.layouts)]
    if workload.rotary != ("",) and "kvcache" in workload.entries:
        words += ["--rotary", ",".join(style or "none" for style in workload.rotary)]
    if workload.kv_dtypes != ("",) and {"kvcache", "varlen"} & set(workload.entries):
        words += ["--kv-dtype", ",".join(kv or "same" for kv in workload.kv_dtypes)]
    if not workload.backward and {"attention", "varlen"} & set(workload.entries):
        words.append("--no-backward")
    return words
