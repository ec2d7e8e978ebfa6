"""GPU probe of the backward the tables pick: gradients against the fp32 reference on a few odd
shapes (numerics rule, factor 3), then backward TFLOPS next to the mma.sync key-major kernels
(the tables' previous choice) and SDPA's FLASH and CUDNN, one
process. Run it under a timeout before the GPU tier: a pipeline that deadlocks shows here.

    PYTHONPATH=. python3 .ci/probe_backward.py [--no-timing]
"""

import sys

import torch

import flashgen
from flashgen import bench, plans, tuning
from flashgen.reference import naive_attention


def check(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + head_dim)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    d_o = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(d_o)
        return [t.grad.float() for t in leaves]

    ours = grads(lambda a, b, c: flashgen.attention(a, b, c, causal=causal))
    ref = grads(lambda a, b, c: naive_attention(a, b, c, causal=causal)[0])
    low = grads(lambda a, b, c: naive_attention(a, b, c, causal=causal, upcast=False)[0])
    kind = plans.backward(0, head_dim, dtype, causal, False, "").kernels[1].spec.name
    worst = ""
    for name, g, r, lp in zip(("dq", "dk", "dv"), ours, ref, low):
        err, bound = (g - r).abs().max().item(), 3 * (lp - r).abs().max().item() + 1e-5
        worst += f" {name} {err:.2e}/{bound:.2e}{'' if err <= bound else ' FAIL'}"
    print(f"{kind} B={batch} H={heads}:{kv_heads} {seqlen_q}x{seqlen_k} d={head_dim} causal={causal}:{worst}", flush=True)
    return "FAIL" not in worst


def timing(head_dim, causal, seqlen):
    q, k, v = bench._inputs(seqlen, head_dim)
    flops = bench.MODES["bwd"] * bench.forward_flops(*q.shape[:3], seqlen, head_dim, causal)
    row = {}

    def run(q, k, v, causal):
        return flashgen.attention(q, k, v, causal=causal)

    row["flashgen"] = flops / bench.time_ms(bench._timer(run, q, k, v, causal, "bwd")) / 1e9
    saved = tuning.HOPPER_BACKWARD_HEAD_DIM
    tuning.HOPPER_BACKWARD_HEAD_DIM = 0  # the key-major kernels the tables ran before this family
    plans.clear()
    try:
        row["key-major"] = flops / bench.time_ms(bench._timer(run, q, k, v, causal, "bwd")) / 1e9
    finally:
        tuning.HOPPER_BACKWARD_HEAD_DIM = saved
        plans.clear()
    for name, pin in bench.sdpa_backends().items():
        if name in ("flash", "cudnn"):
            row[name] = flops / bench.time_ms(bench._timer(bench._pinned(pin), q, k, v, causal, "bwd")) / 1e9
    print(f"bwd d={head_dim} causal={causal} T={seqlen}: " + ", ".join(f"{n} {t:.0f}" for n, t in row.items())
          + f"  (flashgen / cudnn {row['flashgen'] / row['cudnn']:.2f})", flush=True)


if __name__ == "__main__":
    ok = all([
        check(1, 2, 2, 128, 128, 64, False), check(2, 3, 3, 200, 333, 64, True), check(1, 4, 2, 1000, 1000, 128, True),
        check(2, 2, 1, 17, 300, 96, False), check(1, 2, 2, 300, 17, 128, True), check(1, 3, 1, 1, 77, 32, True),
        check(1, 8, 8, 2048, 2048, 128, False), check(1, 8, 2, 1023, 1023, 64, True),
    ])
    print("probe:", "all within bounds" if ok else "FAILURES", flush=True)
    if ok and "--no-timing" not in sys.argv:
        for head_dim in (64, 128):
            for causal in (False, True):
                for seqlen in (2048, 8192):
                    timing(head_dim, causal, seqlen)
    sys.exit(0 if ok else 1)
