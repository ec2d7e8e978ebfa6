"""The Hopper forward's tile for ALiBi and windows at d = 64 (issue 11: ALiBi <= 1.10x plain): the
variant table runs 192 x 112 (softcap spills at 192 x 128); ALiBi and windows compile without spills
at the plain kernel's 192 x 128 now. Times each tile against the plain kernel, A B A B, and checks
every output against the table's own pick.
Usage: python3 .ci/probe_variant_tiles.py  (needs a GPU; about a minute)"""

import torch

import flashgen
from flashgen import bench, tuning

TILES = [(192, 112), (192, 128), (128, 128)]


def main():
    q, k, v = bench._inputs(8192, 64)
    heads = q.shape[1]
    cases = {"alibi": {"alibi_slopes": bench.alibi_slopes(heads)}, "window 1024": {"window_size": (1023, 1023)}}
    for causal in (False, True):
        plain = lambda: flashgen.attention(q, k, v, causal=causal)  # noqa: E731
        for name, kwargs in cases.items():
            run = lambda: flashgen.attention(q, k, v, causal=causal, **kwargs)  # noqa: E731
            ref = run().float()
            for _ in range(2):  # A B A B: the tiles in turn, twice, each next to plain
                for block_m, block_n in TILES:
                    entry = {"kind": "fwd_sm90", "arch": "sm_90a", "head_dim": 64, "dtype": "*", "causal": "*", "bucket": "*",
                             "variant": True, "softcap": False, "tiles": [{"block_m": block_m, "block_n": block_n, "num_stages": 2}]}
                    with tuning.override([entry]):
                        diff = (run().float() - ref).abs().max().item()
                        ms, plain_ms = bench.time_ms(run), bench.time_ms(plain)
                    print(f"d=64 T=8k {'causal' if causal else 'full'} {name} {block_m}x{block_n}: {ms:.3f} ms, plain "
                          f"{plain_ms:.3f} ms, ratio {ms / plain_ms:.3f}, diff vs table {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
