"""A deployment that never compiles: a folder built by the documented commands, loaded in a fresh
process with FLASHGEN_NO_JIT=1, an empty cache and NVRTC refused, runs the API's main paths
(attention forward and backward over short and long queries, both backward modes, a window;
varlen; decode over contiguous and paged caches; merge), each held to the fp32 reference by the
numerics rule. (The spec selection behind it is tested on the CPU: tests/test_workload.py.)"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen import cli

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
# generated/README.md's own build command, then a serving workload's (every entry point, plain and windowed)
BUILDS = (["--d", "64", "--causal"],
          ["--d", "64", "--causal", "both", "--entry", "all", "--variant", "none", "--variant", "window"])

PRELUDE = """
import torch, flashgen, flashgen.cache, flashgen.compile
from flashgen import reference
def refuse(*a, **k):
    raise AssertionError("NVRTC was called")
flashgen.compile.compile_source = flashgen.cache.compile_source = refuse
"""

MAIN_PATHS = """
flashgen.load("generated")
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16

def rule(ours, exact, low, c, what):
    for mine, ref, lo in zip(ours, exact, low):
        err, bound = (mine.float() - ref.float()).abs().max().item(), c * (lo.float() - ref.float()).abs().max().item() + 1e-5
        assert not mine.isnan().any() and err <= bound, (what, err, bound)

def grads(fn, leaves, d_o):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(d_o)
    return [out.detach()] + [t.grad for t in leaves]

ran = []
for causal in (False, True):
    for seqlen in (48, 1000):  # 64 query rows or fewer (the mma.sync forward), and more (the Hopper one)
        q, k, v = (torch.randn(2, 4, seqlen, 64, device=dev, dtype=dt) for _ in range(3))
        d_o = torch.randn_like(q)
        for window in ((-1, -1), (100, -1 if causal else 30)):
            for deterministic in (False, True):
                ours = grads(lambda q, k, v: flashgen.attention(q, k, v, causal=causal, window_size=window,
                                                                deterministic=deterministic), (q, k, v), d_o)
                exact, low = (grads(lambda q, k, v: reference.naive_attention(q, k, v, causal=causal, window_size=window,
                                                                                upcast=up), (q, k, v), d_o) for up in (True, False))
                rule(ours[:1], exact[:1], low[:1], 2, ("attention", causal, seqlen, window))
                rule(ours[1:], exact[1:], low[1:], 3, ("attention grads", causal, seqlen, window, deterministic))
        ran.append("attention")
    # varlen: packed sequences, the longest short (64 or fewer) and long
    for lengths in ((10, 64, 33), (30, 500, 257)):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        q, k, v = (torch.randn(int(cu[-1]), 4, 64, device=dev, dtype=dt) for _ in range(3))
        d_o = torch.randn_like(q)
        call = lambda q, k, v, f: f(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
        ours = grads(lambda q, k, v: call(q, k, v, flashgen.attention_varlen), (q, k, v), d_o)
        exact, low = (grads(lambda q, k, v: call(q, k, v, lambda *a, **kw: reference.attention_varlen(*a, **kw, upcast=up)),
                            (q, k, v), d_o) for up in (True, False))
        rule(ours[:1], exact[:1], low[:1], 2, ("varlen", causal, lengths))
        rule(ours[1:], exact[1:], low[1:], 3, ("varlen grads", causal, lengths))
    ran.append("varlen")

# decode: one new token and a chunk of 40 (16 packed rows or fewer, and more), contiguous and paged caches
lengths = torch.tensor([100, 700], dtype=torch.int32, device=dev)
for seqlen_q in (1, 40):
    for paged in (False, True):
        q = torch.randn(2, seqlen_q, 4, 64, device=dev, dtype=dt)
        k_new, v_new = (torch.randn(2, seqlen_q, 2, 64, device=dev, dtype=dt) for _ in range(2))
        if paged:
            k_cache, v_cache = (torch.randn(32, 64, 2, 64, device=dev, dtype=dt) for _ in range(2))
            table = torch.randperm(32, device=dev, dtype=torch.int32)[:28].view(2, 14)
        else:
            k_cache, v_cache = (torch.randn(2, 1024, 2, 64, device=dev, dtype=dt) for _ in range(2))
            table = None
        outs = []
        for fn in (flashgen.attention_with_kvcache, reference.attention_with_kvcache,
                   lambda *a, **kw: reference.attention_with_kvcache(*a, **kw, upcast=False)):
            outs.append(fn(q, k_cache.clone(), v_cache.clone(), k=k_new, v=v_new, cache_seqlens=lengths,
                           block_table=table, causal=True))
        rule(outs[:1], outs[1:2], outs[2:], 2, ("decode", seqlen_q, paged))
    ran.append("decode")
# varlen over a paged cache (the decode kernels' varlen form)
k_cache, v_cache = (torch.randn(32, 64, 2, 64, device=dev, dtype=dt) for _ in range(2))
table = torch.randperm(32, device=dev, dtype=torch.int32)[:24].view(3, 8)
cu_q = torch.tensor([0, 1, 5, 45], dtype=torch.int32, device=dev)
cu_k = torch.tensor([0, 300, 700, 1212], dtype=torch.int32, device=dev)
q = torch.randn(45, 4, 64, device=dev, dtype=dt)
outs = [fn(q, k_cache, v_cache, cu_q, cu_k, 40, 512, causal=True, block_table=table)
        for fn in (flashgen.attention_varlen, reference.attention_varlen,
                   lambda *a, **kw: reference.attention_varlen(*a, **kw, upcast=False))]
rule(outs[:1], outs[1:2], outs[2:], 2, "paged varlen")
# merge
o_a, o_b = (torch.randn(2, 3, 4, 64, device=dev, dtype=dt) for _ in range(2))
lse_a, lse_b = (torch.randn(2, 3, 4, device=dev) for _ in range(2))
merged, lse = flashgen.merge_attention_states(o_a, lse_a, o_b, lse_b)
want, want_lse = reference.merge_attention_states(o_a, lse_a, o_b, lse_b)
assert (merged.float() - want.float()).abs().max().item() < 1e-2 and torch.allclose(lse, want_lse, atol=1e-5)
print("ran", sorted(set(ran)), "merge")
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    for words in BUILDS:
        result = CliRunner().invoke(cli.main, ["build", *words, "--out", str(root / "generated")])
        assert result.exit_code == 0, result.output
    return root


def run_deployed(root: Path, body: str) -> str:
    env = {**os.environ, "FLASHGEN_NO_JIT": "1", "FLASHGEN_CACHE_DIR": str(root / "empty-cache"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(PRELUDE) + body], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (root / "empty-cache").exists()
    return result.stdout


def test_the_generated_readme_runs_as_written(deployment):
    readme = (ROOT / "generated" / "README.md").read_text().split("```")
    python = "".join(part[len("python\n"):] for part in readme[1::2] if part.startswith("python\n"))
    run_deployed(deployment, python)


def test_the_main_paths_run_under_no_jit_from_the_built_folder(deployment):
    assert run_deployed(deployment, MAIN_PATHS).strip() == "ran ['attention', 'decode', 'varlen'] merge"
