"""What every kernel family provides, and the checks the mma.sync families share.

A family is one unit that owns everything about its kernels: which specs it accepts (and why not),
the spec fields its code depends on, its template, its shared-memory layout, its ordered parameter
list and its launch geometry. Nothing outside the family branches on its kind.
"""

from __future__ import annotations

import dataclasses

from .. import __version__, modifiers, variants
from .. import axes
from ..axes import OUTPUT_TYPES
from ..params import Params
from ..smem import SmemLayout
from ..spec import DEFAULTS, SMEM_LIMIT, KernelSpec, SpecError

# How each field appears in a kernel name, in name order (the kind comes first).
NAME_PARTS = {
    "head_dim": "d{}",
    "head_dim_v": "v{}",  # or nothing when V has q's head dim
    "block_m": "m{}",
    "block_n": "n{}",
    "dtype": "{}",
    "out_dtype": "o{}",  # or nothing when the output has dtype's type
    "kv_dtype": "kv{}",  # or nothing when the KV cache has dtype's type
    "causal": None,  # causal / full
    "num_warps": "w{}",
    "num_stages": "s{}",
    "arch": None,  # sm_90a -> sm90a
    "persistent": None,  # "persistent", or nothing
    "exp2_fma": "e{}",  # or nothing when 0
    "varlen": None,  # "varlen", or nothing
    "paged": None,  # "paged", or nothing
    "variants": None,  # the variants' names, or nothing
    "score_mod": None,  # "smod" / "mmod" + a hash of the rule's source, or nothing
    "mask_mod": None,
    "rotary": None,  # "rope_" + its style, or nothing
}
MODIFIER_TAG = {"score_mod": "smod", "mask_mod": "mmod"}
FLAGS = ("persistent", "varlen", "paged")  # named when set


def modifier_context(spec: KernelSpec) -> dict:
    """What the templates need of a spec's user rules: each rule's CUDA struct and the kernel
    parameters that fill it, and whether the score rule has a gradient."""
    context = {}
    for kind in ("score_mod", "mask_mod"):
        source = getattr(spec, kind)
        if source:
            context[f"{kind}_struct"] = modifiers.struct(kind, source)
            context[f"{kind}_tensors"] = [name for name, _ in modifiers.kernel_tensors(kind, source)]
    context["score_mod_grad"] = bool(spec.score_mod and modifiers.parse(spec.score_mod)["grad"])
    return context


def block_mask_lists(key_major: bool) -> dict:
    """The template context of a mask rule's block mask lists (templates/block_mask.cuh.j2): per
    query tile its key tiles, or per key tile (key_major) its query tiles."""
    query_tiles, key_tiles = "(seqlen_q + BLOCK_M - 1) / BLOCK_M", "(seqlen_k + BLOCK_N - 1) / BLOCK_N"
    return {"list_key_major": key_major, "list_rows": key_tiles if key_major else query_tiles,
            "list_width": query_tiles if key_major else key_tiles}


def check_rules_fixed_length(spec: KernelSpec) -> None:
    if spec.varlen and (spec.score_mod or spec.mask_mod):
        raise SpecError("score_mod / mask_mod with varlen=True: the user rules take fixed-length batches for now")


def check_backward_rule(spec: KernelSpec) -> None:
    """A backward kernel's score rule must come with its gradient (dS takes d(score_mod)/d(score))."""
    if spec.score_mod and not modifiers.parse(spec.score_mod)["grad"]:
        raise SpecError("score_mod: a backward kernel needs the rule's gradient (ScoreMod(..., grad=...))")


