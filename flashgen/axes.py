"""The two axes every kernel is specialized along, as data: the element types a kernel reads and
writes, and the targets it compiles for with what each one's hardware has. Families, templates
and the runtime read these tables, not literals; a new type or target starts here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementType:
    """A tensor element type of q, k, v (and o, for the 16-bit ones; accumulation is always fp32)."""

    name: str  # the spec's `dtype` and the kernel name's part
    torch: str  # its torch.dtype's name (looked up when torch is imported)
    ptx: str  # its PTX type (mma, wgmma and cvt operands)
    bytes: int  # storage per element
    storage: str  # the C type a kernel stores it as (its arithmetic is fp32): elem_t
    tensor_map: int  # CU_TENSOR_MAP_DATA_TYPE_* for a TMA descriptor of it
    about: str
    output: bool = True  # kernels write it (FP8 inputs give a 16-bit output: the spec's out_dtype)
    max: float = 0.0  # the largest finite value, for types stored with a scale (0: not scaled)

    @property
    def mma_k(self) -> int:
        """The k of one tensor-core step: 32 bytes of each operand row."""
        return 32 // self.bytes

    @property
    def chunk_cols(self) -> int:
        """Elements in one 128-byte row of a swizzled tile (one TMA box's width)."""
        return 128 // self.bytes


ELEMENT_TYPES = {t.name: t for t in (
    ElementType("fp16", "float16", "f16", 2, "unsigned short", 6, "IEEE half precision"),
    ElementType("bf16", "bfloat16", "bf16", 2, "unsigned short", 9, "bfloat16"),
    # FP8 (OCP e4m3, no infinities): q, k, v with a descale each; the forward's output is 16-bit
    ElementType("e4m3", "float8_e4m3fn", "e4m3", 1, "unsigned char", 0, "FP8 e4m3 (4 exponent, 3 mantissa bits)",
                output=False, max=448.0),
)}
OUTPUT_TYPES = tuple(name for name, t in ELEMENT_TYPES.items() if t.output)


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
