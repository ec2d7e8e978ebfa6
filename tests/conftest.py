import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--sweep", action="store_true", default=False,
                     help="compile every shipped spec in the compile sweeps (CI runs `python -m pytest -q --sweep -m "
                          "sweep` after the default run); without it each sweep compiles a sample (tests/sweeps.py)")


# Tests left out of this run, by reason: one summary line each instead of a line per test.
NOT_RUN = {
    "gpu": "GPU tests not run: no CUDA GPU here (the GPU tier: `python -m pytest -m gpu` on an NVIDIA GPU)",
    "sweep": "compile-sweep specs not run beyond each sweep's sample: `python -m pytest -q --sweep -m sweep` runs them (CI does)",
}


def pytest_collection_modifyitems(config, items):
    left_out = {"gpu": not torch.cuda.is_available(), "sweep": not config.getoption("--sweep")}
    kept, dropped = [], []
    for item in items:
        reason = next((reason for reason, out in left_out.items() if out and reason in item.keywords), None)
        (dropped if reason else kept).append(item)
        if reason:
            config.stash.setdefault(_not_run, {}).setdefault(reason, 0)
            config.stash[_not_run][reason] += 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_not_run = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter, config):
    for reason, count in config.stash.get(_not_run, {}).items():
        terminalreporter.write_line(f"{count} {NOT_RUN[reason]}")


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test starts from a seed of its own id: unseeded inputs are the same whichever tests ran
    before (-k, -x, -n), so a failure reproduces."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tests never touch the user's cache: one fresh cache for the whole session."""
    root = os.environ.get("FLASHGEN_TEST_CACHE") or str(tmp_path_factory.mktemp("flashgen-cache"))
    os.chmod(root, 0o700)
    previous = os.environ.get("FLASHGEN_CACHE_DIR")
    os.environ["FLASHGEN_CACHE_DIR"] = root
    yield root
    if previous is None:
        os.environ.pop("FLASHGEN_CACHE_DIR", None)
    else:
        os.environ["FLASHGEN_CACHE_DIR"] = previous


def run_prebuilt(tmp_path, spec, body: str) -> str:
    """Build `spec` (with its backward kernels) into the package tmp_path/aot_kernels, then run
    `body` in a fresh process that has imported it as `module`, with FLASHGEN_NO_JIT set, an
    empty cache and the compiler patched to fail: the prebuilt files alone must do. Returns stdout."""
    import flashgen

    flashgen.build([spec], tmp_path / "aot_kernels")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import flashgen.cache, flashgen.compile
        def refuse(*a, **k):
            raise AssertionError("NVRTC was called")
        flashgen.compile.compile_source = flashgen.cache.compile_source = refuse
        from aot_kernels import {spec.name} as module
        from flashgen.reference import naive_attention
    """) + textwrap.dedent(body)
    env = {**os.environ, "FLASHGEN_NO_JIT": "1", "FLASHGEN_CACHE_DIR": str(tmp_path / "empty-cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def outputs_and_grads(fn, q, k, v, grad=True, seed=20261203):
    """(out, dq, dk, dv) of fn(q, k, v) on fresh leaves with a seeded upstream gradient, or (out,)."""
    gen = torch.Generator(device=q.device).manual_seed(seed)
    d_o = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=gen)
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    out = fn(*leaves)
    if not grad:
        return (out.detach(),)
    out.backward(d_o)
    return (out.detach(), *(t.grad for t in leaves))


def check_by_the_numerics_rule(ours, exact, low, dtype):
    """max|x - exact| <= c * max|x_low - exact| + 1e-5 for the output (c = 2) and each gradient (c = 3),
    x_low the same computation in the inputs' dtype; no NaN anywhere."""
    assert len(ours) == len(exact) == len(low), "the three computations return as many tensors"
    for name, mine, ref, lowp in zip(("out", "dq", "dk", "dv"), ours, exact, low):
        assert mine.shape == ref.shape and mine.dtype == dtype, name
        assert not mine.isnan().any(), f"NaN in {name}"
        err = (mine.float() - ref.float()).abs().max().item()
        bound = (2 if name == "out" else 3) * (lowp.float() - ref.float()).abs().max().item() + 1e-5
        assert math.isfinite(bound), f"{name}: the low-precision reference is not finite, so it bounds nothing"
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


def in_a_thread_with_no_context(fn):
    """fn() on a new thread that has no CUDA context current (as the autograd thread, or a serving
    thread, may start): its result, or its exception raised here."""
    import threading

    from flashgen import runtime

    results = []

    def work():
        try:
            runtime.driver().cuCtxSetCurrent(None)
            results.append((True, fn()))
        except Exception as error:  # noqa: BLE001  (raised again on the caller's thread)
            results.append((False, error))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    [(ok, value)] = results
    if not ok:
        raise value
    return value
