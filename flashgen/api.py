"""flashgen.attention: input checks, the launch plans, and the torch.library custom ops.

The forward op carries the kernel it runs as its spec's canonical text ("" = the tables' choice),
so a graph traced by torch.compile holds no Python objects, and prebuilt (ahead-of-time) kernels
run through the same ops. In eager mode the same implementations run without the op dispatcher,
which costs more per call than everything else together (see run_attention).
"""

from __future__ import annotations

import math

import torch

from . import inputs, modifiers, plans, variants
from .blockmask import BlockMasks
from .compile import NoJitError  # noqa: F401  (re-exported: flashgen.NoJitError)
from .inputs import aligned
from .plans import DTYPES
from .spec import KernelSpec


# A call's variant travels as these arguments of the ops, after `deterministic`; PLAIN_ARGS are a
# plain call's (the eager path passes none at all).
VARIANT_ARGS = ("window_left", "window_right", "softcap", "alibi_slopes", "score_mod", "score_mod_tensors", "mask_mod",
                "mask_mod_tensors")
PLAIN_ARGS = (-1, -1, 0.0, None, "", [], "", [])


def _variant_values(q, k, causal, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, score_mod="",
                    score_mod_tensors=None, mask_mod="", mask_mod_tensors=None) -> tuple[tuple, dict]:
    """The variant of a call's kernels (tuning.variant_fields' form) and the values they take
    (flashgen.variants, flashgen.modifiers; the arguments are already checked)."""
    flags = variants.Variant(window_left, window_right, softcap, alibi_slopes is not None)
    variant = (*flags.fields, *((("score_mod", score_mod),) if score_mod else ()), *((("mask_mod", mask_mod),) if mask_mod else ()))
    values = {**flags.values(), "alibi_slopes": alibi_slopes, "score_mod_tensors": list(score_mod_tensors or ()),
              "mask_mod_tensors": list(mask_mod_tensors or ())}
    if mask_mod:
        rule = modifiers.Rule(mask_mod, values["mask_mod_tensors"])
        values["block_masks"] = BlockMasks(rule, causal, (window_left, window_right), q.shape[0], q.shape[1], q.shape[2],
                                           k.shape[2], q.device, plans.device_arch(q.get_device()))
    return variant, values


def forward_impl(q, k, v, causal: bool, scale: float, kernel: str, need_lse: bool = True, *variant, backward=None):
    """(o, lse) by the forward plan; lse is None when not needed (the kernel then skips it).
    `kernel` is the canonical text of the spec to run, or "" for the tables' choice; `variant` the
    VARIANT_ARGS, already checked (none: plain). `backward`: the deterministic flag of a backward
    that will follow, whose kernels then start loading first (plans.warm_backward), or None."""
    batch, heads, seqlen_q, head_dim = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device) if need_lse else None
    if o.numel() == 0:
        return o, lse
    if k.shape[2] == 0:  # no keys: every row sees nothing
        return o.zero_(), None if lse is None else lse.fill_(-math.inf)
    device = q.get_device()
    values = {"q": aligned(q), "k": aligned(k), "v": aligned(v), "o": o, "lse": lse, "scale": scale}
    fields = ()
    if variant and variant != PLAIN_ARGS:
        fields, more = _variant_values(q, k, causal, *variant)
        values.update(more)
    if backward is not None:
        plans.warm_backward(device, head_dim, q.dtype, causal, backward, kernel, fields)
    plans.forward(device, head_dim, q.dtype, causal, seqlen_q, kernel, fields).run(device, values)
    return o, lse


