"""Where an eager decode step's host time goes (issue 10: no worse than SDPA's), on the GPU machine.

Times the bench's decode step (B = 1, 32:8 heads, d = 128, 1k paged cache, append + attention)
against one SDPA call, then each piece of the step alone (the checks, the output allocation, the
plan lookup, the launch values, the plan's run, and inside it the packing and the driver calls),
then a cProfile of the step. The same for the forward's host-overhead row (1x1x128x64 causal).
Usage: python3 .ci/probe_host.py [calls]   (needs a GPU; about 30 s)
"""

import os
import sys

# .ci/profile.py would shadow the standard library's profile module, which cProfile imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import cProfile  # noqa: E402
import copy  # noqa: E402
import ctypes  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch
import torch.nn.functional as F

from flashgen import api, bench, ops, plans, runtime, serving, workspace

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 5000


def per_call_us(fn, calls=CALLS, rounds=5):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = bench._decode_step(1, 1024, True, gen)
    step = bench._flashgen_step(inputs)
    q, k, v = bench._sdpa_inputs(1, 1024, gen)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    rows = {"decode step (flashgen)": step, "SDPA call, same shape": sdpa}

    # The step's pieces, each alone (the values as the step makes them).
    a = inputs
    found = serving.check_kvcache_inputs(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"],
                                         a["block_table"], 0, True)
    paged, capacity, seqlen_new, variant, _ = found
    o = torch.empty_like(a["q"], memory_format=torch.contiguous_format)
    plan, splits = plans.decode(0, 128, torch.bfloat16, paged, 4, 1, 8, capacity + seqlen_new, 0, variant.fields, "")

    def values():
        return ops.decode_values(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"],
                                     a["block_table"], capacity, seqlen_new, o, None, splits, True, 128 ** -0.5, variant)

    vals = values()
    plan.run(0, vals)  # vals gains the plan's scratch (partials, counts), which kernel.launch below needs
    kernel = plan.kernels[0]
    no_pdl = copy.copy(kernel)
    no_pdl.dependent = False  # cuLaunchKernel instead of cuLaunchKernelEx with its attribute
    slot = runtime.launch_slot()
    lib = runtime.driver()
    ref = slot[3]
    rows.update({
        "  check_kvcache_inputs": lambda: serving.check_kvcache_inputs(
            a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"], a["block_table"], 0, True),
        "  torch.empty_like(q)": lambda: torch.empty_like(a["q"], memory_format=torch.contiguous_format),
        "  plans.decode": lambda: plans.decode(0, 128, torch.bfloat16, paged, 4, 1, 8, capacity + seqlen_new, 0,
                                               variant.fields, ""),
        "  launch_values": values,
        "  plan.run (scratch + launch)": lambda: plan.run(0, dict(vals)),
        "    workspace.where": lambda: workspace.where(0),
        "    kernel pack": lambda: kernel._pack(slot[0], vals),
        "    kernel.launch": lambda: kernel.launch(0, vals),
        "    kernel.launch, no dependent launch": lambda: no_pdl.launch(0, vals),
        "    cuCtxGetCurrent": lambda: lib.cuCtxGetCurrent(ref),
        "    current raw stream": lambda: runtime._current_stream(0),
        "    capture_of": lambda: runtime.capture_of(runtime._current_stream(0), 0),
    })
    fq, fk, fv = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows["forward 1x1x128x64 causal (flashgen)"] = lambda: api.attention(fq, fk, fv, causal=True)
    rows["forward, SDPA"] = lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=True)

    print(f"host us per call (best of 5 rounds of {CALLS}), {torch.cuda.get_device_name()}")
    for name, fn in rows.items():
        print(f"{name:42s} {per_call_us(fn):8.2f}")
    empty = ctypes.CDLL(None).getpid
    print(f"{'ctypes call of getpid (a floor)':42s} {per_call_us(empty):8.2f}")

    for name, fn in (("decode step", step), ("forward", rows["forward 1x1x128x64 causal (flashgen)"])):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\n---- cProfile of {CALLS} calls: {name} ----")
        print(text.getvalue())


if __name__ == "__main__":
    main()
