"""The element types and targets are data (flashgen.axes): the spec's choices, the families'
targets, the templates' types and the runtime's tensor maps all read the two tables."""

import pytest
import torch

from flashgen import axes, plans, runtime, spec, tuning
from flashgen.families import family
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError


def test_the_spec_takes_the_tables_types_and_targets():
    assert spec.DTYPES == tuple(axes.ELEMENT_TYPES) and spec.ARCHS == tuple(axes.TARGETS)
    assert spec.SMEM_LIMIT == {arch: target.smem_per_block for arch, target in axes.TARGETS.items()}
    assert plans.DTYPES == {torch.float16: "fp16", torch.bfloat16: "bf16"}
    for element in axes.ELEMENT_TYPES.values():
        assert runtime._TENSOR_MAP_DTYPES[getattr(torch, element.torch)] == element.tensor_map


def test_a_family_builds_for_the_targets_with_what_it_needs():
    assert family("fwd_sm90").archs == family("bwd_sm90_kvq").archs == axes.with_("tma", "wgmma", "setmaxnreg") == ("sm_90a",)
    assert family("fwd").archs == spec.ARCHS
    with pytest.raises(SpecError, match=r"arch='sm_90': a fwd_sm90 kernel needs sm_90a \(TMA, wgmma, setmaxnreg\)"):
        KernelSpec(head_dim=64, kind="fwd_sm90", block_m=128, block_n=128, arch="sm_90")
    assert tuning.forward_spec(64, "bf16", False, "sm_90", 4096).kind == "fwd"  # (the tables pick what builds there)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_the_decode_kernel_is_a_dependent_launch_where_the_target_has_one(arch):
    decode = tuning.decode_spec(64, "bf16", arch, False, 1)
    assert decode.family.dependent_launch(decode) == axes.TARGETS[arch].dependent_launch
    assert ("griddepcontrol.wait" in render(decode)) == axes.TARGETS[arch].dependent_launch


@pytest.mark.parametrize("dtype", axes.OUTPUT_TYPES)
def test_a_kernel_stores_and_multiplies_its_element_type_as_the_table_says(dtype):
    element = axes.ELEMENT_TYPES[dtype]
    source = render(KernelSpec(head_dim=64, dtype=dtype, arch="sm_80"))
    assert f"typedef {element.storage} elem_t;" in source
    assert f".f32.{element.ptx}.{element.ptx}.f32" in source  # mma.sync's operand types
