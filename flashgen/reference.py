"""The oracle: attention in plain PyTorch, two ways.

`naive_attention` materializes the scores (fine for tests, never for real lengths).
`tiled_attention` is the executable form of the kernel's algorithm: it walks the same query-tile x
key-tile schedule (key tiles from last to first, tiles no row sees skipped, as `key_tiles` says) and keeps
the running (m, l, o) state per row, rescaling when a new maximum appears. It can record the state
after every tile, which is what a reader steps through to see the algorithm work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .variants import UNBOUNDED  # a window side without bound, as the kernel takes it (key_tiles mirrors the kernel)

# The oracle checks its inputs with checks of its own, never the implementation's (api.py, varlen.py,
# serving.py, variants.py): it must not share code with what it checks. Its errors name the
# argument and what is allowed, as the public functions' do; unlike the kernels it takes any
# floating dtype, head dim and strides, on any device.

NAIVE_Q, NAIVE_KV = ("batch", "heads", "seqlen_q", "head_dim"), ("batch", "heads_kv", "seqlen_k", "head_dim")


def _checked(q, k, v, q_layout, kv_layout, names=("q", "k", "v"), *, batch=None, scale=None, scale_name="scale",
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, block_table=None, learnable_sink=None):
    """The references' input checks. q_layout and kv_layout name the dimensions (the heads at
    "heads" and "heads_kv", head_dim last; "batch" in both: one batch size); batch is the number of
    sequences, which (batch, heads) slopes and a block_table's rows count (default: q's "batch").
    Returns (scale, window_size, softcap), normalized: scale defaults to 1/sqrt(head_dim)."""
    for name, t, layout in zip(names, (q, k, v), (q_layout, kv_layout, kv_layout)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(layout):
            raise ValueError(f"{name} must have {len(layout)} dimensions ({', '.join(layout)}); got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}; the reference takes floating-point tensors")
    listed = ", ".join(names)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{listed} must share one dtype; got " + ", ".join(f"{n} {t.dtype}" for n, t in zip(names, (q, k, v))))
    if k.shape[:-1] != v.shape[:-1]:  # (v may have a head dim of its own)
        raise ValueError(f"{names[1]} and {names[2]} must have one shape ({', '.join(kv_layout[:-1])}, ...); got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if "batch" in q_layout and "batch" in kv_layout and q.shape[q_layout.index("batch")] != k.shape[kv_layout.index("batch")]:
        raise ValueError(f"{listed} must have one batch size; got {names[0]} {q.shape[q_layout.index('batch')]}, "
                         f"{names[1]} {k.shape[kv_layout.index('batch')]}")
    heads, kv_heads = q.shape[q_layout.index("heads")], k.shape[kv_layout.index("heads_kv")]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{names[0]} has {heads} heads and {names[1]}, {names[2]} have {kv_heads}: the number of query heads "
                         f"must be a multiple of the number of key/value heads (GQA/MQA)")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{names[0]} and {names[1]} must have the same head_dim; got {names[0]} {q.shape[-1]}, "
                         f"{names[1]} {k.shape[-1]}")
    if not q.device == k.device == v.device:
        raise ValueError(f"{listed} must be on one device; got " + ", ".join(f"{n} {t.device}" for n, t in zip(names, (q, k, v))))
    given = scale
    try:
        scale = q.shape[-1] ** -0.5 if given is None else float(given)
    except (TypeError, ValueError):
        scale = math.nan  # not a number: refused below
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{scale_name}={given!r}: must be a positive finite number (default 1/sqrt(head_dim))")
    try:
        left, right = window_size
        ok = all(int(side) == side >= -1 for side in (left, right))
    except (TypeError, ValueError, OverflowError):  # not a pair; not ints (int(inf) overflows)
        ok = False
    if not ok:
        raise ValueError(f"window_size={window_size!r}: must be (left, right), two ints >= -1 (-1 = unbounded)")
    try:
        softcap = float(softcap or 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"softcap={softcap!r}: must be a finite number >= 0 (0 = no soft-capping)") from None
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: must be a finite number >= 0 (0 = no soft-capping)")
    batch = q.shape[q_layout.index("batch")] if batch is None else batch
    if block_table is not None and not (isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32
                                        and block_table.dim() == 2 and block_table.shape[0] == batch):
        raise ValueError(f"block_table must be an int32 tensor (batch, max_blocks) with batch {batch}; got "
                         f"{getattr(block_table, 'dtype', type(block_table).__name__)} {tuple(getattr(block_table, 'shape', ()))}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; it must be torch.float32 (FlashAttention's rule)")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; it must be ({heads},) or ({batch}, {heads})")
        if alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes' last dimension must be contiguous (stride 1)")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, the inputs on {q.device}: they must be on one device")
    if learnable_sink is not None:
        if not isinstance(learnable_sink, torch.Tensor):
            raise TypeError(f"learnable_sink must be a torch.Tensor, got {type(learnable_sink).__name__}")
        if learnable_sink.dtype != torch.float32 or tuple(learnable_sink.shape) != (heads,):
            raise ValueError(f"learnable_sink must be a float32 tensor of shape ({heads},), one logit per query head; got "
                             f"{learnable_sink.dtype} {tuple(learnable_sink.shape)}")
        if learnable_sink.device != q.device:
            raise ValueError(f"learnable_sink is on {learnable_sink.device}, the inputs on {q.device}: they must be on one device")
    return scale, (int(left), int(right)), softcap


def _clip_window(window_size, keys: int) -> tuple[int, int]:
    """FlashAttention's rule for its seqlen_k (the keys; varlen: max_seqlen_k; kvcache: the cache's
    capacity): a window side of at least that many keys bounds nothing (-1)."""
    return tuple(-1 if side >= keys else side for side in window_size)


def visible(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _expand_kv(q, k, v):
    """Repeat key/value heads for GQA/MQA so every query head has its own (reference only)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return k, v


