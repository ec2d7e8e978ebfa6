"""flashgen: exact FlashAttention kernels generated from a small DSL, compiled at run time.

    import flashgen
    out = flashgen.attention(q, k, v, causal=True)     # (B, H, T, d) fp16/bf16 CUDA tensors

The pipeline reads in one direction: KernelSpec (spec.py) -> CUDA source (render.py, templates/)
-> cubin (compile.py) -> disk cache (cache.py) -> loaded kernel (runtime.py) -> torch op (api.py).
"""

__version__ = "0.1.0"

from .aot import PrebuiltKernel, build, load  # noqa: E402
from .api import NoJitError, attention  # noqa: E402
from .cache import CacheError, KernelCache  # noqa: E402
from .compile import CompileError, Resources  # noqa: E402
from .render import render  # noqa: E402
from .spec import KernelSpec, SpecError  # noqa: E402

__all__ = [
    "CacheError",
    "CompileError",
    "KernelCache",
    "KernelSpec",
    "NoJitError",
    "PrebuiltKernel",
    "Resources",
    "SpecError",
    "attention",
    "build",
    "load",
    "render",
]
