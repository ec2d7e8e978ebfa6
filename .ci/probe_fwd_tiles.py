"""The Hopper forward's tiles once Q sits in registers (S = Q K^T reads only K from shared memory).
`tiles`: at d = 64 two consumers with Q in registers (128 x 128 ... 128 x 192) against the
three-consumer 192 x 128, which has no room for Q; at d = 128, 128 x 144 against 128 x 128.
`persistent`: the shipped tiles against their persistent versions (Q leaves shared memory as soon
as it is in registers, so the next tile's Q loads under this one's key loop) at short lengths.
TFLOPS of each candidate, A B A B in one process, every output checked against the shipped pick.
`persistent-long`: the same at 8k and 16k, no mask.
Usage: python3 .ci/probe_fwd_tiles.py [tiles|persistent|persistent-long]  (needs a GPU; about two minutes)"""

import sys

import torch

import flashgen
from flashgen import bench, tuning

PERSISTENT = {64: [(192, 128, False), (192, 128, True)], 128: [(128, 128, False), (128, 128, True)]}
SETS = {  # candidates by head dim, lengths, masks (causal or not)
    "tiles": ({64: [(192, 128, False), (128, 128, False), (128, 160, False), (128, 192, False)],
               128: [(128, 128, False), (128, 144, False)]}, (2048, 8192, 16384), (False, True)),
    "persistent": (PERSISTENT, (1024, 2048, 4096), (False, True)),
    "persistent-long": (PERSISTENT, (8192, 16384), (False,)),
}


def main():
    tiles_of, seqlens, masks = SETS[sys.argv[1] if len(sys.argv) > 1 else "tiles"]
    print(torch.cuda.get_device_name())
    for d, tiles in tiles_of.items():
        for causal in masks:
            for seqlen in seqlens:
                q, k, v = bench._inputs(seqlen, d)
                run = lambda: flashgen.attention(q, k, v, causal=causal)  # noqa: E731
                ref = run().float()
                times = {tile: [] for tile in tiles}
                for _ in range(2):
                    for block_m, block_n, persistent in tiles:
                        entry = {"kind": "fwd_sm90", "arch": "sm_90a", "head_dim": d, "dtype": "*", "causal": "*", "bucket": "*",
                                 "tiles": [{"block_m": block_m, "block_n": block_n, "num_stages": 2, "persistent": persistent}]}
                        with tuning.override([entry]):
                            diff = (run().float() - ref).abs().max().item()
                            assert diff < 2e-2, (d, causal, seqlen, block_m, block_n, persistent, diff)
                            times[(block_m, block_n, persistent)].append(bench.time_ms(run))
                b, h, t, _ = q.shape
                pairs = t * t / (2 if causal else 1)
                row = "  ".join(f"{m}x{n}{'p' if p else ''} " + "/".join(f"{4 * b * h * pairs * d / ms / 1e9:.0f}" for ms in ts)
                                for (m, n, p), ts in times.items())
                print(f"d={d} {'causal' if causal else 'full'} T={seqlen}: {row}", flush=True)


if __name__ == "__main__":
    main()
