"""User modifiers: a score rule or a mask rule written as a short CUDA expression, with a Python twin
that the oracle runs (FlexAttention's score_mod / mask_mod, compiled into flashgen's kernels).

    bias = torch.randn(heads, 2 * 1024 - 1, device="cuda")        # a T5-style relative bias
    rel = flashgen.ScoreMod(
        "score + bias[h * 2047 + (q_idx - kv_idx + 1023)]",          # CUDA: score, b, h, q_idx, kv_idx
        lambda score, b, h, q_idx, kv_idx: score + bias[h, q_idx - kv_idx + 1023],
        grad="1.f",                                                  # d(new score) / d(score)
        tensors={"bias": bias})
    out = flashgen.attention(q, k, v, causal=True, score_mod=rel)

The expression sees the scaled score (after softcap and ALiBi when those are on), the batch and
query-head indices b, h, and the positions q_idx, kv_idx (ints); tensors are read by name as flat,
contiguous arrays of their dtype. A mask rule returns true to keep a key. Indices passed to a rule
are always inside the sequences, so a rule may index its tensors by them.

The expression, its gradient and the tensors' names and dtypes are the modifier's `source`: part of
the kernel's spec, so of its name and cache key. The tensors themselves are kernel arguments (new
values, same kernel). Gradients: the backward multiplies dS by `grad`; no gradient flows into a
modifier's tensors (a learnable bias needs its own backward: the kernels never form dS in memory).
"""

from __future__ import annotations

import hashlib
import json
import keyword
import re
from typing import Callable

# dtype name -> C type of a modifier's tensor
CTYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "bool": "bool", "uint8": "unsigned char",
          "int8": "signed char", "int16": "short"}
INDICES = ("score", "b", "h", "q_idx", "kv_idx")
# the rule's own arguments, and names the rule's struct or the kernel around it holds
RESERVED = {*INDICES, "grad", "DEVICE", "NEG_INF", "POS_INF", "mod"}
# C++ keywords and type names a tensor cannot be named (Python's keywords are refused too)
CPP_WORDS = {
    "auto", "bool", "break", "case", "char", "const", "constexpr", "continue", "default", "delete", "do", "double", "else",
    "enum", "extern", "float", "for", "goto", "if", "inline", "int", "long", "new", "operator", "private", "public",
    "register", "restrict", "return", "short", "signed", "sizeof", "static", "struct", "switch", "template", "this",
    "typedef", "typename", "union", "unsigned", "using", "virtual", "void", "volatile", "while", "true", "false",
    "nullptr", "half", "i64", "u32", "u64", "elem_t",
}
# what would make the text more than one expression: statements, blocks, comments, and
# preprocessor lines (a newline, '#', a line continuation, or a digraph)
FORBIDDEN = (";", "{", "}", "//", "/*", "\n", "\r", "#", "\\", "<%", "%>", "<:", ":>", "%:")


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def check_expression(kind: str, cuda) -> None:
    """One CUDA expression on one line: no statement, block, comment or preprocessor line."""
    if not isinstance(cuda, str) or not cuda.strip():
        raise ValueError(f"{kind}: the CUDA expression must be a non-empty string, got {cuda!r}")
    found = [token for token in FORBIDDEN if token in cuda]
    if found:
        raise ValueError(f"{kind}: {cuda!r} must be one expression on one line (it holds {found[0]!r}: no ';', braces, "
                         f"comments, newlines, '#', backslashes or digraphs)")


def check_name(kind: str, name) -> None:
    """A tensor's name: an identifier that names nothing else in the kernel."""
    if (not (isinstance(name, str) and name.isidentifier() and name.isascii()) or keyword.iskeyword(name) or name in RESERVED
            or name in CPP_WORDS or name.startswith("_")):
        raise ValueError(
            f"{kind}: tensor name {name!r} must be an ASCII identifier, not starting with '_', other than a C++ or "
            f"Python keyword or one of {', '.join(sorted(RESERVED))}"
        )


def _check(kind: str, cuda, tensors) -> None:
    check_expression(kind, cuda)
    import torch

    for name, tensor in tensors.items():
        check_name(kind, name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{kind}: tensors[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if _dtype_name(tensor) not in CTYPES:
            raise TypeError(f"{kind}: tensors[{name!r}] has dtype {tensor.dtype}; allowed: {', '.join(CTYPES)}")


class _Modifier:
    kind = ""

    def __init__(self, cuda: str, python: Callable, tensors: dict | None):
        self.tensors = dict(tensors or {})
        self._copies: dict = {}  # name -> ((address, version), contiguous copy) of a non-contiguous tensor
        _check(self.kind, cuda, self.tensors)
        self.cuda, self.python = cuda, python

    @property
    def declarations(self) -> list[tuple[str, str]]:
        """(name, C type) of each tensor, in order."""
        return [(name, CTYPES[_dtype_name(t)]) for name, t in self.tensors.items()]

    def _source(self, **more) -> str:
        return json.dumps({"cuda": self.cuda, **more, "tensors": self.declarations}, sort_keys=True, separators=(",", ":"))

    def arguments(self) -> list:
        """The tensors as the kernel takes them: contiguous, in declaration order. A non-contiguous
        tensor's copy is reused while the tensor is unchanged, so that block masks kept by the
        tensors' identity (flashgen.blockmask) match from call to call."""
        import torch

        out = []
        for name, t in self.tensors.items():
            if t.is_contiguous() or t.is_inference() or torch.compiler.is_compiling():
                out.append(t.contiguous())
                continue
            stamp = (t.data_ptr(), t._version)
            kept = self._copies.get(name)
            if kept is None or kept[0] != stamp:
                kept = self._copies[name] = (stamp, t.contiguous())
            out.append(kept[1])
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cuda!r}, tensors={list(self.tensors)})"


