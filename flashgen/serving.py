"""flashgen's serving functions: attention over a KV cache with FlashAttention's
`flash_attn_with_kvcache` names, layouts and semantics, and the merge of two attention states by
their log-sum-exp. Input checks (named errors, all of them before the device check, so they run
on CPU tensors), then the launch plans of plans.decode and plans.merge.

Nothing here reads a tensor's values on the host: a decode step is one set of launches whose
lengths the kernels read on the device, so it can be captured in a CUDA graph once and replayed
as the cache grows. Under torch.compile both functions are torch.library custom ops
(flashgen::attention_with_kvcache, which declares the caches it appends to as mutated, and
flashgen::merge_attention_states), whose real implementations are the eager functions.
"""

from __future__ import annotations

import torch

from . import inputs, ops, variants
from .families.decode import MAX_SPLITS
from .inputs import is_aligned
from .plans import DTYPES, MAX_GRID_YZ

MAX_KEYS = 2**31 - 1  # positions are int32 in the kernels


def _pair_like_q(q, first, second, dims: int, layout: str) -> None:
    """Two (name, tensor) arguments that come together (k and v, rotary_cos and rotary_sin): each a
    tensor of `dims` dimensions with q's dtype, and both of one shape."""
    for name, t in (first, second):
        inputs.tensor(name, t, dims, layout)
    inputs.one_dtype({"q": q, first[0]: first[1], second[0]: second[1]})
    inputs.same("shape", {first[0]: tuple(first[1].shape), second[0]: tuple(second[1].shape)})


def _well_formed(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits):
    """check_kvcache_inputs' answer for a call made the common way (tensors of the right types,
    shapes and device; lengths as a tensor or None), else None: each attribute read once, since
    they cost. Anything this accepts, the full check accepts too."""
    tensor = torch.Tensor
    if not type(q) is type(k_cache) is type(v_cache) is tensor:
        return None
    q_shape, cache_shape, dtype = q.shape, k_cache.shape, q.dtype
    if len(q_shape) != 4 or len(cache_shape) != 4 or v_cache.shape != cache_shape:
        return None
    batch, _, heads, head_dim = q_shape
    pages, rows, kv_heads, cache_dim = cache_shape
    device = q.get_device()
    if (dtype not in DTYPES or k_cache.dtype != dtype or v_cache.dtype != dtype or cache_dim != head_dim or not head_dim
            or head_dim % 8 or head_dim > 256 or not kv_heads or heads % kv_heads or batch > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ
            or not q.is_cuda or k_cache.get_device() != device or v_cache.get_device() != device or q.stride()[3] != 1
            or not (is_aligned(k_cache) and is_aligned(v_cache))):
        return None
    seqlen_new = 0
    if k is not None or v is not None:
        if type(k) is not tensor or type(v) is not tensor or cache_seqlens is None:
            return None
        new_shape = k.shape
        if (v.shape != new_shape or len(new_shape) != 4 or new_shape[0] != batch or new_shape[2] != kv_heads
                or new_shape[3] != head_dim or k.dtype != dtype or v.dtype != dtype or k.stride()[3] != 1
                or v.stride()[3] != 1 or k.get_device() != device or v.get_device() != device):
            return None
        seqlen_new = new_shape[1]
        if seqlen_new and not (q_shape[1] and heads):
            return None  # appends and no query: refused by the full check
    if block_table is None:
        if pages != batch:
            return None
        capacity = rows
    else:
        if (type(block_table) is not tensor or block_table.dtype != torch.int32 or rows % 16 or not 16 <= rows <= 256
                or block_table.get_device() != device):
            return None
        table_shape = block_table.shape
        if len(table_shape) != 2 or table_shape[0] != batch:
            return None
        capacity = table_shape[1] * rows
    if cache_seqlens is not None and (
        type(cache_seqlens) is not tensor or cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,)
        or cache_seqlens.get_device() != device
    ):
        return None
    if capacity + seqlen_new > MAX_KEYS or type(num_splits) is not int or not 0 <= num_splits <= MAX_SPLITS:
        return None
    return block_table is not None, capacity, seqlen_new


