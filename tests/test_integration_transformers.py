"""The transformers hook without a GPU (and without transformers): with the CPU oracle in place of
the kernels, a padded batch comes out as each row's real tokens attended alone, and the variants
flashgen does not have yet are refused by name."""

from types import SimpleNamespace

import pytest
import torch

from flashgen import reference
from flashgen.integrations import transformers as hook
from flashgen.reference import naive_attention


def oracle_attention(q, k, v, *, causal=False, scale=None, return_lse=False, deterministic=False):
    return naive_attention(q, k, v, causal=causal, scale=scale)[0]


@pytest.fixture
def oracle(monkeypatch):
    calls = []

    def varlen(*args, **kwargs):
        calls.append(args[3:7])
        return reference.attention_varlen(*args, **kwargs)

    monkeypatch.setattr(hook, "_kernels", lambda: (oracle_attention, varlen))
    return calls


MODULE = SimpleNamespace(training=False, is_causal=True)


def qkv(batch=2, heads=4, kv_heads=2, length=7, d=16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, h, length, d, generator=gen) for h in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_attends_each_row_s_real_tokens_alone(oracle, side):
    q, k, v = qkv()
    lengths = [7, 4]
    mask = torch.zeros(2, 7, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    if side == "left":
        mask = mask.flip(1)
    out, weights = hook.attention_forward(MODULE, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (2, 7, 4, 16)
    for row in range(2):
        keep = mask[row]
        alone = naive_attention(q[row:row + 1, :, keep], k[row:row + 1, :, keep], v[row:row + 1, :, keep], causal=True, scale=0.25)[0]
        torch.testing.assert_close(out[row, keep], alone[0].transpose(0, 1), atol=1e-6, rtol=0)
        assert torch.equal(out[row, ~keep], torch.zeros_like(out[row, ~keep]))  # padded query rows
    (cu_q, cu_k, max_q, max_k), = oracle
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 7, 11] and (max_q, max_k) == (7, 7)


def test_no_mask_runs_attention_and_packed_sequences_run_varlen_directly(oracle):
    q, k, v = qkv(batch=1)
    out, _ = hook.attention_forward(MODULE, q, k, v, None)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True)[0].transpose(1, 2))
    cu = torch.tensor([0, 3, 7])
    out, _ = hook.attention_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    expected = reference.attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), cu.int(), cu.int(), 4, 4, causal=True)
    torch.testing.assert_close(out[0], expected)


@pytest.mark.parametrize("settings, named", [
    (dict(sliding_window=3), "sliding_window"),
    (dict(softcap=30.0), "softcap"),
    (dict(sliding_window=3, softcap=30.0), "sliding_window and softcap"),
])
def test_variants_flashgen_lacks_are_refused_by_name(oracle, settings, named):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"this model sets {named}, which flashgen's attention does not support yet"):
        hook.attention_forward(MODULE, q, k, v, None, **settings)


def test_settings_that_change_nothing_pass(oracle):
    """A window at least as long as the keys is no window, and softcap 0 or None is none: such a
    model runs, and the kernels get no variant keyword."""
    q, k, v = qkv(batch=1)
    out, _ = hook.attention_forward(MODULE, q, k, v, None, sliding_window=7, softcap=0.0)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True)[0].transpose(1, 2))


def test_variants_reach_kernels_that_take_them(monkeypatch):
    seen = {}

    def attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
        seen.update(window_size=window_size, softcap=softcap)
        return oracle_attention(q, k, v, causal=causal, scale=scale)

    def varlen(*args, window_size=(-1, -1), softcap=0.0, **kwargs):
        return reference.attention_varlen(*args, **kwargs)

    monkeypatch.setattr(hook, "_kernels", lambda: (attention, varlen))
    q, k, v = qkv(batch=1)
    hook.attention_forward(MODULE, q, k, v, None, sliding_window=3, softcap=50.0)
    assert seen == {"window_size": (2, 0), "softcap": 50.0}
