"""GPU probe of the Hopper backward's three-consumer layout (block_n=96, `trio`) against the split
layout (block_n=64) and SDPA's CUDNN backend, at d = 192 with d_v = 128 (DeepSeek's) and 192:
forward + backward ms, FlashAttention's bench convention (16k tokens a call, 16 heads, bf16), causal
and not, each case timed A B C A B C in one process; first the largest difference between the two
layouts' gradients (both against the same inputs), as a sanity check beside the GPU tier's test.

    PYTHONPATH=. python3 .ci/probe_trio.py [--seqlens 2048,8192] [--dims 192/128,192/192] [--stages 2]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen import bench, tuning


def entries(head_dim, block_n, stages):
    return [{"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
             "tiles": [{"block_m": 64, "block_n": block_n, "num_stages": stages}]} for kind in ("bwd_sm90_kvq", "bwd_sm90_kv")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--dims", default="192/128,192/192")
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    rows = ["| d / d_v | T | causal | split ms | trio ms | cudnn ms | split / trio | cudnn / trio | trio TFLOPS |",
            "|---|---|---|---|---|---|---|---|---|"]
    for dims in args.dims.split(","):
        head_dim, head_dim_v = (int(d) for d in dims.split("/"))
        layouts = {"split": entries(head_dim, 64, 2), "trio": entries(head_dim, 96, args.stages)}
        for seqlen in (int(t) for t in args.seqlens.split(",")):
            batch, heads = bench.TOKENS // seqlen, 16
            gen = torch.Generator(device="cuda").manual_seed(seqlen)
            q, k = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            v = torch.randn(batch, heads, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
            for causal in (True, False):
                def ours(q, k, v):
                    return flashgen.attention(q, k, v, causal=causal)

                def cudnn(q, k, v):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                grads = {}
                for name, layout in layouts.items():
                    with tuning.override(layout):
                        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                        out = ours(*leaves)
                        out.backward(torch.ones_like(out))
                        grads[name] = [t.grad for t in leaves]
                worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["split"], grads["trio"]))
                print(f"d {head_dim}/{head_dim_v} T={seqlen} causal={causal}: largest |split - trio| gradient difference "
                      f"{worst:.3e}", flush=True)
                times = {"split": [], "trio": [], "cudnn": []}
                for _ in range(2):
                    for name in times:
                        if name == "cudnn":
                            try:
                                times[name].append(bench.time_ms(bench.training_step(cudnn, (q, k, v))))
                            except RuntimeError as error:
                                times[name].append(float("nan"))
                                print(f"cudnn refused: {str(error).splitlines()[0][:120]}", flush=True)
                            continue
                        with tuning.override(layouts[name]):
                            times[name].append(bench.time_ms(bench.training_step(ours, (q, k, v))))
                best = {name: min(values) for name, values in times.items()}
                # forward S and O, backward S again, dP, dV, dK, dQ
                flops = 2 * batch * heads * seqlen * seqlen * (4 * head_dim + 3 * head_dim_v) / (2 if causal else 1)
                rows.append(f"| {head_dim} / {head_dim_v} | {seqlen} | {causal} | {best['split']:.3f} | {best['trio']:.3f} | "
                            f"{best['cudnn']:.3f} | {best['split'] / best['trio']:.3f} | {best['cudnn'] / best['trio']:.3f} | "
                            f"{flops / best['trio'] / 1e9:.0f} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