def _variant(q, causal, window_size, softcap, alibi_slopes, capacity: int, learnable_sink=None) -> variants.Variant:
    """The call's variants, checked (flashgen.variants; slopes per query head, or per sequence and
    query head; window sides of at least the capacity unbounded, as FlashAttention makes them)."""
    return variants.make_if_given(lambda: variants.Call(causal, q.shape[0], q.shape[2], q.device, keys=capacity),
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


def _check_cache_rows(batch: int, paged: bool, cache_batch_idx, cache_leftpad) -> None:
    """cache_batch_idx and cache_leftpad: int32 (batch,) tensors, for a contiguous cache (as with
    FlashAttention: a paged sequence's rows are its block table's)."""
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is None:
            continue
        inputs.int32(name, t, (batch,), f"(batch,) = ({batch},)")
        if paged:
            raise ValueError(f"{name} takes a contiguous cache: a paged sequence's rows are the ones its block_table names")


def _rotary_style(q, k, rotary_cos, rotary_sin, rotary_interleaved, capacity: int) -> str:
    """The rotary embedding's style for the decode spec ("" without one), with its tables checked
    the way FlashAttention checks them."""
    if rotary_cos is None and rotary_sin is None:
        return ""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin come together: pass both or neither")
    _pair_like_q(q, ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), 2, "(seqlen_ro, rotary_dim / 2)")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin turn the appended keys and q: pass the new k and v as well "
                         "(FlashAttention's rule)")
    seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    head_dim = q.shape[3]
    if not rotary_dim or rotary_dim % 16 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim={rotary_dim} (2 * rotary_cos.shape[1]): must be a multiple of 16, at least 16 and at most "
            f"head_dim={head_dim}"
        )
    if seqlen_ro < max(capacity, 1):
        raise ValueError(f"rotary_cos has {seqlen_ro} positions: it needs at least the cache's capacity, {capacity}, and one")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be True or False, got {rotary_interleaved!r}")
    return "interleaved" if rotary_interleaved else "halves"


