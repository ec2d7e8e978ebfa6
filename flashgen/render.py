"""Render a KernelSpec to CUDA C++ with its family's Jinja template (templates/).

Jinja substitutes constants and keeps or drops whole code paths, so the rendered file holds only
what this specialization runs. StrictUndefined turns a missing variable into an error instead of an
empty string in the generated code.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import jinja2

from .spec import KernelSpec


def templates_dir() -> Path:
    """The in-tree templates/ of a checkout, else the copy the wheel ships in flashgen/templates/."""
    package = Path(__file__).resolve().parent
    in_tree = package.parent / "templates"
    return in_tree if (in_tree / "device.cuh.j2").is_file() else package / "templates"


class _BytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's compiled templates on disk (one file per template, keyed by its source's checksum and
    the Python version, written atomically), where a damaged file is a miss, never a crash."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (EOFError, ValueError, TypeError, pickle.UnpicklingError):  # cut in its checksum or its code
            bucket.reset()


@functools.cache
def _environment(bytecode_dir: str | None = None) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=_BytecodeCache(bytecode_dir) if bytecode_dir else None,
    )


def render(spec: KernelSpec, bytecode_dir: Path | None = None) -> str:
    """The kernel's CUDA source. With `bytecode_dir` the compiled templates are kept there: the
    first render in a process then loads them instead of compiling them (~40 ms), which is most of
    loading a cached kernel in a fresh process (the cache renders to find its entry)."""
    family = spec.family
    environment = _environment(str(bytecode_dir) if bytecode_dir else None)
    return environment.get_template(family.template).render(family.context(spec))
