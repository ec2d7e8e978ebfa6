"""One workload of the bench, run once between cudaProfilerStart/Stop so that Nsight Compute can
profile just its kernels (after a warm-up that compiles and plans them).
Usage: ncu --profile-from-start off --clock-control none ... python3 .ci/profile.py NAME
NAME: fwd, fwd_softcap, bwd, bwd_softcap (d = 128, T = 8k), doc_fwd, doc_bwd, causal64_fwd,
causal64_bwd (d = 64, T = 8k), decode8k, decode64k (B = 1, 32:8 heads, d = 128; a suffix _e4m3 for the
FP8 cache, _paged for 16-token pages: decode64k_e4m3_paged), packed_prefill,
paged16, paged256 (.ci/bench_paged_prefill.py's problem: 16 x 2048 queries over 8k keys, causal, d = 128,
packed or in shuffled pages of 16 or 256 tokens), dv128_bwd, dv128_causal_bwd (d = 192, d_v = 128,
T = 8k, .ci/bench_head_dim_v.py's shape; a suffix _cudnn runs SDPA's CUDNN backend on it instead,
dv128_causal_bwd_cudnn; _trio runs the three-consumer backward layout), fp8_fwd, fp8_fwd256 (e4m3,
d = 128 or 256, T = 8k) (needs a GPU)."""

import sys

import torch

import flashgen
from flashgen import bench


def prefill(page):
    """bench_paged_prefill's problem through attention_varlen: packed keys (page 0) or pages."""
    batch, chunk, keys, d, heads = 16, 2048, 8192, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch * chunk, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch * keys, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk
    cu_k = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * keys
    if not page:
        return lambda: flashgen.attention_varlen(q, k, v, cu_q, cu_k, chunk, keys, causal=True)
    order = torch.randperm(batch * keys // page, device="cuda", generator=gen)
    k_cache, v_cache = (t.view(-1, page, heads, d)[order].contiguous() for t in (k, v))
    table = torch.argsort(order).view(batch, keys // page).to(torch.int32)
    return lambda: flashgen.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, chunk, keys, causal=True, block_table=table)


def workload(name):
    if name == "packed_prefill" or name.startswith("paged"):
        return prefill(int(name[5:]) if name.startswith("paged") else 0)
    if name.startswith("fp8_fwd"):  # d = 128 (fp8_fwd) or 256 (fp8_fwd256), T = 8k, e4m3 with descales of 1
        q, k, v = (t.to(torch.float8_e4m3fn) for t in bench._inputs(8192, 256 if name.endswith("256") else 128))
        one = torch.ones(q.shape[0], k.shape[1], device="cuda")
        return lambda: flashgen.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one)
    if name.startswith("dv128"):
        if name.endswith("_trio"):  # the three-consumer backward layout, ahead of the table
            from flashgen import tuning
            tuning._overrides[:0] = [{"kind": kind, "arch": "sm_90a", "head_dim": 192, "dtype": "*", "causal": "*", "bucket": "*",
                                      "tiles": [{"block_m": 64, "block_n": 96, "num_stages": 2}]}
                                     for kind in ("bwd_sm90_kvq", "bwd_sm90_kv")]
        q, k, v = bench._inputs(8192, 192)
        leaves = [t.clone().requires_grad_() for t in (q, k, v[..., :128].contiguous())]
        if name.endswith("_cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal="causal" in name)
        else:
            out = flashgen.attention(*leaves, causal="causal" in name)
        d_o = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, leaves, d_o, retain_graph=True)
    if name.startswith("decode"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        size, *flags = name[len("decode"):].split("_")
        inputs = bench._decode_step(1, int(size.rstrip("k")) * 1024, "paged" in flags, gen,
                                    cache="e4m3" if "e4m3" in flags else "bf16")
        return bench._flashgen_step(inputs)
    d = 64 if name.startswith(("doc", "causal64")) else 128
    q, k, v = bench._inputs(8192, d)
    kwargs, causal = {}, name.startswith("causal64")
    if "softcap" in name:
        kwargs["softcap"] = bench.SOFTCAP
    if name.startswith("doc"):
        causal, kwargs, _ = bench.rule_cases(q.shape[0], q.shape[1], 8192)["documents (mask rule)"]
    if name.endswith("fwd"):
        return lambda: flashgen.attention(q, k, v, causal=causal, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=causal, **kwargs)
    d_o = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, d_o, retain_graph=True)


def main():
    run = workload(sys.argv[1])
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
