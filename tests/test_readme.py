"""The README's two set-up commands: what they install is what they then import, CI runs the test
command exactly, and the torch the package asks for is one the README says is tested."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COMMANDS = [line for line in re.findall(r"```bash\n(.*?)```", README, re.S) if line.startswith("python3 -m venv")]


def test_the_readme_has_two_setup_commands_that_install_the_checkout_they_run_from():
    assert len(COMMANDS) == 2
    main, tests = (command.strip().split(" && ") for command in COMMANDS)
    # both run from the root, so `python -m ...` imports the checkout: the install is that checkout (editable)
    assert "pip install -e ." in main and 'pip install -e ".[test]"' in tests
    assert tests[-1] == "python -m pytest -q"


def test_ci_runs_the_readme_test_command_step_by_step_then_the_rest_of_the_sweeps():
    steps = COMMANDS[1].strip().split(" && ")
    script = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    start = script.index(steps[0])
    assert script[start:start + len(steps)] == steps
    assert script[start + len(steps)] == "python -m pytest -q --sweep -m sweep"


def test_the_torch_the_package_needs_is_one_the_readme_says_is_tested():
    (oldest,) = re.findall(r'^\s*"torch>=(\d+\.\d+)",', (ROOT / "pyproject.toml").read_text(), re.M)  # (no tomllib on 3.10)
    assert f"torch {oldest}" in README
    assert "driver for CUDA 13" in README and "sm_90a" in README  # the prerequisites, and the first command's target
