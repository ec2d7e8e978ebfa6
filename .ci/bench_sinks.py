"""GPU probe of attention sinks' cost (issue 42's target: at most 3 % over the plain kernel, forward
and backward, d = 64 and 128, T = 8k, causal and with a causal window of 128): each case timed A B A
B (plain, sink, plain, sink) in one process, FlashAttention's bench convention (16k tokens a call,
model dim 2048, bf16). The backward with a sink also computes the sink's gradient.

    PYTHONPATH=. python3 .ci/bench_sinks.py [--head-dims 64,128] [--seqlen 8192]
"""

import argparse

import torch

import flashgen
from flashgen import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args()
    rows = ["| d | mask | mode | plain ms | sink ms | sink / plain (two rounds) |", "|---|---|---|---|---|---|"]
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        q, k, v = bench._inputs(args.seqlen, head_dim)
        sink = torch.linspace(-2.0, 2.0, q.shape[1], device="cuda")
        for mask, keywords in (("causal", dict(causal=True)), ("window 128", dict(causal=True, window_size=(127, 0)))):
            for mode in ("fwd", "bwd"):
                times = {"plain": [], "sink": []}
                for _ in range(2):
                    for name, extra in (("plain", {}), ("sink", dict(learnable_sink=sink))):
                        leaves = [t.detach().clone().requires_grad_(mode == "bwd") for t in (q, k, v)]
                        extra = {key: value.detach().clone().requires_grad_(mode == "bwd") for key, value in extra.items()}
                        call = lambda: flashgen.attention(*leaves, **keywords, **extra)  # noqa: E731
                        if mode == "fwd":
                            times[name].append(bench.time_ms(call))
                        else:
                            out = call()
                            d_o = torch.randn_like(out)
                            grads = [*leaves, *extra.values()]
                            times[name].append(bench.time_ms(
                                lambda: [setattr(t, "grad", None) for t in grads] and out.backward(d_o, retain_graph=True)))
                ratios = [s / p for s, p in zip(times["sink"], times["plain"])]
                rows.append(f"| {head_dim} | {mask} | {mode} | {min(times['plain']):.3f} | {min(times['sink']):.3f} | "
                            f"{ratios[0]:.3f}, {ratios[1]:.3f} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
