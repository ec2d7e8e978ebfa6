"""GPU tier: the variant examples run and pass their own checks against flashgen.reference
(each example's main() asserts the numerics rule on the output and the gradients)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [
    ["--length", "2048", "--window", "512"],  # Gemma-2 2B's layer shapes (head dim 256), a shorter sequence
    ["--length", "1000", "--window", "300", "--softcap", "2", "--hidden", "512", "--head-dim", "64", "--batch", "2"],
], ids=["gemma2-2b", "small"])
def test_gemma2_attention_example(args):
    result = load("gemma2_attention").main(args)
    assert set(result) == {"output", "gradients"}


@pytest.mark.parametrize("args", [
    ["--length", "1024"],
    ["--length", "777", "--heads", "12", "--head-dim", "64", "--per-batch"],
    ["--length", "500", "--heads", "6", "--bidirectional"],
], ids=["causal", "per-batch", "bidirectional"])
def test_alibi_example(args):
    result = load("alibi").main(args)
    assert set(result) == {"output", "gradients"}


def test_long_context_example_on_one_gpu():
    """examples/long_context.py as a ring of one (plain python, no torchrun): it trains (the loss
    falls from the first step to the last, finite throughout)."""
    import re
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(EXAMPLES / "long_context.py"), "--tokens", "16384", "--steps", "25"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [sum(float(x) for x in found[0]) for found in
              (re.findall(r"loss ([0-9.]+) on the first half.*?, ([0-9.]+) on the second", line)
               for line in result.stdout.splitlines()) if found]
    assert len(losses) == 25 and losses[-1] < losses[0], result.stdout
