"""`python -m flashgen.check [FOLDER]`: check the kernels `flashgen build` wrote into FOLDER
(generated/ by default).

Without a GPU it loads each one as a deployment would (checksums, specs, the backward kernels built
with it; nothing is compiled) and says so; with one it also runs each forward and backward on
random inputs and holds them to the fp32 reference by FlashAttention's rule, next to
F.scaled_dot_product_attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import variants


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "generated")
    from .aot import load
    from .settings import problems

    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        print(f"error: {folder} {what}: python -m flashgen.check takes a build folder (what `flashgen build --out` "
              f"writes; generated/ by default)", file=sys.stderr)
        return 1
    found = problems()  # a deployment's environment as `flashgen doctor` checks it (FLASHGEN_NO_JIT=garbage too)
    try:
        kernels = load(folder)
    except (OSError, ValueError) as error:
        found.append(error)
    for error in found:
        print(f"error: {error}", file=sys.stderr)
    if found:
        return 1
    import torch

    gpu = torch.cuda.is_available()
    ok = True
    for name, kernel in kernels.items():
        companions = ", ".join(kernel.meta.get("backward", [])) or "none"
        print(f"{name}: loaded from {kernel.path} ({kernel.resources.registers} registers; backward: {companions})")
        if not gpu:
            continue
        try:
            ok &= _check(kernel, torch)
        except (RuntimeError, ValueError) as error:  # NoJitError, CacheError, CompileError, CudaError
            print(f"error: {error}", file=sys.stderr)
            ok = False
    if not gpu:
        print("no CUDA GPU visible: the kernels load; run this on an NVIDIA GPU (sm_80 or newer) to check their results")
        return 0
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


def _check(kernel, torch) -> bool:
    """Forward and backward of one prebuilt kernel against the fp32 reference (and SDPA)."""
    import torch.nn.functional as F

    from .reference import naive_attention

    spec = kernel.spec
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    generator = torch.Generator(device="cuda").manual_seed(20261202)
    q, k, v = (torch.randn(2, 8, 1000, d, device="cuda", dtype=dtype, generator=generator).requires_grad_()
               for d in (spec.head_dim, spec.head_dim, spec.d_v))
    d_o = torch.randn(v.shape, device="cuda", dtype=dtype, generator=generator)
    variant = variant_arguments(spec, q)
    runs = {
        "flashgen": lambda: kernel(q, k, v, **variant),
        "exact": lambda: naive_attention(q, k, v, causal=spec.causal, **variant),  # fp32
        "low": lambda: naive_attention(q, k, v, causal=spec.causal, upcast=False, **variant),  # input dtype
    }
    if not variant:  # (SDPA has no variants)
        runs["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)
    results = {}
    for name, fn in runs.items():
        out = fn()
        out.backward(d_o)
        results[name] = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    ours, exact, low, sdpa = (results.get(name) for name in ("flashgen", "exact", "low", "sdpa"))
    ok = True
    for i, label in enumerate(("out", "dq", "dk", "dv")):
        err = (ours[i] - exact[i]).abs().max().item()
        bound = (2 if i == 0 else 3) * (low[i] - exact[i]).abs().max().item() + 1e-5
        ok &= err <= bound
        beside = f", |flashgen - sdpa| = {(ours[i] - sdpa[i]).abs().max().item():.2e}" if sdpa else ""
        print(f"  {label}: max |flashgen - fp32 ref| = {err:.2e} (bound {bound:.2e}){beside}")
    return ok


def variant_arguments(spec, q) -> dict:
    """Arguments that exercise the variants a kernel was built for (each declaration's sample: a
    window of 256 keys, softcap 30, ALiBi's geometric slopes, spread sinks), passed alike to the
    kernel and to the reference."""
    return {d.keyword: d.sample(spec, q) for d in variants.on(spec) if d.sample is not None}

if __name__ == "__main__":
    sys.exit(main())
