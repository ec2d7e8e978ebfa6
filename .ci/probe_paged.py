"""What the paged decode's extra time over the contiguous cache is made of: the kernel's page
indirection, or where the pages lie in memory. `flashgen bench --decode` scatters 16-token pages
in a random order over the whole cache (the hardest case for the memory system's address
translation: at B = 8 and 128k tokens the pages spread over 2 GB per cache); here the same cache
also runs with its pages in order and shuffled only within each sequence, and with larger pages.
Each paged cache holds the contiguous one's values, so every output must equal the contiguous
step's. GPU times are CUDA-graph replays of the decode step (bench.graph_time_us).
Usage: python3 .ci/probe_paged.py  (needs a GPU; about 12 GB of memory at B = 8, 128k)."""

import torch

from flashgen import bench
from flashgen.serving import attention_with_kvcache

CASES = [(1, 8192), (1, 65536), (8, 131072)]
ORDERS = ("in order", "shuffled per sequence", "shuffled")


def table(batch: int, per_seq: int, order: str, gen) -> torch.Tensor:
    """Page numbers (batch, per_seq): sequence b's i-th page."""
    pages = batch * per_seq
    if order == "in order":
        return torch.arange(pages, device="cuda", dtype=torch.int32).view(batch, per_seq)
    if order == "shuffled":
        return torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, per_seq)
    shuffled = [b * per_seq + torch.randperm(per_seq, device="cuda", generator=gen) for b in range(batch)]
    return torch.stack(shuffled).to(torch.int32)


def paged_copy(cache: torch.Tensor, block_table: torch.Tensor, page: int) -> torch.Tensor:
    """The contiguous (B, T, H_kv, d) cache as pages of `page` tokens placed where block_table says."""
    batch, seqlen, kv_heads, d = cache.shape
    pages = cache.reshape(batch * (seqlen // page), page, kv_heads, d)
    out = torch.empty_like(pages)
    out[block_table.flatten().long()] = pages
    return out


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'B':>2} {'cache':>7} {'layout':<34} {'us':>8} {'vs contiguous':>14} {'max diff':>9}", flush=True)
    for batch, seqlen in CASES:
        inputs = bench._decode_step(batch, seqlen, False, gen)
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        step = lambda: attention_with_kvcache(**inputs, causal=True)  # noqa: E731
        reference = step().float()
        base = bench.graph_time_us(step)
        print(f"{batch:>2} {seqlen:>7} {'contiguous':<34} {base:8.1f} {1.0:14.2f} {'':>9}", flush=True)
        for page in (16, 64, 256):
            for order in ORDERS if page == 16 else ("shuffled",):
                block_table = table(batch, seqlen // page, order, gen)
                paged = dict(inputs, k_cache=paged_copy(k_cache, block_table, page),
                             v_cache=paged_copy(v_cache, block_table, page), block_table=block_table)
                paged_step = lambda: attention_with_kvcache(**paged, causal=True)  # noqa: E731
                # the step appends at the same position each time: restore nothing, both see one cache
                diff = (paged_step().float() - reference).abs().max().item()
                us = bench.graph_time_us(paged_step)
                print(f"{batch:>2} {seqlen:>7} {f'paged {page}, {order}':<34} {us:8.1f} {us / base:14.2f} {diff:9.1e}",
                      flush=True)
                del paged
        del inputs, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
