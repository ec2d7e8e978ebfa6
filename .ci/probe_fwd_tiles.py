"""The Hopper forward's tiles once Q sits in registers (S = Q K^T reads only K from shared memory).
`tiles`: at d = 64 two consumers with Q in registers (128 x 128 ... 128 x 192) against the
three-consumer 192 x 128, which has no room for Q; at d = 128, 128 x 144 against 128 x 128.
`persistent`: the shipped tiles against their persistent versions (Q leaves shared memory as soon
as it is in registers, so the next tile's Q loads under this one's key loop) at short lengths.
TFLOPS of each candidate, A B A B in one process, every output checked against the shipped pick.
`persistent-long`: the same at 8k and 16k, no mask. `dv128`: d = 192 with V's own head dim 128 (the
table picks by the wider head dim, 128 x 96; V's smaller tiles leave room for 112 and 128 keys).
Usage: python3 .ci/probe_fwd_tiles.py [tiles|persistent|persistent-long|dv128]  (needs a GPU; about two minutes)"""

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
    "dv128": ({(192, 128): [(128, 96, False), (128, 112, False), (128, 128, False)]}, (2048, 8192), (False, True)),
}


def main():
    tiles_of, seqlens, masks = SETS[sys.argv[1] if len(sys.argv) > 1 else "tiles"]
    print(torch.cuda.get_device_name())
    for dims, tiles in tiles_of.items():
        d, d_v = dims if isinstance(dims, tuple) else (dims, dims)  # (V with a head dim of its own)
        for causal in masks:
            for seqlen in seqlens:
                q, k, v = bench._inputs(seqlen, d)
                v = v[..., :d_v].contiguous()
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
                row = "  ".join(f"{m}x{n}{'p' if p else ''} " + "/".join(f"{2 * b * h * pairs * (d + d_v) / ms / 1e9:.0f}" for ms in ts)
                                for (m, n, p), ts in times.items())
                print(f"d={d}{f' d_v={d_v}' if d_v != d else ''} {'causal' if causal else 'full'} T={seqlen}: {row}", flush=True)


if __name__ == "__main__":
    main()
