"""GPU probe of two choices the variant kernels make, each timed against its alternatives in one
process (d = 128, T = 8192, B = 2, 16 heads, bf16, as `flashgen bench --variants`):

- the share of each score tile whose exp2 the soft-capped Hopper forward runs on the FMA pipe
  (flashgen.families.hopper.HopperForward.SOFTCAP_FMA_EXP2; softmax.cuh.j2's exp2_fma), 0 to 1,
  for softcap and, as a control, for the plain kernel;
- the tiles of the Hopper backward's split layout for softcap and ALiBi at d = 64 and 128
  (block_m 64 or 128; block_n = 64 is the layout that builds them), and the plain kernel in the
  same layout (what the layout costs, apart from the score).

Every timed configuration is first checked against the fp32 reference (numerics rule).

    PYTHONPATH=. python3 .ci/probe_variants.py [--shares 0,0.25]
"""

import argparse

import torch

import flashgen
from flashgen import bench, kernels, plans, reference, tuning
from flashgen.families import family

BATCH, HEADS, SEQLEN, CAP = 2, 16, 8192, 50.0


def inputs(head_dim, seqlen=SEQLEN, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    return [torch.randn(BATCH, HEADS, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3)]


def checked(kwargs, head_dim, causal):
    """Forward and gradients against the fp32 reference on an odd shape (factor 2 / 3)."""
    q, k, v = (t[:, :, :1023] for t in inputs(head_dim))
    d_o = torch.randn_like(q)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(d_o)
        return [out.float(), *(t.grad.float() for t in leaves)]

    ours = run(lambda a, b, c: flashgen.attention(a, b, c, causal=causal, **kwargs))
    ref = run(lambda a, b, c: reference.naive_attention(a, b, c, causal=causal, **kwargs)[0])
    low = run(lambda a, b, c: reference.naive_attention(a, b, c, causal=causal, upcast=False, **kwargs)[0])
    return all((o - r).abs().max() <= (2 if i == 0 else 3) * (lp - r).abs().max() + 1e-5
               for i, (o, r, lp) in enumerate(zip(ours, ref, low)))


def time_ms(kwargs, head_dim, causal, mode):
    q, k, v = inputs(head_dim)
    return bench.time_ms(bench._timer(lambda q, k, v, causal: flashgen.attention(q, k, v, causal=causal, **kwargs),
                                      q, k, v, causal, mode))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shares", default="0,0.25")
    args = parser.parse_args()
    slopes = torch.rand(HEADS, device="cuda") * 0.5
    forward = family("fwd_sm90")
    saved = forward.SOFTCAP_FMA_EXP2, forward.fma_exp2_tiles
    print("| exp2 on FMA | variant | causal | fwd ms | vs plain (share 0) | checked |")
    print("|---|---|---|---|---|---|")
    for causal in (False, True):
        plain_ms = time_ms({}, 128, causal, "fwd")
        for share in (float(x) for x in args.shares.split(",")):
            for name, kwargs in (("softcap", {"softcap": CAP}), ("plain", {})):
                forward.SOFTCAP_FMA_EXP2 = share
                forward.fma_exp2_tiles = (lambda spec, share=share: int(spec.block_n // 8 * share)) if name == "plain" else saved[1]
                plans.clear()
                kernels.clear()
                ok = checked(kwargs, 128, causal)
                ms = time_ms(kwargs, 128, causal, "fwd")
                print(f"| {share} | {name} | {causal} | {ms:.3f} | {ms / plain_ms:.3f} | {ok} |", flush=True)
        forward.SOFTCAP_FMA_EXP2, forward.fma_exp2_tiles = saved
        del forward.fma_exp2_tiles  # back to the class's method
        plans.clear()
        kernels.clear()

    print()
    print("| d | variant | causal | tiles | bwd ms | vs plain bwd | checked | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for head_dim in (64, 128):
        for causal in (False, True):
            plain_ms = time_ms({}, head_dim, causal, "bwd")
            for name, kwargs in (("plain", {}), ("softcap", {"softcap": CAP}), ("alibi", {"alibi_slopes": slopes})):
                for block_m in (64, 128):
                    entries = [{"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
                                **({"variant": True} if kwargs else {}), "tiles": [{"block_m": block_m, "block_n": 64, "num_stages": 2}]}
                               for kind in ("bwd_sm90_kvq", "bwd_sm90_kv")]
                    try:
                        with tuning.override(entries):
                            ok = checked(kwargs, head_dim, causal)
                            ms = time_ms(kwargs, head_dim, causal, "bwd")
                            q = inputs(head_dim)[0]
                            kernel = bench._kernel_name(q, causal, "bwd", tuple(bench.variant_fields(q, causal, kwargs)))
                    except Exception as error:  # a tile shape the family refuses
                        print(f"| {head_dim} | {name} | {causal} | {block_m}x64 | - | - | {type(error).__name__}: {error} | |")
                        continue
                    print(f"| {head_dim} | {name} | {causal} | {block_m}x64 | {ms:.3f} | {ms / plain_ms:.3f} | {ok} | {kernel} |",
                          flush=True)


if __name__ == "__main__":
    main()
