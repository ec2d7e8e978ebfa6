"""The torch side of every call: the torch.library custom ops (what torch.compile records), their
fake implementations, autograd, and the eager path, for each layout the public functions take.

- fixed (flashgen.attention: (batch, heads, seq, d)) and packed (attention_varlen: (total, heads,
  d) with cu_seqlens) are one differentiable op pair, flashgen::attention_fwd / attention_bwd: a
  packed call passes its cu_seqlens, a fixed one None. The forward op carries the kernel it runs
  as its spec's canonical text ("" = the tables' choice), so a traced graph holds no Python
  objects and prebuilt kernels run through the same ops. In eager mode the same implementations
  run without the op dispatcher, which costs more per call than everything else together.
- paged (the decode kernels: attention_with_kvcache, attention_varlen over a block table) and the
  merge of two states are forward-only ops (decode_impl, merge_impl), recorded whole under
  torch.compile; when such an op runs, its public function runs eagerly, checks included.

A call's arguments are checked by its public function (flashgen.inputs) before they reach here.
"""

from __future__ import annotations

import torch

from . import kernels, modifiers, plans, tuning, variants
from .blockmask import BlockMasks
from .families.decode import fast_divisor
from .inputs import aligned

# A call's variants travel as these arguments of the ops, after `deterministic` (flashgen.variants
# declares them); PLAIN_ARGS are a plain call's (the eager path passes none at all).
VARIANT_ARGS = tuple(name for name, _, _ in variants.OP_ARGS)
PLAIN_ARGS = variants.PLAIN_ARGS


def autocast_inputs(q, k, v):
    """Under CUDA autocast, every floating input but fp64 and FP8 in the autocast dtype (SDPA's
    policy; FP8 inputs are already quantized, with their descales)."""
    if not torch.is_autocast_enabled("cuda"):
        return q, k, v
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 and t.dtype not in plans.FP8_DTYPES else t for t in (q, k, v))


def variant_values(q, k, causal, *op_args) -> tuple[tuple, dict]:
    """The variant of a call's kernels (tuning.variant_fields' form) and the values they take by
    name, from the ops' variant arguments (already checked). A mask rule's block mask honours the
    other variants that hide keys; rules take fixed layouts only: it reads q and k as (batch,
    heads, seq, d)."""
    chosen = variants.Variant.from_op_args(op_args)
    values = chosen.values()
    if "mask_mod" in chosen.args:
        rule = modifiers.Rule(chosen.args["mask_mod"], values["mask_mod_tensors"])
        masks = tuple(name for name in chosen.fields if name in variants.FIELDS and variants.BY_NAME[name].mask)
        mask_values = {arg: values[arg] for name in masks for arg in variants.BY_NAME[name].arguments}
        values["block_masks"] = BlockMasks(rule, causal, masks, mask_values, q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                           q.device, plans.device_arch(q.get_device()))
    return chosen.fields, values


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


# ---- fixed and packed: the differentiable op pair ----------------------------------------------------


def output_like(q, v):
    """The output: q's layout, with V's head dim."""
    return torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty((*q.shape[:-1], v.shape[-1]))


def grad_v_like(k, v):
    """dV, allocated like k (the kernels take dK's strides for it) unless V has a head dim of its own."""
    return torch.empty_like(k) if v.shape == k.shape else k.new_empty(v.shape)


def forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, causal: bool, scale: float, kernel: str,
                 need_lse: bool = True, *variant, backward=None):
    """(o, lse) by the forward plan: o like q; lse (batch, heads, seq) fixed, (heads, total_q)
    packed (cu_seqlens given), fp32, or None when not needed (the kernel then skips it). `kernel`
    is the canonical text of the spec to run, or "" for the tables' choice; `variant` the
    VARIANT_ARGS, already checked (none: plain). `backward`: the deterministic flag of a backward
    that will follow, whose kernels then start loading first (plans.warm_backward), or None."""
    packed = cu_seqlens_q is not None
    if packed:
        total_q, heads, head_dim = q.shape
        lse_shape, keys, seqlen_q = (heads, total_q), k.shape[0], min(max_seqlen_q, total_q)  # (no sequence is longer)
    else:
        batch, heads, seqlen_q, head_dim = q.shape
        lse_shape, keys = (batch, heads, seqlen_q), k.shape[2]
    head_dim_v = v.shape[-1] if v.shape[-1] != head_dim else 0  # V's head dim where it has its own
    o = output_like(q, v)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    if o.numel() == 0:
        return o, lse
    if keys == 0:  # no keys: every row sees nothing
        return o.zero_(), None if lse is None else variants.no_key_lse(lse, packed, variant)
    device = q.get_device()
    values = {"q": aligned(q), "k": aligned(k), "v": aligned(v), "o": o, "lse": lse, "scale": scale}
    if packed:
        values.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=seqlen_q)
    fields = ()
    if variant and variant != PLAIN_ARGS:
        fields, more = variant_values(q, k, causal, *variant)
        values.update(more)
    if backward is not None:
        plans.warm_backward(device, head_dim, q.dtype, causal, backward, kernel, fields, varlen=packed, head_dim_v=head_dim_v)
    plan = (plans.forward_varlen if packed else plans.forward)(device, head_dim, q.dtype, causal, seqlen_q, kernel, fields,
                                                               head_dim_v=head_dim_v)
    plan.run(device, values)
    return o, lse


# ---- FP8: a forward-only op -------------------------------------------------------------------------

# Within each 16 keys, the key that position k of FP8's transposed V holds: the order in which a
# thread's e4m3 registers of P hold them (templates/fwd_sm90_consumer.cuh.j2, convert_p: position
# 4 t + b is key 2 t + b % 2 + 8 (b / 2)), so P needs no exchange between lanes. The fp8_v kernel
# (templates/fp8_values.cu.j2) lays V out so.
FP8_KEY_ORDER = tuple(2 * (k // 4) + (k % 4) % 2 + 8 * ((k % 4) // 2) for k in range(16))


def fp8_values(v: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """V (e4m3: (B, H_kv, keys, d_v), or packed (total_k, H_kv, d_v) with cu_seqlens_k) laid out as
    the FP8 forward's kernel reads it, by the fp8_v kernel alone (the forward's plan runs it as its
    first step; flashgen.reference.fp8_values and fp8_values_varlen say the layout in PyTorch)."""
    values = {"v_keys": aligned(v), "cu_seqlens_k": None if cu_seqlens_k is None else cu_seqlens_k.contiguous()}
    values["v"] = torch.empty(plans.fp8_values_shape(values), dtype=v.dtype, device=v.device)
    if v.numel() == 0 or (cu_seqlens_k is not None and cu_seqlens_k.shape[0] < 2):  # nothing to lay out: no grid
        return values["v"].zero_()
    device = v.get_device()
    kernels.get(tuning.fp8_values_spec(v.shape[-1], plans.device_arch(device), cu_seqlens_k is not None)).launch(device, values)
    return values["v"]


def fp8_forward(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, causal: bool,
                scale: float, out_dtype: torch.dtype, need_lse: bool, variant: tuple, kernel: str = ""):
    """(o, lse) of an FP8 forward (e4m3 q, k, v, checked: flashgen.attention's layout, or packed
    with cu_seqlens as attention_varlen's; descales fp32 (batch or sequences, H_kv) or None): o in
    out_dtype with V's head dim, lse (B, H, Tq) or (H, total_q) fp32 or None. `kernel`: the
    canonical text of the spec to run ("" = the tables' choice). Through the custom op when
    torch.compile traces the call (lse then always computed)."""
    if torch.compiler.is_compiling():
        return attention_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale,
                             out_dtype, kernel, *(variant or PLAIN_ARGS))
    return _fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale,
                             out_dtype, need_lse, variant, kernel)


@torch.library.custom_op("flashgen::attention_fp8", mutates_args=(), device_types="cuda", schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, bool causal, float scale, ScalarType out_dtype, str kernel, "
    f"{variants.OP_SCHEMA}) -> (Tensor, Tensor)"))
def attention_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, out_dtype,
                  kernel, *variant):
    """(o, lse) of the FP8 forward as one op (what torch.compile records); `variant`: VARIANT_ARGS."""
    return _fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale,
                             out_dtype, True, variant, kernel)


@attention_fp8.register_fake
def _attention_fp8_fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale,
                        out_dtype, kernel, *variant):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype), q.new_empty(lse_shape, dtype=torch.float32)