def backward_impl(d_o, q, k, v, o, lse, d_lse, causal: bool, scale: float, deterministic: bool, kernel: str = "",
                  *variant):
    """(dq, dk, dv) from the forward's inputs, output and log-sum-exp; P is recomputed. `kernel`
    is the forward's spec (canonical text, or ""): the backward compiles for its target."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    device = q.get_device()
    values = {name: aligned(t) for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("d_o", d_o))}
    values.update(lse=lse.contiguous(), d_lse=None if d_lse is None else d_lse.contiguous(), dq=dq, dk=dk, dv=dv, scale=scale,
                  dq_accum=None)  # the plan's scratch replaces it where a kernel adds dQ into an fp32 sum
    fields = ()
    if variant and variant != PLAIN_ARGS:
        fields, more = _variant_values(q, k, causal, *variant)
        values.update(more)
    plans.backward(device, q.shape[3], q.dtype, causal, deterministic, kernel, fields).run(device, values)
    return dq, dk, dv


@torch.library.custom_op("flashgen::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, kernel: str,
    deterministic: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
    score_mod: str, score_mod_tensors: list[torch.Tensor], mask_mod: str, mask_mod_tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse). `deterministic` only chooses the backward kernels (the forward always is)."""
    return forward_impl(q, k, v, causal, scale, kernel, True, window_left, window_right, softcap, alibi_slopes,
                        score_mod, score_mod_tensors, mask_mod, mask_mod_tensors)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, kernel, deterministic, *variant):
    batch, heads, seqlen_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(
    d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, d_lse: torch.Tensor | None, causal: bool, scale: float, deterministic: bool,
    kernel: str, window_left: int, window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
    score_mod: str, score_mod_tensors: list[torch.Tensor], mask_mod: str, mask_mod_tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's inputs, output and log-sum-exp; P is recomputed."""
    return backward_impl(d_o, q, k, v, o, lse, d_lse, causal, scale, deterministic, kernel, window_left, window_right,
                         softcap, alibi_slopes, score_mod, score_mod_tensors, mask_mod, mask_mod_tensors)


@attention_bwd.register_fake
def _attention_bwd_fake(d_o, q, k, v, o, lse, d_lse, causal, scale, deterministic, kernel, *variant):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


def side_tensors(variant) -> list[torch.Tensor]:
    """The tensors a variant reads (ALiBi slopes, rule tensors): saved for the backward with the
    inputs, so that one changed in place between forward and backward is an error, as q would be."""
    found = []
    for value in variant:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list):  # a rule's tensors
            found += value
    return found


def autocast_inputs(q, k, v):
    """Under CUDA autocast, every floating input but fp64 in the autocast dtype (SDPA's policy)."""
    if not torch.is_autocast_enabled("cuda"):
        return q, k, v
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, kernel, deterministic, *variant = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *side_tensors(variant))
    ctx.causal, ctx.scale, ctx.kernel, ctx.deterministic, ctx.variant = causal, scale, kernel, deterministic, variant
    ctx.set_materialize_grads(False)  # an unused lse then costs nothing in the backward


def _backward(ctx, d_o, d_lse, backward=attention_bwd, op=True):
    q, k, v, o, lse, *_ = ctx.saved_tensors  # (the side tensors: unpacked to check their versions)
    if d_o is None:
        d_o = torch.zeros_like(o)
    dq, dk, dv = backward(d_o, q, k, v, o, lse, d_lse, ctx.causal, ctx.scale, ctx.deterministic, ctx.kernel, *ctx.variant)
    # no gradient for the variant's arguments (the op's autograd wants a list for each list of tensors)
    return dq, dk, dv, None, None, None, None, *([None] * len(a) if op and isinstance(a, list) else None for a in ctx.variant)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's autograd, minus the dispatcher: what eager training calls."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel, deterministic, *variant):
        output = forward_impl(q, k, v, causal, scale, kernel, True, *variant, backward=deterministic)
        _setup_context(ctx, (q, k, v, causal, scale, kernel, deterministic, *variant), output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph: refused, not silently cut
    def backward(ctx, d_o, d_lse):
        return _backward(ctx, d_o, d_lse, backward=backward_impl, op=False)


def run_attention(q, k, v, causal: bool, scale: float, kernel: str, deterministic: bool, need_lse: bool = True,
                  variant: tuple = ()):
    """(o, lse): through the custom op when torch.compile traces the call; in eager mode through
    the same implementation directly (with autograd only when a gradient is needed). Without a
    gradient and with need_lse=False, lse is None and never computed. `variant` is () or
    (window_left, window_right, softcap, alibi_slopes), checked."""
    if torch.compiler.is_compiling():
        return attention_fwd(q, k, v, causal, scale, kernel, deterministic, *(variant or PLAIN_ARGS))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, causal, scale, kernel, deterministic, *variant)
    return forward_impl(q, k, v, causal, scale, kernel, need_lse, *variant)


