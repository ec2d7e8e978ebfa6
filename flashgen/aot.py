"""Ahead of time: build kernels into a folder (generated/ by default) and load them back with no
compiler present.

Per kernel the folder holds <name>.cu (the source), <name>.<checksum>.cubin, <name>.json (spec,
the cubin's name and checksum, resources) and, for a forward kernel, <name>.py, a module whose
`attention` runs it. A forward kernel's JSON names the backward kernels built with it, which load
with it, so the imported function is differentiable. Each file is written atomically and the JSON
last; the cubin is named by its checksum, so writing the JSON switches a kernel from its old build
to its new one in one step, and backward kernels are written before the forward kernels that name
them. A build interrupted at any point leaves every kernel loading as before or as new, never
wrongly. A kernel loads only into the flashgen version that built it. The files are readable by
everyone (a deployment folder, unlike the private cache).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import __version__
from .cache import cubin_matches, default_cache, write_atomic
from .compile import NoJitError, Resources
from .render import render
from .spec import SMEM_LIMIT, KernelSpec
from .workload import backward_of

MODULE = '''"""flashgen ahead-of-time kernel {name} (flashgen {version}, NVRTC {nvrtc}).

    from {package} import {name}
    out = {name}.attention(q, k, v)        # runs the prebuilt cubin; no compiler needed
