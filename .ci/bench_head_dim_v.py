"""GPU probe of V with a head dim of its own (issue 42's target: d = 192, d_v = 128, forward +
backward at least as fast as the padded path, V padded to 192 and the output cropped, which is what
the transformers hook did before; and at least 1.0x SDPA's CUDNN backend where cuDNN takes the
shape). FlashAttention's bench convention (16k tokens a call, 16 heads, bf16), causal and not; each
case timed A B A B in one process; a backend that refuses the shape is reported as such.

    PYTHONPATH=. python3 .ci/bench_head_dim_v.py [--seqlens 2048,8192] [--dims 192,128]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen import bench


def fwd_bwd(fn, q, k, v):
    """ms of one forward + backward (the output's gradient precomputed)."""
    return bench.time_ms(bench.training_step(fn, (q, k, v)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--dims", default="192,128")
    args = parser.parse_args()
    head_dim, head_dim_v = (int(d) for d in args.dims.split(","))
    rows = [f"| T | causal | d_v {head_dim_v} ms | padded ms | cudnn ms | padded / ours | cudnn / ours | fwd: ours ms, cudnn ms |",
            "|---|---|---|---|---|---|---|---|"]
    for seqlen in (int(t) for t in args.seqlens.split(",")):
        batch, heads = bench.TOKENS // seqlen, 16
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        v = torch.randn(batch, heads, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16, generator=gen)
        for causal in (True, False):
            ours = lambda q, k, v: flashgen.attention(q, k, v, causal=causal)  # noqa: E731
            padded = lambda q, k, v: flashgen.attention(  # noqa: E731
                q, k, F.pad(v, [0, head_dim - head_dim_v]) if head_dim > head_dim_v else v, causal=causal)[..., :head_dim_v]

            def cudnn(q, k, v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            times = {"ours": [], "padded": [], "cudnn": []}
            for _ in range(2):
                for name, fn in (("ours", ours), ("padded", padded), ("cudnn", cudnn)):
                    try:
                        times[name].append(fwd_bwd(fn, q, k, v))
                    except RuntimeError as error:  # the backend does not take the shape
                        times[name].append(float("nan"))
                        print(f"{name} refused T={seqlen} causal={causal}: {str(error).splitlines()[0][:120]}", flush=True)
            best = {name: min(values) for name, values in times.items()}
            with torch.no_grad():  # the forward alone: which side of the step the difference is on
                forward = {name: bench.time_ms(lambda fn=fn: fn(q, k, v)) for name, fn in (("ours", ours), ("cudnn", cudnn))}
            rows.append(f"| {seqlen} | {causal} | {best['ours']:.3f} | {best['padded']:.3f} | {best['cudnn']:.3f} | "
                        f"{best['padded'] / best['ours']:.3f} | {best['cudnn'] / best['ours']:.3f} | "
                        f"{forward['ours']:.3f}, {forward['cudnn']:.3f} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
