"""The examples on a CPU machine: each answers --help with what it shows, and without an NVIDIA GPU
exits with status 1 after one line that says so (no traceback). The GPU tier runs them for real
(test_gpu_examples.py, test_gpu_training.py, test_gpu_generate.py, test_gpu_modifiers.py)."""

import ast
import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def without_a_gpu():
    """{example name: CompletedProcess} of each example run with no arguments and every GPU hidden,
    all started at once (each imports torch: seconds of CPU)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    started = {path.stem: subprocess.Popen([sys.executable, str(path)], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True) for path in EXAMPLES}
    results = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it went on to work without a GPU (train_gpt once trained on the CPU)
            process.kill()
            stdout, stderr = process.communicate()
            stderr += "\n(still running after 60 s: killed)"
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results


def test_every_example_is_covered():
    assert {path.stem for path in EXAMPLES} >= {"alibi", "gemma2_attention", "generate", "rules", "train_gpt"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_help_describes_the_example(path, monkeypatch, capsys):
    """`python examples/NAME.py --help`, run as the command line runs it (here: no second torch import)."""
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith(f"usage: {path.name}"), out
    described = ast.get_docstring(ast.parse(path.read_text())).split("\n\n")[0]  # its first paragraph
    assert len(described.split()) >= 10, "the docstring opens with a paragraph on what the example shows"
    squeeze = lambda text: "".join(text.split())  # noqa: E731  (argparse wraps the lines its own way)
    assert squeeze(described) in squeeze(out), out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_without_a_gpu_one_line_and_status_1(without_a_gpu, path):
    result = without_a_gpu[path.stem]
    assert result.returncode == 1, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and f"{path.name} needs an NVIDIA GPU (sm_80+)" in result.stderr, result.stderr


def load_train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLES[0].parent / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_train_gpt_writes_files_only_where_it_is_told(tmp_path, monkeypatch):
    """SDPA alone on the CPU (a tiny model, two steps): nothing lands in the current directory
    unless named (it once wrote its PNG there); --plot PATH writes the PNG there."""
    pytest.importorskip("matplotlib")
    train_gpt = load_train_gpt()
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    tiny = ["--device", "cpu", "--attention-only", "sdpa", "--layers", "1", "--heads", "1", "--embd", "16", "--block", "16",
            "--batch", "2", "--steps", "2", "--max-bytes", "20000", "--quiet"]
    train_gpt.main(tiny)
    assert list(here.iterdir()) == []
    plot = tmp_path / "out" / "losses.png"
    plot.parent.mkdir()
    train_gpt.main([*tiny, "--plot", str(plot)])
    assert list(here.iterdir()) == [] and plot.stat().st_size > 0
