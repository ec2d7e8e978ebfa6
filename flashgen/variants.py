"""Attention variants: sliding windows, logit soft-capping and ALiBi (FlashAttention's names and
semantics), and the user rules (flashgen.modifiers), each declared once in REGISTRY.

A declaration says what the rest of the package asks of a variant: its name (the KernelSpec's
`variants` entry, the kernel name's part, the templates' flag), the public keyword that turns it on,
the device hook it acts at (the mask piece, templates/mask.cuh.j2: which keys a query sees; the
score piece, templates/score.cuh.j2: the value the softmax takes for a score, with or without a
derivative the backward multiplies into dS), the kernel parameters it adds and their host values,
the registers it costs beside a kernel's accumulators, and whether the tuning table keys on it.
Families and tables ask these traits (`on`, `has`), not the names. A spec without a variant renders
no trace of it. The values (a window's bounds, a cap, slopes) are kernel arguments, so one compiled
kernel serves every window, cap and slope. `Variant` is one call's values, checked (`make`), and
what the plans and launches read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from .params import Param, pointer, scalar

UNBOUNDED = 1 << 30  # a window side without bound, as the kernel takes it (no sequence is this long)


@dataclass(frozen=True)
class Declaration:
    """One variant, as every layer sees it.

    name:        the KernelSpec `variants` entry (a rule: its own spec field, holding its source),
                 the kernel name's part, the templates' flag.
    keyword:     the public functions' keyword that turns it on.
    header:      what the rendered kernel's first line says of it.
    mask:        it hides keys: the mask piece's key-tile range and per-element test.
    score:       it changes a score before the softmax (the score piece): "pointwise" (a function of
                 the score alone), "positional" (of the score and its row and key) or "rule".
    grad:        the backward multiplies dS by the score's derivative.
    tuning_key:  the tuning table's key for kernels that have it, where entries are tuned apart (it
                 moves a kernel's bound, as a tanh per score does); "" where they are not.
    registers:   what it takes per thread beside a kernel's accumulators, in the per-element loops.
    arguments:   the launch's named arguments its parameters read.
    params:      its kernel parameters (after a spec's others), from the spec.
    mask_args:   the kernel parameters the Mask piece's constructor takes.
    holds_causal: its mask holds causal's too (a window's right side is 0 under causal), so a
                 kernel that has it asks it alone.
    """

    name: str
    keyword: str
    header: str
    mask: bool = False
    score: str = ""
    grad: bool = False
    tuning_key: str = ""
    registers: int = 8
    arguments: tuple[str, ...] = ()
    params: Callable = field(default=lambda spec: [], repr=False)
    mask_args: tuple[str, ...] = ()
    holds_causal: bool = False
    rule: bool = False  # a user rule (flashgen.modifiers): its spec field holds its source


def window_bound(side: int) -> int:
    """A window side as the kernel takes it: no bound is a bound no key reaches."""
    return UNBOUNDED if side < 0 else side


def _window_params(spec) -> list[Param]:
    return [scalar("window_left", "int", "window_bound(window_left)"), scalar("window_right", "int", "window_bound(window_right)")]


def _softcap_params(spec) -> list[Param]:
    return [scalar("softcap_scale", "float", "scale / softcap")]  # raw score -> tanh's argument


def _alibi_params(spec) -> list[Param]:
    return [pointer("alibi_slopes", "const float*"),
            scalar("alibi_batch_stride", "int", "alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0"),
            # slopes in the units of the value the softmax takes (score.cuh.j2)
            scalar("alibi_scale", "float", "1.0 / softcap" if has(spec, "softcap") else "1.0 / scale")]


def _rule_params(kind: str):
    def params(spec) -> list[Param]:
        from .modifiers import kernel_tensors

        return [Param(name, f"const {ctype}* __restrict__", "ptr", f"{kind}_tensors[{i}].data_ptr()")
                for i, (name, ctype) in enumerate(kernel_tensors(kind, getattr(spec, kind)))]

    return params


REGISTRY: tuple[Declaration, ...] = (
    Declaration("window", "window_size", ", sliding window", mask=True, arguments=("window_left", "window_right"),
                params=_window_params, mask_args=("window_left", "window_right"), holds_causal=True),
    Declaration("softcap", "softcap", ", soft-capped scores", score="pointwise", grad=True, tuning_key="softcap",
                arguments=("softcap",), params=_softcap_params),
    Declaration("alibi", "alibi_slopes", ", ALiBi", score="positional", arguments=("alibi_slopes",), params=_alibi_params),
    Declaration("score_mod", "score_mod", ", a user score rule", score="rule", grad=True, registers=48,
                arguments=("score_mod_tensors",), params=_rule_params("score_mod"), rule=True),
    Declaration("mask_mod", "mask_mod", ", a user mask rule", mask=True, registers=48, tuning_key="mask_rule",
                arguments=("mask_mod_tensors", "block_masks"), params=_rule_params("mask_mod"), rule=True),
)
BY_NAME = {declaration.name: declaration for declaration in REGISTRY}
FIELDS = tuple(declaration.name for declaration in REGISTRY if not declaration.rule)  # what KernelSpec.variants holds
RULES = tuple(declaration.name for declaration in REGISTRY if declaration.rule)  # spec fields of their own (sources)
# the kernels' named arguments: the variants' values, the rules' tensors and block masks
# (flashgen.blockmask.BlockMasks: the tiles a mask rule leaves, per tile shape, made on first use)
ARGUMENTS = tuple(name for declaration in REGISTRY for name in declaration.arguments)
TUNING_KEYS = {declaration.tuning_key: declaration.name for declaration in REGISTRY if declaration.tuning_key}


def on(spec) -> tuple[Declaration, ...]:
    """The declarations of the variants a spec has, in registry order."""
    return tuple(d for d in REGISTRY if (getattr(spec, d.name) if d.rule else d.name in spec.variants))


def has(spec, name: str) -> bool:
    declaration = BY_NAME[name]
    return bool(getattr(spec, name)) if declaration.rule else name in spec.variants


def normalized(names) -> tuple[str, ...]:
    """A spec's `variants`: known names, each once, in registry order (so equal specs compare equal)."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"variants={names!r}: must be a tuple of variant names ({', '.join(FIELDS)})")
    unknown = [name for name in names if name not in FIELDS]
    if unknown:
        raise ValueError(f"variants={tuple(names)!r}: {', '.join(map(repr, unknown))} is not one of {', '.join(FIELDS)}")
    return tuple(name for name in FIELDS if name in names)


