"""Ahead of time: build kernels into a folder (generated/ by default) and load them back with no
compiler present.

Per kernel the folder holds <name>.cu (the source), <name>.cubin, <name>.json (spec, checksum,
resources) and, for a forward kernel, <name>.py, a module whose `attention` runs it. A forward
kernel's JSON names the backward kernels built with it, which load with it, so the imported
function is differentiable. Each file is written atomically and the JSON last, so a folder
interrupted mid-build never holds a kernel that loads wrongly.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import __version__
from .cache import cubin_matches, default_cache, write_atomic
from .compile import Resources
from .runtime import Kernel
from .spec import KernelSpec
from .tuning import backward_specs

MODULE = '''"""flashgen ahead-of-time kernel {name} (flashgen {version}, NVRTC {nvrtc}).

    from {package} import {name}
    out = {name}.attention(q, k, v)        # runs the prebuilt cubin; no compiler needed
"""

from pathlib import Path as _Path

import flashgen as _flashgen

attention = _flashgen.load(_Path(__file__).with_suffix(".json"))
spec = attention.spec
'''

PACKAGE_INIT = '''"""Ahead-of-time flashgen kernels: `import <this package>.<kernel name>`, or flashgen.load(path)."""
'''


def export(spec: KernelSpec, out: Path, backward: tuple[str, ...] = ()) -> dict:
    """Build (or take from the cache) one kernel and write its files into `out`."""
    artifact = default_cache().get(spec)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / spec.name
    write_atomic(stem.with_suffix(".cu"), (artifact.path / "kernel.cu").read_bytes())
    write_atomic(stem.with_suffix(".cubin"), artifact.cubin)
    meta = {k: v for k, v in artifact.meta.items() if k != "compile_seconds"}
    if spec.kind == "fwd":
        meta["backward"] = list(backward)
        module = MODULE.format(name=spec.name, version=__version__, nvrtc=meta["nvrtc"], package=out.name)
        write_atomic(stem.with_suffix(".py"), module.encode())
    write_atomic(stem.with_suffix(".json"), json.dumps(meta, indent=2).encode())  # last
    return meta


def with_backward(specs: list[KernelSpec]) -> dict[KernelSpec, tuple[str, ...]]:
    """Each forward spec with the backward kernels (both modes) that the tables pick for it."""
    plan = {}
    for spec in specs:
        if spec.kind != "fwd":
            plan.setdefault(spec, ())
            continue
        picked = []
        for deterministic in (False, True):
            picked += backward_specs(spec.head_dim, spec.dtype, spec.causal, spec.arch, deterministic)
        picked = list(dict.fromkeys(picked))
        plan[spec] = tuple(p.name for p in picked)
        for companion in picked:
            plan.setdefault(companion, ())
    return plan


def build(specs: list[KernelSpec], out: Path, jobs: int | None = None, progress=None,
          backward: bool = True) -> list[dict]:
    """Build every spec (and, with backward=True, the backward kernels of each forward spec) into
    `out`, in parallel processes; `progress(meta)` after each one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    init = out / "__init__.py"
    if not init.exists():
        write_atomic(init, PACKAGE_INIT.encode())
    plan = with_backward(specs) if backward else {spec: () for spec in specs}
    jobs = jobs or min(len(plan), os.cpu_count() or 1)
    results = []
    if jobs <= 1 or len(plan) <= 1:
        for spec, companions in plan.items():
            results.append(export(spec, out, companions))
            if progress:
                progress(results[-1])
        return results
    # spawn, not fork: the parent may hold a CUDA context, which a forked child must not inherit
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(export, spec, out, companions) for spec, companions in plan.items()]
        for future in as_completed(futures):
            results.append(future.result())
            if progress:
                progress(results[-1])
    return results


def built(out: Path) -> list[dict]:
    """Metadata of the kernels in a build folder."""
    found = []
    for path in sorted(Path(out).glob("*.json")):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "cubin_sha256" in meta and path.with_suffix(".cubin").exists():
            found.append({**meta, "path": str(path)})
    return found


class PrebuiltKernel:
    """A kernel loaded from a build folder, callable like flashgen.attention with its mask fixed."""

    def __init__(self, kernel: Kernel, meta: dict, path: Path):
        self.kernel = kernel
        self.spec = kernel.spec
        self.meta = meta
        self.path = path
        self.resources = Resources(**meta["resources"])

    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False,
                 deterministic: bool = False):
        from .api import DTYPES, check_inputs, run_attention, softmax_scale

        check_inputs(q, k, v)
        spec = self.spec
        if q.shape[-1] != spec.head_dim or DTYPES[q.dtype] != spec.dtype:
            raise ValueError(
                f"{spec.name} takes head_dim={spec.head_dim} {spec.dtype}; got head_dim="
                f"{q.shape[-1]} {DTYPES[q.dtype]}"
            )
        o, lse = run_attention(
            q, k, v, spec.causal, softmax_scale(scale, spec.head_dim), spec.name, bool(deterministic),
            need_lse=bool(return_lse),
        )
        return (o, lse) if return_lse else o

    def __repr__(self) -> str:
        return f"PrebuiltKernel({self.spec.name}, {self.path})"


def _read(meta_path: Path) -> tuple[Kernel, dict]:
    meta = json.loads(meta_path.read_text())
    cubin = meta_path.with_suffix(".cubin").read_bytes()
    if not cubin_matches(cubin, meta):
        raise ValueError(f"{meta_path.with_suffix('.cubin')} does not match its checksum: rebuild it")
    return Kernel(KernelSpec(**meta["spec"]), cubin), meta


def load(path) -> PrebuiltKernel:
    """Load a forward kernel written by `flashgen build` (the .json, .cubin or .py path, or the
    stem) and the backward kernels built with it. Needs no compiler; touches no GPU until called."""
    from .api import register

    meta_path = Path(path).with_suffix(".json")  # kernel names hold no dots
    kernel, meta = _read(meta_path)
    for name in meta.get("backward", []):
        register(_read(meta_path.with_name(name + ".json"))[0])
    return PrebuiltKernel(register(kernel), meta, meta_path)
