"""flashgen.attention rejects what the kernels cannot take, with a message that says what is wrong.

These run on CPU tensors: every check before the device check fires without a GPU.
"""

import math
import re

import pytest
import torch

import flashgen
from flashgen.api import softmax_scale

BF16, FP16 = torch.bfloat16, torch.float16


def t(*shape, dtype=BF16, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def qkv(heads=4, kv_heads=4, d=64, dtype=BF16):
    return t(2, heads, 16, d, dtype=dtype), t(2, kv_heads, 16, d, dtype=dtype), t(2, kv_heads, 16, d, dtype=dtype)


def attention_error(q, k, v, error, match):
    with pytest.raises(error, match=match):
        flashgen.attention(q, k, v)


def test_not_a_tensor():
    _, k, v = qkv()
    attention_error([[1.0]], k, v, TypeError, "q must be a torch.Tensor, got list")


def test_three_dimensional_q():
    q, k, v = qkv()
    attention_error(q[0], k, v, ValueError, r"q must have 4 dimensions .* got shape \(4, 16, 64\)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    attention_error(q, k, v, TypeError, rf"q has dtype {dtype}; flashgen supports torch.float16 and torch.bfloat16")


def test_mixed_dtypes():
    q, _, v = qkv()
    k = t(2, 4, 16, 64, dtype=FP16)
    attention_error(q, k, v, TypeError, r"share one dtype; got q torch.bfloat16, k torch.float16")


def test_batch_mismatch():
    q, k, v = qkv()
    attention_error(q[:1], k, v, ValueError, "same batch size; got q 1, k 2, v 2")


def test_head_dims_disagree():
    q, _, _ = qkv(d=64)
    _, k, v = qkv(d=32)
    attention_error(q, k, v, ValueError, "q and k must have the same head_dim; got q 64, k 32")


def test_v_may_have_a_head_dim_of_its_own_but_a_supported_one():
    q, k, _ = qkv(d=64)
    attention_error(q, k, t(2, 4, 16, 12), ValueError, r"head_dim=12 \(v\) is not supported: it must be a multiple of 8")
    attention_error(q, k, t(2, 4, 16, 128), ValueError, "CUDA")  # 64 / 128 passes every check up to the device's


def test_kv_head_count_mismatch():
    q, k, _ = qkv()
    v = t(2, 2, 16, 64)
    attention_error(q, k, v, ValueError, "k and v must have the same number of heads; got k 4, v 2")


def test_query_heads_not_a_multiple_of_kv_heads():
    q, k, v = qkv(heads=8, kv_heads=3)
    attention_error(q, k, v, ValueError, "q has 8 heads and k, v have 3: .* multiple")


def test_kv_seqlen_mismatch():
    q, k, _ = qkv()
    v = t(2, 4, 15, 64)
    attention_error(q, k, v, ValueError, "same sequence length; got k 16, v 15")


@pytest.mark.parametrize("d", [100, 264])
def test_unsupported_head_dim(d):
    q, k, v = qkv(d=d)
    attention_error(q, k, v, ValueError, rf"head_dim={d} is not supported: it must be a multiple of 8 in \[8, 256\]")


def test_last_dim_not_contiguous():
    q, k, v = qkv()
    q = t(2, 4, 64, 16).transpose(-1, -2)  # shape (2, 4, 16, 64), stride 16 along head_dim
    assert q.shape == k.shape
    attention_error(q, k, v, ValueError, "q's last dimension must be contiguous .* got stride 16")


def test_other_strides_are_accepted_up_to_the_device_check():
    q, k, v = qkv()
    q = t(2, 16, 4, 64).transpose(1, 2)  # (B, T, H, d) layout viewed as (B, H, T, d)
    attention_error(q, k, v, ValueError, "runs on NVIDIA GPUs")


def test_tensors_on_different_devices():
    q, _, _ = qkv()
    k, v = t(2, 4, 16, 64, device="meta"), t(2, 4, 16, 64, device="meta")
    attention_error(q, k, v, ValueError, "q, k, v must be on one device; got q cpu, k meta, v meta")


def test_cpu_tensors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs: q, k, v are on cpu") as caught:
        flashgen.attention(q, k, v, scale=0)  # the input checks run before the scale check
    if not torch.cuda.is_available():
        assert "PyTorch sees no CUDA GPU" in str(caught.value)


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf")])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=re.escape(f"scale={float(scale)}: must be a positive finite number")):
        softmax_scale(scale, 64)


def test_default_and_explicit_scale():
    assert softmax_scale(None, 64) == 0.125
    assert math.isclose(softmax_scale(None, 40), 40**-0.5)
    assert softmax_scale(0.5, 64) == 0.5
    assert softmax_scale(torch.tensor(0.25), 64) == 0.25


def test_alignment_keeps_usable_views_and_copies_the_rest():
    from flashgen.inputs import aligned

    x = torch.randn(2, 3, 10, 64)
    assert aligned(x) is x and aligned(x.transpose(1, 2)).data_ptr() == x.data_ptr()
    wide = torch.randn(2, 3, 10, 72)[..., :64]  # row stride 72: usable as is
    assert aligned(wide) is wide
    odd = torch.randn(2, 3, 10, 68)[..., :64]  # row stride 68: not a multiple of 8 elements
    fixed = aligned(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    shifted = torch.randn(2 * 3 * 10 * 64 + 3)[3:].view(2, 3, 10, 64)  # base not 16-byte aligned
    assert aligned(shifted).data_ptr() % 16 == 0 and torch.equal(aligned(shifted), shifted)
    single = torch.randn(1, 1, 5, 64).as_strided((1, 1, 5, 64), (7, 3, 64, 1))  # size-1 dims: any stride
    assert aligned(single) is single
    broadcast = torch.ones(1, 1, 4, 1).expand(1, 2, 4, 64)  # last-dim stride 0, as a gradient can be
    assert aligned(broadcast).stride(-1) == 1 and torch.equal(aligned(broadcast), broadcast)
