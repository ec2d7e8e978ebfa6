"""Where the FP8 forward's lse error on inputs with outliers comes from (issue 43). The scores as
Hopper's FP8 tensor cores sum them (torch._scaled_mm on the same e4m3 q and k: fast accumulation
keeps the MMA's own accumulator, the default promotes it to fp32 every few k-steps) against the
oracle's fp32 sum of the same exact products. For each of test_gpu_fp8's problems, prints the lse
error against the oracle of flashgen, of the lse from fast-accumulated scores and of the lse from
promoted ones (max, RMSE, mean signed), and flashgen's distance to the fast-accumulated lse.
Usage: python3 .ci/probe_fp8_lse.py  (needs an sm_90 GPU)."""

import sys

import torch

import flashgen
from flashgen import reference

sys.path.insert(0, "tests")
from test_gpu_fp8 import problem, tensor_core_lse  # noqa: E402

SHAPES = {"gqa-d128": (2, 8, 2, 1000, 1000, 128), "d64-tq<tk": (1, 4, 4, 333, 1500, 64),
          "mqa-d256": (1, 4, 1, 700, 700, 256), "d192-v128": (1, 4, 2, 500, 500, 192, 128)}


def stats(a, b, visible):
    d = (a - b)[visible]
    return f"max {d.abs().max().item():.2e} rmse {d.pow(2).mean().sqrt().item():.2e} mean {d.mean().item():+.2e}"


def main():
    for name, shape in SHAPES.items():
        for causal in (False, True):
            for outliers in (False, True):
                q, k, v, qd, kd, vd = problem(*shape, outliers=outliers, seed=len(shape) + causal)
                with torch.no_grad():
                    _, lse = flashgen.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                                return_lse=True)
                _, ref = reference.naive_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                                   out_dtype=torch.float32, return_lse=True)
                visible = torch.isfinite(ref)
                fast, promoted = (tensor_core_lse(q, k, qd, kd, causal, f) for f in (True, False))
                tag = f"{name} {'causal' if causal else 'full'} {'outliers' if outliers else 'normal'}"
                print(f"{tag}: flashgen   {stats(lse, ref, visible)}")
                print(f"{tag}: fast-accum {stats(fast, ref, visible)}")
                print(f"{tag}: promoted   {stats(promoted, ref, visible)}")
                print(f"{tag}: flashgen - fast-accum {stats(lse, fast, visible)}", flush=True)


if __name__ == "__main__":
    main()