def check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, rotary_cos=None, rotary_sin=None,
                         rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None,
                         learnable_sink=None, k_descale=None, v_descale=None) -> tuple[bool, int, int, variants.Variant, str]:
    """Raise a clear error for anything the decode kernels cannot take; returns (paged, capacity,
    seqlen_new, variant, rotary): whether the cache is paged, the keys one sequence's cache holds at
    most, the number of tokens appended, the call's variants, and the rotary embedding's style
    ("" for none). An FP8 cache (k_cache, v_cache float8_e4m3fn) needs k_descale and v_descale."""
    common = (rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
              and k_descale is None and v_descale is None)
    found = _well_formed(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits) if common else None
    if found is not None:
        return (*found, _variant(q, causal, window_size, softcap, alibi_slopes, found[1], learnable_sink), "")
    inputs.tensor("q", q, 4, "(batch, seqlen_q, heads, head_dim), like flash_attn_with_kvcache")
    paged = block_table is not None
    cache_layout = "(num_blocks, page_size, heads_kv, head_dim) with a block_table" if paged else "(batch, seqlen_cache, heads_kv, head_dim)"
    inputs.tensor("k_cache", k_cache, 4, cache_layout)
    inputs.tensor("v_cache", v_cache, 4, cache_layout)
    batch, seqlen_q, heads, head_dim = q.shape
    if inputs.is_float8(k_cache) or inputs.is_float8(v_cache):
        inputs.fp8_cache(q, {"k_cache": k_cache, "v_cache": v_cache}, {"k_descale": k_descale, "v_descale": v_descale}, batch,
                         k_cache.shape[2])
    else:
        inputs.half_precision("q", q)
        inputs.one_dtype({"q": q, "k_cache": k_cache, "v_cache": v_cache})
        inputs.no_cache_descales({"k_descale": k_descale, "v_descale": v_descale}, k_cache.dtype)
    inputs.same(f"shape {cache_layout}", {"k_cache": tuple(k_cache.shape), "v_cache": tuple(v_cache.shape)})
    pages_or_batch, rows, kv_heads, cache_dim = k_cache.shape
    inputs.same("head_dim", {"q": head_dim, "k_cache": cache_dim})
    inputs.head_dim(head_dim)
    inputs.query_groups(heads, kv_heads, "the caches")
    if (k is None) != (v is None):
        raise ValueError(f"k and v are appended together: got k {'None' if k is None else 'a tensor'} and v {'None' if v is None else 'a tensor'}")
    seqlen_new = 0
    if k is not None:
        _pair_like_q(q, ("k", k), ("v", v), 4, "(batch, seqlen_new, heads_kv, head_dim)")
        if k.shape[0] != batch or k.shape[2] != kv_heads or k.shape[3] != head_dim:
            raise ValueError(
                f"k and v must be (batch, seqlen_new, heads_kv, head_dim) = ({batch}, seqlen_new, {kv_heads}, {head_dim}); "
                f"got {tuple(k.shape)}"
            )
        if cache_seqlens is None:
            raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens (an int or an int32 (batch,) tensor)")
        seqlen_new = k.shape[1]
        if seqlen_new and batch and kv_heads and not (seqlen_q and heads):
            raise ValueError(
                f"q has shape {tuple(q.shape)}, no query rows, and k, v hold {seqlen_new} new tokens: the kernel that "
                f"appends them runs over the queries, so pass at least one query with them"
            )
    if paged:
        inputs.int32("block_table", block_table)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch, max_blocks_per_sequence) with batch {batch}; got shape {tuple(block_table.shape)}")
        inputs.page_size(rows, "k_cache.shape[1]")
        capacity = block_table.shape[1] * rows
    else:
        if pages_or_batch != batch and cache_batch_idx is None:
            raise ValueError(
                f"k_cache has batch {pages_or_batch} and q {batch}: a contiguous cache is (batch, seqlen_cache, heads_kv, "
                f"head_dim) (pass block_table for a paged one)"
            )
        capacity = rows
    if capacity + seqlen_new > MAX_KEYS:
        raise ValueError(f"the cache holds {capacity} keys and {seqlen_new} are appended: at most {MAX_KEYS} keys in all")
    if isinstance(cache_seqlens, torch.Tensor):
        inputs.int32("cache_seqlens", cache_seqlens, (batch,), f"(batch,) = ({batch},)")
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor, got {type(cache_seqlens).__name__}")
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens={cache_seqlens}: must be in [0, {capacity}] (the cache's capacity)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits!r}: must be an int in [0, {MAX_SPLITS}] (0: chosen from the shapes)")
    inputs.last_dim_contiguous({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v})
    inputs.aligned_in_place({"k_cache": k_cache, "v_cache": v_cache}, "it is written in place, so flashgen cannot copy it")
    inputs.grid("attention_with_kvcache", batch, kv_heads, "sequences", "key/value heads")
    _check_cache_rows(batch, paged, cache_batch_idx, cache_leftpad)
    rotary = _rotary_style(q, k, rotary_cos, rotary_sin, rotary_interleaved, capacity)
    variant = _variant(q, causal, window_size, softcap, alibi_slopes, capacity, learnable_sink)
    inputs.on_one_cuda_device("attention_with_kvcache", {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
        "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
        "cache_seqlens": cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None, "k_descale": k_descale,
        "v_descale": v_descale})
    return paged, capacity, seqlen_new, variant, rotary


def attention_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
    cache_leftpad=None, block_table=None, softmax_scale=None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes=None,
    num_splits: int = 0, return_softmax_lse: bool = False, *, learnable_sink=None, k_descale=None, v_descale=None,
):
    """Attention of q over a KV cache, appending new keys and values first: FlashAttention's
    `flash_attn_with_kvcache` (same names, layouts and semantics), for decoding and chunked prefill.

    q: (batch, seqlen_q, heads, head_dim), float16 or bfloat16, head_dim a multiple of 8 up to 256.
    An FP8 cache (FlashAttention-3's, on GPUs with FP8: sm_89 and sm_90): k_cache and v_cache
    torch.float8_e4m3fn with k_descale and v_descale, fp32 (batch, heads_kv); a cached key is its
    stored value times its sequence's and KV head's descale, and head_dim a multiple of 16. The new
    k and v (q's dtype) are stored divided by their descale, rounded to nearest e4m3 and saturated
    at +-448 (never NaN from a finite value), and attended to as stored.
    k_cache, v_cache: (batch, seqlen_cache, heads_kv, head_dim), or paged (num_blocks, page_size,
    heads_kv, head_dim) with block_table (batch, max_blocks) int32 naming each sequence's pages in
    order; page_size a multiple of 16 from 16 to 256. heads is a multiple of heads_kv (GQA/MQA:
    the query heads of a KV head are computed together, so each K/V byte is read once).
    cache_seqlens: the tokens each sequence holds in the cache, an int or an int32 (batch,) tensor;
    None means the whole cache (seqlen_cache, or max_blocks * page_size).
    cache_batch_idx: int32 (batch,), the row of a contiguous cache (batch_cache, seqlen_cache, ...)
    each sequence uses (None: row b); two sequences that append must not share a row.
    cache_leftpad: int32 (batch,), where each sequence's keys start in a contiguous cache (None: 0):
    sequence b's keys are positions cache_leftpad[b] .. cache_seqlens[b] (left-padded batches).
    k, v: optional (batch, seqlen_new, heads_kv, head_dim), written into the caches in place at
    positions cache_seqlens[b] .. + seqlen_new, then attended to with the cache (cache_seqlens is not
    updated: the caller adds seqlen_new, as with FlashAttention).
    rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) of q's dtype, seqlen_ro at least
    the capacity, rotary_dim a multiple of 16 up to head_dim; only with k and v. The new keys turn
    to positions cache_seqlens[b] + j before they are stored, and q to cache_seqlens[b] + i with
    causal or a window, else every query to cache_seqlens[b] (FlashAttention's rule). The first
    rotary_dim dimensions turn: pairs (2j, 2j + 1) with rotary_interleaved (GPT-J), else (j, j +
    rotary_dim / 2) (GPT-NeoX); in fp32, rounded to q's dtype.
    causal: aligned bottom-right to each sequence's length n after the append: query i sees key j
    iff j <= n - seqlen_q + i (seqlen_q > 1 serves chunked prefill and speculative decoding).
    Variants, flash_attn_with_kvcache's, aligned the same way (query i at key position
    i' = n - seqlen_q + i): window_size=(left, right) keeps keys i' - left <= j <= i' + right (-1 =
    no bound on that side, and so is a side of at least the capacity, as in FlashAttention; causal
    sets right to 0), and splits cover only the key tiles a block's windows see; softcap > 0 makes
    the scaled scores softcap * tanh(s / softcap); alibi_slopes, fp32 of shape (heads,) or (batch,
    heads), adds -slope * |i' - j|; learnable_sink, fp32 (heads,), joins each row's softmax
    denominator as a logit with no value (attention()'s; counted once across splits). Their values
    are kernel arguments:
    a captured graph replays with the values it was captured with.
    softmax_scale defaults to 1/sqrt(head_dim). num_splits: how many blocks split each sequence's
    keys (split-KV); 0 chooses from the shapes and the GPU, never from the lengths, so one captured
    CUDA graph serves every length. return_softmax_lse: also return lse (batch, heads, seqlen_q)
    fp32, natural log (-inf for a query that sees no key, whose output is 0).

    Out-of-range lengths and pages never make a kernel read or write outside the caches: a length
    in cache_seqlens is clamped to [0, capacity] (capacity = seqlen_cache, or max_blocks *
    page_size), a left pad to [0, that length]; new tokens at positions past the capacity are
    attended to but not stored; a block-table entry outside [0, num_blocks) reads as zero keys and
    values and is never written; a cache_batch_idx entry outside [0, batch_cache) is a row with no
    keys that takes no appends; rotary positions past the tables take their last row.
    (flashgen.reference.attention_with_kvcache computes exactly this.) Pages shared by sequences
    must not be appended to.

    Returns out (batch, seqlen_q, heads, head_dim), and lse with return_softmax_lse. Under
    torch.compile (fullgraph too) the call is the custom op flashgen::attention_with_kvcache, and the
    checks run when it runs.
    """
    if torch.compiler.is_compiling():
        lengths = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
        length = -1 if cache_seqlens is None or lengths is not None else int(cache_seqlens)
        out, lse = ops.attention_with_kvcache_op(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths, length, cache_batch_idx, cache_leftpad, block_table,
            softmax_scale, causal, rotary_interleaved, num_splits, return_softmax_lse, k_descale, v_descale,
            [int(side) for side in window_size], float(softcap), alibi_slopes, learnable_sink)  # (variants.KEYWORDS' order)
        return (out, lse) if return_softmax_lse else out
    paged, capacity, seqlen_new, variant, rotary = check_kvcache_inputs(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, causal, window_size, softcap, alibi_slopes,
        rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad, learnable_sink, k_descale, v_descale)
    out, lse = ops.kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, paged, capacity, seqlen_new,
                           inputs.softmax_scale(softmax_scale, q.shape[3]), causal, variant, rotary,
                           rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, num_splits, return_softmax_lse,
                           k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_softmax_lse else out


