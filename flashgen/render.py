"""Render a KernelSpec to CUDA C++ with the Jinja templates under templates/.

Jinja substitutes constants and keeps or drops whole code paths, so the rendered file holds only
what this specialization runs. StrictUndefined turns a missing variable into an error instead of an
empty string in the generated code.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from . import __version__
from .spec import KernelSpec

TEMPLATES = {
    "fwd": "attention_fwd.cu.j2",
    "bwd_q": "attention_bwd_q.cu.j2",
    **{kind: "attention_bwd.cu.j2" for kind in ("bwd_kvq", "bwd_kv", "bwd_kq", "bwd_k", "bwd_v")},
}


def templates_dir() -> Path:
    """The in-tree templates/ of a checkout, else the copy the wheel ships in flashgen/templates/."""
    package = Path(__file__).resolve().parent
    in_tree = package.parent / "templates"
    return in_tree if (in_tree / TEMPLATES["fwd"]).is_file() else package / "templates"


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


def dq_item(spec: KernelSpec) -> tuple[int, int]:
    """The key-major dQ product's work item, (m16 query tiles, n16 head-dim pairs): the shape that
    keeps the busiest warp's mma count lowest, then its operand loads, within 32 fp32
    accumulators per thread."""
    row_tiles, pairs = spec.block_m // 16, spec.head_dim_pad // 16

    def cost(item):
        rows, cols = item
        per_warp = -(-(row_tiles // rows) * (pairs // cols) // spec.num_warps)
        return per_warp * rows * cols, per_warp * (rows + cols)

    shapes = [(r, c) for r in (1, 2, 4) for c in (1, 2, 3, 4) if not row_tiles % r and not pairs % c and r * c <= 4]
    return min(shapes, key=cost)


def template_context(spec: KernelSpec) -> dict:
    """Everything a template may use: the spec's fields and the layout derived from them."""
    grads = spec.grads
    dq_rows, dq_pairs = dq_item(spec)
    # Key-major backward: (accumulator, fp32 tile it is multiplied from, shared-memory B operand)
    gemms = [g for g in (("dv", "s", "do_tile"), ("dk", "dp", "q_tile")) if g[0][1] in grads]
    return {
        **{field: getattr(spec, field) for field in spec.__dataclass_fields__},
        "name": spec.name,
        "version": __version__,
        "head_dim_pad": spec.head_dim_pad,
        "smem_stride": spec.smem_stride,
        "num_threads": spec.num_threads,
        "ptx_type": {"fp16": "f16", "bf16": "bf16"}[spec.dtype],
        "has_dk": "k" in grads,
        "has_dv": "v" in grads,
        "has_dq": "q" in grads,
        "need_dp": "k" in grads or "q" in grads,
        "gemms": gemms,
        "grads_text": " and ".join({"k": "dK", "v": "dV"}[g] for g in grads if g != "q"),
        "prep_lanes": spec.prep_lanes,
        "wgmma": spec.wgmma,  # also stores the shared-memory tiles as wgmma's core matrices
        "dq_rows": dq_rows,
        "dq_pairs": dq_pairs,
    }


def render(spec: KernelSpec) -> str:
    return _environment().get_template(TEMPLATES[spec.kind]).render(template_context(spec))