def _well_formed(q, k, v) -> bool:
    """The per-call fast path of check_inputs: True when nothing is wrong."""
    if not type(q) is type(k) is type(v) is torch.Tensor:
        return False
    q_shape, k_shape, dtype = q.shape, k.shape, q.dtype  # each attribute read once: they cost
    if len(q_shape) != 4 or len(k_shape) != 4:
        return False
    batch, heads, _, head_dim = q_shape
    kv_batch, kv_heads, _, kv_dim = k_shape
    return (
        dtype in DTYPES and dtype == k.dtype == v.dtype and v.shape == k_shape
        and kv_batch == batch and kv_dim == head_dim and kv_heads and not heads % kv_heads
        and not head_dim % 8 and 8 <= head_dim <= 256
        and q.stride()[3] == 1 and k.stride()[3] == 1 and v.stride()[3] == 1  # cheaper than stride(-1)
        and q.is_cuda and q.get_device() == k.get_device() == v.get_device()  # ints: no device objects
    )


def check_inputs(q, k, v) -> None:
    """Raise a clear error for anything the kernels cannot take."""
    if _well_formed(q, k, v):
        return
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        inputs.tensor(name, t, 4, "(batch, heads, seq, head_dim), like F.scaled_dot_product_attention")
        inputs.half_precision(name, t)
    inputs.one_dtype(named)
    inputs.same("batch size", {name: t.shape[0] for name, t in named.items()})
    inputs.same("number of heads", {"k": k.shape[1], "v": v.shape[1]})
    inputs.query_groups(q.shape[1], k.shape[1])
    inputs.same("sequence length", {"k": k.shape[2], "v": v.shape[2]})
    inputs.same("head_dim", {name: t.shape[3] for name, t in named.items()})
    inputs.head_dim(q.shape[3])
    inputs.last_dim_contiguous(named)
    inputs.on_one_cuda_device("attention", named)


def softmax_scale(scale, head_dim: int) -> float:
    return inputs.softmax_scale(scale, head_dim, "scale")


def attention(
    q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
    deterministic: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, score_mod: modifiers.ScoreMod | None = None,
    mask_mod: modifiers.MaskMod | None = None,
):
    """Exact softmax(q k^T * scale) v without materializing the scores; differentiable.

    q: (B, H, Tq, d); k, v: (B, H_kv, Tk, d) with H a multiple of H_kv (GQA/MQA), float16 or
    bfloat16 on one CUDA device; any strides with the last dimension contiguous. d is a multiple
    of 8 up to 256. causal=True masks bottom-right aligned: query i sees key j iff
    j <= i + Tk - Tq (SDPA's is_causal when Tq == Tk); a query that sees no key gets 0.
    Under torch.autocast, floating inputs (but fp64) are cast to the autocast dtype first, as SDPA does.
    scale defaults to 1/sqrt(d). With return_lse=True also returns the (B, H, Tq) fp32
    log-sum-exp of the scaled scores (natural log; -inf for a row with no visible key).

    The forward is deterministic. The default backward adds dq up with fp32 atomics, so dq may
    differ in its last bits from run to run (dk and dv never do); deterministic=True computes dq in
    a separate pass instead, which costs some speed and gives bitwise-identical gradients.

    Variants, with FlashAttention's names and semantics (flash_attn_func's), on the scaled scores
    s of query i and key j, with i' = i + Tk - Tq: window_size=(left, right) keeps keys
    i' - left <= j <= i' + right (-1, or a side of at least Tk, = no bound on that side; causal
    sets right to 0), and key
    tiles outside the window are never visited; softcap > 0 makes the scores
    softcap * tanh(s / softcap); alibi_slopes, fp32 of shape (H,) or (B, H), adds
    -slope * |i' - j|. They combine, and all are differentiable (no gradient for the slopes).

    User rules (flashgen.ScoreMod, flashgen.MaskMod: a CUDA expression and its Python twin, compiled
    into the kernel): score_mod rewrites each score after the variants; mask_mod drops keys, and
    key tiles where it keeps none are never visited (a block mask, made once per shape for a rule
    that reads no tensor, per call otherwise). No gradient flows into a rule's tensors.
    """
    return call(q, k, v, causal, scale, return_lse, deterministic, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod)