class ScoreMod(_Modifier):
    """score_mod(score, b, h, q_idx, kv_idx) -> new score, as a CUDA expression `cuda` (float) with its
    Python twin `python` (FlexAttention's signature: tensors that broadcast) and `grad`, the CUDA
    expression of d(new score) / d(score) that the backward needs ("" = forward only)."""

    kind = "score_mod"

    def __init__(self, cuda: str, python: Callable, grad: str = "", tensors: dict | None = None):
        super().__init__(cuda, python, tensors)
        if grad:
            _check("score_mod grad", grad, {})
        self.grad = grad
        self.source = self._source(grad=grad)  # made once: torch.compile reads it as a constant


class MaskMod(_Modifier):
    """mask_mod(b, h, q_idx, kv_idx) -> keep, as a CUDA expression `cuda` (true keeps the key) with its
    Python twin `python`. per_batch / per_head=False say the rule ignores b / h: the block mask
    (which tiles hold a visible key) is then computed once for all batches / heads."""

    kind = "mask_mod"

    def __init__(self, cuda: str, python: Callable, tensors: dict | None = None, per_batch: bool = True,
                 per_head: bool = True):
        super().__init__(cuda, python, tensors)
        self.per_batch, self.per_head = bool(per_batch), bool(per_head)
        for flag, index in (("per_batch", "b"), ("per_head", "h")):
            if not getattr(self, flag) and re.search(rf"\b{index}\b", cuda):
                raise ValueError(f"mask_mod: {cuda!r} reads {index} while {flag}=False says it ignores it (its block mask "
                                 f"would come from {index} = 0 alone)")
        self.source = self._source(per_batch=self.per_batch, per_head=self.per_head)


class Rule:
    """A mask rule rebuilt from what the ops carry (its source and tensors): what BlockMasks reads."""

    def __init__(self, source: str, tensors: list):
        parsed = parse(source)
        self.source, self.per_batch, self.per_head = source, parsed["per_batch"], parsed["per_head"]
        self.tensors = dict(zip((name for name, _ in parsed["tensors"]), tensors))

    def arguments(self) -> list:
        return list(self.tensors.values())


def parse(source: str) -> dict:
    """A modifier's source (spec field text) back as a dict: cuda, tensors, and grad or per_batch/per_head."""
    return json.loads(source)


def validate(kind: str, source: str) -> None:
    """A source as ScoreMod/MaskMod make it, whoever wrote it: its keys, one-line expressions,
    tensor names and C types (what spec.check_modifier runs on every spec)."""
    parsed = parse(source)
    keys = {"cuda", "tensors", *(("grad",) if kind == "score_mod" else ("per_batch", "per_head"))}
    if not isinstance(parsed, dict) or set(parsed) != keys:
        raise ValueError(f"{kind}: a source holds exactly the keys {sorted(keys)}")
    check_expression(kind, parsed["cuda"])
    if kind == "score_mod" and parsed["grad"]:
        check_expression("score_mod grad", parsed["grad"])
    if kind == "mask_mod" and not all(isinstance(parsed[flag], bool) for flag in ("per_batch", "per_head")):
        raise ValueError("mask_mod: per_batch and per_head must be true or false")
    if not isinstance(parsed["tensors"], list):
        raise ValueError(f"{kind}: tensors must be a list of [name, C type] pairs")
    for pair in parsed["tensors"]:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"{kind}: tensors must be a list of [name, C type] pairs, got {pair!r}")
        check_name(kind, pair[0])
        if pair[1] not in CTYPES.values():
            raise ValueError(f"{kind}: tensor {pair[0]!r} has C type {pair[1]!r}; allowed: {', '.join(CTYPES.values())}")


def tag(source: str) -> str:
    """A short, stable name part for a modifier's source."""
    return hashlib.sha256(source.encode()).hexdigest()[:8]


def struct(kind: str, source: str) -> str:
    """The CUDA struct of a modifier: its tensors as members, the rule (and for a score rule its
    gradient) as member functions over score, b, h, q_idx, kv_idx."""
    spec = parse(source)
    name = {"score_mod": "ScoreMod", "mask_mod": "MaskMod"}[kind]
    members = "".join(f"    const {ctype}* __restrict__ {tensor};\n" for tensor, ctype in spec["tensors"])
    if kind == "score_mod":
        body = (f"    DEVICE float operator()(float score, int b, int h, int q_idx, int kv_idx) const {{ return ({spec['cuda']}); }}\n")
        if spec["grad"]:
            body += (f"    DEVICE float grad(float score, int b, int h, int q_idx, int kv_idx) const {{ return ({spec['grad']}); }}\n")
    else:
        body = f"    DEVICE bool operator()(int b, int h, int q_idx, int kv_idx) const {{ return ({spec['cuda']}); }}\n"
    return f"struct {name} {{\n{members}{body}}};"


def kernel_tensors(kind: str, source: str) -> list[tuple[str, str]]:
    """(kernel parameter name, C type) of a modifier's tensors: prefixed by the rule, so they never meet
    the kernel's own names."""
    prefix = {"score_mod": "smod_", "mask_mod": "mmod_"}[kind]
    return [(prefix + tensor, ctype) for tensor, ctype in parse(source)["tensors"]]