def visible_in_window(seqlen_q: int, seqlen_k: int, window_size, causal: bool = False, device=None) -> torch.Tensor:
    """FlashAttention's local mask, bottom-right aligned like causal: with i' = i + seqlen_k -
    seqlen_q, query i sees key j iff i' - left <= j <= i' + right (-1 = no bound on that side);
    causal caps right at 0."""
    left, right = window_size
    right = 0 if causal else right
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


def _positions(q, k):
    """b, h, q_idx, kv_idx as tensors that broadcast over (batch, heads, seqlen_q, seqlen_k): what a
    score_mod or mask_mod is called with (FlexAttention's convention, plain indices)."""
    batch, heads, seqlen_q, _ = q.shape
    device = q.device
    return (torch.arange(batch, device=device)[:, None, None, None], torch.arange(heads, device=device)[None, :, None, None],
            torch.arange(seqlen_q, device=device)[None, None, :, None], torch.arange(k.shape[2], device=device)[None, None, None, :])


def _capped_and_biased(scores, softcap, alibi_slopes):
    """The score variants on (batch, heads, seqlen_q, seqlen_k) scaled scores: softcap, then ALiBi
    (slopes (heads,) or (batch, heads)), bottom-right aligned."""
    seqlen_q, seqlen_k = scores.shape[-2:]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(scores.device)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        i = torch.arange(seqlen_q, device=scores.device)[:, None] + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=scores.device)[None, :]
        scores = scores - slopes * (i - j).abs()
    return scores


def _masked(scores, causal, window_size):
    """-inf where the causal mask or the window (visible_in_window) hides a key."""
    seqlen_q, seqlen_k = scores.shape[-2:]
    if tuple(window_size) != (-1, -1):
        return scores.masked_fill(~visible_in_window(seqlen_q, seqlen_k, window_size, causal, scores.device), -math.inf)
    if causal:
        return scores.masked_fill(~visible(seqlen_q, seqlen_k, scores.device), -math.inf)
    return scores


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dequantized(q, k, v, descales: dict, out_dtype):
    """FP8 inputs as the values they stand for (FlashAttention-3's rule: the stored value times its
    descale, fp32 of shape (batch, heads_kv), one per KV head and its query heads), in fp32, and
    the output's dtype (bf16 unless out_dtype says; for other inputs their own dtype). Descales
    with inputs that are not FP8 are refused by name."""
    given = [name for name, value in descales.items() if value is not None]
    if q.dtype not in FP8:
        if given:
            raise ValueError(f"{given[0]} is for float8 inputs (q, k, v of dtype {' or '.join(map(str, FP8))}); got {q.dtype}")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype={out_dtype}: for {q.dtype} inputs the output is {q.dtype}")
        return q, k, v, q.dtype
    if out_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype={out_dtype}: for float8 inputs it must be torch.bfloat16 (the default), float16 or float32")
    batch, heads_kv = k.shape[0], k.shape[1]
    group = q.shape[1] // heads_kv
    out = []
    for (name, descale), t, repeat in zip(descales.items(), (q, k, v), (group, 1, 1)):
        if descale is None:
            out.append(t.float())
            continue
        if not (isinstance(descale, torch.Tensor) and descale.dtype == torch.float32 and tuple(descale.shape) == (batch, heads_kv)):
            raise ValueError(f"{name} must be a float32 tensor of shape ({batch}, {heads_kv}) (batch, heads_kv); got "
                             f"{getattr(descale, 'dtype', type(descale).__name__)} {tuple(getattr(descale, 'shape', ()))}")
        if descale.device != q.device:
            raise ValueError(f"{name} is on {descale.device}, the inputs on {q.device}: they must be on one device")
        out.append(t.float() * descale.repeat_interleave(repeat, dim=1)[:, :, None, None])
    return (*out, out_dtype or torch.bfloat16)


FP8_P_LOG2 = 8  # the FP8 forward's exponentials run 2^8 above each row's max (P in [0, 256], rounded to e4m3)