def _fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, causal: bool,
                      scale: float, out_dtype: torch.dtype, need_lse: bool, variant: tuple, kernel: str):
    packed = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    lse_shape = (q.shape[1], q.shape[0]) if packed else q.shape[:3]
    o = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    if o.numel() == 0:
        return o, lse
    if k.shape[0 if packed else 2] == 0:  # no keys: every row sees nothing
        return o.zero_(), None if lse is None else variants.no_key_lse(lse, packed, variant)
    values = {"q": aligned(q), "k": aligned(k), "v_keys": aligned(v), "o": o,  # (the plan lays V out for its kernel: `v`)
              "lse": lse, "scale": scale, **{name: None if t is None else t.contiguous() for name, t in
                                             (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))}}
    if packed:
        values.update(cu_seqlens_q=cu_seqlens_q.contiguous(), cu_seqlens_k=cu_seqlens_k.contiguous(),
                      max_seqlen_q=min(max_seqlen_q, q.shape[0]))
    fields = ()
    if variant and variant != PLAIN_ARGS:
        fields, more = variant_values(q, k, causal, *variant)
        values.update(more)
    head_dim_v = v.shape[-1] if v.shape[-1] != head_dim else 0
    plans.forward_fp8(q.get_device(), head_dim, out_dtype, causal, fields, head_dim_v, kernel, packed).run(q.get_device(), values)
    return o, lse


def learned(variant) -> tuple[str, torch.Tensor] | None:
    """The given variant argument that takes a gradient, by name (a sink's (batch or sequences,
    heads) logits), or None: the backward returns its gradient."""
    return next(((name, value) for (name, _, _), value in zip(variants.OP_ARGS, variant)
                 if value is not None and name in variants.GRADIENTS), None)


def _learned_grad_like(variant, lse):
    given = learned(variant)
    return lse.new_empty((0,)) if given is None else torch.empty(given[1].shape, dtype=torch.float32, device=lse.device)


def backward_impl(d_o, q, k, v, o, lse, d_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                  causal: bool, scale: float, deterministic: bool, kernel: str = "", *variant):
    """(dq, dk, dv, learned_grad) from the forward's inputs, output and log-sum-exp; P is recomputed.
    `kernel` is the forward's spec (canonical text, or ""): the backward compiles for its target.
    learned_grad is the gradient of a learned variant argument (a sink's, in its shape), which the
    prep sums from its delta = rowsum(dO * O) - dlse and lse (variants.GRADIENTS' rule); empty
    unless one is given."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), grad_v_like(k, v)
    learned_grad = _learned_grad_like(variant, lse)
    if q.numel() == 0 or k.numel() == 0:  # (no keys: O = 0, delta = -dlse)
        if learned_grad.numel():  # (no kernel runs: the rule itself)
            name, value = learned(variant)
            delta = -d_lse if d_lse is not None else torch.zeros_like(lse)
            learned_grad.copy_(variants.GRADIENTS[name](value, delta, lse, cu_seqlens_q))
        return dq.zero_(), dk.zero_(), dv.zero_(), learned_grad
    device = q.get_device()
    values = {name: aligned(t) for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("d_o", d_o))}
    values.update(lse=lse.contiguous(), d_lse=None if d_lse is None else d_lse.contiguous(), dq=dq, dk=dk, dv=dv, scale=scale,
                  dq_accum=None)  # the plan's scratch replaces it where a kernel adds dQ into an fp32 sum
    packed = cu_seqlens_q is not None
    if packed:
        values.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=min(max_seqlen_q, q.shape[0]),
                      max_seqlen_k=min(max_seqlen_k, k.shape[0]))
    fields = ()
    if variant and variant != PLAIN_ARGS:
        fields, more = variant_values(q, k, causal, *variant)
        values.update(more)
    head_dim_v = v.shape[-1] if v.shape[-1] != q.shape[-1] else 0
    plan = (plans.backward_varlen if packed else plans.backward)(device, q.shape[-1], q.dtype, causal, deterministic, kernel,
                                                                 fields, head_dim_v=head_dim_v)
    plan.run(device, values)
    if learned_grad.numel():
        torch.sum(values["learned_grad"], -1, out=learned_grad)
    return dq, dk, dv, learned_grad


@torch.library.custom_op("flashgen::attention_fwd", mutates_args=(), device_types="cuda", schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    f"bool causal, float scale, str kernel, bool deterministic, {variants.OP_SCHEMA}) -> (Tensor, Tensor)"))
def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel, deterministic,
                  *variant):
    """(o, lse). max_seqlen_k and `deterministic` are for the backward (the forward always is);
    `variant`: VARIANT_ARGS."""
    return forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, kernel, True, *variant)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, cu_seqlens_q, *args):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
    return output_like(q, v), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flashgen::attention_bwd", mutates_args=(), device_types="cuda", schema=(
    "(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? d_lse, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, float scale, bool deterministic, "
    f"str kernel, {variants.OP_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)"))
def attention_bwd(d_o, q, k, v, o, lse, d_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                  deterministic, kernel, *variant):
    """(dq, dk, dv, learned_grad) from the forward's inputs, output and log-sum-exp; P is recomputed."""
    return backward_impl(d_o, q, k, v, o, lse, d_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                         deterministic, kernel, *variant)


