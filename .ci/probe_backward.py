"""GPU probe of the backward the tables pick: gradients against the fp32 reference on a few odd
shapes (numerics rule, factor 3), then TFLOPS of the backward (and of forward + backward) next to
the mma.sync key-major kernels (the tables' previous sm_90a backward: "key-major") and SDPA's
FLASH and CUDNN, one process, the bench's shapes (16k tokens, model dim 2048). Run it under a
timeout before the GPU tier: a pipeline that deadlocks shows here.

    PYTHONPATH=. python3 .ci/probe_backward.py [--no-timing] [--head-dims 64,128,192,256]
        [--seqlens 2048,4096,8192] [--modes bwd,fwd+bwd] [--causal both|yes|no]

Above head dim 128 the Hopper backward runs its split layout (block_n=64); each timing row names
the kernels that ran.
"""

import argparse
import sys

import torch

import flashgen
from flashgen import bench, plans, tuning
from flashgen.reference import naive_attention


def check(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype=torch.bfloat16, deterministic=False):
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + head_dim)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(d_o)
        return [t.grad.float() for t in leaves]

    ours = grads(lambda a, b, c: flashgen.attention(a, b, c, causal=causal, deterministic=deterministic))
    ref = grads(lambda a, b, c: naive_attention(a, b, c, causal=causal))
    low = grads(lambda a, b, c: naive_attention(a, b, c, causal=causal, upcast=False))
    kind = plans.backward(0, head_dim, dtype, causal, deterministic, "").kernels[1].spec.name
    worst = ""
    for name, g, r, lp in zip(("dq", "dk", "dv"), ours, ref, low):
        err, bound = (g - r).abs().max().item(), 3 * (lp - r).abs().max().item() + 1e-5
        worst += f" {name} {err:.2e}/{bound:.2e}{'' if err <= bound else ' FAIL'}"
    print(f"{kind} B={batch} H={heads}:{kv_heads} {seqlen_q}x{seqlen_k} d={head_dim} causal={causal}:{worst}", flush=True)
    return "FAIL" not in worst


def timing(head_dim, causal, seqlen, mode):
    q, k, v = bench._inputs(seqlen, head_dim)
    flops = bench.MODES[mode] * bench.forward_flops(*q.shape[:3], seqlen, head_dim, causal)
    row = {}

    def run(q, k, v, causal):
        return flashgen.attention(q, k, v, causal=causal)

    row["flashgen"] = flops / bench.time_ms(bench._timer(run, q, k, v, causal, mode)) / 1e9
    kernels = bench._kernel_name(q, causal, "bwd")
    saved = tuning.HOPPER_BACKWARD_HEAD_DIM
    tuning.HOPPER_BACKWARD_HEAD_DIM = 0  # the key-major kernels the tables ran before this family
    plans.clear()
    try:
        row["key-major"] = flops / bench.time_ms(bench._timer(run, q, k, v, causal, mode)) / 1e9
    finally:
        tuning.HOPPER_BACKWARD_HEAD_DIM = saved
        plans.clear()
    for name, pin in bench.sdpa_backends().items():
        if name in ("flash", "cudnn"):
            try:
                row[name] = flops / bench.time_ms(bench._timer(bench._pinned(pin), q, k, v, causal, mode)) / 1e9
            except RuntimeError:  # no such backend for this shape
                row[name] = float("nan")
    print(f"{mode} d={head_dim} causal={causal} T={seqlen}: " + ", ".join(f"{n} {t:.0f}" for n, t in row.items())
          + f"  (flashgen / key-major {row['flashgen'] / row['key-major']:.2f}, / cudnn {row['flashgen'] / row['cudnn']:.2f})"
          + f"  [{kernels}]", flush=True)


def ints(text):
    return tuple(int(x) for x in text.split(","))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--head-dims", type=ints, default=(64, 128, 192, 256))
    parser.add_argument("--seqlens", type=ints, default=(2048, 8192))
    parser.add_argument("--modes", default="bwd", help="comma-separated: bwd, fwd+bwd")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    args = parser.parse_args()
    ok = all([
        check(1, 2, 2, 128, 128, 64, False), check(2, 3, 3, 200, 333, 64, True), check(1, 4, 2, 1000, 1000, 128, True),
        check(2, 2, 1, 17, 300, 96, False), check(1, 2, 2, 300, 17, 128, True), check(1, 3, 1, 1, 77, 32, True),
        check(1, 8, 8, 2048, 2048, 128, False), check(1, 8, 2, 1023, 1023, 64, True),
        # the split layout (block_n=64), what the tables run above head dim 128
        check(1, 4, 2, 1000, 1000, 256, True), check(2, 2, 1, 17, 300, 192, False), check(1, 2, 2, 300, 17, 256, True),
        check(1, 8, 8, 2048, 2048, 192, False), check(1, 8, 2, 1023, 1023, 136, True), check(1, 3, 1, 1, 77, 256, True),
        check(2, 4, 2, 777, 1000, 256, True, torch.float16, deterministic=True),
        check(2, 4, 2, 777, 1000, 192, False, deterministic=True),
    ])
    print("probe:", "all within bounds" if ok else "FAILURES", flush=True)
    if ok and not args.no_timing:
        causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
        for mode in args.modes.split(","):
            for head_dim in args.head_dims:
                for causal in causals:
                    for seqlen in args.seqlens:
                        timing(head_dim, causal, seqlen, mode)
    sys.exit(0 if ok else 1)
