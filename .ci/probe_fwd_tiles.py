"""The Hopper forward's tiles once Q sits in registers (S = Q K^T reads only K from shared memory):
at d = 64 two consumers with Q in registers (128 x 128 ... 128 x 192) against the three-consumer
192 x 128, which has no room for Q; at d = 128, 128 x 144 against 128 x 128. TFLOPS of each tile,
A B A B in one process, every output checked against the shipped pick.
Usage: python3 .ci/probe_fwd_tiles.py  (needs a GPU; about two minutes)"""

import torch

import flashgen
from flashgen import bench, tuning

TILES = {64: [(192, 128), (128, 128), (128, 160), (128, 192)], 128: [(128, 128), (128, 144)]}


def main():
    print(torch.cuda.get_device_name())
    for d, tiles in TILES.items():
        for causal in (False, True):
            for seqlen in (2048, 8192, 16384):
                q, k, v = bench._inputs(seqlen, d)
                run = lambda: flashgen.attention(q, k, v, causal=causal)  # noqa: E731
                ref = run().float()
                times = {tile: [] for tile in tiles}
                for _ in range(2):
                    for block_m, block_n in tiles:
                        entry = {"kind": "fwd_sm90", "arch": "sm_90a", "head_dim": d, "dtype": "*", "causal": "*",
                                 "bucket": "*", "tiles": [{"block_m": block_m, "block_n": block_n, "num_stages": 2}]}
                        with tuning.override([entry]):
                            diff = (run().float() - ref).abs().max().item()
                            assert diff < 2e-2, (d, causal, seqlen, block_m, block_n, diff)
                            times[(block_m, block_n)].append(bench.time_ms(run))
                b, h, t, _ = q.shape
                pairs = t * t / (2 if causal else 1)
                row = "  ".join(f"{m}x{n} " + "/".join(f"{4 * b * h * pairs * d / ms / 1e9:.0f}" for ms in ts)
                                for (m, n), ts in times.items())
                print(f"d={d} {'causal' if causal else 'full'} T={seqlen}: {row}", flush=True)


if __name__ == "__main__":
    main()
