"""The block mask of a user mask rule (kind block_mask): one block per (query tile x key tile) counts
the positions the mask and the rule keep, and writes the tile's state (0 none, 1 some, 2 all).
flashgen.blockmask runs it and lists, per row of tiles, the ones an attention kernel visits."""

from __future__ import annotations

from .. import variants
from ..params import Param, Params, scalar
from ..spec import KernelSpec, SpecError
from .base import Family


class BlockMaskStates(Family):
    kinds = ("block_mask",)
    needs_rule = True  # (its spec is a mask rule's source: flashgen.blockmask makes it from a MaskMod)
    template = "block_mask.cu.j2"
    # head_dim: unused (pass 8); the built-in variants that hide keys, beside the rule
    fields = ("block_m", "block_n", "causal", "arch", *(d.name for d in variants.REGISTRY if d.mask and not d.rule), "mask_mod")
    arguments = ("states", "seqlen_q", "seqlen_k", "batches", "heads",
                 *(a for d in variants.REGISTRY if d.mask and not d.rule for a in d.arguments), "mask_mod_tensors")

    def check(self, spec: KernelSpec) -> None:
        if not spec.mask_mod:
            raise SpecError("mask_mod='': a block_mask kernel needs a mask rule")
        for field in ("block_m", "block_n"):
            value = getattr(spec, field)
            if value % 16 or not 16 <= value <= 256:
                raise SpecError(f"{field}={value}: must be a multiple of 16 in [16, 256]")

    def threads(self, spec: KernelSpec) -> int:
        return 128

    def params(self, spec: KernelSpec) -> Params:
        return Params(self.arguments, [
            Param("states", "unsigned char* __restrict__", "ptr", "states.data_ptr()"),  # [batches * heads, M, N]
            scalar("seqlen_q", "int"), scalar("seqlen_k", "int"), scalar("heads", "int"),
            *variants.params(spec),
        ])

    def grid(self, spec: KernelSpec) -> str:
        return f"(-(-seqlen_k // {spec.block_n}), -(-seqlen_q // {spec.block_m}), batches * heads)"
