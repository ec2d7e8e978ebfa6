"""GPU probe of the Hopper backward's tiles for softcap and ALiBi, timed against each other in one
process (T = 8192, B = 2, 16 heads, bf16, as `flashgen bench --variants`): the block_n = 128
layout (the plain tiles, and 64 x 128 at d = 64) against the split one (128 x 64), each next to the
plain kernel on the same tiles (what the layout costs apart from the score) and to the plain
kernel the tables pick ("vs plain bwd").

Every timed configuration is first checked against the fp32 reference (numerics rule).

    PYTHONPATH=. python3 .ci/probe_variants.py
"""

import torch

import flashgen
from flashgen import bench, reference, tuning

BATCH, HEADS, SEQLEN, CAP = 2, 16, 8192, 50.0
TILES = {64: ((128, 128), (64, 128), (128, 64)), 128: ((64, 128), (128, 64))}  # (block_m, block_n): block_n = 64 is the split layout


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
    ref = run(lambda a, b, c: reference.naive_attention(a, b, c, causal=causal, **kwargs))
    low = run(lambda a, b, c: reference.naive_attention(a, b, c, causal=causal, upcast=False, **kwargs))
    return all((o - r).abs().max() <= (2 if i == 0 else 3) * (lp - r).abs().max() + 1e-5
               for i, (o, r, lp) in enumerate(zip(ours, ref, low)))


def time_ms(kwargs, head_dim, causal, mode):
    q, k, v = inputs(head_dim)
    return bench.time_ms(bench._timer(lambda q, k, v, causal: flashgen.attention(q, k, v, causal=causal, **kwargs),
                                      q, k, v, causal, mode))


def main():
    slopes = torch.rand(HEADS, device="cuda") * 0.5
    print("| d | variant | causal | tiles | bwd ms | vs plain bwd | checked | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for head_dim in (64, 128):
        for causal in (False, True):
            plain_ms = time_ms({}, head_dim, causal, "bwd")
            for name, kwargs in (("plain", {}), ("softcap", {"softcap": CAP}), ("alibi", {"alibi_slopes": slopes})):
                for block_m, block_n in TILES[head_dim]:
                    entries = [{"kind": kind, "arch": "sm_90a", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
                                **({"variant": True} if kwargs else {}),
                                "tiles": [{"block_m": block_m, "block_n": block_n, "num_stages": 2}]}
                               for kind in ("bwd_sm90_kvq", "bwd_sm90_kv")]
                    try:
                        with tuning.override(entries):
                            ok = checked(kwargs, head_dim, causal)
                            ms = time_ms(kwargs, head_dim, causal, "bwd")
                            q = inputs(head_dim)[0]
                            kernel = bench._kernel_name(q, causal, "bwd", tuple(bench.variant_fields(q, causal, kwargs)))
                    except Exception as error:  # a tile shape the family refuses
                        print(f"| {head_dim} | {name} | {causal} | {block_m}x{block_n} | - | - | {type(error).__name__}: {error} | |")
                        continue
                    print(f"| {head_dim} | {name} | {causal} | {block_m}x{block_n} | {ms:.3f} | {ms / plain_ms:.3f} | {ok} | {kernel} |",
                          flush=True)


if __name__ == "__main__":
    main()
