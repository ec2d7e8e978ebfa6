"""flashgen: exact FlashAttention kernels generated from a small DSL, compiled at run time.

    import flashgen
    out = flashgen.attention(q, k, v, causal=True)     # (B, H, T, d) fp16/bf16 CUDA tensors

The pipeline reads in one direction: KernelSpec (spec.py; its kernel family in families/) -> CUDA
source (render.py, templates/) -> cubin (compile.py) -> disk cache (cache.py) -> loaded kernel
(kernels.py, runtime.py) -> launch plan (plans.py) -> torch op (api.py).

Names are imported on first use, so `import flashgen` (and the `flashgen` command) stays cheap:
only what runs kernels imports torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "attention": "api",
    "attention_varlen": "varlen",
    "attention_with_kvcache": "serving",
    "merge_attention_states": "serving",
    "ScoreMod": "modifiers",
    "MaskMod": "modifiers",
    "CacheError": "cache",
    "KernelCache": "cache",
    "CompileError": "compile",
    "NoJitError": "compile",
    "Resources": "compile",
    "PrebuiltKernel": "aot",
    "build": "aot",
    "load": "aot",
    "render": "render",
    "KernelSpec": "spec",
    "SpecError": "spec",
    "SettingError": "settings",
}
_SUBMODULES = (
    "aot", "api", "bench", "blockmask", "cache", "check", "cli", "compile", "families", "kernels", "modifiers", "params",
    "plans", "reference", "render", "runtime", "serving", "settings", "smem", "spec", "tuning", "variants", "varlen",
)

__all__ = sorted(_EXPORTS) + ["reference"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
