"""flashgen.attention: SDPA's layout and arguments, checked (flashgen.inputs), then the
differentiable op pair of flashgen.ops with a fixed layout. Prebuilt (ahead-of-time) kernels enter
through `call` with their spec.
"""

from __future__ import annotations

import torch

from . import inputs, modifiers, ops, variants
from .compile import NoJitError  # noqa: F401  (re-exported: flashgen.NoJitError)
from .plans import DTYPES, FP8_DTYPES
from .spec import KernelSpec


def _well_formed(q, k, v) -> bool:
    """The per-call fast path of check_inputs: True when nothing is wrong."""
    if not type(q) is type(k) is type(v) is torch.Tensor:
        return False
    q_shape, k_shape, v_shape, dtype = q.shape, k.shape, v.shape, q.dtype  # each attribute read once: they cost
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return False
    batch, heads, _, head_dim = q_shape
    kv_batch, kv_heads, _, kv_dim = k_shape
    v_dim = v_shape[3]  # V may have a head dim of its own
    return (
        dtype in DTYPES and dtype == k.dtype == v.dtype and v_shape[:3] == k_shape[:3]
        and kv_batch == batch and kv_dim == head_dim and kv_heads and not heads % kv_heads
        and not head_dim % 8 and 8 <= head_dim <= 256 and (v_dim == head_dim or (not v_dim % 8 and 8 <= v_dim <= 256))
        and q.stride()[3] == 1 and k.stride()[3] == 1 and v.stride()[3] == 1  # cheaper than stride(-1)
        and q.is_cuda and q.get_device() == k.get_device() == v.get_device()  # ints: no device objects
    )


def check_inputs(q, k, v, fp8: bool = False) -> None:
    """Raise a clear error for anything the kernels cannot take. fp8: q, k, v are FP8, which
    inputs.fp8 checks (not the 16-bit rule)."""
    if not fp8 and _well_formed(q, k, v):
        return
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        inputs.tensor(name, t, 4, "(batch, heads, seq, head_dim), like F.scaled_dot_product_attention")
        if not fp8:
            inputs.half_precision(name, t)
    if not fp8:
        inputs.one_dtype(named)
    inputs.same("batch size", {name: t.shape[0] for name, t in named.items()})
    inputs.same("number of heads", {"k": k.shape[1], "v": v.shape[1]})
    inputs.query_groups(q.shape[1], k.shape[1])
    inputs.same("sequence length", {"k": k.shape[2], "v": v.shape[2]})
    inputs.head_dims(q.shape[3], k.shape[3], v.shape[3])
    inputs.last_dim_contiguous(named)
    inputs.on_one_cuda_device("attention", named)


def softmax_scale(scale, head_dim: int) -> float:
    return inputs.softmax_scale(scale, head_dim, "scale")


