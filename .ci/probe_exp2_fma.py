"""GPU probe of the Hopper forward's exp2_fma (k of every 8 softmax exponentials on the FMA pipes):
the tables' forward spec with k = 0 .. 4, timed against each other in one process at the bench's
shapes (16k tokens, model dim 2048, bf16), plain and softcap (50), in interleaved rounds so that
the ratios to k = 0 carry no drift. Each spec is first checked against the fp32 reference
(numerics rule, factor 2) on an odd shape.

    PYTHONPATH=. python3 .ci/probe_exp2_fma.py [--head-dims 64,128] [--seqlens 2048,8192,16384]
"""

import argparse

import torch

from flashgen import bench, reference, tuning
from flashgen.api import call

SHARES = (0, 1, 2, 3, 4)
ROUNDS = 3


def checked(spec, causal, softcap):
    gen = torch.Generator(device="cuda").manual_seed(spec.head_dim)
    q, k, v = (torch.randn(2, 4, 1023, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    kwargs = {"softcap": softcap} if softcap else {}
    out = call(q, k, v, causal, None, False, False, spec=spec, **kwargs).float()
    ref = reference.naive_attention(q, k, v, causal=causal, **kwargs).float()
    low = reference.naive_attention(q, k, v, causal=causal, upcast=False, **kwargs).float()
    return (out - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192,16384")
    args = parser.parse_args()
    print("| d | mask | softcap | T | " + " | ".join(f"k={k} ms" for k in SHARES) + " | best vs k=0 | spec (k=0) |")
    print("|---" * (6 + len(SHARES)) + "|")
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for softcap in (0.0, 50.0):
                base = tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", 4096, variant=("softcap",) if softcap else ())
                specs = [base.replace(exp2_fma=k) for k in SHARES]
                bad = [spec.name for spec in specs if not checked(spec, causal, softcap)]
                if bad:
                    print(f"FAILED the numerics rule: {', '.join(bad)}")
                    continue
                for seqlen in map(int, args.seqlens.split(",")):
                    q, k, v = bench._inputs(seqlen, head_dim, torch.bfloat16)
                    kwargs = {"softcap": softcap} if softcap else {}
                    times = {spec: [] for spec in specs}
                    for _ in range(ROUNDS):
                        for spec in specs:
                            times[spec].append(bench.time_ms(lambda: call(q, k, v, causal, None, False, False, spec=spec, **kwargs)))
                    best = [min(times[spec]) for spec in specs]
                    mask = "causal" if causal else "full"
                    print(f"| {head_dim} | {mask} | {softcap or '-'} | {seqlen} | " + " | ".join(f"{t:.3f}" for t in best)
                          + f" | {min(best) / best[0]:.3f} (k={SHARES[best.index(min(best))]}) | {base.name} |", flush=True)


if __name__ == "__main__":
    main()
