"""A kernel's parameter list: one ordered description from which both the CUDA signature and the
host-side packing are generated, so that the two cannot drift apart.

Each parameter has a C type and a Python expression for its host value, written in terms of the
launch's named arguments (`q`, `k`, `scale`, ...). `Params.packer()` turns the list into one small
Python function that takes the arguments from a mapping of the call's values, packs every value at
its C offset (natural alignment; a `CUtensorMap` is 128 bytes at a 64-byte boundary) and returns
the grid size, so a call costs one `itemgetter` and one `pack_into`:

    params = Params(["q", "scale"], [*tensor("q"), scalar("scale_log2", "float", "scale * LOG2E")])
    params.signature()   # const elem_t* __restrict__ q, i64 q_batch, ..., float scale_log2
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from operator import itemgetter

LOG2E = 1.4426950408889634
# Bytes of kernel parameters a launch may pass (CUDA's long-standing limit; 32 KiB only on 12.1+).
MAX_BYTES = 4096

# kind -> (struct code, bytes, alignment)
KINDS = {
    "ptr": ("Q", 8, 8),
    "i64": ("q", 8, 8),
    "int": ("i", 4, 4),
    "float": ("f", 4, 4),
    "tensormap": ("128s", 128, 64),
}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C declaration and where its host value comes from."""

    name: str
    ctype: str  # C type as declared, e.g. "const elem_t* __restrict__", "int"
    kind: str  # one of KINDS: how the value is packed
    value: str  # Python expression for the host value, over the launch's arguments
    group: str = ""  # parameters of one group (a tensor and its strides) share a line

    @property
    def declaration(self) -> str:
        return f"{self.ctype} {self.name}"


def tensor(name: str, const: bool = True, elem: str = "elem_t", dims: tuple[str, ...] = ("batch", "head", "row"),
           value: str | None = None) -> list[Param]:
    """A tensor argument: its data pointer, then the strides (in elements) of its leading `dims`.
    The tensor is the argument `name`, or `value` (an argument's name or an expression over them)."""
    qualifier = "const " if const else ""
    value = value or name
    stride = (lambda i: f"{value}_stride[{i}]") if value.isidentifier() else (lambda i: f"{value}.stride({i})")
    params = [Param(name, f"{qualifier}{elem}* __restrict__", "ptr", f"{value}.data_ptr()", name)]
    params += [Param(f"{name}_{dim}", "i64", "i64", stride(i), name) for i, dim in enumerate(dims)]
    return params


def strides(name: str, of: str, dims: tuple[str, ...] = ("batch", "head", "row")) -> list[Param]:
    """Strides (in elements) named `name`_<dim>, taken from tensor `of`: for tensors that share a
    layout and pass it once."""
    return [Param(f"{name}_{dim}", "i64", "i64", f"{of}_stride[{i}]", name) for i, dim in enumerate(dims)]


def pointer(name: str, ctype: str, optional: bool = False) -> Param:
    """A bare data pointer; an optional one is null when its argument is None."""
    value = f"0 if {name} is None else {name}.data_ptr()" if optional else f"{name}.data_ptr()"
    return Param(name, f"{ctype} __restrict__", "ptr", value)


def scalar(name: str, ctype: str, value: str | None = None) -> Param:
    """An int, i64 or float parameter; its value is the argument of the same name unless given."""
    return Param(name, ctype, ctype, value or name)


def tensormap(name: str, value: str) -> Param:
    """A TMA descriptor, passed by value: the kernel reads it from the parameter space."""
    return Param(name, "const __grid_constant__ CUtensorMap", "tensormap", value)


class Params:
    """An ordered parameter list and the launch arguments its values are computed from."""

    def __init__(self, arguments: list[str], params: list[Param]):
        self.arguments = list(arguments)
        self.params = list(params)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate kernel parameter names: {names}")
        fmt, offset, self.offsets = "=", 0, []
        for param in self.params:
            code, size, align = KINDS[param.kind]
            pad = -offset % align
            fmt += f"{pad}x{code}" if pad else code
            self.offsets.append(offset + pad)
            offset += pad + size
        self.struct = struct.Struct(fmt)
        if self.struct.size > MAX_BYTES:
            raise ValueError(f"{self.struct.size} bytes of kernel parameters: more than {MAX_BYTES}")

    def signature(self, indent: str = "    ") -> str:
        """The CUDA parameter list: a tensor's pointer and strides on one line, and consecutive
        scalars of one type."""
        lines, key = [], None
        for param in self.params:
            group = param.group or param.ctype
            if lines and group == key:
                lines[-1] += ", " + param.declaration
            else:
                lines.append(param.declaration)
            key = group
        return ",\n".join(indent + line for line in lines)

    def used(self, grid: str) -> list[str]:
        """The arguments the values and the grid read (a family may declare more than one of its
        kernels needs)."""
        text = " ".join([p.value for p in self.params] + [grid])
        return [a for a in self.arguments if re.search(rf"\b{a}\b", text)]

    def packer_source(self, grid: str) -> str:
        """Python source of `pack(buffer, values) -> (x, y, z)`: takes the arguments it reads from
        `values` (a mapping that may hold more), packs every value into `buffer` in signature order
        and returns the grid (`grid`, an expression)."""
        tensors = sorted({p.value.split("_stride[")[0] for p in self.params if "_stride[" in p.value})
        used = self.used(grid)
        lines = ["def pack(buffer, values):"]
        if used:  # take = itemgetter(*used): one call for every argument (one name: the bare value)
            lines.append(f"    {', '.join(used)} = take(values)")
        lines += [f"    {t}_stride = {t}.stride()" for t in tensors]
        lines.append("    pack_into(buffer, 0,")
        lines += [f"        {p.value},  # {p.name}" for p in self.params]
        lines.append("    )")
        lines.append(f"    return {grid}")
        return "\n".join(lines) + "\n"

    def packer(self, grid: str, helpers: dict | None = None):
        """The function packer_source describes, compiled; its `arguments` are the names it takes.
        `helpers` are functions the value expressions call."""
        used = self.used(grid)
        take = itemgetter(*used) if used else None
        namespace = {"pack_into": self.struct.pack_into, "take": take, "LOG2E": LOG2E, **(helpers or {})}
        exec(compile(self.packer_source(grid), "<flashgen packer>", "exec"), namespace)  # noqa: S102
        pack = namespace["pack"]
        pack.arguments = tuple(used)
        return pack
