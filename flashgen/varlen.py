"""flashgen.attention_varlen: a batch of sequences of different lengths, packed without padding,
with the names, layouts and semantics of FlashAttention's `flash_attn_varlen_func`.

The kernels are the varlen forms of attention()'s (the `varlen` spec field): block_info finds each
sequence's rows through cu_seqlens, so no token is copied into a padded layout and no block works
on padding (blocks past their sequence's end exit at once). Like attention(), the call goes through
torch.library custom ops under torch.compile and straight to the implementation in eager mode; it
reads nothing from the GPU on the host, so it never syncs and is CUDA-graph capturable.

With a block_table (flash_attn_varlen_func's paged KV cache: chunked prefill over cached prefixes)
the keys and values are pages of a cache, and the decode kernels run it (the `varlen` form of
decode_paged), forward only, as in FlashAttention.
"""

from __future__ import annotations

import torch

from . import inputs, ops, variants
from .plans import DTYPES, FP8_DTYPES, MAX_GRID_YZ


# ---- input checks -------------------------------------------------------------------------------


def _is_length(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """The per-call fast path of check_inputs: True when nothing is wrong."""
    if not type(q) is type(k) is type(v) is type(cu_seqlens_q) is type(cu_seqlens_k) is torch.Tensor:
        return False
    q_shape, k_shape, v_shape, cu_shape = q.shape, k.shape, v.shape, cu_seqlens_q.shape
    if len(q_shape) != 3 or len(k_shape) != 3 or len(cu_shape) != 1 or cu_seqlens_k.shape != cu_shape:
        return False
    total_q, heads, head_dim = q_shape
    total_k, kv_heads, kv_dim = k_shape
    batch = cu_shape[0] - 1
    device = q.get_device()
    return (
        q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and len(v_shape) == 3 and v_shape[:2] == k_shape[:2]
        and kv_dim == head_dim and kv_heads and not heads % kv_heads and heads <= MAX_GRID_YZ
        and not head_dim % 8 and 8 <= head_dim <= 256 and (v_shape[2] == head_dim or (not v_shape[2] % 8 and 8 <= v_shape[2] <= 256))
        and q.stride()[2] == 1 and k.stride()[2] == 1 and v.stride()[2] == 1
        and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and 0 <= batch <= MAX_GRID_YZ
        and _is_length(max_seqlen_q) and _is_length(max_seqlen_k)
        and (max_seqlen_q > 0 if total_q else max_seqlen_q >= 0) and (max_seqlen_k > 0 if total_k else max_seqlen_k >= 0)
        and (batch > 0 or not (total_q or total_k))
        and q.is_cuda and device == k.get_device() == v.get_device() == cu_seqlens_q.get_device() == cu_seqlens_k.get_device()
    )


def check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None, fp8=False,
                 fp8_cache=False) -> None:
    """Every check that needs neither the GPU nor cu_seqlens' values: named errors for what the
    kernels cannot take. With a block_table, k and v are a paged cache (num_blocks, page_size,
    heads_kv, head_dim). fp8: q, k, v are FP8, which inputs.fp8 checks (not the 16-bit rule);
    fp8_cache: k and v are, which inputs.fp8_cache checks."""
    paged = block_table is not None
    kv_rows = "num_blocks, page_size, heads_kv" if paged else "total_k, heads_kv"
    kv_layout = f"({kv_rows}, head_dim): " + ("a paged cache, with block_table" if paged else
                                              "packed sequences, like flash_attn_varlen_func")
    inputs.tensor("q", q, 3, "(total_q, heads, head_dim): packed sequences, like flash_attn_varlen_func")
    inputs.tensor("k", k, 4 if paged else 3, kv_layout)
    inputs.tensor("v", v, 4 if paged else 3, kv_layout)
    named = {"q": q, "k": k, "v": v}
    if not (fp8 or fp8_cache):
        for name, t in named.items():
            inputs.half_precision(name, t)
        inputs.one_dtype(named)
    inputs.same(f"shape ({kv_rows})", {"k": tuple(k.shape[:-1]), "v": tuple(v.shape[:-1])})
    total_q, heads, head_dim = q.shape
    inputs.query_groups(heads, k.shape[-2])
    inputs.head_dims(head_dim, k.shape[-1], v.shape[-1], v_own="attention_varlen with a block_table" if paged else "")
    inputs.last_dim_contiguous(named)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        inputs.int32(name, cu)
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,): each sequence's first row, then the total; "
                             f"got shape {tuple(cu.shape)}")
    inputs.same("shape (batch + 1,)", {"cu_seqlens_q": tuple(cu_seqlens_q.shape), "cu_seqlens_k": tuple(cu_seqlens_k.shape)})
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        inputs.int32("block_table", block_table)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch, max_blocks_per_sequence) with batch {batch}; got shape "
                             f"{tuple(block_table.shape)}")
        inputs.page_size(k.shape[1], "k.shape[1]")
    inputs.grid("attention_varlen", batch, heads, "sequences", "query heads")
    total_k = 0 if paged else k.shape[0]  # a paged cache's rows are pages, not keys
    for name, value, total, t in (("max_seqlen_q", max_seqlen_q, total_q, "q"), ("max_seqlen_k", max_seqlen_k, total_k, "k")):
        if not _is_length(value) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a non-negative int, the longest sequence's length (a Python int)")
        if total and not value:
            raise ValueError(f"{name}=0 but {t} has {total} rows: it must be the longest sequence's length")
        if total and not batch:
            raise ValueError(f"cu_seqlens_{t[0]} holds no sequence (shape (1,)) but {t} has {total} rows")


