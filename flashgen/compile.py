"""Compile rendered CUDA to a CUBIN with NVRTC (through CuPy), and read ptxas' resource report.

Always a CUBIN for a real architecture, never PTX: the driver on the machine that runs the kernel
may be older than the NVRTC wheel, and could not JIT newer PTX. Compiling needs no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .settings import SettingError
from .spec import KernelSpec


class NoJitError(RuntimeError):
    """FLASHGEN_NO_JIT is set and a kernel that is not prebuilt was asked for."""


def jit_disabled() -> bool:
    """FLASHGEN_NO_JIT: 1/true/yes/on means no code path may compile (only `flashgen build` and
    `flashgen show --resources` do, which ask for it); unset, empty or 0/false/no/off means kernels
    compile on first use."""
    value = os.environ.get("FLASHGEN_NO_JIT", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"FLASHGEN_NO_JIT={value!r}: must be 1, true, yes or on (never compile), or 0, false, no, off or empty")


def no_jit_error(spec: KernelSpec) -> NoJitError:
    return NoJitError(
        f"kernel {spec.name} is not prebuilt and FLASHGEN_NO_JIT is set: build it with "
        f"`flashgen build` and load it with flashgen.load(), or unset FLASHGEN_NO_JIT"
    )


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

    def __reduce__(self):  # a worker process of a parallel build sends it whole to the parent
        return CompileError, (self.spec_name, self.log, self.options, self.source_path)


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


def _nvrtc_caches() -> bool:
    """NVRTC 12.9 and later keep a compile cache of their own, and a hit there skips ptxas, so the
    log then lacks ptxas' resource report. flashgen's disk cache is the one that counts: NVRTC's is off."""
    major, minor = (int(part) for part in nvrtc_version().split(".")[:2])
    return (major, minor) >= (12, 9)


def compile_options(spec: KernelSpec) -> list[str]:
    options = [f"-arch={spec.arch}", "-std=c++17", "-Xptxas=-v", "-default-device"]
    if _nvrtc_caches():
        options.append("--no-cache")
    if os.environ.get("FLASHGEN_DEBUG"):
        options.append("-lineinfo")  # source lines for ncu, at no cost in speed
    return options


def compile_source(spec: KernelSpec, source: str, source_path: Path | None = None, *,
                   ahead_of_time: bool = False) -> Binary:
    """NVRTC source -> CUBIN for spec.arch. Raises CompileError with the log on failure, and
    NoJitError when FLASHGEN_NO_JIT forbids compiling (unless building ahead of time)."""
    if jit_disabled() and not ahead_of_time:
        raise no_jit_error(spec)
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
        cubin = _cubin(nvrtc, program)
    finally:
        nvrtc.destroyProgram(program)
    return Binary(cubin=cubin, resources=parse_resources(log, spec.name), log=log, options=tuple(options))


def _cubin(nvrtc, program) -> bytes:
    """The program's whole CUBIN. CuPy's getCUBIN drops its last byte (it reads the buffer like a
    C string): the driver still loads such a cubin, but cuobjdump and nvdisasm refuse it. So the
    bytes come from the libnvrtc CuPy has loaded, by its soname."""
    lib = ctypes.CDLL(f"libnvrtc.so.{nvrtc.getVersion()[0]}")
    handle, size = ctypes.c_void_p(program), ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(handle, ctypes.byref(size)):
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buffer = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(handle, buffer):
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buffer.raw


def compile_ptx(spec: KernelSpec, source: str) -> bytes:
    """NVRTC source -> PTX for spec.arch's virtual target (compute_80 for sm_80). Only for running
    one target's code on a newer GPU, whose driver compiles the PTX when it loads it (the GPU tier
    runs the sm_80 kernels on Hopper this way); flashgen itself ships and runs CUBINs only."""
    if jit_disabled():
        raise no_jit_error(spec)
    nvrtc = _nvrtc()
    options = [f"-arch={spec.arch.replace('sm_', 'compute_')}", "-std=c++17", "-default-device"]
    program = nvrtc.createProgram(source, f"{spec.name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise CompileError(spec.name, nvrtc.getProgramLog(program) or str(error), options, None) from None
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return ptx.encode() if isinstance(ptx, str) else ptx


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
