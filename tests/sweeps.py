"""The compile sweeps: every shipped spec compiles (no spills, the instructions it must hold), in
CI. The README's test command compiles a sample, so that it finishes in minutes on two cores: the
first spec of each group (by default its kind, target and head-dim bucket) runs always; the others
carry the `sweep` mark and run with `--sweep` (tests/conftest.py)."""

import pytest


def group(spec) -> tuple:
    """A sweep's default group: kind, target, and whether the head dim is above 128 (where several
    families change their layout)."""
    return spec.kind, spec.arch, spec.head_dim > 128, spec.varlen


def sweep(specs, by=group) -> list:
    """pytest params over `specs`, named by spec: the first of each group unmarked, the rest `sweep`."""
    seen = set()
    params = []
    for spec in specs:
        key = by(spec)
        params.append(pytest.param(spec, id=spec.name, marks=() if key not in seen else (pytest.mark.sweep,)))
        seen.add(key)
    return params