class Family:
    """One kind of kernel (or a few kinds that share a template)."""

    kinds: tuple[str, ...] = ()
    template: str = ""
    # the spec fields the kernel's code depends on, and the variants (flashgen.variants) it builds
    fields: tuple[str, ...] = (*(f for f in NAME_PARTS if f not in ("variants", "rotary", "paged", "out_dtype", "kv_dtype")), *variants.EVERYWHERE)
    arguments: tuple[str, ...] = ()  # the launch's named arguments, from which parameters are computed
    forward = False  # a forward kernel: what attention() runs and `flashgen build` makes importable
    dtypes: tuple[str, ...] = OUTPUT_TYPES  # the element types (flashgen.axes) its kernels take
    needs: tuple[str, ...] = ()  # the hardware its kernels use (flashgen.axes.Target's flags): it builds for the targets that have it
    needs_rule = False  # its specs carry a user rule's source (MaskMod), which only Python can give
    tune_space: dict[str, tuple] = {}  # the tile fields `flashgen tune` sweeps, and their values
    # Code choices `flashgen tune` then tries on the best few tile shapes, one field at a time (the
    # shapes are ranked with them at their defaults), and their values past the default.
    tune_knobs: dict[str, tuple] = {}

    # ---- which specs ---------------------------------------------------------------------------

    @property
    def archs(self) -> tuple[str, ...]:
        """The targets it builds for: those with what it needs."""
        return axes.with_(*self.needs)

    def check_arch(self, kind: str, arch: str) -> None:
        """Raise SpecError naming the target(s) a kind needs unless it builds for `arch`."""
        if arch not in self.archs:
            need = f" ({', '.join(axes.CAPABILITIES[c] for c in self.needs)})" if self.needs else ""
            raise SpecError(f"arch={arch!r}: a {kind} kernel needs {' or '.join(self.archs)}{need}")

    def validate(self, spec: KernelSpec) -> None:
        """Raise SpecError unless this family can build and run `spec`."""
        self.check_arch(spec.kind, spec.arch)
        for field, default in DEFAULTS.items():
            if field not in ("kind", "variants") and field not in self.fields and getattr(spec, field) != default:
                raise SpecError(
                    f"{field}={getattr(spec, field)!r}: a {spec.kind} kernel does not use {field} "
                    f"(leave it at its default, {default!r})"
                )
        if spec.dtype not in self.dtypes:
            raise SpecError(f"dtype={spec.dtype!r}: a {spec.kind} kernel takes {', '.join(self.dtypes)}")
        unbuilt = [name for name in spec.variants if not variants.builds(self.fields, spec.kind, name)]
        if unbuilt:
            raise SpecError(f"variants={spec.variants!r}: a {spec.kind} kernel does not build {', '.join(unbuilt)}")
        self.check(spec)
        limit = SMEM_LIMIT[spec.arch]
        if spec.smem_bytes > limit:
            raise SpecError(
                f"block_m={spec.block_m}, block_n={spec.block_n}, num_stages={spec.num_stages}, "
                f"{spec.dims_text}: needs {spec.smem_bytes} bytes of shared memory, "
                f"more than the {limit} a block may use on {spec.arch}"
            )

    def check(self, spec: KernelSpec) -> None:
        """The family's own rules (tile shapes, registers)."""

    def name(self, spec: KernelSpec) -> str:
        parts = [spec.kind]
        for field, form in NAME_PARTS.items():
            if field in self.fields or field == "variants":
                value = getattr(spec, field)
                if field == "causal":
                    parts.append("causal" if value else "full")
                elif field == "arch":
                    parts.append(value.replace("_", ""))
                elif field in FLAGS:
                    parts += [field] if value else []
                elif field == "variants":
                    parts += list(value)
                elif field in ("exp2_fma", "head_dim_v", "out_dtype", "kv_dtype"):
                    parts += [form.format(value)] if value else []
                elif field == "rotary":
                    parts += [f"rope_{value}"] if value else []
                elif field in MODIFIER_TAG:
                    parts += [MODIFIER_TAG[field] + modifiers.tag(value)] if value else []
                else:
                    parts.append(form.format(value))
        return "_".join(parts)

    # ---- what the kernel is made of --------------------------------------------------------------

    def threads(self, spec: KernelSpec) -> int:
        return 32 * spec.num_warps

    def dependent_launch(self, spec: KernelSpec) -> bool:
        """Whether the kernel is launched as a programmatic dependent of the one before it on the
        stream (sm_90): it may be scheduled while that one ends, and waits for its writes."""
        return False

    def smem(self, spec: KernelSpec) -> SmemLayout:
        return SmemLayout([])

    def params(self, spec: KernelSpec) -> Params:
        raise NotImplementedError

    def helpers(self, spec: KernelSpec) -> dict:
        """Functions the parameter expressions call (a tensor map encoder, say)."""
        return dict(variants.HELPERS)

    def grid(self, spec: KernelSpec) -> str:
        """The grid (x, y, z) as an expression over the arguments: x counts tiles, y heads, z batches."""
        raise NotImplementedError

    def dq_reader(self, spec: KernelSpec) -> KernelSpec | None:
        """A kernel adding dQ into an fp32 sum (a dq_accum parameter): the kernel that reads the sum
        back into dq, or None where the family's dq_from_accum does it on the host."""
        return None

    def context(self, spec: KernelSpec) -> dict:
        """Everything the template may use: the spec's fields and what is derived from them."""
        on = variants.on(spec)
        return {
            **dataclasses.asdict(spec),
            "name": spec.name,
            "version": __version__,
            "head_dim_pad": spec.head_dim_pad,
            "d_v": spec.d_v,  # V's head dim and the output's (head_dim unless the spec's head_dim_v says otherwise)
            "d_v_pad": spec.d_v_pad,
            "num_threads": self.threads(spec),
            "ptx_type": spec.element.ptx,
            "elem_bytes": spec.element.bytes,
            "elem_storage": spec.element.storage,
            "fp8": spec.element.bytes == 1,
            "p_offset": spec.element.bytes == 1,  # P's exponentials 2^P_LOG2 above the row's max (softmax.cuh.j2)
            "kv_fp8": bool(spec.kv_dtype),  # an FP8 KV cache (decode kernels)
            "out_ptx_type": spec.output_element.ptx,  # the output's (the element type's, but for FP8 inputs)
            "out_storage": spec.output_element.storage,
            "wgmma": False,
            "params": self.params(spec).signature(),
            **{name: name in spec.variants for name in variants.FIELDS},  # each variant's flag (templates' hooks)
            # the Mask's runtime bounds (templates/mask.cuh.j2)
            "mask_args": "".join(f", {arg}" for declaration in on for arg in declaration.mask_args),
            "score": any(declaration.score for declaration in on),  # a score piece (templates/score.cuh.j2)
            "score_grad": any(declaration.grad for declaration in on),  # the backward multiplies dS by the score's derivative
            # the forwards' positional score alone (ALiBi): a tile's distances split into a part per key
            # and one per row (score.cuh.j2)
            "score_offsets": (any(d.score == "positional" for d in on) and not any(d.score == "rule" for d in on)
                              and spec.kind in ("fwd", "fwd_sm90")),
            **modifier_context(spec),
            "variants_text": "".join(declaration.header for declaration in on),
            "smem_layout": self.smem(spec).cuda(),
            "dependent_launch": self.dependent_launch(spec),  # the kernel waits with griddepcontrol.wait
        }

    def packer(self, spec: KernelSpec):
        """`pack(buffer, values) -> blocks` for this spec's parameters (see Params.packer);
        specs whose parameters and grid read the same share one."""
        params, grid, helpers = self.params(spec), self.grid(spec), self.helpers(spec)
        key = (params.struct.format, params.packer_source(grid), tuple(helpers.items()))
        pack = _packers.get(key)
        if pack is None:
            pack = _packers[key] = params.packer(grid, helpers)
        return pack


