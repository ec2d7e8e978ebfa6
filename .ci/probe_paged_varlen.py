"""How fast attention_varlen runs over a paged cache (the decode kernels' varlen form) next to the
same problem over packed keys (the varlen forward: the Hopper kernel on sm_90a). Chunked prefill
over cached prefixes: 16 sequences, each a chunk of new queries over its prefix plus the chunk
(causal), d = 128, 32 query heads on 8 KV heads, bf16, 16-token pages in a shuffled order. The
packed keys hold the paged cache's values, so the outputs must agree. GPU times are CUDA-graph
replays (bench.graph_time_us); TFLOPS count the causal part of each chunk's rows only.
Usage: python3 .ci/probe_paged_varlen.py  (needs a GPU)."""

import torch

import flashgen
from flashgen import bench

HEADS, KV_HEADS, D, PAGE, SEQUENCES = 32, 8, 128, 16, 16
CASES = [(64, 4096), (512, 4096), (2048, 2048), (1, 8192)]  # (chunk, prefix): queries per sequence, keys before them


def problem(chunk: int, prefix: int, gen):
    keys = chunk + prefix
    per_seq = -(-keys // PAGE)
    cu_q = torch.arange(0, (SEQUENCES + 1) * chunk, chunk, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, (SEQUENCES + 1) * keys, keys, device="cuda", dtype=torch.int32)
    q = torch.randn(SEQUENCES * chunk, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(SEQUENCES * keys, KV_HEADS, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    table = torch.randperm(SEQUENCES * per_seq, device="cuda", generator=gen).view(SEQUENCES, per_seq).to(torch.int32)
    pages = []
    for cache in (k, v):  # the packed keys, sequence by sequence, into the table's pages
        padded = torch.zeros(SEQUENCES, per_seq * PAGE, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
        padded[:, :keys] = cache.view(SEQUENCES, keys, KV_HEADS, D)
        paged = torch.empty(SEQUENCES * per_seq, PAGE, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
        paged[table.flatten().long()] = padded.view(SEQUENCES * per_seq, PAGE, KV_HEADS, D)
        pages.append(paged)
    return q, (k, v), pages, table, cu_q, cu_k, chunk, keys


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| chunk | prefix | packed keys us | paged us | paged / packed | paged TFLOPS | kernel |")
    print("|---|---|---|---|---|---|---|")
    for chunk, prefix in CASES:
        q, (k, v), (k_pages, v_pages), table, cu_q, cu_k, max_q, max_k = problem(chunk, prefix, gen)
        packed = lambda: flashgen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # noqa: E731
        paged = lambda: flashgen.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, causal=True,  # noqa: E731
                                                  block_table=table)
        error = (packed().float() - paged().float()).abs().max().item()
        packed_us, paged_us = bench.graph_time_us(packed), bench.graph_time_us(paged)
        pairs = SEQUENCES * HEADS * sum(prefix + i + 1 for i in range(chunk))  # (query, key) pairs under the causal mask
        tflops = 4 * pairs * D / (paged_us * 1e-6) / 1e12
        plan, _ = flashgen.plans.decode(0, D, torch.bfloat16, True, max_q * HEADS // KV_HEADS, SEQUENCES, KV_HEADS, max_k,
                                        varlen=True)
        print(f"| {chunk} | {prefix} | {packed_us:.1f} | {paged_us:.1f} | {paged_us / packed_us:.2f} | {tflops:.0f} | "
              f"{plan.kernels[0].spec.name} (max |diff| {error:.2e}) |")


if __name__ == "__main__":
    main()