def call_variant(q, k, causal, window_size, softcap, alibi_slopes, score_mod, mask_mod) -> tuple:
    """A call's variant arguments, checked, as the ops take them (VARIANT_ARGS), or () when plain.
    Window sides of at least Tk keys are unbounded (flash_attn_func's rule)."""
    chosen = variants.make(causal, window_size, softcap, alibi_slopes, q.shape[0], q.shape[1], q.device, keys=k.shape[-2])
    rules = []
    for name, rule, kind in (("score_mod", score_mod, modifiers.ScoreMod), ("mask_mod", mask_mod, modifiers.MaskMod)):
        if rule is not None and not isinstance(rule, kind):
            raise TypeError(f"{name} must be a flashgen.{kind.__name__}, got {type(rule).__name__}")
        tensors = [] if rule is None else rule.arguments()
        for tensor_name, tensor in zip(() if rule is None else rule.tensors, tensors):
            if tensor.device != q.device:
                raise ValueError(f"{name}'s tensor {tensor_name!r} is on {tensor.device}, the inputs on {q.device}")
        rules += ["" if rule is None else rule.source, tensors]
    if chosen == variants.PLAIN and not rules[0] and not rules[2]:
        return ()
    slopes = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[1])  # sliced like q
    return (chosen.window_left, chosen.window_right, chosen.softcap, slopes, *rules)


def call(q, k, v, causal, scale, return_lse, deterministic, spec: KernelSpec | None = None, *,
         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None, mask_mod=None):
    """attention() with, optionally, the forward kernel fixed to `spec` (a prebuilt kernel's):
    the one path every public entry point takes."""
    q, k, v = autocast_inputs(q, k, v)
    check_inputs(q, k, v)
    variant = ()
    if alibi_slopes is not None or softcap or window_size != (-1, -1) or score_mod is not None or mask_mod is not None:
        variant = call_variant(q, k, causal, window_size, softcap, alibi_slopes, score_mod, mask_mod)  # () when plain
    kernel = ""
    if spec is not None:
        if q.shape[-1] != spec.head_dim or DTYPES[q.dtype] != spec.dtype:
            raise ValueError(
                f"{spec.name} takes head_dim={spec.head_dim} {spec.dtype}; got head_dim="
                f"{q.shape[-1]} {DTYPES[q.dtype]}"
            )
        wanted = dict.fromkeys(variants.Variant(*variant[:3], variant[3] is not None).fields if variant else (), True)
        if spec.window and tuple(window_size) != (-1, -1) and "window" not in wanted:
            # the call's window bounds nothing at this Tk (sides >= Tk are unbounded): the window kernel
            # runs it with unbounded sides (causal's right side stays 0: the kernel's window is its mask)
            variant = (-1, 0 if causal else -1, *(variant[2:] if variant else (0.0, None, "", [], "", [])))
            wanted["window"] = True
        wanted.update({field: source for field, source in zip(("score_mod", "mask_mod"), variant[4::2]) if source})
        have = {field: getattr(spec, field) for field in (*variants.FIELDS, "score_mod", "mask_mod") if getattr(spec, field)}
        if have != wanted:
            raise ValueError(
                f"{spec.name} is built for variants {sorted(have) or 'none'}; this call asks for {sorted(wanted) or 'none'}"
            )
        kernel = spec.canonical()
    o, lse = run_attention(
        q, k, v, bool(causal), softmax_scale(scale, q.shape[-1]), kernel, bool(deterministic), need_lse=bool(return_lse),
        variant=variant,
    )
    return (o, lse) if return_lse else o
