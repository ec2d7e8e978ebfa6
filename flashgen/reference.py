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


def naive_attention(q, k, v, causal=False, scale=None, upcast=True):
    """softmax(q k^T * scale) v with the full score matrix. Returns (o, lse).

    upcast=True computes in fp32 (the reference); upcast=False keeps the inputs' dtype for the
    matmuls and the probabilities, which is what "the same computation in low precision" costs.
    Rows that see no key give o = 0 and lse = -inf.
    """
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _expand_kv(q, k, v)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float()
    if causal:
        scores = scores.masked_fill(~visible(q.shape[2], k.shape[2], q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
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


def key_tiles(m0: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> range:
    """The key tiles the query tile at rows [m0, m0 + block_m) visits: the mirror of Mask's
    key_begin and key_end in templates/mask.cuh.j2 (tiles no row of the tile sees are skipped)."""
    end = math.ceil(seqlen_k / block_n)
    if causal:
        last_key = min(m0 + block_m, seqlen_q) - 1 + seqlen_k - seqlen_q  # of the tile's last row
        end = 0 if last_key < 0 else min(end, last_key // block_n + 1)
    return range(0, end)


def tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal):
    """The kernel's schedule: for each query tile, the key tiles it visits, in the kernel's order
    (last to first)."""
    for m_block in range(math.ceil(seqlen_q / block_m)):
        yield m_block, list(reversed(key_tiles(m_block * block_m, block_m, block_n, seqlen_q, seqlen_k, causal)))


def tiled_attention(q, k, v, causal=False, scale=None, block_m=64, block_n=64, record=None):
    """Online-softmax attention over tiles, in fp32. Returns (o, lse); appends TileStates to record."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _expand_kv(q, k, v)
    q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
    mask = visible(seqlen_q, seqlen_k, q.device) if causal else None
    for m_block, n_blocks in tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal):
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
    return o.to(dtype), lse
