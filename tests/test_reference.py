"""The oracle: naive and tiled attention agree, and the tiled walk records the kernel's algorithm."""

import math

import pytest
import torch

from flashgen.reference import naive_attention, tile_schedule, tiled_attention

# The three-token example: all scores 0, so causal row i averages the first i + 1 values.
Q3 = K3 = torch.zeros(1, 1, 3, 2)
V3 = torch.tensor([[10.0, 0.0], [0.0, 20.0], [30.0, 30.0]]).view(1, 1, 3, 2)
O3 = torch.tensor([[10.0, 0.0], [5.0, 10.0], [40 / 3, 50 / 3]])


def test_three_tokens_naive():
    o, lse = naive_attention(Q3, K3, V3, causal=True)
    torch.testing.assert_close(o[0, 0], O3, atol=1e-3, rtol=0)
    torch.testing.assert_close(lse[0, 0], torch.log(torch.tensor([1.0, 2.0, 3.0])))


@pytest.mark.parametrize("block_m, block_n", [(1, 1), (2, 2), (3, 3), (1, 2)])
def test_three_tokens_tiled(block_m, block_n):
    o, lse = tiled_attention(Q3, K3, V3, causal=True, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(o[0, 0], O3, atol=1e-3, rtol=0)
    torch.testing.assert_close(lse[0, 0], torch.log(torch.tensor([1.0, 2.0, 3.0])))


SHAPES = [
    # batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, block_m, block_n
    (2, 3, 3, 37, 37, 16, 16, 16),
    (1, 2, 2, 20, 53, 8, 7, 13),  # Tq < Tk
    (1, 2, 2, 53, 20, 32, 16, 7),  # Tq > Tk
    (1, 8, 2, 33, 45, 16, 64, 64),  # GQA, one tile holds everything
    (2, 4, 1, 17, 29, 24, 5, 9),  # MQA
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_matches_naive(shape, causal):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, block_m, block_n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=gen)
    o, lse = tiled_attention(q, k, v, causal=causal, scale=0.3, block_m=block_m, block_n=block_n)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, scale=0.3)
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_gqa_uses_the_right_kv_head():
    q = torch.randn(1, 4, 5, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    o, _ = naive_attention(q, k, v)
    for head in range(4):  # query heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
        alone, _ = naive_attention(q[:, head : head + 1], k[:, head // 2 : head // 2 + 1], v[:, head // 2 : head // 2 + 1])
        torch.testing.assert_close(o[:, head], alone[:, 0])


@pytest.mark.parametrize("block_m, block_n", [(2, 2), (4, 1), (64, 64)])
def test_rows_with_no_visible_key(block_m, block_n):
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    # bottom-right aligned, Tq=5, Tk=3: query i sees keys j <= i - 2, so rows 0 and 1 see nothing
    for o, lse in (
        naive_attention(q, k, v, causal=True),
        tiled_attention(q, k, v, causal=True, block_m=block_m, block_n=block_n),
    ):
        assert torch.equal(o[..., :2, :], torch.zeros(1, 2, 2, 8))
        assert torch.equal(lse[..., :2], torch.full((1, 2, 2), -math.inf))
        assert torch.isfinite(lse[..., 2:]).all() and not o.isnan().any()


def test_tile_schedule():
    assert list(tile_schedule(128, 128, 64, 64, True)) == [(0, [0]), (1, [1, 0])]
    assert list(tile_schedule(128, 128, 64, 64, False)) == [(0, [1, 0]), (1, [1, 0])]
    assert list(tile_schedule(3, 5, 2, 2, True)) == [(0, [1, 0]), (1, [2, 1, 0])]  # last_key 3, then 4
    assert list(tile_schedule(5, 3, 2, 2, True)) == [(0, []), (1, [0]), (2, [1, 0])]  # tile 0 sees nothing


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_record_follows_the_schedule(causal):
    q, k, v = torch.randn(1, 1, 70, 8), torch.randn(1, 1, 50, 8), torch.randn(1, 1, 50, 8)
    record = []
    tiled_attention(q, k, v, causal=causal, block_m=16, block_n=16, record=record)
    schedule = list(tile_schedule(70, 50, 16, 16, causal))
    visited = [(m_block, n_block) for m_block, n_blocks in schedule for n_block in n_blocks]
    assert [(s.m_block, s.n_block) for s in record] == visited
    for m_block, n_blocks in schedule:
        assert n_blocks == sorted(n_blocks, reverse=True)
    if causal:  # query tile 0 holds rows 0-15, which see keys j <= i - 20: none
        assert schedule[0] == (0, []) and schedule[-1] == (4, [3, 2, 1, 0])
    else:
        assert all(n_blocks == [3, 2, 1, 0] for _, n_blocks in schedule)


def test_record_of_three_tokens_matches_hand_computation():
    record = []
    tiled_attention(Q3, K3, V3, causal=True, block_m=3, block_n=1, record=record)
    inf = math.inf
    # After each key tile (keys visited last to first): rows that have seen a key have m = 0, and
    # l counts the keys seen; acc sums their values.
    expected = [
        (2, [-inf, -inf, 0.0], [0.0, 0.0, 1.0], [[0, 0], [0, 0], [30, 30]]),
        (1, [-inf, 0.0, 0.0], [0.0, 1.0, 2.0], [[0, 0], [0, 20], [30, 50]]),
        (0, [0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [[10, 0], [10, 20], [40, 50]]),
    ]
    assert len(record) == len(expected)
    for state, (n_block, m, l, acc) in zip(record, expected):
        assert (state.m_block, state.n_block) == (0, n_block)
        assert state.m[0, 0].tolist() == m
        assert state.l[0, 0].tolist() == l
        assert state.o[0, 0].tolist() == acc


def test_low_precision_reference_differs_a_little():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    exact, _ = naive_attention(q, k, v)
    low, _ = naive_attention(q, k, v, upcast=False)
    assert exact.dtype == low.dtype == torch.bfloat16
    diff = (exact.float() - low.float()).abs().max().item()
    assert 0 < diff < 0.05
