"""GPU probe of the attention variants in the forward the tables pick (the Hopper family on sm_90a):
the time of softcap, ALiBi and sliding windows next to the plain kernel, in FlashAttention's bench
convention (16k tokens a call, model dim 2048, bf16). The issue's targets: softcap and ALiBi cost
at most 10% over the plain kernel (d = 128, T = 8k); a causal window runs in at most 1.1x the
fraction of key tiles it visits times the time of full causal attention.

    PYTHONPATH=. python3 .ci/bench_variants.py [--head-dims 64,128] [--seqlen 8192]
"""

import argparse

import torch

import flashgen
from flashgen import bench, plans


def tiles_visited(seqlen, block_m, block_n, left, causal=True):
    """Key tiles the query tiles visit (mask.cuh.j2's key_begin / key_end, Tq = Tk): a causal
    window of `left` keys, or full causal attention for left = -1."""
    total = 0
    for m0 in range(0, seqlen, block_m):
        last = min(m0 + block_m, seqlen) - 1
        begin = max(0, m0 - left) // block_n if left >= 0 else 0
        end = min(-(-seqlen // block_n), last // block_n + 1) if causal else -(-seqlen // block_n)
        total += max(0, end - begin)
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args()
    seqlen = args.seqlen
    rows = ["| d | variant | kernel | ms | vs plain | tile area / causal's | ms / (area share x causal ms) |", "|---|---|---|---|---|---|---|"]
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        q, k, v = bench._inputs(seqlen, head_dim)
        heads = q.shape[1]
        slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
        cases = [
            ("full", False, {}), ("full softcap 30", False, dict(softcap=30.0)), ("full alibi", False, dict(alibi_slopes=slopes)),
            ("causal", True, {}), ("causal softcap 30", True, dict(softcap=30.0)), ("causal alibi", True, dict(alibi_slopes=slopes)),
            ("causal softcap + alibi", True, dict(softcap=30.0, alibi_slopes=slopes)),
            *((f"causal window {w}", True, dict(window_size=(w, 0))) for w in (256, 1024, 4096)),
            ("window (1024, 1024)", False, dict(window_size=(1024, 1024))),
        ]
        plain = {}
        for name, causal, variant in cases:
            ms = bench.time_ms(lambda: flashgen.attention(q, k, v, causal=causal, **variant))
            fields = tuple(f for f, on in (("window", "window_size" in variant), ("softcap", "softcap" in variant),
                                           ("alibi", "alibi_slopes" in variant)) if on)
            spec = plans.forward(0, head_dim, q.dtype, causal, seqlen, "", fields).kernels[0].spec
            if not variant:
                plain[causal] = (ms, spec)
            base_ms, base_spec = plain[causal]
            fraction = target = ""
            if "window_size" in variant and causal:
                # in tile area: a variant kernel may have other tiles than the plain one
                part = tiles_visited(seqlen, spec.block_m, spec.block_n, variant["window_size"][0]) * spec.block_m * spec.block_n
                whole = tiles_visited(seqlen, base_spec.block_m, base_spec.block_n, -1) * base_spec.block_m * base_spec.block_n
                fraction = f"{part / whole:.3f}"
                target = f"{ms / (part / whole * base_ms):.2f}"  # <= 1.1 wanted
            rows.append(f"| {head_dim} | {name} | {spec.name} | {ms:.3f} | {ms / base_ms:.3f} | {fraction} | {target} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
