"""Forward and backward time of the bench's user rules under other Hopper tile shapes (each kernel
first checked against the plain-PyTorch oracle on a small slice by the bench's own cases).
Usage: python3 .ci/probe_rules.py  (needs a GPU)."""

import torch

from flashgen import bench, tuning


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def entry(kind, tiles):
    return {"kind": kind, "arch": "sm_90a", "head_dim": 64, "dtype": "*", "causal": "*", "bucket": "*", "variant": True,
            "tiles": [tiles]}


def main():
    import flashgen

    batch, heads, seqlen = 2, 32, 8192
    q, k, v = (torch.randn(batch, heads, seqlen, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cases = bench.rule_cases(batch, heads, seqlen)
    forwards = [dict(block_m=192, block_n=112, num_stages=2), dict(block_m=128, block_n=128, num_stages=2),
                dict(block_m=192, block_n=112, num_stages=2, persistent=True),
                dict(block_m=128, block_n=128, num_stages=2, persistent=True), dict(block_m=128, block_n=96, num_stages=2),
                # three consumers for a score rule (192 x 112 has no registers for one), and
                # exponentials on the FMA pipes: at d = 64 the multi-function unit bounds the softmax
                dict(block_m=192, block_n=96, num_stages=2), dict(block_m=192, block_n=96, num_stages=2, exp2_fma=1),
                dict(block_m=128, block_n=128, num_stages=2, exp2_fma=1), dict(block_m=128, block_n=128, num_stages=2, exp2_fma=2)]
    backwards = [dict(block_m=64, block_n=128, num_stages=2), dict(block_m=128, block_n=128, num_stages=2),
                 dict(block_m=128, block_n=64, num_stages=2), dict(block_m=64, block_n=128, num_stages=3)]
    for name, (causal, rule, _) in cases.items():
        ref = flashgen.attention(q, k, v, causal=causal, **rule)
        for tiles in forwards:
            try:
                with tuning.override([entry("fwd_sm90", tiles)]):
                    out = flashgen.attention(q, k, v, causal=causal, **rule)
                    ms = timed(lambda: flashgen.attention(q, k, v, causal=causal, **rule))
                print(f"{name:24s} fwd {tiles} {ms:.3f} ms  max|diff| {(out.float() - ref.float()).abs().max().item():.1e}", flush=True)
            except Exception as error:  # a refused shape
                print(f"{name:24s} fwd {tiles} refused: {str(error)[:80]}", flush=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        d_o = torch.randn_like(q)
        for tiles in backwards:
            try:
                with tuning.override([entry("bwd_sm90_kvq", tiles)]):
                    out = flashgen.attention(*leaves, causal=causal, **rule)
                    fwd = timed(lambda: flashgen.attention(*leaves, causal=causal, **rule))
                    both = timed(lambda: torch.autograd.grad(flashgen.attention(*leaves, causal=causal, **rule), leaves, d_o))
                print(f"{name:24s} bwd {tiles} {both - fwd:.3f} ms", flush=True)
            except Exception as error:
                print(f"{name:24s} bwd {tiles} refused: {str(error)[:80]}", flush=True)
        # dQ in its own pass (the deterministic kernels), as FlexAttention's backward does, instead of
        # added up across key blocks: with few query tiles per key block (documents) the sum's fixed
        # costs weigh more
        fwd = timed(lambda: flashgen.attention(*leaves, causal=causal, deterministic=True, **rule))
        both = timed(lambda: torch.autograd.grad(flashgen.attention(*leaves, causal=causal, deterministic=True, **rule), leaves, d_o))
        print(f"{name:24s} bwd deterministic (bwd_sm90_kv + bwd_q) {both - fwd:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
