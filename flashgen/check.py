"""`python -m flashgen.check`: compile a kernel and, on a GPU, check it against PyTorch SDPA.

Without a GPU it compiles (NVRTC needs none) and prints what ptxas reports; with one it runs the
forward and backward on random inputs and holds both to the fp32 reference by FlashAttention's
rule, next to F.scaled_dot_product_attention.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import attention, tuning
from .cache import default_cache
from .reference import naive_attention


def main() -> int:
    gpu = torch.cuda.is_available()
    arch = tuning_arch() if gpu else "sm_90a"
    spec = tuning.forward_spec(64, "bf16", True, arch, seqlen_q=1024)
    artifact = default_cache().get(spec)
    print(f"{spec.name}: {artifact.resources}, cached at {artifact.path}")
    if not gpu:
        print("no CUDA GPU visible: compiled only; attention() needs an NVIDIA GPU (sm_80 or newer)")
        return 0
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    d_o = torch.randn_like(q)
    runs = {
        "flashgen": lambda: attention(q, k, v, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "exact": lambda: naive_attention(q, k, v, causal=True)[0],  # fp32
        "low": lambda: naive_attention(q, k, v, causal=True, upcast=False)[0],  # bf16
    }
    results = {}
    for name, fn in runs.items():
        out = fn()
        out.backward(d_o)
        results[name] = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    ours, sdpa, exact, low = (results[name] for name in runs)
    ok = True
    for i, label in enumerate(("out", "dq", "dk", "dv")):
        err = (ours[i] - exact[i]).abs().max().item()
        bound = (2 if i == 0 else 3) * (low[i] - exact[i]).abs().max().item() + 1e-5
        vs_sdpa = (ours[i] - sdpa[i]).abs().max().item()
        ok &= err <= bound
        print(f"{label}: max |flashgen - fp32 ref| = {err:.2e} (bound {bound:.2e}), |flashgen - sdpa| = {vs_sdpa:.2e}")
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


def tuning_arch() -> str:
    from .api import device_arch

    return device_arch(torch.cuda.current_device())


if __name__ == "__main__":
    sys.exit(main())
