"""The two axes every kernel is specialized along, as data: the element types a kernel reads and
writes, and the targets it compiles for with what each one's hardware has. Families, templates
and the runtime read these tables, not literals; a new type or target starts here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementType:
    """A tensor element type of q, k, v and o (accumulation is always fp32)."""

    name: str  # the spec's `dtype` and the kernel name's part
    torch: str  # its torch.dtype's name (looked up when torch is imported)
    ptx: str  # its PTX type (mma, wgmma and cvt operands)
    bytes: int  # storage per element
    storage: str  # the C type a kernel stores it as (its arithmetic is fp32): elem_t
    tensor_map: int  # CU_TENSOR_MAP_DATA_TYPE_* for a TMA descriptor of it
    about: str


ELEMENT_TYPES = {t.name: t for t in (
    ElementType("fp16", "float16", "f16", 2, "unsigned short", 6, "IEEE half precision"),
    ElementType("bf16", "bfloat16", "bf16", 2, "unsigned short", 9, "bfloat16"),
)}


@dataclass(frozen=True)
class Target:
    """A compile target: the largest dynamic shared memory one block may opt in to (CUDA
    programming guide), and the hardware the kernels may use there."""

    arch: str
    smem_per_block: int
    wgmma: bool = False  # warpgroup MMA (sm_90a only)
    tma: bool = False  # the tensor memory accelerator: bulk tensor copies on mbarriers
    setmaxnreg: bool = False  # moving registers between warpgroups
    dependent_launch: bool = False  # programmatic dependent launch (griddepcontrol)
    clusters: bool = False  # thread block clusters and distributed shared memory
    fp8: bool = False  # e4m3 / e5m2 tensor-core operands
    devices: str = ""


TARGETS = {t.arch: t for t in (
    Target("sm_80", 163 * 1024, devices="A100"),
    Target("sm_86", 99 * 1024, devices="A10, RTX 30xx"),
    Target("sm_87", 163 * 1024, devices="Jetson Orin"),
    Target("sm_89", 99 * 1024, fp8=True, devices="L4, L40, RTX 40xx"),
    Target("sm_90", 227 * 1024, tma=True, dependent_launch=True, clusters=True, fp8=True, devices="H100, H200 (portable code)"),
    Target("sm_90a", 227 * 1024, wgmma=True, tma=True, setmaxnreg=True, dependent_launch=True, clusters=True, fp8=True,
           devices="H100, H200"),
)}


CAPABILITIES = {"wgmma": "wgmma", "tma": "TMA", "setmaxnreg": "setmaxnreg", "dependent_launch": "programmatic dependent launch",
                "clusters": "clusters", "fp8": "FP8 tensor cores"}  # Target's flags, as errors say them


def with_(*capabilities: str) -> tuple[str, ...]:
    """The targets that have every one of `capabilities` (Target's flags), in table order."""
    return tuple(arch for arch, target in TARGETS.items() if all(getattr(target, c) for c in capabilities))