"""

from pathlib import Path as _Path

import flashgen as _flashgen

attention = _flashgen.load(_Path(__file__).with_suffix(".json"))
spec = attention.spec
'''

# The package's __init__.py: what generated/__init__.py holds (tracked), and what a build writes
# into a new folder.
PACKAGE_INIT = '''"""Ahead-of-time flashgen kernels (see README.md). `load()` registers every kernel in this folder
with flashgen, so that flashgen.attention and the other functions run them with no compiler, and
returns the forward kernels by name; `from <this package> import <kernel name>` imports one of them
(`<kernel name>.attention(q, k, v)`)."""

from pathlib import Path as _Path


def load() -> dict:
    """flashgen.load(this folder), wherever it is installed."""
    import flashgen

    return flashgen.load(_Path(__file__).parent)
'''

READABLE = 0o644  # built files: a deployment folder others may read


def export(spec: KernelSpec, out: Path, backward: tuple[str, ...] = ()) -> dict:
    """Build (or take from the cache) one kernel and write its files into `out`."""
    artifact = default_cache().get(spec, ahead_of_time=True)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / spec.name
    _write(stem.with_suffix(".cu"), render(spec).encode())  # (the source the cache compiled: rendering is deterministic)
    meta = {k: v for k, v in artifact.meta.items() if k != "compile_seconds"}
    meta["cubin"] = f"{spec.name}.{meta['cubin_sha256'][:16]}.cubin"
    _write(out / meta["cubin"], artifact.cubin)
    if spec.family.forward and not spec.varlen:  # (a varlen kernel runs under attention_varlen: no module)
        meta["backward"] = list(backward)
        module = MODULE.format(name=spec.name, version=__version__, nvrtc=meta["nvrtc"], package=out.name)
        _write(stem.with_suffix(".py"), module.encode())
    _write(stem.with_suffix(".json"), json.dumps(meta, indent=2).encode())  # last: the switch to this build
    for old in (*out.glob(f"{spec.name}.*.cubin"), stem.with_suffix(".cubin")):  # the builds before it
        if old.name != meta["cubin"]:
            old.unlink(missing_ok=True)
    return meta


def _write(path: Path, data: bytes) -> None:
    write_atomic(path, data)
    os.chmod(path, READABLE)


def with_backward(specs: list[KernelSpec]) -> dict[KernelSpec, tuple[str, ...]]:
    """Each forward spec with the names of the backward kernels (both modes) that run after it,
    which are added to the plan too; every other spec with none."""
    plan = {}
    for spec in specs:
        if not spec.family.forward:
            plan.setdefault(spec, ())
            continue
        picked = backward_of(spec)
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
        _write(init, PACKAGE_INIT.encode())
    plan = with_backward(specs) if backward else {spec: () for spec in specs}
    jobs = jobs or min(len(plan), os.cpu_count() or 1)
    results = []
    if jobs <= 1 or len(plan) <= 1:
        for spec, companions in sorted(plan.items(), key=lambda item: bool(item[1])):  # named kernels first
            results.append(export(spec, out, companions))
            if progress:
                progress(results[-1])
        return results
    # spawn, not fork: the parent may hold a CUDA context, which a forked child must not inherit
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for stage in (False, True):  # the kernels that forward kernels name, then the forward kernels
            futures = [pool.submit(export, spec, out, companions) for spec, companions in plan.items() if bool(companions) == stage]
            for future in as_completed(futures):
                results.append(future.result())
                if progress:
                    progress(results[-1])
    return results


def built(out: Path) -> list[dict]:
    """Metadata of the kernels in a build folder (scan's first half: damaged ones left out)."""
    return scan(out)[0]


def scan(out: Path) -> tuple[list[dict], list[str]]:
    """The kernels in a build folder: the metadata of those whole, and for each damaged one (its
    JSON unreadable or not a kernel's, or its cubin missing) a sentence naming the file and what to
    do. Other JSON files (not named <kind>_...) are not kernels, and are left alone."""
    from .families import KINDS

    found, damaged = [], []
    for path in sorted(Path(out).glob("*.json")):
        if not path.stem.startswith(tuple(f"{kind}_" for kind in KINDS)):
            continue
        try:
            meta = _read_json(path)
            if not (isinstance(meta, dict) and "cubin_sha256" in meta):
                raise _damaged(path, "not a kernel's metadata: no cubin_sha256")
            cubin = _cubin_path(path, meta)
            if not cubin.exists():
                raise _damaged(path, f"its cubin {cubin.name} is missing")
        except (OSError, ValueError) as error:
            damaged.append(str(error) if isinstance(error, ValueError) else f"{path} cannot be read ({error.strerror})")
            continue
        found.append({**meta, "path": str(path)})
    return found, damaged


def _damaged(meta_path: Path, why: str) -> ValueError:
    return ValueError(f"{meta_path} is damaged ({why}): rebuild it with `flashgen build --out {meta_path.parent}`")


def _read_json(meta_path: Path):
    """A kernel's JSON file, parsed; a ValueError naming the file if it is not JSON."""
    try:
        return json.loads(meta_path.read_text())
    except ValueError as error:  # (JSONDecodeError, UnicodeDecodeError)
        raise _damaged(meta_path, f"not valid JSON: {error}") from None


def _cubin_path(meta_path: Path, meta: dict) -> Path:
    """A kernel's cubin: the one its JSON names (<name>.<checksum>.cubin), or <name>.cubin as
    flashgen wrote it before."""
    name = meta.get("cubin", meta_path.stem + ".cubin")
    if not isinstance(name, str) or Path(name).name != name:
        raise ValueError(f"{meta_path}: its cubin must be a file beside it, got {name!r}")
    return meta_path.with_name(name)


class PrebuiltKernel:
    """A forward kernel loaded from a build folder, callable like flashgen.attention with its mask
    fixed; it runs through exactly the same path (autocast, input checks, the custom op)."""

    def __init__(self, spec: KernelSpec, meta: dict, path: Path, smem_bytes: int = 0):
        self.spec = spec
        self.meta = meta
        self.path = path
        self.resources = Resources(**meta["resources"])
        self.smem_bytes = smem_bytes or spec.smem_bytes  # the most any of its kernels asks for, backward included

    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False, deterministic: bool = False,
                 **variants):
        """flashgen.attention(q, k, v, causal=<the kernel's>, ...) on this kernel; `variants` are
        attention()'s variant keywords, and must be the ones it was built for."""
        from .api import call

        if getattr(q, "is_cuda", False):
            from .plans import device_arch

            target = device_arch(q.get_device())
            if not runs_on(self.spec.arch, target):
                raise ValueError(
                    f"{self.spec.name} was built for {self.spec.arch}; this GPU ({q.device}) runs {target} code: "
                    f"build it with `flashgen build --arch {target}`"
                )
            if self.smem_bytes > SMEM_LIMIT[target]:  # (sm_80 tiles on sm_86 / sm_89, which have less)
                raise ValueError(
                    f"{self.spec.name} (or its backward) takes {self.smem_bytes // 1024} KiB of shared memory a block; "
                    f"this GPU ({q.device}, {target}) allows {SMEM_LIMIT[target] // 1024} KiB: build it with "
                    f"`flashgen build --arch {target}`"
                )
        return call(q, k, v, self.spec.causal, scale, return_lse, deterministic, spec=self.spec, **variants)

    def __repr__(self) -> str:
        return f"PrebuiltKernel({self.spec.name}, {self.path})"


def runs_on(arch: str, target: str) -> bool:
    """Whether a cubin for `arch` runs on a GPU whose own target is `target`: the same major
    version and no newer minor one (sm_80 code runs on sm_86); an sm_90a cubin only on sm_90a."""
    if arch.endswith("a") or target.endswith("a"):
        return arch == target
    return arch[:-1] == target[:-1] and arch[-1] <= target[-1]


def _read(meta_path: Path) -> tuple[KernelSpec, bytes, dict]:
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} is missing: the build in {meta_path.parent} is incomplete; run `flashgen build` again")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("flashgen") != __version__:
        built_by = meta.get("flashgen") if isinstance(meta, dict) else None
        raise ValueError(
            f"{meta_path.name} was built by flashgen {built_by}, and this is flashgen {__version__} (a kernel's "
            f"parameters may change between versions): rebuild it with `flashgen build`"
        )
    cubin_path = _cubin_path(meta_path, meta)
    cubin = cubin_path.read_bytes()
    if not cubin_matches(cubin, meta):
        raise ValueError(f"{cubin_path} does not match its checksum: rebuild it")
    return KernelSpec(**meta["spec"]), cubin, meta