def fp8_emulated(q, k, v, causal=False, scale=None, *, q_descale=None, k_descale=None, v_descale=None,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None):
    """The FP8 numerics rule's yardstick (README): the FP8 forward's computation done by PyTorch,
    on FP8 q, k, v ((batch, heads, seq, d), GQA allowed) with FlashAttention-3's descales. The
    dequantized inputs in bf16, their products in fp32, the variants as naive_attention applies
    them, P = 2^FP8_P_LOG2 exp(s - m) rounded to e4m3 (saturating) for P V and divided by the
    unrounded sum (a sink's term included). Returns bf16 (batch, heads, seq_q, d_v); a row that
    sees no key gives 0."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_emulated takes float8_e4m3fn inputs; got {q.dtype}")
    q, k, v, _ = _dequantized(q, k, v, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}, None)
    q, k, v = (t.to(torch.bfloat16).float() for t in (q, k, v))
    k, v = _expand_kv(q, k, v)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = _masked(_capped_and_biased(scores, softcap, alibi_slopes), causal, _clip_window(window_size, k.shape[-2]))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top) * 2.0**FP8_P_LOG2
    total = e.sum(-1, keepdim=True)
    if learnable_sink is not None:  # one more term of the sum that carries no value
        total = total + torch.exp(learnable_sink.float().view(-1, 1, 1) - top) * 2.0**FP8_P_LOG2
    out = (e.clamp_max(448.0).to(torch.float8_e4m3fn).float() @ v) / torch.where(total > 0, total, torch.ones_like(total))
    return out.to(torch.bfloat16)


def naive_attention(q, k, v, causal=False, scale=None, upcast=True, *, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, score_mod=None, mask_mod=None, return_lse=False, learnable_sink=None,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """softmax(q k^T * scale) v with the full score matrix: flashgen.attention in plain PyTorch, on
    any device. q and k (batch, heads, seqlen_q, head_dim), (batch, heads_kv, seqlen_k, head_dim), v
    the same as k or with a head dim of its own (then out's), heads a multiple of heads_kv, of one
    floating dtype. Returns out in q's dtype, and with
    return_lse=True (out, lse), lse the (batch, heads, seqlen_q) fp32 log-sum-exp, as attention().

    upcast=True computes in fp32 (the reference); upcast=False keeps the inputs' dtype for the
    matmuls and the probabilities, which is what "the same computation in low precision" costs.
    Rows that see no key give o = 0 and lse = -inf.

    The variants, with FlashAttention's names and semantics, applied in this order to the scaled
    scores s: softcap > 0 makes them softcap * tanh(s / softcap); alibi_slopes (heads,) or
    (batch, heads), fp32, adds -slope * |i + seqlen_k - seqlen_q - j|; score_mod(s, b, h, q_idx,
    kv_idx) returns new scores (FlexAttention's convention: plain indices, tensors that broadcast);
    then the masks: causal, window_size=(left, right) (visible_in_window; as in flash_attn_func, a
    side of at least seqlen_k keys is unbounded), and mask_mod(b, h, q_idx, kv_idx) (True keeps).
    The rules are Python functions: a flashgen.ScoreMod or MaskMod's twin is its .python.
    learnable_sink (heads,) fp32 joins each row's softmax as one more score that carries no value
    (the softmax over the row's scores and the sink, the sink's column dropped); differentiable.

    FP8 inputs (q, k, v float8_e4m3fn or e5m2, FlashAttention-3's FP8 forward): q_descale,
    k_descale, v_descale (fp32 (batch, heads_kv), None = 1) give the true values (stored times
    descale), which the oracle attends to in fp32 (upcast only); out in out_dtype (default bf16).
    """
    scale, window_size, softcap = _checked(q, k, v, NAIVE_Q, NAIVE_KV, scale=scale, window_size=window_size,
                                           softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    if q.dtype in FP8 and not upcast:
        raise ValueError("upcast=False with float8 inputs: the oracle dequantizes them and computes in fp32 (upcast=True)")
    q, k, v, out_dtype = _dequantized(q, k, v, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale},
                                      out_dtype)
    for name, rule in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if rule is not None and not callable(rule):
            raise TypeError(f"{name} must be a Python function (of a flashgen rule, its .python), got {type(rule).__name__}")
    o, lse = _attention(q, k, v, causal, scale, upcast, _clip_window(window_size, k.shape[-2]), softcap, alibi_slopes,
                        score_mod, mask_mod, learnable_sink)
    o = o.to(out_dtype)
    return (o, lse) if return_lse else o


def attention_backward(d_o, q, k, v, o, lse, causal=False, scale=None, *, softcap=0.0):
    """The gradients (dq, dk, dv) of one block of attention, FlashAttention's backward in fp32: P
    recomputed from the scores and a given log-sum-exp (lse, (batch, heads, seqlen_q)), delta =
    rowsum(dO * O) from a given output o. With the lse and output of the whole row (more keys than
    this block's), the block's share of the row's gradients, which is how a ring of blocks
    (flashgen.distributed) differentiates: the shares add up. Layouts as naive_attention's (GQA:
    dk, dv summed over each KV head's query heads); returns them in q's, k's and v's dtypes."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.float() for t in (q, *_expand_kv(q, k, v)))
    d_of, of = d_o.float(), o.float()
    s = qf @ kf.transpose(-1, -2) * scale
    slope = 1.0
    if softcap:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t  # d(softcap tanh(x / softcap)) / dx
    if causal:
        s = s.masked_fill(~visible_in_window(q.shape[2], k.shape[2], (-1, 0), device=q.device), -math.inf)
    p = torch.exp(s - lse.float()[..., None]).nan_to_num(0.0)  # (rows with lse -inf see nothing)
    dv = p.transpose(-1, -2) @ d_of
    dp = d_of @ vf.transpose(-1, -2)
    ds = p * (dp - (d_of * of).sum(-1, keepdim=True)) * slope
    dq, dk = ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale
    if group > 1:
        dk, dv = (t.unflatten(1, (k.shape[1], group)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _attention(q, k, v, causal, scale, upcast, window_size, softcap=0.0, alibi_slopes=None, score_mod=None,
               mask_mod=None, sink=None):
    """naive_attention with the window as given (the serving oracles clip it at their own seqlen_k);
    `sink` (heads,): each head's sink logit."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _expand_kv(q, k, v)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scores = _capped_and_biased(torch.matmul(q * scale, k.transpose(-1, -2)).float(), softcap, alibi_slopes)
    if score_mod is not None:
        scores = score_mod(scores, *_positions(q, k)).float()
    scores = _masked(scores, causal, window_size)
    if mask_mod is not None:
        scores = scores.masked_fill(~torch.as_tensor(mask_mod(*_positions(q, k)), device=q.device), -math.inf)
    if sink is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:  # one more column that carries no value
        column = sink.float().view(*(1,) * (scores.dim() - 3), -1, 1, 1).expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a fully masked row: 0, not NaN
    o = torch.matmul(probs.to(v.dtype), v)
    return o.to(dtype), lse


@dataclass
class TileState:
    """The running softmax state of one query tile after it has absorbed one key tile."""

    m_block: int
    n_block: int
    m: torch.Tensor  # (..., rows) running max of the scaled scores
    l: torch.Tensor  # (..., rows) running sum of exp(score - m)
    o: torch.Tensor  # (..., rows, d) running sum of exp(score - m) * v, not yet divided by l


def _window_bounds(causal: bool, window_size) -> tuple[int, int] | None:
    """(left, right) as the Mask takes them, or None for no window: FlashAttention's rule (causal
    caps right at 0; (-1, -1), or causal with left -1, is no window), then -1 -> UNBOUNDED."""
    left, right = window_size
    if causal:
        right = 0 if left != -1 else -1
    if (left, right) == (-1, -1):
        return None
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


def key_tiles(m0: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool,
              window_size=(-1, -1)) -> range:
    """The key tiles the query tile at rows [m0, m0 + block_m) visits: the mirror of Mask's
    key_begin and key_end in templates/mask.cuh.j2 (tiles no row of the tile sees are skipped, at
    both ends under a window)."""
    tiles = math.ceil(seqlen_k / block_n)
    diag = seqlen_k - seqlen_q
    window = _window_bounds(causal, window_size)
    if window is None and not causal:
        return range(0, tiles)
    left, right = window or (UNBOUNDED, 0)
    begin = max(0, m0 + diag - left) // block_n if window else 0  # the first key of the tile's first row
    last_key = min(m0 + block_m, seqlen_q) - 1 + diag + right  # of the tile's last row
    end = 0 if last_key < 0 else max(begin, min(tiles, last_key // block_n + 1))
    return range(begin, end)


def query_tiles(n0: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool,
                window_size=(-1, -1)) -> range:
    """The query tiles that visit the key tile at keys [n0, n0 + block_n): the mirror of Mask's
    query_begin and query_end (what the key-major backward walks)."""
    tiles = math.ceil(seqlen_q / block_m)
    diag = seqlen_k - seqlen_q
    window = _window_bounds(causal, window_size)
    if window is None and not causal:
        return range(0, tiles)
    left, right = window or (UNBOUNDED, 0)
    begin = max(0, n0 - diag - right) // block_m  # the first query that sees key n0, and its tile
    if not window:
        return range(begin, tiles)
    last_row = min(n0 + block_n, seqlen_k) - 1 - diag + left  # the last query that sees a key of the tile
    end = 0 if last_row < 0 else max(begin, min(tiles, last_row // block_m + 1))
    return range(begin, end)


def visited_tiles(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool, window_size=(-1, -1),
                  key_major: bool = False) -> int:
    """How many (query tile, key tile) pairs a kernel of these tiles visits: query-major (the
    forward) by key_tiles, key-major (the key-major backward) by query_tiles."""
    if key_major:
        return sum(len(query_tiles(n * block_n, block_m, block_n, seqlen_q, seqlen_k, causal, window_size))
                   for n in range(math.ceil(seqlen_k / block_n)))
    return sum(len(key_tiles(m * block_m, block_m, block_n, seqlen_q, seqlen_k, causal, window_size))
               for m in range(math.ceil(seqlen_q / block_m)))


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_size=(-1, -1)) -> int:
    """How many (query, key) pairs the mask keeps (what visible / visible_in_window hold True),
    counted row by row without forming the mask."""
    window = _window_bounds(causal, window_size) or ((UNBOUNDED, 0) if causal else (UNBOUNDED, UNBOUNDED))
    left, right = window
    diag = seqlen_k - seqlen_q
    return sum(max(0, min(seqlen_k - 1, i + diag + right) - max(0, i + diag - left) + 1) for i in range(seqlen_q))


def tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal, window_size=(-1, -1)):
    """The kernel's schedule: for each query tile, the key tiles it visits, in the kernel's order
    (last to first)."""
    for m_block in range(math.ceil(seqlen_q / block_m)):
        yield m_block, list(reversed(key_tiles(m_block * block_m, block_m, block_n, seqlen_q, seqlen_k, causal, window_size)))


def tiled_attention(q, k, v, causal=False, scale=None, block_m=64, block_n=64, record=None, window_size=(-1, -1), *,
                    return_lse=False):
    """Online-softmax attention over tiles, in fp32. Returns out, or (out, lse) with return_lse, as
    naive_attention; appends TileStates to record. window_size as naive_attention's (not clipped
    at seqlen_k): the tiles outside the window are skipped, as the kernel does."""
    scale, window_size, _ = _checked(q, k, v, NAIVE_Q, NAIVE_KV, scale=scale, window_size=window_size)
    dtype = q.dtype
    k, v = _expand_kv(q, k, v)
    q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
    mask = visible(seqlen_q, seqlen_k, q.device) if causal else None
    if tuple(window_size) != (-1, -1):
        mask = visible_in_window(seqlen_q, seqlen_k, window_size, causal, q.device)
    for m_block, n_blocks in tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal, window_size):
        rows = slice(m_block * block_m, min((m_block + 1) * block_m, seqlen_q))
        q_tile = q[..., rows, :]
        m = torch.full(q_tile.shape[:-1], -math.inf, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_tile)
        for n_block in n_blocks:
            cols = slice(n_block * block_n, min((n_block + 1) * block_n, seqlen_k))
            s = torch.matmul(q_tile, k[..., cols, :].transpose(-1, -2)) * scale
            if mask is not None:
                s = s.masked_fill(~mask[rows, cols], -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            shift = torch.where(m_new == -math.inf, 0.0, m_new)  # rows with nothing seen yet
            alpha = torch.exp(m - shift)  # rescales what was summed under the old max
            p = torch.exp(s - shift[..., None])
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v[..., cols, :])
            m = m_new
            if record is not None:
                record.append(TileState(m_block, n_block, m.clone(), l.clone(), acc.clone()))
        seen = l > 0
        o[..., rows, :] = torch.where(seen[..., None], acc / l.clamp_min(1e-30)[..., None], 0.0)
        lse[..., rows] = torch.where(seen, m + torch.log(l.clamp_min(1e-30)), -math.inf)
    return (o.to(dtype), lse) if return_lse else o.to(dtype)


# ---- packed sequences of different lengths (flashgen.attention_varlen) -------------------------


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """The offsets as a list, after the checks flashgen.attention_varlen cannot afford (they read
    the values on the host: a device sync): they start at 0, never decrease, end at the packed
    tensor's row count, and no sequence is longer than max_seqlen."""
    offsets = cu_seqlens.tolist()
    which = name.removeprefix("cu_seqlens_")
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] = {offsets[0]}: the offsets must start at 0")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if any(n < 0 for n in lengths):
        b = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing; {name}[{b + 1}] = {offsets[b + 1]} < {name}[{b}] = {offsets[b]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] = {offsets[-1]}, but {which} has {total} rows: the last offset must be the total")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen_{which}={max_seqlen}, but a sequence has {max(lengths)} rows: it must be the longest length")
    return offsets


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                     return_lse=False, block_table=None, learnable_sink=None, upcast=True, *, k_descale=None,
                     v_descale=None):
    """flashgen.attention_varlen in plain PyTorch, on any device (the CPU included): naive
    attention of each sequence alone, bottom-right causal within it, and so the variants
    (naive_attention's: the window and ALiBi aligned to each sequence's own end; alibi_slopes
    (heads,) or (batch, heads), batch the sequence's index). Returns what the kernel
    returns: out (total_q, heads, d) in q's dtype, and with return_lse the (heads, total_q) fp32
    log-sum-exp (-inf, with out 0, for a row that sees no key). It runs the input checks
    attention_varlen runs, and also those of cu_seqlens' values (check_cu_seqlens), which the
    kernel path skips. upcast=False keeps the inputs' dtype for the matmuls (the numerics rule's
    low-precision reference); `deterministic` and a zero `dropout_p` are accepted for the same
    signature (this is deterministic, and has no dropout). With a block_table, k and v are a paged
    cache and sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of its
    pages (clamped to the table's capacity; a page outside the cache reads as zeros), as in the kernel.
    A paged FP8 cache (float8_e4m3fn k and v, 16-bit q) comes with k_descale and v_descale, fp32
    (batch, heads_kv), as attention_with_kvcache's.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: flashgen computes exact attention without dropout; pass 0.0")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor (FlashAttention's layout), got {getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.dim() != 1 or not len(cu):
            raise ValueError(f"{name} must have shape (batch + 1,): each sequence's first row, then the total; got {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have shape (batch + 1,); got {tuple(cu_seqlens_q.shape)} "
                         f"and {tuple(cu_seqlens_k.shape)}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a non-negative int, the longest sequence's length")
    batch = cu_seqlens_q.shape[0] - 1
    paged = block_table is not None
    fp8_cache = paged and k.dtype in FP8 and q.dtype not in FP8
    if fp8_cache:
        k_scale, v_scale = _cache_descales(q, k, v, k_descale, v_descale, batch)
        stored_k, stored_v = k, v
        k, v = k.to(q.dtype), v.to(q.dtype)  # (for the checks below)
    elif k_descale is not None or v_descale is not None:
        raise ValueError("k_descale and v_descale (attention_varlen's reference) are for a paged FP8 cache (float8_e4m3fn)")
    kv_layout = ("num_blocks", "page_size", "heads_kv", "head_dim") if paged else ("total_k", "heads_kv", "head_dim")
    softmax_scale, window_size, softcap = _checked(
        q, k, v, ("total_q", "heads", "head_dim"), kv_layout, batch=batch, scale=softmax_scale, scale_name="softmax_scale",
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
        learnable_sink=learnable_sink)
    window_size = _clip_window(window_size, max_seqlen_k)  # FlashAttention's: clipped at max_seqlen_k
    starts_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    total_k = k.shape[0] if block_table is None else int(cu_seqlens_k[-1])  # paged: the offsets give lengths only
    starts_k = check_cu_seqlens(cu_seqlens_k, total_k, max_seqlen_k, "cu_seqlens_k")
    outs, lses = [q.new_zeros((0, q.shape[1], v.shape[-1]))], [torch.zeros(q.shape[1], 0, device=q.device)]  # (V's head dim)
    for seq, ((q0, q1), (k0, k1)) in enumerate(zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:]))):
        seq_q = q[q0:q1].transpose(0, 1)[None]
        if block_table is None:
            seq_k, seq_v = (t[k0:k1].transpose(0, 1)[None] for t in (k, v))
        else:
            positions = torch.arange(min(max(k1 - k0, 0), block_table.shape[1] * k.shape[1]), device=k.device)
            if fp8_cache:
                seq_k, seq_v = (dequantize(_cache_rows(t, seq, positions, block_table), scale[seq], q.dtype, upcast).transpose(0, 1)[None]
                                for t, scale in ((stored_k, k_scale), (stored_v, v_scale)))
            else:
                seq_k, seq_v = (_cache_rows(t, seq, positions, block_table).transpose(0, 1)[None] for t in (k, v))
        o, lse = _attention(seq_q, seq_k, seq_v, causal, softmax_scale, upcast, window_size, softcap,
                            _slopes_of(alibi_slopes, seq), sink=learnable_sink)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse) if return_lse else out


def _slopes_of(alibi_slopes, b):
    """Sequence b's ALiBi slopes, (heads,), from (heads,) or (batch, heads) ones (or None)."""
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]