def _check_paged(q, k, v) -> None:
    """What the paged form adds: the caches are read in place (16-byte aligned rows), and there is
    no backward through them (FlashAttention has none either)."""
    inputs.aligned_in_place({"k": k, "v": v}, "a paged cache is read in place")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("attention_varlen with a block_table computes no gradients (as in FlashAttention): call it under "
                         "torch.no_grad(), or with tensors that do not require grad")


def check_variant(q, cu_seqlens_q, max_seqlen_k, causal, window_size, softcap, alibi_slopes,
                  learnable_sink=None) -> variants.Variant:
    """The call's variants, checked (flashgen.variants): slopes per query head, or per sequence
    (cu_seqlens_q's batch) and query head; window sides of at least max_seqlen_k unbounded
    (flash_attn_varlen_func's rule)."""
    return variants.make_if_given(lambda: variants.Call(causal, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device, keys=max_seqlen_k),
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, block_table=None, learnable_sink=None,
                 well_formed: bool | None = None, cache_descales: dict | None = None) -> variants.Variant:
    """Raise a clear error for anything the kernels cannot take (nothing that needs a sync);
    returns the call's variants. well_formed: the fast test's answer where the caller has it.
    cache_descales (name: tensor or None): a paged cache's k_descale and v_descale, which an FP8
    cache needs and a 16-bit one refuses."""
    if well_formed is None:
        well_formed = block_table is None and _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if well_formed:
        return check_variant(q, cu_seqlens_q, max_seqlen_k, causal, window_size, softcap, alibi_slopes, learnable_sink)
    descales = cache_descales or {}
    fp8_cache = block_table is not None and inputs.is_float8(k)
    check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=block_table, fp8_cache=fp8_cache)
    if fp8_cache:
        inputs.fp8_cache(q, {"k": k, "v": v}, descales, cu_seqlens_q.shape[0] - 1, k.shape[2])
    else:
        inputs.no_cache_descales(descales, k.dtype)
    variant = check_variant(q, cu_seqlens_q, max_seqlen_k, causal, window_size, softcap, alibi_slopes, learnable_sink)
    if block_table is not None:
        _check_paged(q, k, v)
    inputs.on_one_cuda_device("attention_varlen", {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                                   "cu_seqlens_k": cu_seqlens_k, "block_table": block_table, **descales})
    return variant