@dataclass(frozen=True)
class Variant:
    """One call's variants. window_left / window_right: -1 = unbounded; with causal, the right
    side is 0 (FlashAttention's rule). softcap: 0 = none. alibi: slopes are passed (the tensor
    travels with the call's values, not here)."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False

    @property
    def window(self) -> bool:
        return (self.window_left, self.window_right) != (-1, -1)

    @cached_property
    def fields(self) -> tuple[str, ...]:
        """The spec fields this variant sets (only those that are on: the plain spec stays plain).
        Kept once computed: a decode step reads it on every call."""
        on = {"window": self.window, "softcap": self.softcap > 0, "alibi": self.alibi}
        return tuple(field for field, value in on.items() if value)

    def values(self) -> dict:
        """The kernels' named arguments, less the slopes tensor."""
        return {"window_left": self.window_left, "window_right": self.window_right, "softcap": self.softcap}


PLAIN = Variant()


def make(causal: bool, window_size, softcap, alibi_slopes, batch: int, heads: int, device, keys: int | None = None) -> Variant:
    """Check a call's variant arguments (named in every error) and normalize them: causal caps the
    window's right side at 0, and a window that bounds nothing is no window (causal alone, or
    nothing). With `keys` (FlashAttention's seqlen_k: attention_with_kvcache's cache capacity), a
    side of at least that many keys is unbounded, as FlashAttention makes it; so a window that
    only such sides bound is no window (which decides where rotary turns q)."""
    try:
        left, right = (int(x) for x in window_size)
        ok = len(tuple(window_size)) == 2 and all(int(x) == x for x in window_size)
    except (TypeError, ValueError):
        ok = False
    if not ok or left < -1 or right < -1 or max(left, right) >= UNBOUNDED:
        raise ValueError(
            f"window_size={window_size!r}: must be (left, right), two ints >= -1 (-1 = unbounded) below {UNBOUNDED}"
        )
    if keys is not None:
        left, right = clip_window((left, right), keys)
    if causal:
        right = 0
        if left == -1:
            right = -1  # causal alone: the causal mask, no window
    softcap = float(softcap or 0.0)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: must be a finite number >= 0 (0 = no soft-capping)")
    if alibi_slopes is not None:
        check_slopes(alibi_slopes, batch, heads, device)
    return Variant(left, right, softcap, alibi_slopes is not None)


def clip_window(window_size, keys: int) -> tuple[int, int]:
    """FlashAttention's rule for its seqlen_k (flash_attn_func: the keys' length; varlen:
    max_seqlen_k; kvcache: the cache's capacity): a window side of at least that many keys is
    unbounded (-1). It changes rows only where a sequence has more queries than keys plus one."""
    return tuple(-1 if side >= keys else side for side in window_size)


def check_slopes(slopes, batch: int, heads: int, device) -> None:
    import torch  # here: the CLI imports this module and must not pay for torch

    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes has dtype {slopes.dtype}; it must be torch.float32 (FlashAttention's rule)")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; it must be ({heads},) or ({batch}, {heads})")
    if slopes.stride(-1) != 1:
        raise ValueError("alibi_slopes' last dimension must be contiguous (stride 1)")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, the inputs on {device}: they must be on one device")


def params(spec, tiles: tuple[int, int, bool] | None = None) -> list[Param]:
    """The kernel parameters of the spec's variants and rules, after its others (an empty list for
    a plain spec). The softmax's own scale_log2 changes with softcap: see scale_log2(). `tiles`:
    (rows, columns, key-major) of the block mask lists a mask_mod kernel walks (its tile shape)."""
    out = [param for declaration in on(spec) for param in declaration.params(spec)]
    if spec.score_mod:
        out.append(scalar("score_unit", "float", "softcap if softcap else scale"))  # the score piece's value -> natural logit
    if spec.mask_mod and tiles is not None:
        lists = f"block_masks.get({tiles[0]}, {tiles[1]}, {tiles[2]})"
        out += [Param("bm_count", "const int* __restrict__", "ptr", f"{lists}.count.data_ptr()"),
                Param("bm_index", "const int* __restrict__", "ptr", f"{lists}.index.data_ptr()"),
                Param("bm_state", "const unsigned char* __restrict__", "ptr", f"{lists}.state.data_ptr()"),
                scalar("bm_batch", "int", f"{lists}.batch_stride"), scalar("bm_head", "int", f"{lists}.head_stride")]
    return out


def scale_log2(spec) -> str:
    """The host expression of the softmax's scale_log2, which turns the value the score piece
    leaves (the raw score; with softcap, tanh of the scaled one; with a score_mod, the logit
    itself) into a base-2 logit."""
    return "LOG2E" if spec.score_mod else "softcap * LOG2E" if has(spec, "softcap") else "scale * LOG2E"


HELPERS = {"window_bound": window_bound}