def attention(
    q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
    deterministic: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, learnable_sink: torch.Tensor | None = None,
    score_mod: modifiers.ScoreMod | None = None, mask_mod: modifiers.MaskMod | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Exact softmax(q k^T * scale) v without materializing the scores; differentiable.

    q, k: (B, H, Tq, d), (B, H_kv, Tk, d); v: (B, H_kv, Tk, d_v), with H a multiple of H_kv (GQA/MQA),
    float16 or bfloat16 on one CUDA device; any strides with the last dimension contiguous. d and
    d_v are multiples of 8 up to 256; v may have a head dim of its own (d_v != d: DeepSeek's 192 / 128
    in prefill and training), and the output then has d_v. causal=True masks bottom-right aligned: query i sees key j iff
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
    -slope * |i' - j|; learnable_sink, fp32 of shape (H,) (gpt-oss' attention sinks), joins each
    row's softmax denominator as one more logit that carries no value:
    p_ij = exp(s_ij - m_i) / (exp(sink_h - m_i) + sum_j exp(s_ij - m_i)), m_i the max over the row's
    scores and the sink (lse includes it; a row that sees no key gets 0 and lse = sink_h). They
    combine, and all are differentiable: the sink gets its gradient
    d sink_h = -sum_i P_sink,i * (dO_i . O_i), the slopes none.

    User rules (flashgen.ScoreMod, flashgen.MaskMod: a CUDA expression and its Python twin, compiled
    into the kernel): score_mod rewrites each score after the variants; mask_mod drops keys, and
    key tiles where it keeps none are never visited (a block mask, made once per shape for a rule
    that reads no tensor, per call otherwise). No gradient flows into a rule's tensors.

    FP8 (FlashAttention-3's arguments; sm_90a): q, k and v in torch.float8_e4m3fn, each with an
    optional descale, q_descale, k_descale, v_descale: fp32 (B, H_kv), the true value of an element
    being the stored one times the descale of its batch and KV head (None: 1). The output is
    bfloat16, or out_dtype (torch.bfloat16 or torch.float16). P is rounded to e4m3 for P V, as
    FlashAttention-3 does. The FP8 forward is forward-only: inputs that require grad are refused.
    """
    return call(q, k, v, causal, scale, return_lse, deterministic, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, score_mod=score_mod, mask_mod=mask_mod,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype)


def call_variant(q, k, causal, **keywords) -> variants.Variant:
    """A call's variants (flashgen.variants' keywords), checked: window sides of at least Tk keys
    are unbounded (flash_attn_func's rule), slopes are per head or per batch and head."""
    return variants.make(variants.Call(causal, q.shape[0], q.shape[1], q.device, keys=k.shape[-2]), **keywords)


def _with_neutral(spec: KernelSpec, chosen: variants.Variant, call: variants.Call, given: dict) -> variants.Variant:
    """A prebuilt kernel's variant that the call asked for but that bounds nothing at its shapes (a
    window of at least Tk keys, FlashAttention's rule) runs at values with which the kernel computes
    as if it were off (unbounded sides), rather than being refused."""
    neutral = {}
    for declaration in variants.on(spec):
        value = given.get(declaration.keyword, declaration.default)
        if declaration.neutral and declaration.name not in chosen.fields and value is not None and value != declaration.default:
            neutral.update(declaration.neutral(call))
    return variants.Variant({**chosen.args, **neutral}) if neutral else chosen


def _prebuilt(spec: KernelSpec, q, k, v, causal, chosen: variants.Variant, given: dict, dtypes: dict) -> variants.Variant:
    """The variant a prebuilt kernel runs a call with, once the call is one it was built for (its
    head dims, element type and variants; `dtypes` maps torch's to the spec's)."""
    if q.shape[-1] != spec.head_dim or v.shape[-1] != spec.d_v or dtypes[q.dtype] != spec.dtype:
        shape = f"head_dim={q.shape[-1]}" + (f", head_dim_v={v.shape[-1]}" if v.shape[-1] != q.shape[-1] else "")
        raise ValueError(f"{spec.name} takes {spec.dims_text} {spec.dtype}; got {shape} {dtypes[q.dtype]}")
    chosen = _with_neutral(spec, chosen, variants.Call(causal, q.shape[0], q.shape[1], q.device, k.shape[-2]), given)
    have = {d.name: getattr(spec, d.name) if d.rule else True for d in variants.on(spec)}
    wanted = dict(item if isinstance(item, tuple) else (item, True) for item in chosen.fields)
    if have != wanted:
        raise ValueError(f"{spec.name} is built for variants {sorted(have) or 'none'}; this call asks for {sorted(wanted) or 'none'}")
    return chosen


def call(q, k, v, causal, scale, return_lse, deterministic, spec: KernelSpec | None = None, *,
         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None, score_mod=None, mask_mod=None,
         q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """attention() with, optionally, the forward kernel fixed to `spec` (a prebuilt kernel's):
    the one path every public entry point takes."""
    q, k, v = ops.autocast_inputs(q, k, v)  # (FP8 inputs stay as they are)
    well_formed = _well_formed(q, k, v)  # (check_inputs' fast test, once)
    # FP8 (its arguments, or inputs the 16-bit fast test refuses that are FP8): a path of its own, off the hot one
    if (out_dtype is not None or not q_descale is k_descale is v_descale is None
            or (not well_formed and getattr(q, "dtype", None) in FP8_DTYPES)):
        return _fp8_call(q, k, v, causal, scale, return_lse, spec, q_descale, k_descale, v_descale, out_dtype,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                         score_mod=score_mod, mask_mod=mask_mod)
    if not well_formed:
        check_inputs(q, k, v)
    chosen, given = variants.PLAIN, {}
    if (alibi_slopes is not None or softcap or window_size != (-1, -1) or learnable_sink is not None or score_mod is not None
            or mask_mod is not None or spec is not None):  # (one cheap test for plain calls)
        given = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes,
                 "learnable_sink": learnable_sink, "score_mod": score_mod, "mask_mod": mask_mod}  # (flashgen.variants' keywords)
        chosen = call_variant(q, k, causal, **given)
    kernel = ""
    if spec is not None:
        chosen = _prebuilt(spec, q, k, v, causal, chosen, given, DTYPES)
        kernel = spec.canonical()
    o, lse = ops.attention(q, k, v, None, None, 0, 0, bool(causal), softmax_scale(scale, q.shape[-1]), kernel,
                           bool(deterministic), need_lse=bool(return_lse), variant=chosen.op_args())
    return (o, lse) if return_lse else o


def _fp8_call(q, k, v, causal, scale, return_lse, spec, q_descale, k_descale, v_descale, out_dtype, **keywords):
    """attention() with FP8 inputs: checked, then the FP8 forward (flashgen.ops.fp8_forward)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        inputs.tensor(name, t)
    if q.dtype not in FP8_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}: q_descale, k_descale, v_descale and out_dtype are for FP8 inputs "
                        "(torch.float8_e4m3fn q, k and v)")
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if out_dtype is None:  # bf16, or what a prebuilt kernel writes
        out_dtype = torch.bfloat16 if spec is None else getattr(torch, spec.output_element.torch)
    inputs.fp8({"q": q, "k": k, "v": v}, descales, out_dtype, q.shape[0], k.shape[1])
    check_inputs(q, k, v, fp8=True)
    inputs.on_one_cuda_device("attention", {"q": q, **descales})  # (descales may all be None: 1)
    learning = [name for name, value in keywords.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    if learning and torch.is_grad_enabled():
        raise RuntimeError(f"{inputs.listed(learning)} require{'s' if len(learning) == 1 else ''} grad: FP8 attention is "
                           "forward-only (as FlashAttention-3's); run it under torch.no_grad()")
    chosen = variants.make_if_given(lambda: variants.Call(causal, q.shape[0], q.shape[1], q.device, keys=k.shape[-2]), **keywords)
    kernel = ""
    if spec is not None:  # a prebuilt FP8 kernel: its output type too
        chosen = _prebuilt(spec, q, k, v, causal, chosen, keywords, FP8_DTYPES)
        built_for = getattr(torch, spec.output_element.torch)
        if out_dtype != built_for:
            raise ValueError(f"{spec.name} writes {built_for}; this call asks for out_dtype={out_dtype}")
        kernel = spec.canonical()
    o, lse = ops.fp8_forward(q, k, v, q_descale, k_descale, v_descale, None, None, 0, bool(causal), softmax_scale(scale, q.shape[-1]),
                             out_dtype, bool(return_lse), chosen.op_args(), kernel)
    return (o, lse) if return_lse else o