def check_no_dropout(dropout_p) -> None:
    """flash_attn_varlen_func's dropout_p, accepted where callers pass 0.0 (inference, or training
    without attention dropout); any other value is refused, never ignored."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: flashgen computes exact attention without dropout; pass 0.0")


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p: float = 0.0, softmax_scale=None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
    deterministic: bool = False, return_lse: bool = False, block_table=None, *, learnable_sink=None,
    q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
):
    """Exact attention over a batch of sequences of different lengths, packed without padding;
    FlashAttention's flash_attn_varlen_func (names, layouts, semantics). Differentiable.

    q, k: (total_q, heads, d), (total_k, heads_kv, d); v: (total_k, heads_kv, d_v), heads a multiple
    of heads_kv (GQA/MQA); float16 or bfloat16 on one CUDA device, any row/head strides with the
    last dimension contiguous; d and d_v multiples of 8 up to 256 (v may have a head dim of its own,
    as in attention(): out then has d_v; not with a block_table). cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on the
    same device: sequence b is query rows cu_seqlens_q[b] ... cu_seqlens_q[b + 1] - 1 and key rows
    cu_seqlens_k[b] ... cu_seqlens_k[b + 1] - 1. max_seqlen_q, max_seqlen_k: Python ints, the
    longest query and key lengths (they size the grid). A sequence may be empty.
    causal=True aligns the mask bottom-right in each sequence: query i of sequence b sees key j
    iff j <= i + len_k(b) - len_q(b). A query that sees no key gets 0 (and lse -inf).
    softmax_scale defaults to 1/sqrt(d). Under torch.autocast, floating inputs (but fp64) are cast
    to the autocast dtype first. Returns out (total_q, heads, d_v), and with return_lse=True also the
    (heads, total_q) fp32 log-sum-exp of the scaled scores (natural log), FlashAttention's varlen
    layout. deterministic=True gives bitwise-reproducible gradients, as in attention().
    Variants, flash_attn_varlen_func's, aligned bottom-right in each sequence like causal (query i
    of sequence b at key position i' = i + len_k(b) - len_q(b)): window_size=(left, right) keeps
    keys i' - left <= j <= i' + right (-1 = no bound on that side; causal sets right to 0), and key
    tiles outside the window are never visited; softcap > 0 makes the scaled scores
    softcap * tanh(s / softcap); alibi_slopes, fp32 of shape (heads,) or (batch, heads) (batch =
    the sequence's index), adds -slope * |i' - j|; learnable_sink, fp32 (heads,), joins each row's
    softmax denominator as a logit with no value (attention()'s). All are differentiable (the sink
    gets its gradient, the slopes none). The arguments stand in flash_attn_varlen_func's order, dropout_p included, so calls
    swap whether they pass them by position or by name; there is no dropout (exact attention), so
    dropout_p must be 0.

    block_table: int32 (batch, max_blocks), FlashAttention's paged KV cache. k and v are then
    caches (num_blocks, page_size, heads_kv, d), page_size a multiple of 16 from 16 to 256, read in
    place; sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of its
    pages (block_table[b] in order; a length past max_blocks * page_size is clamped to it, a page
    outside the cache reads as zeros). Chunked prefill over cached prefixes: causal aligns each
    sequence's queries to the end of its keys. Forward only (no gradients, as in FlashAttention);
    max_seqlen_k bounds the key lengths a captured graph may replay with.

    FP8, as attention()'s (sm_90a, forward only): q, k, v torch.float8_e4m3fn, q_descale,
    k_descale, v_descale fp32 (batch, heads_kv) (batch = the sequences), out_dtype bfloat16 (the
    default) or float16; not with a block_table. A paged FP8 cache (sm_89 and sm_90): with a
    block_table, k and v torch.float8_e4m3fn with k_descale and v_descale (a cached value is its
    stored one times its sequence's and KV head's descale), q float16 or bfloat16 (the output's
    dtype), head_dim a multiple of 16.

    Checked on every call, without a sync: types, shapes (3-D packed tensors, (batch + 1,)
    offsets), dtypes (int32 offsets), GQA head counts, head dims, devices, max_seqlen values.
    Not checked: cu_seqlens' values (starting at 0, non-decreasing, ending at total_q / total_k,
    no sequence longer than max_seqlen), which would need them on the host, a device sync on every
    call, and no CUDA-graph capture; flashgen.reference.attention_varlen checks them. Whatever
    they hold, the kernels clamp every offset into the packed tensors, so bad values give wrong
    rows, never an access outside q, k, v or out; of a sequence longer than max_seqlen_q, some rows
    are left uncomputed, as in FlashAttention (there its last ones; here, where the query tiles run
    longest first, its first ones).
    """
    q, k, v = ops.autocast_inputs(q, k, v)  # (FP8 inputs stay as they are)
    well_formed = block_table is None and _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # FP8 queries (their arguments, or inputs the 16-bit fast test refuses that are FP8): a path of their own, off the
    # hot one. (A paged call takes its cache's descales on the paged path: check_inputs checks them.)
    paged = block_table is not None
    if (out_dtype is not None or q_descale is not None or (not paged and not k_descale is v_descale is None)
            or (not well_formed and getattr(q, "dtype", None) in FP8_DTYPES)):
        return _fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, return_lse, block_table, learnable_sink, q_descale, k_descale, v_descale,
                    out_dtype)
    check_no_dropout(dropout_p)
    if paged and torch.compiler.is_compiling():  # one op; its checks run when it runs
        o, lse = ops.attention_varlen_paged_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                               softmax_scale, causal, return_lse, k_descale, v_descale,
                                               [int(side) for side in window_size], float(softcap), alibi_slopes,
                                               learnable_sink)  # (variants.KEYWORDS' order)
        return (o, lse) if return_lse else o
    chosen = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size, softcap,
                          alibi_slopes, block_table, learnable_sink, well_formed=well_formed,
                          cache_descales={"k_descale": k_descale, "v_descale": v_descale})
    if paged:
        o, lse = ops.paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, bool(causal),
                                  inputs.softmax_scale(softmax_scale, q.shape[-1]), chosen, bool(return_lse),
                                  k_descale=k_descale, v_descale=v_descale)
        return (o, lse) if return_lse else o
    o, lse = ops.attention(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                           bool(causal), inputs.softmax_scale(softmax_scale, q.shape[-1]), "", bool(deterministic),
                           need_lse=bool(return_lse), variant=chosen.op_args())
    return (o, lse) if return_lse else o


def _fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
         softcap, alibi_slopes, return_lse, block_table, learnable_sink, q_descale, k_descale, v_descale, out_dtype):
    """attention_varlen with FP8 inputs: checked, then the FP8 forward over packed sequences."""
    check_no_dropout(dropout_p)
    inputs.tensor("q", q)
    if block_table is not None and q.dtype not in FP8_DTYPES:  # (a paged FP8 cache: 16-bit queries, its own dtype out)
        if q_descale is not None:
            raise ValueError("q_descale is for FP8 queries; over a paged FP8 cache (block_table) q is float16 or bfloat16")
        raise ValueError(f"out_dtype={out_dtype}: over a paged FP8 cache the output has q's dtype, {q.dtype}")
    if q.dtype not in FP8_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}: q_descale, k_descale, v_descale and out_dtype are for FP8 inputs "
                        "(torch.float8_e4m3fn q, k and v)")
    if block_table is not None:
        raise ValueError("attention_varlen with FP8 queries reads packed keys; over a paged FP8 cache (block_table) q is "
                         "float16 or bfloat16, with k_descale and v_descale")
    check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, fp8=True)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    inputs.fp8({"q": q, "k": k, "v": v}, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}, out_dtype,
               cu_seqlens_q.shape[0] - 1, k.shape[1])
    chosen = check_variant(q, cu_seqlens_q, max_seqlen_k, causal, window_size, softcap, alibi_slopes, learnable_sink)
    if learnable_sink is not None and learnable_sink.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("learnable_sink requires grad: FP8 attention is forward-only (as FlashAttention-3's); "
                           "run it under torch.no_grad()")
    inputs.on_one_cuda_device("attention_varlen", {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                                                   "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale})
    o, lse = ops.fp8_forward(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, bool(causal),
                             inputs.softmax_scale(softmax_scale, q.shape[-1]), out_dtype, bool(return_lse), chosen.op_args())
    return (o, lse) if return_lse else o