def _register(spec: KernelSpec, cubin: bytes) -> None:
    from .kernels import Kernel, register

    register(Kernel(spec, cubin))


def _importable(spec: KernelSpec) -> bool:
    """A forward kernel of attention(): what a build folder's modules and load() hand out."""
    return spec.family.forward and not spec.varlen


def load(path) -> PrebuiltKernel | dict[str, PrebuiltKernel]:
    """Load a build folder written by `flashgen build`: every kernel in it becomes the one the
    runtime runs for its spec (forward, backward, varlen, decode, merge: whatever the build made),
    and its forward kernels of attention() are returned as {name: kernel}. Or load one forward
    kernel (its .json, .cubin or .py path, or the stem) and the backward kernels built with it.
    Needs no compiler; touches no GPU until called."""
    path = Path(path)
    if path.is_dir():
        return _load_folder(path)
    meta_path = path.with_name(path.name.split(".")[0] + ".json")  # kernel names hold no dots
    if not meta_path.exists():
        named = meta_path if path.exists() else path  # (a path that is not there at all: that one)
        raise FileNotFoundError(f"{named} does not exist: flashgen.load takes a build folder, or a kernel's .json, .cubin "
                                f"or .py (or that path without its suffix)")
    spec, cubin, meta = _read(meta_path)
    if spec.varlen:
        raise ValueError(f"{spec.name} is a varlen kernel: attention_varlen runs it once its folder is loaded "
                         f"(flashgen.load(\"{meta_path.parent}\"))")
    if not spec.family.forward:
        raise ValueError(
            f"{spec.name} is a {spec.kind} kernel, not a forward kernel of attention(): load its folder "
            f"(flashgen.load(\"{meta_path.parent}\")), which registers every kernel in it"
        )
    companions = {}
    for name in meta.get("backward", []):
        companion, companion_cubin, _ = _read(meta_path.with_name(name + ".json"))
        _register(companion, companion_cubin)
        companions[name] = companion
    _register(spec, cubin)
    return _prebuilt(spec, meta, meta_path, companions)


def _load_folder(folder: Path) -> dict[str, PrebuiltKernel]:
    metas, damaged = scan(folder)
    if damaged:  # a deployment must not run with a kernel quietly missing
        raise ValueError(f"{folder} holds damaged kernels: " + "; ".join(damaged))
    if not metas:
        raise FileNotFoundError(
            f"{folder} holds no kernels built by `flashgen build` (a <name>.json with its "
            f"<name>.cubin); build some with `flashgen build --d 64 --out {folder}`"
        )
    read = {}
    for meta in metas:  # every kernel checked (version, checksum) before any is registered
        meta_path = Path(meta["path"])
        read[meta_path.stem] = (*_read(meta_path), meta_path)
    for spec, cubin, _, _ in read.values():
        _register(spec, cubin)
    if folder.resolve() not in LOADED_FOLDERS:
        LOADED_FOLDERS.append(folder.resolve())
    by_name = {name: spec for name, (spec, *_) in read.items()}
    return {name: _prebuilt(spec, meta, meta_path, {n: by_name[n] for n in meta.get("backward", []) if n in by_name})
            for name, (spec, _, meta, meta_path) in read.items() if _importable(spec)}


def _prebuilt(spec: KernelSpec, meta: dict, meta_path: Path, companions: dict[str, KernelSpec]) -> PrebuiltKernel:
    smem_bytes = max([spec.smem_bytes, *(companion.smem_bytes for companion in companions.values())])
    return PrebuiltKernel(spec, meta, meta_path, smem_bytes)


LOADED_FOLDERS: list[Path] = []  # the build folders this process loaded: where a missing kernel belongs


def missing_kernel(spec: KernelSpec) -> NoJitError:
    """The error for a kernel that is neither prebuilt nor in the cache under FLASHGEN_NO_JIT: its
    name, and the command that builds it into the folder this process loads."""
    from .workload import RECORD_ENV, command

    folder = str(LOADED_FOLDERS[-1]) if LOADED_FOLDERS else "generated"
    loaded = (f"the folders this process loaded ({', '.join(map(str, LOADED_FOLDERS))}) do not hold it"
              if LOADED_FOLDERS else "no build folder is loaded (flashgen.load)")
    return NoJitError(
        f"kernel {spec.name} is not prebuilt and FLASHGEN_NO_JIT is set; {loaded}. Build it with\n"
        f"    {command(spec, folder)}\n"
        f"and load the folder with flashgen.load({folder!r}) before the first call (to build every kernel an "
        f"application uses, run it once with {RECORD_ENV}=kernels.jsonl, then `flashgen build --from kernels.jsonl`), "
        f"or unset FLASHGEN_NO_JIT"
    )