@attention_bwd.register_fake
def _attention_bwd_fake(d_o, q, k, v, o, lse, *args):
    variant = args[-len(variants.OP_ARGS):]
    return torch.empty_like(q), torch.empty_like(k), grad_v_like(k, v), _learned_grad_like(variant, lse)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel, deterministic, *variant = inputs
    o, lse = output
    ctx.packed = cu_seqlens_q is not None
    ctx.save_for_backward(q, k, v, o, lse, *((cu_seqlens_q, cu_seqlens_k) if ctx.packed else ()), *side_tensors(variant))
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.causal, ctx.scale, ctx.kernel, ctx.deterministic, ctx.variant = causal, scale, kernel, deterministic, variant
    ctx.set_materialize_grads(False)  # an unused lse then costs nothing in the backward


def _backward(ctx, d_o, d_lse, backward=attention_bwd, op=True):
    q, k, v, o, lse, *rest = ctx.saved_tensors  # (the side tensors: unpacked to check their versions)
    cu_seqlens_q, cu_seqlens_k = rest[:2] if ctx.packed else (None, None)
    if d_o is None:
        d_o = torch.zeros_like(o)
    dq, dk, dv, learned_grad = backward(d_o, q, k, v, o, lse, d_lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q,
                                        ctx.max_seqlen_k, ctx.causal, ctx.scale, ctx.deterministic, ctx.kernel, *ctx.variant)
    # the layout and the settings take no gradient; of the variant's arguments, a learned one's tensor
    # (a sink) does, the others none (the op's autograd wants a list for each list of tensors)
    grads = []
    for (name, _, _), value in zip(variants.OP_ARGS, ctx.variant):
        if name in variants.GRADIENTS and value is not None:
            grads.append(learned_grad)
        else:
            grads.append([None] * len(value) if op and isinstance(value, list) else None)
    return dq, dk, dv, *[None] * 8, *grads


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's autograd, minus the dispatcher: what eager training calls."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel, deterministic,
                *variant):
        output = forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, kernel, True, *variant,
                              backward=deterministic)
        _setup_context(ctx, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel,
                             deterministic, *variant), output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph: refused, not silently cut
    def backward(ctx, d_o, d_lse):
        return _backward(ctx, d_o, d_lse, backward=backward_impl, op=False)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
              kernel: str, deterministic: bool, need_lse: bool = True, variant: tuple = ()):
    """(o, lse) of checked inputs: through the custom op when torch.compile traces the call; in
    eager mode through the same implementation directly (with autograd only when a gradient is
    needed). Without a gradient and with need_lse=False, lse is None and never computed.
    cu_seqlens_q / cu_seqlens_k: None for a fixed layout (max_seqlen_* unused); `variant` is () or
    the VARIANT_ARGS, checked."""
    if torch.compiler.is_compiling():
        return attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel,
                             deterministic, *(variant or PLAIN_ARGS))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kernel,
                                     deterministic, *variant)
    return forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, kernel, need_lse, *variant)


# ---- paged: the decode kernels, forward only -------------------------------------------------------

NO_STRIDES = (0, 0, 0, 0)  # of the new keys and values when there are none


def kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, paged: bool, capacity: int, seqlen_new: int,
            scale: float, causal: bool, variant: variants.Variant, rotary: str, rotary_cos, rotary_sin,
            cache_batch_idx, cache_leftpad, num_splits: int, need_lse: bool, *, k_descale=None, v_descale=None):
    """(o, lse) of attention_with_kvcache's checked inputs: the decode plan for the shape, one
    launch (split-KV merged inside it); lse (batch, heads, seqlen_q) fp32, or None. An FP8 cache
    comes with its descales (fp32 (batch, heads_kv))."""
    batch, seqlen_q, heads, head_dim = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)  # half of torch.empty's host cost
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device) if need_lse else None
    if o.numel() == 0:
        return o, lse
    device = q.get_device()
    kv_dtype = plans.FP8_DTYPES.get(k_cache.dtype, "")
    # (an FP8 cache's long chunks run in the decode kernel too: the paged Hopper forward reads 16-bit pages)
    if paged and not rotary and cache_batch_idx is None and cache_leftpad is None and not kv_dtype:
        prefill = plans.paged_prefill(device, head_dim, q.dtype, causal, seqlen_q, variant.fields)
        if prefill is not None:  # a long chunk: the Hopper forward reads the pages (the new keys stored in them first)
            return _paged_chunk(prefill, q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, seqlen_new, o, lse,
                                causal, scale, variant)
    keys = capacity + seqlen_new
    if variant.args:
        keys = min(keys, variant.keys_seen(seqlen_q) or keys)  # the most one block's windows see
    plan, splits = plans.decode(device, head_dim, q.dtype, paged, seqlen_q * (heads // k_cache.shape[2]), batch,
                                k_cache.shape[2], keys, num_splits, variant.fields, rotary, kv_dtype=kv_dtype)
    values = decode_values(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, seqlen_new, o, lse, splits,
                           causal, scale, variant, k_descale=k_descale, v_descale=v_descale)
    if rotary or cache_batch_idx is not None or cache_leftpad is not None:  # (not the usual decode step)
        values.update(decode_extras(cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin))
    plan.run(device, values)
    return o, lse


def _run_paged_prefill(plan, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, block_table, o, lse,
                       scale: float, variant: variants.Variant, k=None, v=None) -> None:
    """Packed queries (total_q, heads, d) over their sequences' pages, by the paged Hopper forward's
    plan (plans.paged_prefill): o (total_q, heads, d), lse (heads, total_q) or None. k, v: an
    append's new keys (batch, seqlen_new, heads_kv, d), the last of each sequence's keys, read from
    there where the pages have no place for them; or None."""
    values = {"q": aligned(q), "k": k_cache, "v": v_cache, "o": o, "lse": lse, "scale": scale,
              "cu_seqlens_q": cu_seqlens_q.contiguous(), "cu_seqlens_k": cu_seqlens_k.contiguous(),
              "max_seqlen_q": max_seqlen_q, "block_table": block_table.contiguous(),
              "k_new": None if k is None else aligned(k), "v_new": None if v is None else aligned(v),
              "seqlen_new": 0 if k is None else k.shape[1]}
    if variant.args:
        values.update(variant.values())
    plan.run(q.get_device(), values)


def _paged_chunk(plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int, seqlen_new: int, o, lse,
                 causal, scale, variant):
    """attention_with_kvcache's chunk of queries over a paged cache, as packed sequences for the
    paged Hopper forward: sequence b is q[b] over the first cache_seqlens[b] keys of its pages
    (clamped to [0, capacity], as the decode kernels do), then the new keys k[b], v[b] appended
    after them (the append kernel stores those that have a place first; the forward reads the
    others from k, v)."""
    batch, seqlen_q, heads, head_dim = q.shape
    device = q.get_device()
    if seqlen_new == 0:  # (k and v of no rows: nothing to append, nor a map to make of them)
        k = v = None
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.to(torch.int64).clamp(0, capacity)
    else:  # (an int for every sequence; None: every page is full)
        lengths = torch.full((batch,), capacity if cache_seqlens is None else min(max(cache_seqlens, 0), capacity),
                             dtype=torch.int64, device=q.device)
    if k is not None:
        plans.kv_append(device, head_dim, q.dtype).run(device, decode_values(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, seqlen_new, o, lse, 1, causal, scale))
        lengths = lengths + seqlen_new
    cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    packed_lse = torch.empty(heads, batch * seqlen_q, dtype=torch.float32, device=q.device) if lse is not None else None
    _run_paged_prefill(plan, q.reshape(batch * seqlen_q, heads, head_dim), k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                       seqlen_q, block_table, o.view(batch * seqlen_q, heads, head_dim), packed_lse, scale, variant, k, v)
    if lse is not None:
        lse.copy_(packed_lse.view(heads, batch, seqlen_q).transpose(0, 1))
    return o, lse


@torch.library.custom_op("flashgen::attention_with_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda", schema=(
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? rotary_cos, Tensor? rotary_sin, "
    "Tensor? cache_seqlens, SymInt cache_len, Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
    "float? softmax_scale, bool causal, bool rotary_interleaved, SymInt num_splits, bool return_softmax_lse, "
    f"Tensor? k_descale, Tensor? v_descale, {variants.KEYWORD_SCHEMA}) -> (Tensor, Tensor)"))
def attention_with_kvcache_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, rotary_interleaved, num_splits,
                              return_softmax_lse, k_descale, v_descale, *keywords):
    """attention_with_kvcache as one op: cache_seqlens is the tensor, or else cache_len (-1: None);
    the variants' keywords as given (variants.KEYWORDS); lse is (0,) when not asked for (an op
    returns tensors)."""
    from .serving import attention_with_kvcache  # (the public function: it checks, then runs kvcache above)

    lengths = cache_seqlens if cache_seqlens is not None else (None if cache_len < 0 else cache_len)
    out = attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths, cache_batch_idx, cache_leftpad,
                                 block_table, softmax_scale, causal, rotary_interleaved=rotary_interleaved,
                                 num_splits=num_splits, return_softmax_lse=return_softmax_lse, k_descale=k_descale,
                                 v_descale=v_descale, **dict(zip(variants.KEYWORDS, keywords)))
    out, lse = out if return_softmax_lse else (out, q.new_empty(0, dtype=torch.float32))
    return out, lse


@attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
                                 cache_leftpad, block_table, softmax_scale, causal, rotary_interleaved, num_splits,
                                 return_softmax_lse, k_descale, v_descale, *keywords):
    batch, seqlen_q, heads, _ = q.shape
    lse_shape = (batch, heads, seqlen_q) if return_softmax_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def decode_values(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, seqlen_new, o, lse, splits, causal,
                  scale, variant: variants.Variant = variants.PLAIN, *, k_descale=None, v_descale=None) -> dict:
    """What the decode plan's kernels take (families.decode.DecodeAttention.arguments): the
    tensors (copied where their rows are not 16-byte aligned; never the caches), the sizes read
    once here, the variants' values, and an FP8 cache's descales."""
    batch, seqlen_q, heads, _ = q.shape
    if k is not None:
        k, v = aligned(k), aligned(v)
    lengths = isinstance(cache_seqlens, torch.Tensor)
    values = {
        "q": aligned(q), "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
        "k_strides": NO_STRIDES if k is None else k.stride(), "v_strides": NO_STRIDES if v is None else v.stride(),
        "cache_seqlens": cache_seqlens if lengths else None, "cache_seqlens_stride": cache_seqlens.stride(0) if lengths else 0,
        "cache_len": capacity if cache_seqlens is None or lengths else cache_seqlens, "capacity": capacity,
        "block_table": block_table, "cache_batch_idx": None, "cache_leftpad": None, "rotary_cos": None, "rotary_sin": None,
        "o": o, "lse": lse, "partials": None, "counters": None,  # a split plan's scratch replaces them
        "batch": batch, "seqlen_q": seqlen_q, "heads": heads, "kv_heads": k_cache.shape[2], "seqlen_new": seqlen_new,
        "splits": splits, "causal": bool(causal), "scale": scale,
    }
    if variant.args:
        values.update(variant.values())
    if k_descale is not None:
        values.update(k_descale=k_descale, v_descale=v_descale)
    if block_table is not None:
        page_size = k_cache.shape[1]
        if block_table.stride(-1) != 1:
            values["block_table"] = block_table.contiguous()
        values.update(num_pages=k_cache.shape[0], page_size=page_size, page_divisor=fast_divisor(page_size))
    return values


