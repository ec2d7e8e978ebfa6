"""GPU probe of chunked prefill over a paged cache (issue 42's target: 16 sequences, 2048 new queries
each over 8k keys, 16-token pages, causal, d = 128: at least 0.9x the same problem over packed
keys). Both through attention_varlen, timed A B A B in one process (packed, paged, packed, paged);
the pages are shuffled. Also page sizes 32, 64 and 256, the kernel each path ran, and for the page
sizes the producer can gather with cp.async (hopper.GATHERABLE) the gathers and TMA boxes side by side.
With --fp8-cache, also each page size's cache in e4m3 with descales (the decode kernel's varlen form
runs it, widening the values as it reads them), against the same problem over packed bf16 keys.

    PYTHONPATH=. python3 .ci/bench_paged_prefill.py [--head-dim 128] [--heads 16] [--kv-heads 16]
"""

import argparse

import torch

import flashgen
from flashgen import bench, plans
from flashgen.families import hopper


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--pages", default="16,32,64,256", help="page sizes, comma-separated")
    parser.add_argument("--fp8-cache", action="store_true", help="also the paged cache stored in e4m3")
    args = parser.parse_args()
    batch, chunk, keys, d = 16, 2048, 8192, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch * chunk, args.heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch * keys, args.kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk
    cu_k = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * keys
    packed = lambda: flashgen.attention_varlen(q, k, v, cu_q, cu_k, chunk, keys, causal=True)  # noqa: E731
    flops = 4 * batch * args.heads * d * (chunk * keys - chunk * chunk / 2)  # causal, bottom-right: each row's visible keys
    rows = ["| page | loads | packed ms | paged ms | paged / packed speed (two rounds) | paged TFLOPS | kernel |",
            "|---|---|---|---|---|---|---|"]
    gathered = getattr(hopper, "GATHERABLE", None) or hopper.GATHER_PAGES  # (trees before GATHERABLE gathered by default)
    pages = [int(page) for page in args.pages.split(",")]
    kinds = [(page, loads) for page in pages for loads in (("gather", "tma") if page in gathered else ("tma",))]
    kinds += [(page, "e4m3") for page in pages] if args.fp8_cache else []
    for page, loads in kinds:
        hopper.GATHER_PAGES = gathered if loads == "gather" else ()
        order = torch.randperm(batch * keys // page, device="cuda", generator=gen)
        k_cache, v_cache = (t.view(-1, page, args.kv_heads, d)[order].contiguous() for t in (k, v))
        table = torch.argsort(order).view(batch, keys // page).to(torch.int32)  # page j of sequence b: where it went
        scales = {}
        if loads == "e4m3":  # stored at 64x, descales 1/64 (bf16 randn values: a few saturate; the check allows it)
            k_cache, v_cache = ((t * 64).clamp(-448, 448).to(torch.float8_e4m3fn) for t in (k_cache, v_cache))
            scales = {name: torch.full((batch, args.kv_heads), 1 / 64, device="cuda") for name in ("k_descale", "v_descale")}
        paged = lambda: flashgen.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, chunk, keys, causal=True,  # noqa: E731
                                                  block_table=table, **scales)
        if scales:  # (another problem: the keys and values rounded to e4m3; how far, printed)
            print(f"page {page} e4m3: max |paged - packed bf16| = {(paged().float() - packed().float()).abs().max().item():.3e}")
        else:
            torch.testing.assert_close(paged(), packed(), atol=2e-2, rtol=0)  # the same problem
        times = {"packed": [], "paged": []}
        for _ in range(2):
            times["packed"].append(bench.time_ms(packed))
            times["paged"].append(bench.time_ms(paged))
        plan = None if scales else plans.paged_prefill(0, d, torch.bfloat16, True, chunk)
        kernel = plan.steps[0].kernel.spec.name if plan else "decode (varlen)"
        ratios = [p / g for p, g in zip(times["packed"], times["paged"])]
        rows.append(f"| {page} | {loads if page in gathered or scales else 'tma'} | {min(times['packed']):.3f} | {min(times['paged']):.3f} | {ratios[0]:.3f}, {ratios[1]:.3f} | "
                    f"{flops / min(times['paged']) / 1e9:.0f} | {kernel} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
