"""`flashgen tune` on the GPU: candidates are checked, timed, ranked and written."""

import json

import pytest
import torch

from flashgen import tune, tuning
from flashgen.plans import device_arch

pytestmark = pytest.mark.gpu


def test_tune_ranks_checked_candidates_and_the_table_uses_them(tmp_path, monkeypatch):
    arch = device_arch(0)
    problem = tune.Problem("fwd", 64, "bf16", True, arch, "short")
    lines = []
    entries = tune.tune([problem], seqlens=(1024, 2048), log=lines.append)
    assert len(entries) == 1, lines
    entry = entries[0]
    assert entry["bucket"] == "short" and entry["arch"] == arch and 1 <= len(entry["tiles"]) <= tune.TOP
    assert set(entry["tflops"]) == {"1024", "2048"} and all(t > 0 for ts in entry["tflops"].values() for t in ts)
    path = tmp_path / "table.json"
    path.write_text(tuning.format_table(tune.merge(tuning.table(), entries)))
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.reload()
    try:
        spec = tuning.mma_forward_spec(64, "bf16", True, arch, seqlen_q=16)
        assert tune.tiles_of(spec) == entry["tiles"][0]
        assert json.loads(path.read_text())["entries"][0] == entry
    finally:
        monkeypatch.delenv(tuning.TABLE_ENV)
        tuning.reload()


@pytest.mark.parametrize("kind,bucket", [("fwd", "short"), ("bwd_kvq", "long")])
def test_check_rejects_a_kernel_that_disagrees_with_the_reference(kind, bucket, monkeypatch):
    problem = tune.Problem(kind, 64, "bf16", False, device_arch(0), bucket)
    assert tune.check(problem) is None
    real = tune.naive_attention

    def scaled(q, k, v, causal, scale=None, upcast=True):
        return real(q, k, v, causal, scale, upcast) * 1.1  # both references move (their gap stays the bound); the kernel cannot follow

    monkeypatch.setattr(tune, "naive_attention", scaled)
    assert "max error" in tune.check(problem)


def test_problems_for_this_gpu_have_candidates():
    for problem in tune.problems([64, 128], ["bf16"], [False, True], device_arch(0)):
        assert tune.candidates(problem), problem.label()
    assert torch.cuda.is_available()
