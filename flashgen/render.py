"""Render a KernelSpec to CUDA C++ with its family's Jinja template (templates/).

Jinja substitutes constants and keeps or drops whole code paths, so the rendered file holds only
what this specialization runs. StrictUndefined turns a missing variable into an error instead of an
empty string in the generated code.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from .spec import KernelSpec


def templates_dir() -> Path:
    """The in-tree templates/ of a checkout, else the copy the wheel ships in flashgen/templates/."""
    package = Path(__file__).resolve().parent
    in_tree = package.parent / "templates"
    return in_tree if (in_tree / "device.cuh.j2").is_file() else package / "templates"


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: KernelSpec) -> str:
    family = spec.family
    return _environment().get_template(family.template).render(family.context(spec))
