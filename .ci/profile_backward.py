"""Where one backward call's GPU time goes, flashgen next to SDPA's cuDNN backend: torch.profiler
over 10 calls timed the way `flashgen bench` times the backward (`out.backward(dout,
retain_graph=True)`, so autograd's gradient accumulation is in both), the kernels by total time.
Usage (GPU): PYTHONPATH=. python3 .ci/profile_backward.py [d,causal,T ...]  (default 128,0,2048 64,1,2048)"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashgen
from flashgen import bench


def main(cases):
    for case in cases:
        d, causal, seqlen = (int(x) for x in case.split(","))
        q, k, v = bench._inputs(seqlen, d)
        peers = {"flashgen": lambda q, k, v, causal: flashgen.attention(q, k, v, causal=causal),
                 "cudnn": bench._pinned(bench.sdpa_backends()["cudnn"])}
        for name, attention in peers.items():
            run = bench._timer(attention, q, k, v, bool(causal), "bwd")
            for _ in range(5):
                run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    run()
                torch.cuda.synchronize()
            print(f"== {name}: d={d} causal={bool(causal)} T={seqlen}, 10 backward calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    main(sys.argv[1:] or ["128,0,2048", "64,1,2048"])
