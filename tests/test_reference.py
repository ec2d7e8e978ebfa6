"""The oracle: naive and tiled attention agree, and the tiled walk records the kernel's algorithm."""

import math

import pytest
import torch

from flashgen.reference import (
    key_tiles, naive_attention, query_tiles, tile_schedule, tiled_attention, visible, visible_in_window, visible_pairs, visited_tiles,
)

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


# ---- the tiles a window's Mask visits (reference.key_tiles / query_tiles mirror mask.cuh.j2) ---------

def kept(seqlen_q, seqlen_k, causal, window_size):
    """The (seqlen_q, seqlen_k) mask of the (query, key) pairs the rule keeps."""
    if tuple(window_size) != (-1, -1):
        return visible_in_window(seqlen_q, seqlen_k, window_size, causal)
    return visible(seqlen_q, seqlen_k) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)


def seen_tiles(seqlen_q, seqlen_k, block_m, block_n, causal, window_size):
    """Brute force: the (query tile, key tile) pairs holding at least one (query, key) the rule keeps."""
    rows, cols = kept(seqlen_q, seqlen_k, causal, window_size).nonzero(as_tuple=True)
    return set(zip((rows // block_m).tolist(), (cols // block_n).tolist()))


def tile_cases():
    gen = torch.Generator().manual_seed(11)
    for _ in range(400):
        seqlen_q, seqlen_k = (int(x) for x in torch.randint(1, 200, (2,), generator=gen))
        block_m, block_n = (int(x) for x in torch.tensor([16, 32, 64, 128])[torch.randint(0, 4, (2,), generator=gen)])
        left, right = (int(x) for x in torch.randint(-1, 150, (2,), generator=gen))
        causal = bool(torch.randint(0, 2, (1,), generator=gen))
        yield seqlen_q, seqlen_k, block_m, block_n, causal, (left, right)
    yield 100, 100, 64, 64, True, (-1, -1)
    yield 100, 100, 64, 64, False, (-1, -1)
    yield 7, 300, 16, 64, False, (0, 0)  # decode-like: few rows, a narrow band far to the right


def test_the_tiles_visited_are_exactly_those_the_window_keeps_something_of():
    """Both walks (query-major: key_tiles; key-major: query_tiles) visit exactly the tiles holding a
    kept (query, key): nothing kept is skipped, and no empty tile is visited, at either end; and
    visible_pairs counts the kept pairs."""
    for seqlen_q, seqlen_k, block_m, block_n, causal, window in tile_cases():
        expected = seen_tiles(seqlen_q, seqlen_k, block_m, block_n, causal, window)
        by_rows = {(m, n) for m in range(-(-seqlen_q // block_m))
                   for n in key_tiles(m * block_m, block_m, block_n, seqlen_q, seqlen_k, causal, window)}
        by_keys = {(m, n) for n in range(-(-seqlen_k // block_n))
                   for m in query_tiles(n * block_n, block_m, block_n, seqlen_q, seqlen_k, causal, window)}
        case = (seqlen_q, seqlen_k, block_m, block_n, causal, window)
        assert by_rows == expected, case
        assert by_keys == expected, case
        assert visible_pairs(seqlen_q, seqlen_k, causal, window) == int(kept(seqlen_q, seqlen_k, causal, window).sum()), case
        for key_major in (False, True):
            assert visited_tiles(seqlen_q, seqlen_k, block_m, block_n, causal, window, key_major) == len(expected), case


def test_a_sliding_window_visits_its_band_of_tiles():
    """T = 16k, a causal window of 4096 (left 4095) in 64 x 64 tiles: each query tile visits the 65
    key tiles its rows reach (64 at the start, fewer), against the causal triangle's."""
    causal = visited_tiles(16384, 16384, 64, 64, True)
    assert causal == 256 * 257 // 2
    window = visited_tiles(16384, 16384, 64, 64, True, (4095, 0))
    assert window == sum(min(m + 1, 65) for m in range(256))
    assert window == visited_tiles(16384, 16384, 64, 64, True, (4095, 0), key_major=True)
    assert visited_tiles(16384, 16384, 64, 64, True, (16383, 0)) == causal  # a window as long as the keys: causal's


def test_tiled_attention_skips_the_tiles_outside_a_window_and_still_matches():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (90, 120, 120))
    for causal, window in ((True, (20, 0)), (False, (10, 33)), (False, (-1, 5))):
        record = []
        o, lse = tiled_attention(q, k, v, causal=causal, block_m=16, block_n=16, record=record, window_size=window)
        ref_o, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window)
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert len(record) == len(seen_tiles(90, 120, 16, 16, causal, window)) < 6 * 8