def decode_extras(cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin) -> dict:
    """The launch values of the less common arguments: the cache rows and left pads (1-D int32,
    read with stride 1) and the rotary tables (contiguous rows from a 16-byte boundary)."""
    def rows(t):
        return t if t is None or t.stride(0) == 1 else t.contiguous()

    def table(t):
        return t if t is None or (t.is_contiguous() and not t.data_ptr() % 16) else t.clone(memory_format=torch.contiguous_format)

    return {"cache_batch_idx": rows(cache_batch_idx), "cache_leftpad": rows(cache_leftpad), "rotary_cos": table(rotary_cos),
            "rotary_sin": table(rotary_sin)}


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                 scale, variant: variants.Variant, need_lse, *, k_descale=None, v_descale=None):
    """(o, lse) of packed queries over their pages of a paged cache: the decode plan's varlen
    kernel, sized by max_seqlen_q and max_seqlen_k (never by cu_seqlens' values, so a captured graph
    replays with new ones); o like q, lse (heads, total_q) fp32 or None. An FP8 cache comes with
    its descales (fp32 (batch, heads_kv))."""
    total_q, heads, head_dim = q.shape
    batch, page_size, kv_heads = cu_seqlens_q.shape[0] - 1, k_cache.shape[1], k_cache.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device) if need_lse else None
    if o.numel() == 0 or batch == 0:
        return o, lse
    device = q.get_device()
    max_seqlen_q = min(max_seqlen_q, total_q)  # no sequence is longer than the packed tensor (sizes the grid)
    kv_dtype = plans.FP8_DTYPES.get(k_cache.dtype, "")
    prefill = None if kv_dtype else plans.paged_prefill(device, head_dim, q.dtype, causal, max_seqlen_q, variant.fields)
    if prefill is not None:  # long query chunks: the Hopper forward, its producer reading the pages
        _run_paged_prefill(prefill, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, o, lse, scale,
                           variant)
        return o, lse
    capacity = block_table.shape[1] * page_size
    plan, splits = plans.decode(device, head_dim, q.dtype, True, max_seqlen_q * (heads // kv_heads), batch, kv_heads,
                                min(max_seqlen_k, capacity), 0, variant.fields, "", True, kv_dtype=kv_dtype)
    values = decode_values(q[None], k_cache, v_cache, None, None, None, block_table, capacity, 0, o[None], lse, splits, causal,
                           scale, variant, k_descale=k_descale, v_descale=v_descale)
    # launch_values read batch and seqlen_q off the (1, total_q, heads, d) view: the grid's are the
    # sequences and the longest one's queries.
    values.update(batch=batch, seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q.contiguous(),
                  cu_seqlens_k=cu_seqlens_k.contiguous(), total_q=total_q)
    plan.run(device, values)
    return o, lse


@torch.library.custom_op("flashgen::attention_varlen_paged", mutates_args=(), device_types="cuda", schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    "Tensor block_table, float? softmax_scale, bool causal, bool return_lse, Tensor? k_descale, Tensor? v_descale, "
    f"{variants.KEYWORD_SCHEMA}) -> (Tensor, Tensor)"))
def attention_varlen_paged_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
                              causal, return_lse, k_descale, v_descale, *keywords):
    """attention_varlen over a paged cache as one op (what torch.compile records), the variants'
    keywords as given (variants.KEYWORDS); lse is (0,) when not asked for."""
    from .varlen import attention_varlen  # (the public function: it checks, then runs paged_varlen)

    out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                           causal=causal, return_lse=return_lse, block_table=block_table, k_descale=k_descale,
                           v_descale=v_descale, **dict(zip(variants.KEYWORDS, keywords)))
    return out if return_lse else (out, q.new_empty(0, dtype=torch.float32))


@attention_varlen_paged_op.register_fake
def _attention_varlen_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
                                 causal, return_lse, k_descale, v_descale, *keywords):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)


# ---- the merge of two attention states -------------------------------------------------------------


def merge(o_a, lse_a, o_b, lse_b):
    """(o, lse) of merge_attention_states' checked states, (x, y, z, d) and (x, y, z): one launch of
    the merge kernel."""
    o = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    lse = torch.empty(o_a.shape[:-1], dtype=torch.float32, device=o_a.device)
    if o.numel():
        device = o.get_device()
        plans.merge(device, o.shape[-1], o.dtype).run(
            device, {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b, "o": o, "lse": lse}
        )
    return o, lse


@torch.library.custom_op("flashgen::merge_attention_states", mutates_args=(), device_types="cuda")
def merge_attention_states_op(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .serving import merge_attention_states  # (the public function: it checks, then runs merge below)

    return merge_attention_states(o_a, lse_a, o_b, lse_b)


@merge_attention_states_op.register_fake
def _merge_attention_states_fake(o_a, lse_a, o_b, lse_b):
    return o_a.new_empty(o_a.shape), o_a.new_empty(o_a.shape[:-1], dtype=torch.float32)