_packers: dict[tuple[str, str], object] = {}


# Each variant takes registers from the accumulators' budget in the per-element loops (its bounds,
# slope or cap, its indices: its declaration's `registers`). Where ptxas still spills, the tuning
# table's variant entries pick smaller tiles (tests/test_variants.py compiles every pick).
MAX_MARGIN = 48  # variants share their index registers (a rule's own cost: its declaration's registers)


class MmaTiles(Family):
    """Shared rules of the mma.sync families: each warp owns 16 or 32 rows of the tile dimension
    `owner` (block_m, or block_n for the key-major backward) and holds its fp32 accumulators in
    registers."""

    owner = "block_m"
    fields = (*(field for field in NAME_PARTS if field not in ("persistent", "exp2_fma", "rotary", "variants", "paged")),  # one block per tile
              *variants.EVERYWHERE)
    max_accumulators = 192  # fp32 accumulators per thread that fit in 255 registers with room to spare
    builtins_free = False  # the family's tiles hold the built-in variants at no cost (a rule still costs)

    def check(self, spec: KernelSpec) -> None:
        if spec.num_warps not in (1, 2, 4, 8):
            raise SpecError(f"num_warps={spec.num_warps}: must be one of (1, 2, 4, 8)")
        if spec.num_stages not in (2, 3):
            raise SpecError(f"num_stages={spec.num_stages}: must be one of (2, 3)")
        for field in ("block_m", "block_n"):
            value = getattr(spec, field)
            if value % 16 or not 16 <= value <= 256:
                raise SpecError(f"{field}={value}: must be a multiple of 16 in [16, 256]")
        owned = getattr(spec, self.owner)
        if owned % spec.num_warps or self.rows_per_warp(spec) not in (16, 32):
            raise SpecError(
                f"{self.owner}={owned} with num_warps={spec.num_warps}: in a {spec.kind} kernel each "
                f"warp owns {self.owner} / num_warps rows, which must be 16 or 32 "
                f"({self.owner} in {{{16 * spec.num_warps}, {32 * spec.num_warps}}})"
            )
        check_rules_fixed_length(spec)
        on = variants.on(spec)
        margin = min(sum(0 if self.builtins_free and not d.rule else d.registers for d in on), MAX_MARGIN)
        limit = self.max_accumulators - margin
        if self.accumulators(spec) > limit:
            raise SpecError(
                f"block_m={spec.block_m}, block_n={spec.block_n}, {spec.dims_text}, "
                f"num_warps={spec.num_warps}{''.join(f', {d.name}' for d in on)}: each thread would hold "
                f"{self.accumulators(spec)} fp32 accumulators; at most {limit} fit in registers "
                f"(use smaller tiles, or more warps for the same tiles)"
            )

    def rows_per_warp(self, spec: KernelSpec) -> int:
        return getattr(spec, self.owner) // spec.num_warps

    def accumulators(self, spec: KernelSpec) -> int:
        """fp32 registers per thread held across the inner loop (see the template)."""
        raise NotImplementedError

    @staticmethod
    def row_pad(spec: KernelSpec) -> int:
        """The padded width every tile row has: the wider of q's and v's head dims (V's tiles and
        the output's staging share the pitch of Q's and K's)."""
        return max(spec.head_dim_pad, spec.d_v_pad)

    @classmethod
    def row_bytes(cls, spec: KernelSpec) -> int:
        """A padded shared-memory row: 16 extra bytes put ldmatrix's 8 rows in 8 bank groups."""
        return (cls.row_pad(spec) + 8) * 2

    def context(self, spec: KernelSpec) -> dict:
        context = {**super().context(spec), "smem_stride": self.row_pad(spec) + 8}
        if spec.mask_mod:
            context.update(block_mask_lists(key_major=self.owner == "block_n"))
        return context

