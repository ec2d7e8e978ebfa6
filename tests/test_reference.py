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
    o, lse = naive_attention(Q3, K3, V3, causal=True, return_lse=True)
    torch.testing.assert_close(o[0, 0], O3, atol=1e-3, rtol=0)
    torch.testing.assert_close(lse[0, 0], torch.log(torch.tensor([1.0, 2.0, 3.0])))


@pytest.mark.parametrize("block_m, block_n", [(1, 1), (2, 2), (3, 3), (1, 2)])
def test_three_tokens_tiled(block_m, block_n):
    o, lse = tiled_attention(Q3, K3, V3, causal=True, block_m=block_m, block_n=block_n, return_lse=True)
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
    o, lse = tiled_attention(q, k, v, causal=causal, scale=0.3, block_m=block_m, block_n=block_n, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_gqa_uses_the_right_kv_head():
    q = torch.randn(1, 4, 5, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    o = naive_attention(q, k, v)
    for head in range(4):  # query heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
        alone = naive_attention(q[:, head : head + 1], k[:, head // 2 : head // 2 + 1], v[:, head // 2 : head // 2 + 1])
        torch.testing.assert_close(o[:, head], alone[:, 0])


@pytest.mark.parametrize("block_m, block_n", [(2, 2), (4, 1), (64, 64)])
def test_rows_with_no_visible_key(block_m, block_n):
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    # bottom-right aligned, Tq=5, Tk=3: query i sees keys j <= i - 2, so rows 0 and 1 see nothing
    for o, lse in (
        naive_attention(q, k, v, causal=True, return_lse=True),
        tiled_attention(q, k, v, causal=True, block_m=block_m, block_n=block_n, return_lse=True),
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
    exact = naive_attention(q, k, v)
    low = naive_attention(q, k, v, upcast=False)
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
        o, lse = tiled_attention(q, k, v, causal=causal, block_m=16, block_n=16, record=record, window_size=window, return_lse=True)
        ref_o, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert len(record) == len(seen_tiles(90, 120, 16, 16, causal, window)) < 6 * 8


# ---- the references return what the public functions return, and check their inputs themselves ----------


def test_out_alone_unless_return_lse_as_the_public_functions():
    import inspect

    import flashgen
    from flashgen import reference

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    for fn in (naive_attention, tiled_attention):
        out = fn(q, k, v, causal=True)
        assert isinstance(out, torch.Tensor) and out.shape == q.shape, fn.__name__
        same, lse = fn(q, k, v, causal=True, return_lse=True)
        assert torch.equal(same, out) and lse.shape == (2, 4, 5) and lse.dtype == torch.float32, fn.__name__
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # one sequence, (rows, heads, d)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    out = reference.attention_varlen(*packed, cu_q, cu_k, 5, 7)
    same, lse = reference.attention_varlen(*packed, cu_q, cu_k, 5, 7, return_lse=True)
    assert torch.equal(same, out) and out.shape == (5, 4, 8) and lse.shape == (4, 5)
    q_bshd, k_cache, v_cache = (t.transpose(1, 2) for t in (q, k, v))
    out = reference.attention_with_kvcache(q_bshd, k_cache, v_cache)
    same, lse = reference.attention_with_kvcache(q_bshd, k_cache, v_cache, return_softmax_lse=True)
    assert torch.equal(same, out) and out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5)
    # the same name for the flag as the public counterpart (FlashAttention's)
    for public, oracle, flag in ((flashgen.attention, naive_attention, "return_lse"),
                                 (flashgen.attention_varlen, reference.attention_varlen, "return_lse"),
                                 (flashgen.attention_with_kvcache, reference.attention_with_kvcache, "return_softmax_lse")):
        assert flag in inspect.signature(public).parameters and flag in inspect.signature(oracle).parameters, flag


def bhsd(batch=2, heads=4, kv_heads=2, seqlen_q=5, seqlen_k=7, d=8, **changes):
    """naive_attention's arguments, with changes."""
    q, k, v = torch.randn(batch, heads, seqlen_q, d), torch.randn(batch, kv_heads, seqlen_k, d), torch.randn(batch, kv_heads, seqlen_k, d)
    return {"q": q, "k": k, "v": v, **changes}


NAIVE_ERRORS = [  # each one ran without a word (a wrong answer) or died in a matmul before the reference checked it
    (TypeError, "q must be a torch.Tensor, got list", dict(q=[[1.0]])),
    (ValueError, r"k must have 4 dimensions \(batch, heads_kv, seqlen_k, head_dim\); got shape \(2, 7, 8\)", dict(k=torch.zeros(2, 7, 8))),
    (TypeError, "q has dtype torch.int64; the reference takes floating-point tensors", dict(q=torch.zeros(2, 4, 5, 8, dtype=torch.long))),
    (TypeError, "q, k, v must share one dtype; got q torch.float32, k torch.float32, v torch.float64",
     dict(v=torch.zeros(2, 2, 7, 8, dtype=torch.float64))),
    (ValueError, r"k and v must have one shape .* got \(2, 2, 7, 8\) and \(2, 2, 6, 8\)", dict(v=torch.zeros(2, 2, 6, 8))),
    (ValueError, "q, k, v must have one batch size; got q 2, k 1", dict(k=torch.zeros(1, 2, 7, 8), v=torch.zeros(1, 2, 7, 8))),
    (ValueError, "q has 4 heads and k, v have 3: the number of query heads must be a multiple of the number of key/value heads",
     dict(k=torch.zeros(2, 3, 7, 8), v=torch.zeros(2, 3, 7, 8))),
    (ValueError, "q has 4 heads and k, v have 0", dict(k=torch.zeros(2, 0, 7, 8), v=torch.zeros(2, 0, 7, 8))),
    (ValueError, "q and k must have the same head_dim; got q 8, k 16", dict(k=torch.zeros(2, 2, 7, 16), v=torch.zeros(2, 2, 7, 16))),
    (ValueError, "q, k, v must be on one device; got q cpu, k meta, v cpu", dict(k=torch.zeros(2, 2, 7, 8, device="meta"))),
    (ValueError, r"window_size=\(-2, 0\): must be \(left, right\), two ints >= -1", dict(window_size=(-2, 0))),
    (ValueError, r"window_size=\(0, -5\)", dict(window_size=(0, -5))),
    (ValueError, r"window_size=\(1.5, 0\)", dict(window_size=(1.5, 0))),
    (ValueError, r"window_size=\(3,\): must be \(left, right\)", dict(window_size=(3,))),
    (ValueError, r"window_size=\(1, 2, 3\)", dict(window_size=(1, 2, 3))),
    (ValueError, r"window_size=\(inf, 0\)", dict(window_size=(math.inf, 0))),
    (ValueError, "window_size=None", dict(window_size=None)),
    (ValueError, "softcap=-1.0: must be a finite number >= 0", dict(softcap=-1)),
    (ValueError, "softcap=nan", dict(softcap=math.nan)),
    (ValueError, "softcap=inf", dict(softcap=math.inf)),
    (ValueError, "softcap='big'", dict(softcap="big")),
    (TypeError, "alibi_slopes must be a torch.Tensor, got list", dict(alibi_slopes=[0.5] * 4)),
    (TypeError, "alibi_slopes has dtype torch.float64; it must be torch.float32", dict(alibi_slopes=torch.ones(4, dtype=torch.float64))),
    (ValueError, r"alibi_slopes has shape \(2,\); it must be \(4,\) or \(2, 4\)", dict(alibi_slopes=torch.ones(2))),
    (ValueError, r"alibi_slopes has shape \(4, 2\); it must be \(4,\) or \(2, 4\)", dict(alibi_slopes=torch.ones(4, 2))),
    (ValueError, "alibi_slopes' last dimension must be contiguous", dict(alibi_slopes=torch.ones(2, 8)[:, ::2])),
    (ValueError, "alibi_slopes is on meta, the inputs on cpu", dict(alibi_slopes=torch.ones(4, device="meta"))),
    (ValueError, "scale=-1: must be a positive finite number", dict(scale=-1)),
    (ValueError, "scale=0.0: must be a positive finite number", dict(scale=0.0)),
    (ValueError, "scale=inf", dict(scale=math.inf)),
    (ValueError, "scale=nan", dict(scale=math.nan)),
    (ValueError, "scale='big'", dict(scale="big")),
    (TypeError, r"score_mod must be a Python function \(of a flashgen rule, its .python\), got ScoreMod",
     dict(score_mod="ScoreMod")),
    (TypeError, "mask_mod must be a Python function", dict(mask_mod=True)),
]


@pytest.mark.parametrize("error, match, changes", NAIVE_ERRORS, ids=[m[:40] for _, m, _ in NAIVE_ERRORS])
def test_naive_attention_names_what_is_wrong(error, match, changes):
    if changes.get("score_mod") == "ScoreMod":  # the rule itself, where its Python twin belongs
        from flashgen import ScoreMod

        changes = dict(score_mod=ScoreMod("score", lambda score, b, h, q_idx, kv_idx: score))
    with pytest.raises(error, match=match):
        naive_attention(**bhsd(**changes))
    if "score_mod" not in changes and "mask_mod" not in changes and "alibi_slopes" not in changes and "softcap" not in changes:
        with pytest.raises(error, match=match):  # the tiled walk takes the same checks
            tiled_attention(**bhsd(**changes))


def test_the_checks_pass_what_the_oracle_takes_beyond_the_kernels():
    """Any floating dtype and head dim, any strides, -1 sides, a zero softcap, (batch, heads) slopes."""
    args = bhsd(d=12)
    args["q"] = args["q"].double().transpose(2, 3).contiguous().transpose(2, 3)  # head_dim not contiguous
    args["k"], args["v"] = args["k"].double(), args["v"].double()
    out = naive_attention(**args, causal=True, window_size=(-1, 3), softcap=0, alibi_slopes=torch.ones(2, 4), scale=1)
    assert out.dtype == torch.float64 and out.isfinite().all()


def packed(**changes):
    """attention_varlen's arguments (two sequences), with changes."""
    base = dict(q=torch.randn(9, 4, 8), k=torch.randn(12, 2, 8), v=torch.randn(12, 2, 8),
                cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32),
                max_seqlen_q=5, max_seqlen_k=7)
    return {**base, **changes}


def kvcache(**changes):
    """attention_with_kvcache's arguments (a contiguous cache, two new tokens), with changes."""
    base = dict(q=torch.randn(2, 3, 4, 8), k_cache=torch.randn(2, 16, 2, 8), v_cache=torch.randn(2, 16, 2, 8),
                k=torch.randn(2, 2, 2, 8), v=torch.randn(2, 2, 2, 8), cache_seqlens=5)
    return {**base, **changes}


SERVING_ERRORS = [  # the same checks, by the serving references' names
    ("varlen", ValueError, r"k must have 3 dimensions \(total_k, heads_kv, head_dim\)", dict(k=torch.zeros(12, 16))),
    ("varlen", ValueError, "q has 4 heads and k, v have 3", dict(k=torch.zeros(12, 3, 8), v=torch.zeros(12, 3, 8))),
    ("varlen", ValueError, "softmax_scale=-0.5: must be a positive finite number", dict(softmax_scale=-0.5)),
    ("varlen", ValueError, r"alibi_slopes has shape \(3, 4\); it must be \(4,\) or \(2, 4\)", dict(alibi_slopes=torch.ones(3, 4))),
    ("varlen", TypeError, r"cu_seqlens_k must be an int32 tensor \(FlashAttention's layout\), got torch.int64",
     dict(cu_seqlens_k=torch.tensor([0, 5, 12]))),
    ("varlen", TypeError, r"cu_seqlens_q must be an int32 tensor .* got list", dict(cu_seqlens_q=[0, 4, 9])),
    ("varlen", ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\): .* got \(1, 3\)",
     dict(cu_seqlens_q=torch.tensor([[0, 4, 9]], dtype=torch.int32))),
    ("varlen", ValueError, r"cu_seqlens_q and cu_seqlens_k must both have shape \(batch \+ 1,\); got \(3,\) and \(2,\)",
     dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32))),
    ("varlen", ValueError, "max_seqlen_k=True: must be a non-negative int", dict(max_seqlen_k=True)),
    ("varlen", ValueError, "dropout_p=0.1: flashgen computes exact attention without dropout; pass 0.0", dict(dropout_p=0.1)),
    ("varlen", ValueError, r"block_table must be an int32 tensor \(batch, max_blocks\) with batch 2; got torch.int32 \(3, 1\)",
     dict(k=torch.zeros(4, 16, 2, 8), v=torch.zeros(4, 16, 2, 8), block_table=torch.zeros(3, 1, dtype=torch.int32))),
    ("varlen", ValueError, r"k must have 4 dimensions \(num_blocks, page_size, heads_kv, head_dim\)",
     dict(block_table=torch.zeros(2, 1, dtype=torch.int32))),
    ("kvcache", ValueError, "q has 4 heads and k_cache, v_cache have 3",
     dict(k_cache=torch.zeros(2, 16, 3, 8), v_cache=torch.zeros(2, 16, 3, 8))),
    ("kvcache", ValueError, "q and k_cache must have the same head_dim; got q 8, k_cache 16",
     dict(k_cache=torch.zeros(2, 16, 2, 16), v_cache=torch.zeros(2, 16, 2, 16))),
    ("kvcache", TypeError, "q, k_cache, v_cache must share one dtype", dict(k_cache=torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16))),
    ("kvcache", ValueError, "softmax_scale=nan", dict(softmax_scale=math.nan)),
    ("kvcache", ValueError, r"window_size=\(-2, 0\)", dict(window_size=(-2, 0))),
    ("kvcache", ValueError, "softcap=-1.0", dict(softcap=-1.0)),
    ("kvcache", ValueError, "q, k, v must have one batch size; got q 2, k 1", dict(k=torch.zeros(1, 2, 2, 8), v=torch.zeros(1, 2, 2, 8))),
    ("kvcache", ValueError, "k and v must have the caches' heads_kv, 2; got 1", dict(k=torch.zeros(2, 2, 1, 8), v=torch.zeros(2, 2, 1, 8))),
    ("kvcache", ValueError, "k and v are appended together: got k a tensor and v None", dict(v=None)),
    ("kvcache", ValueError, r"block_table must be an int32 tensor \(batch, max_blocks\) with batch 2; got torch.int64",
     dict(block_table=torch.zeros(2, 1, dtype=torch.long))),
]


