"""GPU time of one decode step (bench --decode's problem: B = 1, 32:8 heads, d = 128, bf16 q) under
other decode tile shapes and split counts; each output compared with the tables' own pick.
Usage: python3 .ci/probe_decode.py [--cache e4m3] [--seqlens 8192,65536] [--contiguous]  (needs a GPU)."""

import argparse

import torch

from flashgen import bench, plans, tuning
from flashgen.serving import attention_with_kvcache

TILES = [(64, 4, 3), (64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 8, 3), (128, 8, 2), (64, 2, 4), (32, 2, 6), (64, 4, 2),
         (64, 8, 3), (128, 4, 2), (32, 2, 3)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="bf16", choices=["bf16", "e4m3"])
    parser.add_argument("--seqlens", default="8192,65536")
    parser.add_argument("--contiguous", action="store_true", help="no paged runs")
    parser.add_argument("--rows", type=int, default=4, help="query rows a KV head (4: one token of 32:8 heads)")
    parser.add_argument("--tiles", default="", help="block_n/warps/stages,... instead of TILES (e.g. 128/8/2,64/4/3)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_dtype = "e4m3" if args.cache == "e4m3" else ""
    for seqlen in map(int, args.seqlens.split(",")):
        for paged in (False,) if args.contiguous else (False, True):
            inputs = bench._decode_step(1, seqlen, paged, gen, cache=args.cache)
            if args.rows != 4:  # rows / 4 query tokens (32:8 heads) over the cache, nothing appended
                inputs.update(q=inputs["q"].repeat(1, args.rows // 4, 1, 1), k=None, v=None)
            k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
            ref = attention_with_kvcache(**inputs, causal=True).float()
            kind = "decode_paged" if paged else "decode"
            tiles = [tuple(map(int, t.split("/"))) for t in args.tiles.split(",")] if args.tiles else TILES
            for block_n, warps, stages in tiles:
                entry = {"kind": kind, "arch": "sm_90a", "head_dim": 128, "dtype": "*", "causal": "*", "bucket": "*",
                         "tiles": [{"block_n": block_n, "num_warps": warps, "num_stages": stages}]}
                with tuning.override([entry]):
                    spec, splits = None, None
                    try:
                        plan, splits = plans.decode(0, 128, torch.bfloat16, paged, args.rows, 1, 8,
                                                     seqlen + (args.rows == 4), kv_dtype=kv_dtype)
                        spec = plan.kernels[0].spec
                        for forced in (0, splits * 2):
                            step = lambda: attention_with_kvcache(**inputs, causal=True, num_splits=forced)  # noqa: E731
                            inputs["k_cache"].copy_(k_cache), inputs["v_cache"].copy_(v_cache)
                            diff = (step().float() - ref).abs().max().item()
                            us = bench.graph_time_us(step)
                            print(f"T={seqlen} {'paged' if paged else 'contig'} {spec.name} splits={forced or splits} "
                                  f"{us:.1f} us diff {diff:.1e}", flush=True)
                    except Exception as error:
                        print(f"T={seqlen} {kind} {(block_n, warps, stages)} failed: {str(error)[:100]}", flush=True)


if __name__ == "__main__":
    main()
