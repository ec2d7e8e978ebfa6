"""V with a head dim of its own (KernelSpec.head_dim_v; d_v != d, DeepSeek's 192 / 128): the spec,
the tables' picks, the kernels they pick (rendered and compiled here: no spills, V's width where V
is read and the output written), and the inputs and the oracle that take it."""

import re

import pytest
import torch

import flashgen
from flashgen import reference, tuning
from flashgen.compile import compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError


def test_the_spec_names_v_s_head_dim_and_keeps_one_kernel_per_shape():
    spec = KernelSpec(head_dim=192, head_dim_v=128, kind="fwd", arch="sm_80", block_m=64, block_n=32)
    assert spec.name.startswith("fwd_d192_v128_") and spec.d_v == 128
    same = KernelSpec(head_dim=128, head_dim_v=128, kind="fwd", arch="sm_80", block_m=64, block_n=32)
    assert same.head_dim_v == 0 and same == KernelSpec(head_dim=128, kind="fwd", arch="sm_80", block_m=64, block_n=32)
    with pytest.raises(SpecError, match=r"head_dim_v=100: must be a multiple of 8"):
        KernelSpec(head_dim=128, head_dim_v=100)
    with pytest.raises(SpecError, match="a decode kernel does not use head_dim_v"):
        tuning.decode_spec(128, "bf16", "sm_90a", False, 1).replace(head_dim_v=64)


def test_the_tables_pick_kernels_with_v_s_head_dim_for_every_path():
    picks = [
        tuning.forward_spec(192, "bf16", True, "sm_90a", 4096, head_dim_v=128),
        tuning.forward_spec(192, "bf16", True, "sm_90a", 64, head_dim_v=128),
        tuning.forward_spec(64, "fp16", False, "sm_80", 4096, varlen=True, head_dim_v=128),
        *tuning.backward_specs(192, "bf16", True, "sm_80", False, head_dim_v=128),
        *tuning.backward_specs(192, "bf16", True, "sm_80", True, head_dim_v=128),
        *tuning.backward_specs(128, "bf16", False, "sm_80", False, head_dim_v=64),
    ]
    assert [s.kind for s in picks[:3]] == ["fwd_sm90", "fwd", "fwd"]
    assert all(s.d_v != s.head_dim for s in picks)
    assert {s.kind for s in picks[3:]} >= {"bwd_v", "bwd_kq", "bwd_k", "bwd_q", "bwd_kvq"}


@pytest.mark.parametrize("spec", [
    KernelSpec(head_dim=192, head_dim_v=128, kind="fwd_sm90", block_m=128, block_n=128, causal=True),
    KernelSpec(head_dim=64, head_dim_v=128, kind="fwd_sm90", block_m=128, block_n=128, persistent=True),
    KernelSpec(head_dim=192, head_dim_v=128, kind="fwd", arch="sm_80", block_m=64, block_n=32, varlen=True),
    KernelSpec(head_dim=128, head_dim_v=64, kind="bwd_kvq", arch="sm_80", block_m=64, block_n=64, causal=True),
    KernelSpec(head_dim=64, head_dim_v=128, kind="bwd_kv", arch="sm_90a", block_m=64, block_n=64),  # wgmma products
], ids=lambda spec: spec.name)
def test_kernels_with_v_s_head_dim_compile_without_spills(spec):
    binary = compile_source(spec, render(spec))
    assert binary.resources.spill_stores == binary.resources.spill_loads == 0, binary.resources


def test_the_hopper_forward_multiplies_p_by_v_at_v_s_width():
    spec = KernelSpec(head_dim=192, head_dim_v=128, kind="fwd_sm90", block_m=128, block_n=112)
    source = render(spec)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", source))
    assert shapes == {"112", "128"}  # S = Q K^T over 112 keys (k-steps over d = 192), O += P V at d_v = 128
    assert "constexpr int MMA_K = 16;" in source and "constexpr int HEAD_DIM_PAD = 192;" in source  # 12 k-steps over d


def test_the_oracle_and_the_inputs_take_v_s_head_dim():
    q, k = torch.randn(1, 4, 9, 48), torch.randn(1, 2, 11, 48)
    v = torch.randn(1, 2, 11, 16)
    out = reference.naive_attention(q, k, v, causal=True)
    assert out.shape == (1, 4, 9, 16)
    expanded = reference.naive_attention(q, k, torch.nn.functional.pad(v, [0, 32]), causal=True)  # zeros past d_v
    torch.testing.assert_close(out, expanded[..., :16])
    with pytest.raises(ValueError, match="q and k must have the same head_dim"):
        reference.naive_attention(q, k[..., :32], v)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="v has head_dim=16 and q 48: attention_varlen with a block_table takes v with q's"):
        flashgen.attention_varlen(q[0].transpose(0, 1).to(torch.bfloat16), torch.zeros(2, 16, 2, 48, dtype=torch.bfloat16),
                                  torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16), cu, cu, 9, 9,
                                  block_table=torch.zeros(1, 2, dtype=torch.int32))
