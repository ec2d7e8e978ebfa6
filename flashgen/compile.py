"""Compile rendered CUDA to a CUBIN with NVRTC (through CuPy), and read ptxas' resource report.

Always a CUBIN for a real architecture, never PTX: the driver on the machine that runs the kernel
may be older than the NVRTC wheel, and could not JIT newer PTX. Compiling needs no GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .spec import KernelSpec


class CompileError(RuntimeError):
    """NVRTC rejected a rendered kernel. Carries everything needed to reproduce it."""

    def __init__(self, spec_name: str, log: str, options: list[str], source_path: Path | None):
        self.spec_name = spec_name
        self.log = log
        self.options = list(options)
        self.source_path = source_path
        where = f" (source saved at {source_path})" if source_path else ""
        super().__init__(
            f"NVRTC failed to compile {spec_name}{where}\n"
            f"options: {' '.join(self.options)}\n{log.strip()}"
        )


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for the kernel: per-thread registers, static shared memory, spills."""

    registers: int
    static_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    resources: Resources
    log: str
    options: tuple[str, ...]


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except ImportError as error:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "flashgen compiles kernels with CuPy's NVRTC: pip install cupy-cuda13x nvidia-cuda-nvrtc"
        ) from error
    return nvrtc


@functools.cache
def nvrtc_version() -> str:
    """The NVRTC release kernels are compiled with. From the pip wheel's metadata when the wheel
    is installed (CuPy loads that library first): loading libnvrtc just to ask would cost a warm
    start from the cache more than everything else it does."""
    try:
        return importlib.metadata.version("nvidia-cuda-nvrtc")
    except importlib.metadata.PackageNotFoundError:
        major, minor = _nvrtc().getVersion()
        return f"{major}.{minor}"


def compile_options(spec: KernelSpec) -> list[str]:
    options = [f"-arch={spec.arch}", "-std=c++17", "-Xptxas=-v", "-default-device"]
    if os.environ.get("FLASHGEN_DEBUG"):
        options.append("-lineinfo")  # source lines for ncu, at no cost in speed
    return options


def compile_source(spec: KernelSpec, source: str, source_path: Path | None = None) -> Binary:
    """NVRTC source -> CUBIN for spec.arch. Raises CompileError with the log on failure."""
    nvrtc = _nvrtc()
    options = compile_options(spec)
    filename = str(source_path) if source_path else f"{spec.name}.cu"
    program = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program) or str(error)
            raise CompileError(spec.name, log, options, source_path) from None
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    return Binary(cubin=cubin, resources=parse_resources(log, spec.name), log=log, options=tuple(options))


def parse_resources(log: str, function: str | None = None) -> Resources:
    """Read `ptxas -v` output (the NVRTC log when compiled with -Xptxas=-v) for one entry function
    (the first one reported when `function` is None)."""
    sections = re.split(r"Compiling entry function '", log)[1:]
    if function is not None:
        sections = [s for s in sections if s.startswith(function + "'")]
    if not sections or not re.search(r"Used \d+ registers", sections[0]):
        raise ValueError(f"no ptxas resource report for {function or 'any function'} in the NVRTC log")
    section = sections[0]

    def number(pattern: str) -> int:
        match = re.search(pattern, section)
        return int(match.group(1)) if match else 0

    return Resources(
        registers=number(r"Used (\d+) registers"),
        static_smem=number(r"(\d+) bytes smem"),
        stack_frame=number(r"(\d+) bytes stack frame"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
    )