@pytest.mark.parametrize("which, error, match, changes", SERVING_ERRORS, ids=[f"{w}-{m[:40]}" for w, _, m, _ in SERVING_ERRORS])
def test_the_serving_references_name_what_is_wrong(which, error, match, changes):
    from flashgen import reference

    fn, args = (reference.attention_varlen, packed) if which == "varlen" else (reference.attention_with_kvcache, kvcache)
    fn(**args())  # good as given
    with pytest.raises(error, match=match):
        fn(**args(**changes))


def test_merge_refuses_lse_of_the_wrong_shape():
    """A FlashAttention (batch, heads, seqlen) lse of one-token outputs (batch, 1, heads, d) would
    broadcast into a (batch, heads, heads, d) answer."""
    from flashgen import reference

    o, lse = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4)
    reference.merge_attention_states(o, lse, o, lse)
    with pytest.raises(ValueError, match=r"lse_b must have shape o.shape\[:-1\] = \(2, 1, 4\) .* got \(2, 4, 1\)"):
        reference.merge_attention_states(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(ValueError, match=r"o_a and o_b must have one shape \(..., head_dim\); got \(2, 1, 4, 8\) and \(2, 4, 1, 8\)"):
        reference.merge_attention_states(o, lse, o.transpose(1, 2), lse)
    with pytest.raises(TypeError, match="lse_a must be a floating-point torch.Tensor, got list"):
        reference.merge_attention_states(o, [0.0], o, lse)


def test_fp8_inputs_are_attended_as_their_dequantized_values():
    """FlashAttention-3's FP8 rule: the true value is the stored e4m3 one times its descale (fp32,
    (batch, heads_kv), a KV head's scale shared by its query heads); the oracle attends to those
    values in fp32 and returns bf16 unless out_dtype says otherwise."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 33, 32, generator=gen).to(torch.float8_e4m3fn) for h in (4, 2, 2))
    q_descale, k_descale, v_descale = (torch.rand(2, 2, generator=gen) + 0.5 for _ in range(3))
    out, lse = naive_attention(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                               return_lse=True)
    q_true = q.float() * q_descale.repeat_interleave(2, dim=1)[..., None, None]  # query heads 0, 1 on KV head 0
    k_true, v_true = k.float() * k_descale[..., None, None], v.float() * v_descale[..., None, None]
    want, want_lse = naive_attention(q_true, k_true, v_true, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16)) and torch.equal(lse, want_lse)
    assert naive_attention(q, k, v, out_dtype=torch.float16).dtype == torch.float16
    assert torch.equal(naive_attention(q, k, v).float(), naive_attention(q.float(), k.float(), v.float()).bfloat16().float())


def test_fp8_arguments_are_refused_by_name_where_they_do_not_apply():
    q = torch.randn(1, 2, 8, 16)
    fp8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale is for float8 inputs"):
        naive_attention(q, q, q, q_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"k_descale must be a float32 tensor of shape \(1, 2\)"):
        naive_attention(fp8, fp8, fp8, k_descale=torch.ones(2))
    with pytest.raises(ValueError, match="upcast=False with float8 inputs"):
        naive_attention(fp8, fp8, fp8, upcast=False)
    with pytest.raises(ValueError, match="out_dtype="):
        naive_attention(fp8, fp8, fp8, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="out_dtype="):
        naive_attention(q, q, q, out_dtype=torch.bfloat16)


def test_the_fp8_yardstick_rounds_p_to_e4m3_above_the_row_max():
    """reference.fp8_emulated: FP8 inputs dequantized, P = 2^8 exp(s - m) rounded to e4m3 for P V.
    Close to the fp32 oracle (the rounding's error, not more), unchanged where P's rounding is
    exact (one key: P = 256), and a row that sees no key gives 0."""
    import torch

    from flashgen import reference

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32).to(torch.float8_e4m3fn) for _ in range(3))
    descale = torch.full((1, 2), 0.5)
    got = reference.fp8_emulated(q, k, v, True, q_descale=descale, k_descale=descale, v_descale=descale)
    exact = reference.naive_attention(q, k, v, causal=True, q_descale=descale, k_descale=descale, v_descale=descale,
                                      out_dtype=torch.float32)
    error = (got.float() - exact).abs().max().item()
    assert 0 < error < 0.05
    one = reference.fp8_emulated(q[:, :, :1], k[:, :, :1], v[:, :, :1], v_descale=descale)
    assert torch.equal(one.float(), (v[:, :, :1].float() * 0.5).to(torch.bfloat16).float())
    none_seen = reference.fp8_emulated(q[:, :, :3], k[:, :, :1], v[:, :, :1], True)  # query rows 0, 1 see no key
    assert torch.equal(none_seen[:, :, :2].float(), torch.zeros(1, 2, 2, 32))


def test_the_fp8_yardstick_applies_the_variants_as_the_oracle_does():
    """fp8_emulated with a window, softcap, ALiBi or a sink stays within the rounding's error of
    the oracle with the same variant, and far from it without the variant (so the bound the GPU
    tier draws from it for each variant is that variant's)."""
    import torch

    from flashgen import reference

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32).mul(3).to(torch.float8_e4m3fn) for _ in range(3))
    for options in (dict(window_size=(8, 0)), dict(softcap=2.0), dict(alibi_slopes=torch.tensor([0.5, 1.0])),
                    dict(learnable_sink=torch.tensor([4.0, 6.0]))):
        exact = reference.naive_attention(q, k, v, causal=True, out_dtype=torch.float32, **options)
        with_it = (reference.fp8_emulated(q, k, v, True, **options).float() - exact).abs().max().item()
        without = (reference.fp8_emulated(q, k, v, True).float() - exact).abs().max().item()
        assert with_it < 0.3 < 3 < without, (options, with_it, without)
