"""Kernel families: each owns its specs' validation, template, shared-memory layout, parameter
list and launch geometry (see base.Family). Adding a family is adding a module here, its template,
and its entry in FAMILIES."""

from __future__ import annotations

from .backward import STATS_PAD, BackwardPrep, KeyMajorBackward, QueryMajorBackward, padded
from .base import Family
from .blockmask import BlockMaskStates
from .decode import DecodeAttention, KvAppend, MergeStates, MergeStatesFp32
from .forward import MmaForward
from .hopper import Fp8Values, HopperForward
from .hopper_backward import HopperBackward, HopperDqReader

FAMILIES: tuple[Family, ...] = (
    MmaForward(), HopperForward(), KeyMajorBackward(), QueryMajorBackward(), BackwardPrep(), HopperBackward(), HopperDqReader(),
    DecodeAttention(), KvAppend(), MergeStates(), MergeStatesFp32(), BlockMaskStates(), Fp8Values(),
)
BY_KIND: dict[str, Family] = {kind: family for family in FAMILIES for kind in family.kinds}
KINDS = tuple(BY_KIND)


def family(kind: str) -> Family:
    return BY_KIND[kind]


__all__ = ["BY_KIND", "FAMILIES", "KINDS", "STATS_PAD", "Family", "family", "padded"]
