"""Compile, in parallel, the kernels the GPU tests of the variants and user rules run (the tables'
picks for their fields), so that the tests find them in the cache instead of compiling one by one.
The tests read FLASHGEN_TEST_CACHE (or a fresh cache of their own): this fills that directory.
Usage (GPU machine): FLASHGEN_TEST_CACHE=DIR python3 .ci/prebuild_variants.py, then the tests with the
same FLASHGEN_TEST_CACHE (from anywhere: it imports this checkout's flashgen)"""

import os
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import flashgen  # noqa: E402
import rules  # noqa: E402
from flashgen import tuning  # noqa: E402
from flashgen.plans import device_arch  # noqa: E402

def main():
    if not os.environ.get("FLASHGEN_TEST_CACHE"):
        sys.exit("set FLASHGEN_TEST_CACHE to the directory the tests will read (they never read the default cache)")
    os.environ["FLASHGEN_CACHE_DIR"] = os.environ["FLASHGEN_TEST_CACHE"]  # the build workers inherit it
    arch = device_arch(0)
    flags = [("window",), ("softcap",), ("alibi",), ("window", "softcap"), ("window", "softcap", "alibi")]
    cuda = torch.device("cuda")
    rule_sets = [(("score_mod", rules.alibi(torch.ones(4, device=cuda)).source),),
                 (("mask_mod", rules.sliding_window(64).source),), (("mask_mod", rules.prefix_lm(77).source),),
                 (("mask_mod", rules.documents(torch.zeros(2, 700, dtype=torch.int32, device=cuda)).source),),
                 (("score_mod", rules.relative_bias(torch.zeros(4, 255, device=cuda)).source),)]
    specs = []
    for head_dim, dtype, causal, fields in product(tuning.TEST_HEAD_DIMS, ("bf16", "fp16"), (False, True), flags + rule_sets):
        if head_dim not in (64, 96, 128) and fields != ("window", "softcap", "alibi"):
            continue
        for seqlen in (1, 4096):
            specs.append(tuning.forward_spec(head_dim, dtype, causal, arch, seqlen, variant=fields))
        specs.append(tuning.backward_prep(head_dim, dtype, arch))
        for deterministic in (False, True):
            try:
                specs += tuning.backward_specs(head_dim, dtype, causal, arch, deterministic, variant=fields)
            except flashgen.SpecError:  # a score rule without gradient: forward only
                pass
    specs = list(dict.fromkeys(specs))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        flashgen.build(specs, out, backward=False)
    print(f"prebuilt {len(specs)} kernels in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":  # spawned build workers import this file: only the parent builds
    main()
