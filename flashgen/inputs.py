"""The rules every public function checks its arguments by, each written once, with one error text.

flashgen.attention, attention_varlen, attention_with_kvcache and merge_attention_states call these
on the slow path, after a one-pass test of the common call has failed (each function keeps that
test: it reads every attribute once, since attribute reads cost more than the kernels' launch
on small calls). Each error names the argument and what is allowed. The oracle
(flashgen.reference) checks its own arguments and never calls these.
"""

from __future__ import annotations

import math

import torch

from .plans import DTYPES, FP8_DTYPES, MAX_GRID_YZ
from .spec import HEAD_DIM_RULE


def listed(names) -> str:
    """Names as an error says them: "k and v", "q, k, v"."""
    names = list(names)
    return " and ".join(names) if len(names) == 2 else ", ".join(names)


def tensor(name: str, t, dims: int | None = None, layout: str = "") -> None:
    """`name` is a tensor, of `dims` dimensions when given (`layout` says which)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions {layout}; got shape {tuple(t.shape)}")


def half_precision(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; flashgen supports torch.float16 and torch.bfloat16 "
                        f"(cast with .to(torch.bfloat16))")


def fp8(named: dict, descales: dict, out_dtype, batch: int, kv_heads: int) -> None:
    """An FP8 call (FlashAttention-3's): the tensors (name: tensor) e4m3, none needing a gradient
    (the FP8 forward has no backward); each descale None or fp32 (batch, kv_heads), the true value
    of a tensor's element being its stored one times the descale of its batch and KV head; the
    output 16-bit."""
    for name, t in named.items():
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; with FP8 inputs, q, k and v are all torch.float8_e4m3fn")
    wanting = [name for name, t in named.items() if t.requires_grad]
    if wanting and torch.is_grad_enabled():
        raise RuntimeError(f"{listed(wanting)} require{'s' if len(wanting) == 1 else ''} grad: FP8 attention is forward-only "
                           "(as FlashAttention-3's); run it under torch.no_grad() or with tensors that need no gradient")
    for name, t in descales.items():
        if t is None:
            continue
        tensor(name, t)
        if t.dtype != torch.float32 or tuple(t.shape) != (batch, kv_heads):
            raise ValueError(f"{name} must be float32 of shape (batch, heads_kv) = ({batch}, {kv_heads}); "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    if out_dtype not in DTYPES:
        raise TypeError(f"out_dtype={out_dtype}: the output of an FP8 forward is torch.bfloat16 or torch.float16")
    q = named["q"]
    if q.shape[-1] % 16:  # (TMA reads rows of whole 16 bytes)
        raise ValueError(f"head_dim={q.shape[-1]} with FP8 inputs: it must be a multiple of 16 up to 256")


def is_float8(t) -> bool:
    """Whether t is a tensor of any float8 dtype (e4m3 or e5m2, fn/fnuz): an FP8 cache's check decides what is allowed."""
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.element_size() == 1


def fp8_cache(q, caches: dict, descales: dict, batch: int, kv_heads: int) -> None:
    """An FP8 KV cache (FlashAttention-3's and FlashInfer's): the caches (name: tensor) both
    torch.float8_e4m3fn, q 16-bit, and both descales fp32 (batch, kv_heads): a cached key is its
    stored value times its sequence's and KV head's descale."""
    half_precision("q", q)
    for name, t in caches.items():
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; an FP8 cache is torch.float8_e4m3fn (k and v both)")
    for name, t in descales.items():
        if t is None:
            raise ValueError(f"{listed(caches)} are FP8: pass {name}, float32 of shape (batch, heads_kv) = ({batch}, "
                             f"{kv_heads}) (a cached value is its stored one times its descale)")
        tensor(name, t)
        if t.dtype != torch.float32 or tuple(t.shape) != (batch, kv_heads):
            raise ValueError(f"{name} must be float32 of shape (batch, heads_kv) = ({batch}, {kv_heads}); "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    if q.shape[-1] % 16:  # (a cache row is whole 16-byte chunks)
        raise ValueError(f"head_dim={q.shape[-1]} with an FP8 cache: it must be a multiple of 16 up to 256")


def no_cache_descales(descales: dict, dtype) -> None:
    """Descales given with a 16-bit cache are refused by name (never ignored)."""
    given = [name for name, t in descales.items() if t is not None]
    if given:
        raise ValueError(f"{listed(given)} {'is' if len(given) == 1 else 'are'} for an FP8 cache (torch.float8_e4m3fn); "
                         f"the cache is {dtype}")


def one_dtype(named: dict) -> None:
    """The tensors (name: tensor) share one dtype."""
    if len({t.dtype for t in named.values()}) > 1:
        raise TypeError(f"{listed(named)} must share one dtype; got "
                        + ", ".join(f"{name} {t.dtype}" for name, t in named.items()))


def head_dim(value: int, where: str = "") -> None:
    """`where`: which dimension it is, where no tensor is named q."""
    if value % 8 or not 8 <= value <= 256:
        raise ValueError(f"head_dim={value}{f' ({where})' if where else ''} is not supported: it must be {HEAD_DIM_RULE}")


def head_dims(q_dim: int, k_dim: int, v_dim: int, v_own: str = "") -> None:
    """q and k share a head dim; v may have one of its own (DeepSeek's 192 / 128, say), which the
    output takes, unless `v_own` names the function that does not take one."""
    same("head_dim", {"q": q_dim, "k": k_dim})
    head_dim(q_dim)
    if v_dim != q_dim:
        if v_own:
            raise ValueError(f"v has head_dim={v_dim} and q {q_dim}: {v_own} takes v with q's head dim")
        head_dim(v_dim, "v")


def same(what: str, named: dict) -> None:
    """The values (name: value) are equal: `what` says which quantity (a shape's dimension)."""
    if len(set(named.values())) > 1:
        raise ValueError(f"{listed(named)} must have the same {what}; got "
                         + ", ".join(f"{name} {value}" for name, value in named.items()))


def query_groups(heads: int, kv_heads: int, kv_names: str = "k, v") -> None:
    """GQA/MQA: the query heads split evenly over the key/value heads."""
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q has {heads} heads and {kv_names} have {kv_heads}: the number of query heads must be a "
            f"multiple of the number of key/value heads (GQA/MQA)"
        )


def last_dim_contiguous(named: dict) -> None:
    for name, t in named.items():
        if t is not None and t.stride(-1) != 1:
            raise ValueError(
                f"{name}'s last dimension must be contiguous (stride 1), got stride {t.stride(-1)}; "
                f"other strides may be anything (call .contiguous() on a transposed head_dim)"
            )


def is_aligned(t: torch.Tensor) -> bool:
    """What the kernels read in place: cp.async and TMA move 16 bytes, so the base and every stride
    that is stepped over are multiples of 16 bytes (8 16-bit elements), and nonzero (a TMA tensor
    map takes no stride 0: an expanded k, or a gradient that arrives expanded), the last dimension
    contiguous."""
    if t.data_ptr() % 16:
        return False
    if t.is_contiguous() and t.element_size() > 1:  # the common case, one cheap test (d % 8 == 0)
        return True
    *lead, last = t.stride()
    step = max(8, 16 // t.element_size())  # (elements: 8, or 16 for FP8)
    return last == 1 and all(n == 1 or (s and not s % step) for n, s in zip(t.shape, lead))  # a size-1 stride is never used


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where the kernels cannot read it in place (is_aligned)."""
    return t if is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def aligned_in_place(named: dict, why: str) -> None:
    """Tensors the kernels use in place (caches: `why` says so), which no copy can stand in for."""
    for name, t in named.items():
        if not is_aligned(t):
            raise ValueError(f"{name} must have 16-byte aligned rows (its address and strides multiples of 16 bytes): "
                             f"{why}; got strides {t.stride()}")


def int32(name: str, t, shape: tuple | None = None, meaning: str = "") -> None:
    """An index tensor: int32, of `shape` when given (`meaning` names its dimensions)."""
    tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}; cast with .to(torch.int32)")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {meaning or shape}; got {tuple(t.shape)}")


def page_size(value: int, where: str) -> None:
    """A paged cache's page: a multiple of 16 tokens from 16 to 256 (whole key tiles of the decode
    kernels, a page found by a multiply and a shift)."""
    from .families.decode import PAGE_SIZES

    if value not in PAGE_SIZES:
        raise ValueError(f"page_size={value} ({where}) is not supported: a paged cache's pages must hold a multiple of 16 "
                         f"tokens from 16 to 256")


def on_one_cuda_device(function: str, named: dict) -> None:
    """Every tensor given (name: tensor or None) is on one device, a CUDA GPU."""
    given = {name: t for name, t in named.items() if t is not None}
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        raise ValueError(f"{listed(given)} must be on one device; got "
                         + ", ".join(f"{name} {t.device}" for name, t in given.items()))
    (device,) = devices
    if device.type != "cuda":
        why = "" if torch.cuda.is_available() else " (and PyTorch sees no CUDA GPU on this machine)"
        raise ValueError(f"flashgen.{function} runs on NVIDIA GPUs: {listed(given)} are on {device}{why}")


def grid(function: str, batch: int, heads: int, batch_name: str = "batches", heads_name: str = "heads") -> None:
    """A launch covers at most MAX_GRID_YZ of each in one grid (functions whose plans do not slice)."""
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"flashgen.{function} takes at most {MAX_GRID_YZ:,} {batch_name} and {MAX_GRID_YZ:,} {heads_name} "
                         f"a call (a grid's z and y); got {batch:,} and {heads:,}: split the call")


def softmax_scale(scale, head_dim: int, name: str = "softmax_scale") -> float:
    """The scale the scores are multiplied by: 1/sqrt(head_dim) by default."""
    if scale is None:
        return head_dim**-0.5
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}={scale}: must be a positive finite number (default 1/sqrt(head_dim))")
    return scale
