"""One small call of each new asynchronous path (the Hopper forward and backward with a window, the
d = 256 backward layout, softcap and ALiBi in the Hopper backward's layouts, a mask rule's lists, a
per-head mask rule over GQA groups, a split paged decode step, a windowed decode step), for
compute-sanitizer; then the
same calls again, bitwise equal. Usage (GPU): PYTHONPATH=. python3 .ci/sanitize_variants.py"""

import sys
from pathlib import Path

import torch

import flashgen

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import rules  # noqa: E402


def calls():
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for head_dim, window in ((128, (100, 0)), (256, (-1, -1))):
        q, k, v = (torch.randn(1, 2, 300, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        o = flashgen.attention(q, k, v, causal=True, window_size=window)
        o.sum().backward()
        out += [o, k.grad, v.grad]  # (dq is summed with atomics here: its last bits may move)
    # softcap: the split layout's per-tile hand-over (d = 128) and the one-pass dS^T (d = 64); ALiBi on the plain tiles
    slopes = torch.rand(2, device="cuda", generator=gen)
    for head_dim, kwargs in ((128, {"softcap": 30.0}), (64, {"softcap": 30.0}), (128, {"alibi_slopes": slopes})):
        q, k, v = (torch.randn(1, 2, 300, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        o = flashgen.attention(q, k, v, causal=True, **kwargs)
        o.sum().backward()
        out += [o, k.grad, v.grad]
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))
    o = flashgen.attention(q, k, v, mask_mod=rules.prefix_lm(40), deterministic=True)
    o.sum().backward()
    out += [o, q.grad, k.grad, v.grad]
    # a rule that reads h over GQA groups on the Hopper kernels (each step located in its head's lists)
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(2))
    band = flashgen.MaskMod("abs(q_idx - kv_idx) < 70 * (h + 1)", lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 70 * (h + 1))
    o = flashgen.attention(q, k, v, mask_mod=band)
    o.sum().backward()
    out += [o, k.grad, v.grad]
    # a split paged decode step (block-table entries read a tile ahead)
    pages = torch.randn(2, 40, 16, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(40, device="cuda", generator=gen).view(2, 20).to(torch.int32)
    qp = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.append(flashgen.attention_with_kvcache(qp, pages[0], pages[1], cache_seqlens=torch.tensor([77, 300], dtype=torch.int32,
                                               device="cuda"), block_table=table, num_splits=4))
    cache = torch.randn(2, 2, 512, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    qd = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = torch.tensor([100, 400], dtype=torch.int32, device="cuda")
    out.append(flashgen.attention_with_kvcache(qd, cache[0], cache[1], cache_seqlens=lengths, window_size=(64, 0),
                                               causal=True, num_splits=3))
    return out


first = calls()
again = calls()
same = all(torch.equal(a, b) for a, b in zip(first, again))
print("bitwise equal on rerun:", same)
