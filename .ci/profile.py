"""One workload of the bench, run once between cudaProfilerStart/Stop so that Nsight Compute can
profile just its kernels (after a warm-up that compiles and plans them).
Usage: ncu --profile-from-start off --clock-control none ... python3 .ci/profile.py NAME
NAME: fwd, fwd_softcap, bwd, bwd_softcap (d = 128, T = 8k), doc_fwd, doc_bwd, causal64_fwd,
causal64_bwd (d = 64, T = 8k), decode8k (B = 1, 32:8 heads, d = 128, paged=0) (needs a GPU)."""

import sys

import torch

import flashgen
from flashgen import bench


def workload(name):
    if name.startswith("decode"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = bench._decode_step(1, 8192, False, gen)
        return bench._flashgen_step(inputs)
    d = 64 if name.startswith(("doc", "causal64")) else 128
    q, k, v = bench._inputs(8192, d)
    kwargs, causal = {}, name.startswith("causal64")
    if "softcap" in name:
        kwargs["softcap"] = bench.SOFTCAP
    if name.startswith("doc"):
        causal, kwargs, _ = bench.rule_cases(q.shape[0], q.shape[1], 8192)["documents (mask rule)"]
    if name.endswith("fwd"):
        return lambda: flashgen.attention(q, k, v, causal=causal, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=causal, **kwargs)
    d_o = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, d_o, retain_graph=True)


def main():
    run = workload(sys.argv[1])
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
