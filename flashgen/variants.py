"""Attention variants: sliding windows, logit soft-capping and ALiBi, with FlashAttention's names
and semantics.

A variant has two halves. Its spec field (`window`, `softcap`, `alibi`) renders the code: the
window's tests into the mask piece (templates/mask.cuh.j2), the cap and the bias into the score
piece (templates/score.cuh.j2); a spec without one renders no trace of it. Its values (the window's
bounds, the cap, the slopes) are kernel arguments, so one compiled kernel serves every window,
cap and slope. `Variant` is one call's values, checked, and what the plans and launches read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from .params import Param, pointer, scalar

FIELDS = ("window", "softcap", "alibi")  # the spec fields
# the kernels' named arguments: the variants' values, the modifiers' tensors, and the block masks
# (flashgen.blockmask.BlockMasks: the tiles a mask rule leaves, per tile shape, made on first use)
ARGUMENTS = ("window_left", "window_right", "softcap", "alibi_slopes", "score_mod_tensors", "mask_mod_tensors", "block_masks")
UNBOUNDED = 1 << 30  # a window side without bound, as the kernel takes it (no sequence is this long)


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


def window_bound(side: int) -> int:
    """A window side as the kernel takes it: no bound is a bound no key reaches."""
    return UNBOUNDED if side < 0 else side


def params(spec, tiles: tuple[int, int, bool] | None = None) -> list[Param]:
    """The kernel parameters of the spec's variants and modifiers, after its others (an empty list
    for a plain spec). The softmax's own scale_log2 changes with softcap: see scale_log2(). `tiles`:
    (rows, columns, key-major) of the block mask lists a mask_mod kernel walks (its tile shape)."""
    from .modifiers import kernel_tensors

    out = []
    if spec.window:
        out += [scalar("window_left", "int", "window_bound(window_left)"),
                scalar("window_right", "int", "window_bound(window_right)")]
    if spec.softcap:
        out.append(scalar("softcap_scale", "float", "scale / softcap"))  # raw score -> tanh's argument
    if spec.alibi:
        out += [pointer("alibi_slopes", "const float*"),
                scalar("alibi_batch_stride", "int", "alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0"),
                # slopes in the units of the value the softmax takes (score.cuh.j2)
                scalar("alibi_scale", "float", "1.0 / softcap" if spec.softcap else "1.0 / scale")]
    for kind in ("score_mod", "mask_mod"):
        source = getattr(spec, kind)
        if source:
            out += [Param(name, f"const {ctype}* __restrict__", "ptr", f"{kind}_tensors[{i}].data_ptr()")
                    for i, (name, ctype) in enumerate(kernel_tensors(kind, source))]
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
    return "LOG2E" if spec.score_mod else "softcap * LOG2E" if spec.softcap else "scale * LOG2E"


HELPERS = {"window_bound": window_bound}