def _states(o_a, lse_a, o_b, lse_b):
    """Check two attention states and bring them to one layout: o (..., d) of one float dtype with
    16-byte rows, lse (...) fp32 of o.shape[:-1] with any strides."""
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        inputs.tensor(name, t)
    if o_a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"o_a has dtype {o_a.dtype}; merge_attention_states takes float16, bfloat16 or float32 outputs")
    inputs.one_dtype({"o_a": o_a, "o_b": o_b})
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {t.dtype}")
    if o_a.dim() < 1 or o_b.shape != o_a.shape:
        raise ValueError(f"o_a and o_b must have one shape (..., head_dim); got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != o_a.shape[:-1]:
            raise ValueError(
                f"{name} must have shape o.shape[:-1] = {tuple(o_a.shape[:-1])} (a (batch, heads, seqlen) lse of "
                f"(batch, seqlen, heads, d) outputs is passed as lse.transpose(1, 2)); got {tuple(t.shape)}"
            )
    head_dim = o_a.shape[-1]
    inputs.head_dim(head_dim, "o's last dimension")
    inputs.on_one_cuda_device("merge_attention_states", {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b})
    # The kernel reads (x, y, z) rows: at most three leading dimensions, stepped by strides.
    lead = o_a.shape[:-1]
    if lead.numel() > MAX_KEYS:
        raise ValueError(f"o_a has {lead.numel()} rows: at most {MAX_KEYS}")
    if len(lead) != 3:
        shape3 = (*(1,) * (3 - len(lead)), *lead) if len(lead) < 3 else (-1, *lead[-2:])
        o_a, o_b = o_a.reshape(*shape3, head_dim), o_b.reshape(*shape3, head_dim)
        lse_a, lse_b = lse_a.reshape(o_a.shape[:-1]), lse_b.reshape(o_a.shape[:-1])
    # Both states are read as one (2, ...) tensor whose first stride is the distance between them.
    if o_a.stride() != o_b.stride() or not (is_aligned(o_a) and is_aligned(o_b)):
        o_a, o_b = o_a.contiguous(), o_b.contiguous()
        if not (is_aligned(o_a) and is_aligned(o_b)):
            o_a, o_b = o_a.clone(), o_b.clone()
    if lse_a.stride() != lse_b.stride():
        lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    return o_a, lse_a, o_b, lse_b, lead


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention states of the same queries over disjoint sets of keys (split-KV,
    context parallelism, a cached prefix and a new suffix): lse = log(exp(lse_a) + exp(lse_b)) and
    o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b, computed in fp32 by the merge kernel.

    o_a, o_b: (..., head_dim) float16, bfloat16 or float32, normalized outputs; lse_a, lse_b:
    o.shape[:-1] fp32 log-sum-exps in natural log (FlashInfer's convention; any strides, so a
    FlashAttention (batch, heads, seqlen) lse of (batch, seqlen, heads, d) outputs is passed as
    lse.transpose(1, 2)). A state with lse = -inf holds nothing: both -inf give o = 0, lse = -inf.
    Returns (o, lse): o of o_a's dtype and shape, lse fp32 of o.shape[:-1], both contiguous.
    Under torch.compile the call is the custom op flashgen::merge_attention_states.
    """
    if torch.compiler.is_compiling():
        return ops.merge_attention_states_op(o_a, lse_a, o_b, lse_b)
    o_a, lse_a, o_b, lse_b, lead = _states(o_a, lse_a, o_b, lse_b)
    o, lse = ops.merge(o_a, lse_a, o_b, lse_b)
    return o.view(*lead, o.shape[-1]), lse.view(lead)