# ---- serving: attention over a KV cache, and the merge of attention states ---------------------


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """flashgen.merge_attention_states in plain PyTorch: (o, lse) with lse = log(exp(lse_a) +
    exp(lse_b)) and o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b, in fp32 (fp64 for fp64 states);
    o of o_a's dtype.
    lse has o.shape[:-1]; a state with lse = -inf holds nothing and its o is not read (both -inf:
    o = 0, lse = -inf)."""
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if o_a.dim() < 1 or o_b.shape != o_a.shape:
        raise ValueError(f"o_a and o_b must have one shape (..., head_dim); got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != o_a.shape[:-1]:  # else it would broadcast: a (batch, heads, seqlen) lse of (batch, seqlen, heads, d) outputs
            raise ValueError(f"{name} must have shape o.shape[:-1] = {tuple(o_a.shape[:-1])} (a FlashAttention (batch, heads, "
                             f"seqlen) lse of (batch, seqlen, heads, d) outputs is lse.transpose(1, 2)); got {tuple(t.shape)}")

    def wide(t):  # fp32, or fp64 for fp64 inputs
        return t.to(torch.promote_types(t.dtype, torch.float32))

    lse_a, lse_b = wide(lse_a), wide(lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    shift = torch.where(torch.isneginf(lse), 0.0, lse)  # exp(-inf - 0) = 0, not exp(nan)

    def share(o_s, lse_s):  # a state with lse -inf is never read (the kernel skips it)
        return torch.where(torch.isneginf(lse_s)[..., None], 0.0, torch.exp(lse_s - shift)[..., None] * wide(o_s))

    return (share(o_a, lse_a) + share(o_b, lse_b)).to(o_a.dtype), lse


def fp8_values(v: torch.Tensor) -> torch.Tensor:
    """V of an FP8 forward as its kernel reads it (what the fp8_v kernel writes): (B, H_kv, d_v,
    keys), keys contiguous (wgmma takes 8-bit operands K-major only), padded with zeros to whole 16s
    and each 16 in flashgen.ops.FP8_KEY_ORDER. In PyTorch, on any device (its bytes as uint8: the
    index ops take those)."""
    from .ops import FP8_KEY_ORDER

    batch, kv_heads, keys, head_dim_v = v.shape
    bytes_ = v.view(torch.uint8).transpose(2, 3)
    if keys % 16:
        bytes_ = torch.nn.functional.pad(bytes_, (0, 16 - keys % 16))
    order = torch.tensor(FP8_KEY_ORDER, device=v.device)
    grouped = bytes_.reshape(batch, kv_heads, head_dim_v, -1, 16).index_select(4, order)
    return grouped.reshape(batch, kv_heads, head_dim_v, -1).contiguous().view(v.dtype)


def fp8_values_varlen(v: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Packed V (total_k, H_kv, d_v) of an FP8 forward as its kernel reads it (what the fp8_v kernel
    writes): (1, H_kv, d_v, 16 (ceil(total_k / 16) + sequences + 1)), sequence b's keys from position
    16 (ceil(cu_seqlens_k[b] / 16) + b), a multiple of 16 (so each 16 of a sequence's keys are one
    group of FP8_KEY_ORDER), zeros between. In PyTorch, on any device."""
    from .ops import FP8_KEY_ORDER

    total, kv_heads, head_dim_v = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    width = 16 * (-(-total // 16) + batch + 1)  # past every sequence's start and keys
    out = torch.zeros(kv_heads, head_dim_v, width, dtype=torch.uint8, device=v.device)
    if total and batch:
        cu = cu_seqlens_k.long()
        token = torch.arange(total, device=v.device)
        token = token[(token >= cu[0]) & (token < cu[-1])]  # the rows some sequence holds
        sequence = (torch.searchsorted(cu[1:], token, right=True)).clamp_max(max(batch - 1, 0))
        at = 16 * ((cu[sequence] + 15) // 16 + sequence) + token - cu[sequence]  # each key's position, in order
        inverse = torch.tensor(FP8_KEY_ORDER, device=v.device).argsort()
        at = at - at % 16 + inverse[at % 16]  # key k of a group goes to position inverse[k]
        out.index_copy_(2, at, v.view(torch.uint8)[token].permute(1, 2, 0))
    return out[None].view(v.dtype)


def quantize(x, descale):
    """x stored in an FP8 cache with its descale (fp32, one per KV head: x (..., heads_kv, d) and
    descale (heads_kv,)): x / descale in fp32 (IEEE division), saturated at +-448 and rounded to
    nearest float8_e4m3fn; NaN stays NaN."""
    return (x.float() / descale.to(x.device)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize(x, descale, dtype, upcast=True):
    """The values FP8 rows (..., heads_kv, d) stand for: the stored ones times their KV head's
    descale, in fp32 (or, with upcast=False, rounded to `dtype`, the low-precision reference's)."""
    values = x.float() * descale.to(x.device)[:, None]
    return values if upcast else values.to(dtype)


def _cache_descales(q, k_cache, v_cache, k_descale, v_descale, batch=None):
    """An FP8 cache's checks: both caches float8_e4m3fn, q 16-bit, and both descales fp32 (batch,
    heads_kv) (batch: q's first dimension unless given)."""
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        raise TypeError(f"an FP8 cache is float8_e4m3fn, k_cache and v_cache both; got {k_cache.dtype} and {v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q has dtype {q.dtype}; over an FP8 cache it must be float16 or bfloat16")
    batch, kv_heads = q.shape[0] if batch is None else batch, k_cache.shape[2]
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        if not (isinstance(descale, torch.Tensor) and descale.dtype == torch.float32 and tuple(descale.shape) == (batch, kv_heads)):
            raise ValueError(f"{name} must be a float32 tensor of shape ({batch}, {kv_heads}) (batch, heads_kv) with an FP8 "
                             f"cache; got {getattr(descale, 'dtype', type(descale).__name__)} {tuple(getattr(descale, 'shape', ()))}")
    return k_descale, v_descale


def _cache_rows(cache, b, positions, block_table):
    """Rows `positions` of sequence b's cache: (positions, heads_kv, d); a page outside the cache
    gives zeros (what the kernel reads for it)."""
    if block_table is None:
        return cache[b, positions]
    num_pages, page_size = cache.shape[:2]
    pages = block_table[b].long()[positions // page_size]
    valid = (pages >= 0) & (pages < num_pages)
    rows = cache.new_zeros(len(positions), *cache.shape[2:])
    rows[valid] = cache[pages[valid], positions[valid] % page_size]
    return rows


def _attend(q, keys, values, causal, scale, upcast, splits, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            sink=None):
    """One sequence: q (seqlen_q, heads, d) over keys/values (n, heads_kv, d) -> o (seqlen_q, heads,
    d), lse (heads, seqlen_q), with the variants (alibi_slopes (heads,); sink (heads,)). With
    splits > 1 the keys are cut into that many runs whose states are merged by their log-sum-exp:
    the split-KV form of the same result, the sink merged once, as a state that holds no value."""
    q, keys, values = (t.transpose(0, 1)[None] for t in (q, keys, values))  # (1, heads, rows, d)
    n = keys.shape[2]
    if splits <= 1:
        o, lse = _attention(q, keys, values, causal, scale, upcast, window_size, softcap, alibi_slopes, sink=sink)
        return o[0].transpose(0, 1), lse[0]
    dtype = q.dtype
    k, v = _expand_kv(q, keys, values)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scores = _capped_and_biased(torch.matmul(q * scale, k.transpose(-1, -2)).float(), softcap, alibi_slopes)
    scores = _masked(scores, causal, window_size)
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
    for cols in torch.arange(n, device=q.device).tensor_split(splits):  # runs of keys (some may be empty)
        part = scores[..., cols]
        lse_s = torch.logsumexp(part, dim=-1) if len(cols) else torch.full_like(lse, -math.inf)
        probs = torch.exp(part - torch.where(torch.isneginf(lse_s), 0.0, lse_s)[..., None])
        o_s = torch.matmul(probs.to(v.dtype), v[..., cols, :]).float()
        o, lse = merge_attention_states(o, lse, o_s, lse_s)
    if sink is not None:
        o, lse = merge_attention_states(o, lse, torch.zeros_like(o), sink.float().view(1, -1, 1).expand_as(lse))
    return o.to(dtype)[0].transpose(0, 1), lse[0]


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary position embedding (FlashAttention's tables): x (n, heads, d) at positions (n,), with
    cos and sin (seqlen_ro, rotary_dim / 2); positions are clamped into the tables. The first
    rotary_dim dimensions turn, pairs (2j, 2j + 1) when interleaved (GPT-J), else (j, j +
    rotary_dim / 2) (GPT-NeoX), by angle j of the row's position; computed in fp32 and rounded to
    x's dtype, as the kernels do."""
    half = cos.shape[1]
    rows = positions.long().clamp(0, cos.shape[0] - 1)
    c, s_ = cos[rows].float()[:, None], sin[rows].float()[:, None]  # (n, 1, half)
    turned, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if interleaved:
        a, b = turned[..., 0::2], turned[..., 1::2]
        turned = torch.stack([a * c - b * s_, b * c + a * s_], dim=-1).flatten(-2)
    else:
        a, b = turned[..., :half], turned[..., half:]
        turned = torch.cat([a * c - b * s_, b * c + a * s_], dim=-1)
    return torch.cat([turned.to(x.dtype), rest], dim=-1)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                           cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                           return_softmax_lse=False, learnable_sink=None, upcast=True, *, k_descale=None, v_descale=None):
    """flashgen.attention_with_kvcache in plain PyTorch, on any device (the tests run it on the
    CPU). Like the kernel it appends k and v into k_cache and v_cache in place (pass copies to keep
    the originals), with the kernel's rules for bad input: a length is clamped to [0, capacity], a
    left pad to [0, that length], a new token past the capacity is attended to but not stored, a
    block-table entry outside [0, num_blocks) reads as zeros and is not written, a cache_batch_idx
    entry outside the cache's rows is a row with no keys that takes no appends, and a rotary
    position past the tables takes their last row. The attention reads every sequence's cache
    before any append, and its new keys from k and v (turned, with rotary tables), as the kernel does.

    num_splits > 1 computes each sequence's attention over that many runs of keys merged by
    merge_attention_states (the split-KV form; the same result). upcast=False computes in the
    inputs' dtype (the numerics rule's low-precision reference), like naive_attention. The
    variants (window_size, softcap, alibi_slopes (heads,) or (batch, heads)) are naive_attention's,
    aligned to each sequence's own length (its cache plus the new tokens), as the kernel does; a
    window side of at least the capacity is unbounded (FlashAttention's rule).

    An FP8 cache (k_cache, v_cache float8_e4m3fn) comes with k_descale and v_descale, fp32 (batch,
    heads_kv): a cached key is the stored one times its sequence's and KV head's descale. New keys
    and values are stored quantize()d with them, and attended to as stored (dequantized), as the
    kernel does.
    """
    fp8_cache = k_cache.dtype in FP8
    if fp8_cache:
        k_scale, v_scale = _cache_descales(q, k_cache, v_cache, k_descale, v_descale)
    elif k_descale is not None or v_descale is not None:
        raise ValueError(f"k_descale and v_descale are for an FP8 cache (float8_e4m3fn); k_cache is {k_cache.dtype}")
    stored_k_cache, stored_v_cache = k_cache, v_cache
    if fp8_cache:  # (the checks below see the dequantized caches; appends go to the stored ones)
        k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
    paged = block_table is not None
    cache_layout = ("num_blocks", "page_size", "heads_kv", "head_dim") if paged else ("batch_cache", "seqlen_cache",
                                                                                        "heads_kv", "head_dim")
    q_layout = ("batch", "seqlen_q", "heads", "head_dim")
    scale, window_size, softcap = _checked(
        q, k_cache, v_cache, q_layout, cache_layout, ("q", "k_cache", "v_cache"), scale=softmax_scale,
        scale_name="softmax_scale", window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        block_table=block_table, learnable_sink=learnable_sink)
    if (k is None) != (v is None):
        raise ValueError(f"k and v are appended together: got k {'None' if k is None else 'a tensor'} and v "
                         f"{'None' if v is None else 'a tensor'}")
    if k is not None:
        _checked(q, k, v, q_layout, ("batch", "seqlen_new", "heads_kv", "head_dim"))
        if k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k and v must have the caches' heads_kv, {k_cache.shape[2]}; got {k.shape[2]}")
    batch, seqlen_q, heads, head_dim = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    window_size = _clip_window(window_size, capacity)  # FlashAttention's: clipped at the capacity
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.tolist()
    else:
        lengths = [int(cache_seqlens)] * batch
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(batch))
    room = [capacity if 0 <= r < k_cache.shape[0] or paged else 0 for r in rows]  # a row outside the cache holds nothing
    rows = [r if room[b] else 0 for b, r in enumerate(rows)]
    ends = [min(max(n, 0), room[b]) for b, n in enumerate(lengths)]
    pads = [min(max(p, 0), ends[b]) for b, p in enumerate(cache_leftpad.tolist())] if cache_leftpad is not None else [0] * batch
    rotary = rotary_cos is not None
    per_token = causal or _window_bounds(causal, window_size) is not None  # FlashAttention's rule for q's rotary positions
    outs, lses, new_keys = [], [], []
    for b in range(batch):
        positions = torch.arange(pads[b], ends[b], device=k_cache.device)
        keys = _cache_rows(stored_k_cache, b if paged else rows[b], positions, block_table)
        values = _cache_rows(stored_v_cache, b if paged else rows[b], positions, block_table)
        queries = q[b]
        if rotary:  # new key j at ends[b] + j; query i there too with causal or a window, else at ends[b]
            tokens = torch.arange(seqlen_q, device=q.device)
            queries = apply_rotary(q[b], rotary_cos, rotary_sin, ends[b] + (tokens if per_token else 0 * tokens), rotary_interleaved)
        if k is not None:
            turned = k[b]
            if rotary:
                turned = apply_rotary(k[b], rotary_cos, rotary_sin, ends[b] + torch.arange(k.shape[1], device=k.device), rotary_interleaved)
            new_values = v[b]
            if fp8_cache:  # stored quantized, and attended to as stored
                turned, new_values = quantize(turned, k_scale[b]), quantize(new_values, v_scale[b])
            new_keys.append((turned, new_values))
            keys, values = torch.cat([keys, turned.to(keys.device)]), torch.cat([values, new_values.to(values.device)])
        if fp8_cache:
            keys, values = dequantize(keys, k_scale[b], q.dtype, upcast), dequantize(values, v_scale[b], q.dtype, upcast)
        o, lse = _attend(queries, keys.to(q.device), values.to(q.device), causal, scale, upcast, num_splits, window_size,
                         softcap, _slopes_of(alibi_slopes, b), learnable_sink)
        outs.append(o)
        lses.append(lse)
    if k is not None:  # the appends, after every read
        k_cache, v_cache = stored_k_cache, stored_v_cache
        for b, (turned, new_values) in enumerate(new_keys):
            for j in range(k.shape[1]):
                pos = ends[b] + j
                if pos >= room[b]:
                    break
                if paged:
                    page = int(block_table[b, pos // k_cache.shape[1]])
                    if not 0 <= page < k_cache.shape[0]:
                        continue
                    at = (page, pos % k_cache.shape[1])
                else:
                    at = (rows[b], pos)
                k_cache[at] = turned[j]
                v_cache[at] = new_values[j]
    out = torch.stack(outs)
    return (out, torch.stack(lses).float()) if return_softmax_lse else out
