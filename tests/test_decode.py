"""The serving functions without a GPU: decode and merge specs, the split count, the page-size
division, the oracle against attention written out key by key, the launch plans (stubbed driver),
and the named input errors (CPU tensors: every check runs before the device check)."""

import math
import random
import re
import threading

import pytest
import torch
from test_launch import StubDriver, driver, stub_kernels, unpack  # noqa: F401  (fixtures)

import flashgen
from flashgen import ops, plans, reference, serving, tuning, variants, workspace
from flashgen.families.decode import MAX_SPLITS, PAGE_SIZES, fast_divisor
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

BF16, FP16 = torch.bfloat16, torch.float16


# ---- specs ---------------------------------------------------------------------------------------


def test_decode_spec_names_its_fields_and_layout():
    spec = KernelSpec(head_dim=128, block_m=16, block_n=64, num_warps=4, num_stages=3, kind="decode_paged")
    assert spec.name == "decode_paged_d128_m16_n64_bf16_w4_s3_sm90a"
    row = (128 + 8) * 2
    layout = spec.family.smem(spec)
    assert layout.offsets == {"q": 0, "kv": 16 * row, "reduce": 0, "merge": 0}  # the merges reuse the tiles' space
    assert spec.smem_bytes == 16 * row + 3 * 2 * 64 * row
    assert spec.family.warps_n(spec) == 4  # the 4 warps share the 16 rows and split each key tile
    assert KernelSpec(head_dim=64, kind="merge_fp32").name == "merge_fp32_d64_sm90a"


BAD = [
    (dict(block_m=32, num_warps=4, block_n=64), None),  # valid: 2 warps along rows, 2 along keys
    (dict(block_m=48, num_warps=4), "block_m=48 with num_warps=4"),
    (dict(block_m=16, num_warps=4, block_n=32), "each needs a multiple of 16 keys"),
    (dict(block_m=16, num_warps=3), "num_warps=3"),
    (dict(block_m=16, num_stages=9), "num_stages=9"),
    (dict(block_m=16, block_n=64, causal=True), "causal=True: a decode kernel does not use causal"),
    (dict(block_m=64, num_warps=4, block_n=256, head_dim=256), "would hold 256 fp32 accumulators"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m or "valid" for _, m in BAD])
def test_decode_spec_validation_names_the_field(fields, message):
    fields = {"head_dim": 128, "block_n": 64, "num_stages": 2, "kind": "decode", **fields}
    if message is None:
        KernelSpec(**fields)
    else:
        with pytest.raises(SpecError, match=re.escape(message)):
            KernelSpec(**fields)


def test_merge_fp32_takes_no_dtype():
    with pytest.raises(SpecError, match="dtype='fp16': a merge_fp32 kernel does not use dtype"):
        KernelSpec(head_dim=64, kind="merge_fp32", dtype="fp16")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_86"])
def test_every_serving_kind_has_a_spec_for_every_head_dim(arch):
    specs = tuning.serving_specs(arch)
    appends = ("append_paged",) if arch == "sm_90a" else ()  # (ahead of the paged Hopper forward only)
    assert {s.kind for s in specs} == set(tuning.DECODE_KINDS + tuning.MERGE_KINDS + appends)
    assert {s.head_dim for s in specs} == set(tuning.TEST_HEAD_DIMS)
    for rows, block_m in [(1, 16), (16, 16), (17, 64), (4 * 5, 64), (128, 64)]:
        assert tuning.decode_spec(128, "bf16", arch, True, rows).block_m == block_m
    assert tuning.tuned_spec("decode_paged", 96, "fp16", True, arch).kind == "decode_paged"  # causal is not a field


@pytest.mark.parametrize("spec", [tuning.decode_spec(128, "bf16", "sm_90a", True, 1), tuning.decode_spec(80, "fp16", "sm_80", False, 40),
                                  tuning.merge_spec("merge", 256, "bf16", "sm_90a"), tuning.merge_spec("merge_fp32", 64, "bf16", "sm_80")],
                         ids=lambda spec: spec.name)
def test_serving_kernels_hold_their_instructions(spec):
    """What NVRTC emits (PTX): the decode streams K and V with 16-byte cp.async, multiplies with
    mma.sync, and merges its splits after an atomic count (one that wraps to zero) with loads from
    L2; nothing goes through local memory."""
    from flashgen.compile import compile_ptx
    from flashgen.render import render

    ptx = compile_ptx(spec, render(spec)).decode()
    assert "ld.local" not in ptx and "st.local" not in ptx
    if spec.kind.startswith("decode"):
        for instruction in ("cp.async.cg.shared.global.L2::128B", "cp.async.wait_group", "mma.sync.aligned.m16n8k16.row.col.f32",
                            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "mul.hi.u32" if "paged" in spec.kind else "ld.global",
                            "atom.global.inc.u32", "membar.gl", "ld.global.cg.f32", "bar.red.or.pred"):
            assert instruction in ptx, instruction
    else:
        assert "ex2.approx" in ptx


def test_occupancy_counts_shared_memory_and_threads():
    small = KernelSpec(head_dim=64, block_m=16, block_n=64, num_stages=2, kind="decode")
    big = KernelSpec(head_dim=256, block_m=16, block_n=64, num_stages=3, kind="decode")
    assert big.family.blocks_per_sm(big) == 1 and big.smem_bytes > 113 * 1024
    assert small.family.blocks_per_sm(small) == (227 * 1024 + 1024) // (small.smem_bytes + 1024) == 5
    fp8 = small.replace(kv_dtype="e4m3")  # (smaller stages, but a thread keeps 128 registers: 4 blocks of 128)
    assert fp8.smem_bytes < small.smem_bytes and fp8.family.blocks_per_sm(fp8) == 4


# ---- the page-size division and the split count -----------------------------------------------


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, *PAGE_SIZES, 1000, 2**20 + 1, 2**31 - 1])
def test_fast_divisor_divides_every_position(divisor):
    """(umulhi(n, magic) + n) >> shift, in the kernel's 32-bit arithmetic, is n // divisor."""
    magic, shift = fast_divisor(divisor)
    assert 0 < magic < 2**32 and 0 <= shift <= 31
    numbers = list(range(0, 5000)) + [2**31 - 1 - i for i in range(2000)]
    numbers += [divisor * m + r for m in (1, 2, 1000, 2**31 // divisor - 1) for r in (-1, 0, 1) if 0 <= divisor * m + r < 2**31]
    numbers += random.Random(divisor).sample(range(2**31), 5000)
    for n in numbers:
        high = (n * magic) >> 32
        total = high + n
        assert total < 2**32  # no 32-bit overflow
        assert total >> shift == n // divisor, n


H200_SLOTS = 132 * 2


def test_num_splits_leaves_a_full_gpu_alone():
    assert plans.num_splits(blocks=264, key_tiles=2048, slots=H200_SLOTS) == 1
    assert plans.num_splits(blocks=int(0.8 * H200_SLOTS) + 1, key_tiles=2048, slots=H200_SLOTS) == 1
    assert plans.num_splits(blocks=8, key_tiles=3, slots=H200_SLOTS) == 1  # too few tiles to share


@pytest.mark.parametrize("blocks", [1, 2, 3, 8, 13, 32, 64, 100, 150, 211])
@pytest.mark.parametrize("key_tiles", [1, 2, 16, 128, 1024, 2048])
@pytest.mark.parametrize("slots", [132, 264, 108])
def test_num_splits_fills_the_gpu_within_its_limits(blocks, key_tiles, slots):
    splits = plans.num_splits(blocks, key_tiles, slots)
    assert 1 <= splits <= MAX_SPLITS
    assert splits == 1 or splits <= key_tiles // plans.MIN_SPLIT_TILES  # every split gets tiles to stream
    if blocks >= plans.FULL * slots:
        assert splits == 1
    limit = max(1, min(MAX_SPLITS, key_tiles // plans.MIN_SPLIT_TILES))

    def fill(s):
        return blocks * s / (math.ceil(blocks * s / slots) * slots)

    if splits > 1:  # nearly the best wave fill of any allowed count, and no fewer splits get there
        best = max(fill(s) for s in range(1, limit + 1))
        assert fill(splits) >= plans.GOOD_ENOUGH * best
        assert all(fill(s) < plans.GOOD_ENOUGH * best for s in range(1, splits))


def test_num_splits_for_the_issue_shapes():
    """B = 1 or 8 with 8 KV heads on an H200 (132 SMs, two blocks each): one wave of blocks."""
    for key_tiles in (128, 1024):  # an 8k and a 64k cache in 64-key tiles
        splits = plans.num_splits(8, key_tiles, H200_SLOTS)
        assert 8 * splits <= H200_SLOTS and 8 * splits >= 0.95 * H200_SLOTS
    assert plans.num_splits(8, 16, H200_SLOTS) == 8  # a 1k cache: as many splits as have 2 tiles
    assert plans.num_splits(64, 2048, H200_SLOTS) == 4  # B = 8 at 128k: 256 of 264 slots


# ---- the oracle --------------------------------------------------------------------------------


def written_out(q, keys, values, causal, scale):
    """Attention of one sequence, query by query and key by key in float64: q (Tq, H, d), keys and
    values (n, H_kv, d); returns o (Tq, H, d) and lse (H, Tq)."""
    seqlen_q, heads, _ = q.shape
    n, kv_heads, _ = keys.shape
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((heads, seqlen_q), -math.inf, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i in range(seqlen_q):
            seen = [j for j in range(n) if not causal or j <= n - seqlen_q + i]
            if not seen:
                continue
            scores = torch.stack([(q[i, h].double() * keys[j, g].double()).sum() * scale for j in seen])
            lse[h, i] = torch.logsumexp(scores, 0)
            weights = torch.exp(scores - lse[h, i])
            o[i, h] = sum(w * values[j, g].double() for w, j in zip(weights, seen))
    return o, lse


def random_cache(batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen)
    k = v = None
    if new:
        k, v = (torch.randn(batch, new, kv_heads, d, generator=gen) for _ in range(2))
    if page_size is None:
        caches = [torch.randn(batch, capacity, kv_heads, d, generator=gen) for _ in range(2)]
        return q, caches, k, v, None
    per_seq = -(-capacity // page_size)
    pages = batch * per_seq + 3  # spare pages nobody uses
    table = torch.randperm(pages, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    caches = [torch.randn(pages, page_size, kv_heads, d, generator=gen) for _ in range(2)]
    return q, caches, k, v, table


def sequence_rows(cache, b, n, table):
    if table is None:
        return cache[b, :n]
    page_size = cache.shape[1]
    return torch.stack([cache[table[b, p // page_size], p % page_size] for p in range(n)]) if n else cache[0, :0]


CASES = [
    # batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, lengths, causal
    (3, 1, 4, 4, 16, 40, 0, None, [1, 17, 40], False),
    (2, 1, 8, 2, 24, 64, 1, None, [0, 63], True),  # GQA 4:1, append one token
    (2, 5, 8, 2, 16, 50, 5, None, [7, 30], True),  # speculative decoding: 5 new tokens, causal
    (3, 3, 4, 1, 8, 48, 2, 16, [5, 16, 33], True),  # MQA, paged, seqlen_q != seqlen_new
    (2, 1, 6, 3, 16, 70, 1, 32, [31, 64], False),  # paged, a partial last page
    (1, 4, 2, 2, 8, 20, 0, None, [20], True),  # chunked prefill over a full cache, no append
]


@pytest.mark.parametrize("splits", [0, 1, 3, 40])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_attention_written_out(case, splits):
    batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, lengths, causal = case
    q, (k_cache, v_cache), k, v, table = random_cache(batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, seed=sum(lengths))
    before_k, before_v = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=table, softmax_scale=0.3, causal=causal,
        num_splits=splits, return_softmax_lse=True,
    )
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32
    for b, n in enumerate(lengths):
        keys, values = sequence_rows(before_k, b, n, table), sequence_rows(before_v, b, n, table)
        if new:
            keys, values = torch.cat([keys, k[b]]), torch.cat([values, v[b]])
        o, l = written_out(q[b], keys, values, causal, 0.3)
        torch.testing.assert_close(out[b].double(), o, atol=1e-5, rtol=0)
        assert torch.equal(lse[b].isinf(), l.isinf())
        torch.testing.assert_close(lse[b].double()[l.isfinite()], l[l.isfinite()], atol=1e-5, rtol=0)
        if new:  # appended in place at the sequence's length
            assert torch.equal(sequence_rows(k_cache, b, n + new, table)[n:], k[b])
            assert torch.equal(sequence_rows(v_cache, b, n + new, table)[n:], v[b])
    if new:  # nothing else changed
        changed = (k_cache != before_k).any(-1).any(-1)
        assert changed.sum() <= batch * new


VARIANTS = [dict(window_size=(4, 0)), dict(window_size=(2, 3)), dict(window_size=(-1, 1)), dict(softcap=1.5),
            dict(alibi_slopes="heads"), dict(alibi_slopes="batch"), dict(window_size=(6, 2), softcap=2.0, alibi_slopes="batch")]


@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_reference_variants_are_naive_attention_of_each_sequence(case, variant, splits):
    """Window and ALiBi aligned to each sequence's cache plus its new tokens; split or not, the same."""
    batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, lengths, causal = case
    q, (k_cache, v_cache), k, v, table = random_cache(batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, seed=len(lengths))
    slopes = {"heads": torch.rand(heads), "batch": torch.rand(batch, heads)}
    if "alibi_slopes" in variant:
        variant = {**variant, "alibi_slopes": slopes[variant["alibi_slopes"]]}
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table, softmax_scale=0.3,
        causal=causal, num_splits=splits, return_softmax_lse=True, **variant,
    )
    for b, n in enumerate(lengths):
        keys, values = sequence_rows(before_k, b, n, table), sequence_rows(before_v, b, n, table)
        if new:
            keys, values = torch.cat([keys, k[b]]), torch.cat([values, v[b]])
        mine = dict(variant)
        if "alibi_slopes" in mine and mine["alibi_slopes"].dim() == 2:
            mine["alibi_slopes"] = mine["alibi_slopes"][b]
        o, l = reference.naive_attention(*(t.transpose(0, 1)[None] for t in (q[b], keys, values)), causal=causal, scale=0.3, **mine, return_lse=True)
        torch.testing.assert_close(out[b], o[0].transpose(0, 1), atol=1e-5, rtol=0)
        assert torch.equal(lse[b].isinf(), l[0].isinf())
        torch.testing.assert_close(lse[b][l[0].isfinite()], l[0][l[0].isfinite()], atol=1e-5, rtol=0)


def test_reference_cache_seqlens_as_int_and_none():
    q, (k_cache, v_cache), _, _, _ = random_cache(2, 1, 4, 2, 16, 30, 0)
    whole = reference.attention_with_kvcache(q, k_cache, v_cache)
    as_int = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=30)
    as_tensor = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([30, 30], dtype=torch.int32))
    assert torch.equal(whole, as_int) and torch.equal(whole, as_tensor)


def test_reference_rules_for_bad_lengths_and_pages():
    """A length past the capacity is the capacity, a negative one 0; new tokens past the capacity
    are attended to but not stored; an entry outside [0, num_pages) reads as zeros and takes no
    writes."""
    q, (k_cache, v_cache), k, v, table = random_cache(3, 1, 2, 2, 8, 32, 2, page_size=16, seed=5)
    table[2, 0] = -7  # sequence 2's first page does not exist
    table[2, 1] = 1000
    before = k_cache.clone()
    lengths = torch.tensor([31, 999, -5], dtype=torch.int32)
    out = reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)
    rows0 = sequence_rows(before, 0, 32, table)
    expected0, _ = written_out(q[0], torch.cat([rows0[:31], k[0]]), torch.cat([sequence_rows(v_cache, 0, 31, table), v[0]]), False, 8**-0.5)
    torch.testing.assert_close(out[0].double(), expected0, atol=1e-5, rtol=0)
    assert torch.equal(sequence_rows(k_cache, 0, 32, table)[31], k[0, 0])  # position 32 is past the capacity: dropped
    # sequence 1 is full (clamped to 32): its new tokens are seen and stored nowhere
    assert torch.equal(sequence_rows(k_cache, 1, 32, table), sequence_rows(before, 1, 32, table))
    # sequence 2 starts at 0; its pages are invalid, so its new tokens go nowhere
    expected2, _ = written_out(q[2], k[2], v[2], False, 8**-0.5)
    torch.testing.assert_close(out[2].double(), expected2, atol=1e-5, rtol=0)
    untouched = [p for p in range(k_cache.shape[0]) if p not in table[:2].flatten().tolist()]
    assert torch.equal(k_cache[untouched], before[untouched])
    # reads through a bad page are zeros: a length of 20 with no valid page sees 20 zero keys
    zeros = reference.attention_with_kvcache(q[2:], k_cache, v_cache, cache_seqlens=20, block_table=table[2:])
    assert torch.equal(zeros, torch.zeros_like(zeros))  # zero values, whatever the weights


def test_reference_merge():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen)
    whole, lse = reference.naive_attention(q, k, v, return_lse=True)
    a, lse_a = reference.naive_attention(q, k[:, :, :13], v[:, :, :13], return_lse=True)
    b, lse_b = reference.naive_attention(q, k[:, :, 13:], v[:, :, 13:], return_lse=True)
    o, merged = reference.merge_attention_states(a, lse_a, b, lse_b)
    torch.testing.assert_close(o, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged, lse, atol=1e-6, rtol=0)
    empty = torch.full_like(lse_a, -math.inf)
    o, merged = reference.merge_attention_states(a, lse_a, torch.full_like(b, float("nan")) * 0 + 7, empty)
    torch.testing.assert_close(o, a)
    torch.testing.assert_close(merged, lse_a)
    o, merged = reference.merge_attention_states(a, empty, b, empty)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(merged).all()


def test_reference_low_precision_differs_a_little():
    q, (k_cache, v_cache), k, v, _ = random_cache(2, 1, 4, 2, 32, 100, 1)
    q, k_cache, v_cache, k, v = (t.to(BF16) for t in (q, k_cache, v_cache, k, v))
    ref = reference.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=50)
    low = reference.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=50, upcast=False)
    assert ref.dtype == low.dtype == BF16
    assert 0 < (ref.float() - low.float()).abs().max() < 0.05


def turned_written_out(x, cos, sin, positions, interleaved):
    """Rotary embedding by complex multiplication, in float64: x (n, H, d) at positions (n,)."""
    half = cos.shape[1]
    angle = torch.complex(cos[positions].double(), sin[positions].double())[:, None]  # (n, 1, half)
    part = x[..., : 2 * half].double()
    if interleaved:
        pairs = torch.view_as_complex(part.reshape(*part.shape[:-1], half, 2).contiguous()) * angle
        part = torch.view_as_real(pairs).flatten(-2)
    else:
        pairs = torch.complex(part[..., :half], part[..., half:]) * angle
        part = torch.cat([pairs.real, pairs.imag], -1)
    return torch.cat([part, x[..., 2 * half :].double()], -1)


def rotary_tables(rows, rotary_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, rotary_dim // 2, generator=gen) * 6.3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_apply_rotary_is_complex_multiplication(interleaved):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 40, generator=gen, dtype=torch.float64)
    cos, sin = (t.double() for t in rotary_tables(20, 32))
    positions = torch.tensor([0, 7, 19, 25, -3])  # the last two are clamped into the tables
    got = reference.apply_rotary(x, cos, sin, positions, interleaved)
    torch.testing.assert_close(got.double(), turned_written_out(x, cos, sin, positions.clamp(0, 19), interleaved), atol=1e-6, rtol=0)
    assert torch.equal(got[..., 32:], x[..., 32:])  # past rotary_dim: untouched
    assert got.dtype == x.dtype
    low = reference.apply_rotary(x.to(BF16), cos.to(BF16), sin.to(BF16), positions, interleaved)
    assert low.dtype == BF16


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_rotary_turns_the_new_keys_and_q_at_the_cache_end(case, causal, interleaved):
    """FlashAttention's rule: new key j at cache_seqlens + j (stored turned); query i there too with
    causal (or a window), else every query at cache_seqlens."""
    batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, lengths, _ = case
    q, (k_cache, v_cache), k, v, table = random_cache(batch, seqlen_q, heads, kv_heads, d, capacity, new, page_size, seed=3)
    cos, sin = rotary_tables(capacity + new, 16, seed=2)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                           block_table=table, softmax_scale=0.3, causal=causal, rotary_interleaved=interleaved)
    for b, n in enumerate(lengths):
        turned = turned_written_out(k[b], cos, sin, n + torch.arange(new), interleaved)
        keys = torch.cat([sequence_rows(before_k, b, n, table).double(), turned])
        values = torch.cat([sequence_rows(before_v, b, n, table), v[b]])
        queries = turned_written_out(q[b], cos, sin, n + (torch.arange(seqlen_q) if causal else torch.zeros(seqlen_q, dtype=torch.long)), interleaved)
        o, _ = written_out(queries, keys, values, causal, 0.3)
        torch.testing.assert_close(out[b].double(), o, atol=1e-5, rtol=0)
        stored = sequence_rows(k_cache, b, min(n + new, capacity), table)[n:]
        torch.testing.assert_close(stored.double(), turned[: len(stored)], atol=1e-6, rtol=0)


@pytest.mark.parametrize("window, per_token", [((19, 19), True), ((-1, 0), True), ((20, 50), False), ((-1, 20), False)])
def test_reference_window_turns_each_query_at_its_own_position(window, per_token):
    """With a window each query turns at its own position, as with causal; a side of at least the
    capacity (20 here) bounds nothing in FlashAttention, so a window of only such sides is none,
    and every query turns at the cache's end."""
    q, (k_cache, v_cache), k, v, _ = random_cache(1, 3, 2, 2, 16, 20, 3, seed=4)
    cos, sin = rotary_tables(23, 16)
    lengths = torch.tensor([10], dtype=torch.int32)
    windowed = reference.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cos, sin, lengths, window_size=window)
    turned_q = reference.apply_rotary(q[0], cos, sin, 10 + torch.arange(3) * per_token)
    turned_k = reference.apply_rotary(k[0], cos, sin, 10 + torch.arange(3))
    plain = reference.attention_with_kvcache(turned_q[None], k_cache.clone(), v_cache.clone(), turned_k[None], v, cache_seqlens=lengths,
                                             window_size=window)
    torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


def test_window_sides_of_at_least_the_capacity_are_unbounded():
    """FlashAttention's rule, in attention_with_kvcache's variants: such a side is -1, so a window
    of only such sides is no window (the plain kernel runs), and with causal it is causal alone."""
    cpu = torch.device("cpu")
    make = lambda causal, window, keys=100: variants.make(variants.Call(causal, 1, 8, cpu, keys), window_size=window)  # noqa: E731
    assert make(False, (-1, 100)) == make(False, (100, 250)) == variants.PLAIN
    assert make(True, (100, -1)) == variants.PLAIN and make(True, (99, -1)).args["window_left"] == 99
    assert make(False, (99, 100)).args == {"window_left": 99, "window_right": -1}
    assert make(False, (-1, 100), keys=None) != variants.PLAIN  # no keys: as given
    q = t(1, 1, 8, 64)
    assert serving._variant(q, False, (-1, 100), 0.0, None, 100).fields == ()
    assert serving._variant(q, False, (-1, 99), 0.0, None, 100).fields == ("window",)


def test_reference_cache_batch_idx_picks_the_rows():
    """Sequence b reads and appends to cache row cache_batch_idx[b]; an index outside the cache is
    a row with no keys that takes no appends."""
    q, (k_cache, v_cache), k, v, _ = random_cache(3, 2, 4, 2, 16, 30, 2, seed=6)
    big_k, big_v = torch.randn(5, 30, 2, 16), torch.randn(5, 30, 2, 16)
    before_k = big_k.clone()
    idx = torch.tensor([4, 1, 9], dtype=torch.int32)
    lengths = torch.tensor([12, 28, 5], dtype=torch.int32)
    out = reference.attention_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=lengths, cache_batch_idx=idx, causal=True)
    picked_k, picked_v = before_k[[4, 1]].clone(), big_v[[4, 1]].clone()
    alone = reference.attention_with_kvcache(q[:2], picked_k, picked_v, k[:2], v[:2], cache_seqlens=lengths[:2], causal=True)
    torch.testing.assert_close(out[:2], alone, atol=0, rtol=0)
    assert torch.equal(big_k[4, 12:14], k[0]) and torch.equal(big_k[1, 28:30], k[1])  # appended to the picked rows
    empty = reference.attention_with_kvcache(q[2:], big_k[:1, :0], big_v[:1, :0], k[2:], v[2:], cache_seqlens=0, causal=True)
    torch.testing.assert_close(out[2:], empty, atol=0, rtol=0)  # row 9 is none: only the new tokens
    assert torch.equal(big_k[[0, 2, 3]], before_k[[0, 2, 3]])


def test_reference_cache_leftpad_starts_the_keys_later():
    """Keys [leftpad, cache_seqlens): the same as a cache whose rows start at leftpad, with the
    appends (and rotary positions) still at cache_seqlens."""
    q, (k_cache, v_cache), k, v, _ = random_cache(2, 2, 4, 2, 16, 40, 2, seed=7)
    cos, sin = rotary_tables(42, 16)
    lengths, pads = torch.tensor([30, 6], dtype=torch.int32), torch.tensor([7, 9], dtype=torch.int32)  # 9 > 6: clamped to 6
    k_cache_b, v_cache_b = k_cache.clone(), v_cache.clone()
    out = reference.attention_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths, cache_leftpad=pads, causal=True,
                                           rotary_interleaved=False)
    for b, (n, p) in enumerate(((30, 7), (6, 6))):
        turned_q = reference.apply_rotary(q[b], cos, sin, n + torch.arange(2), interleaved=False)
        turned_k = reference.apply_rotary(k[b], cos, sin, n + torch.arange(2), interleaved=False)
        shifted = reference.attention_with_kvcache(turned_q[None], k_cache_b[b:b + 1, p:].clone(), v_cache_b[b:b + 1, p:].clone(),
                                                   turned_k[None], v[b:b + 1], cache_seqlens=n - p, causal=True)
        torch.testing.assert_close(out[b:b + 1], shifted, atol=0, rtol=0)
        assert torch.equal(k_cache[b, n:n + 2], turned_k)


# ---- the launch plans (stubbed driver, stubbed kernels) ----------------------------------------


@pytest.fixture
def cpu_device(monkeypatch):
    """Device -1 (what CPU tensors report) looks like an H200 to the plans."""
    monkeypatch.setitem(plans._arch, -1, "sm_90a")
    monkeypatch.setitem(plans._sm_counts, -1, 132)


def decode_values(batch=2, seqlen_q=1, heads=8, kv_heads=2, d=128, pages=100, page_size=16, new=1, splits=1, lse=True):
    """attention_with_kvcache's launch values for CPU tensors (paged, a 40-page table)."""
    q = torch.zeros(batch, seqlen_q, heads, d, dtype=BF16)
    k_cache = torch.zeros(pages, page_size, kv_heads, d, dtype=BF16)
    k = torch.zeros(batch, new, kv_heads, d, dtype=BF16)
    lse = torch.empty(batch, heads, seqlen_q) if lse else None
    return ops.decode_values(q, k_cache, torch.zeros_like(k_cache), k, torch.zeros_like(k), torch.zeros(batch, dtype=torch.int32),
                                 torch.zeros(batch, 40, dtype=torch.int32), 40 * page_size, new, torch.empty_like(q), lse, splits,
                                 True, 0.125)


def test_split_decode_plan_is_one_launch_with_partials_and_counts(driver, stub_kernels, cpu_device):
    """A split decode is one kernel: its blocks write partial states to scratch and the last block
    of each row tile merges them, counting in the stream's zeroed counts (flashgen/workspace.py)."""
    plan, splits = plans.decode(-1, 128, BF16, True, 4, 2, 2, 640 + 1)
    assert splits > 1 and [k.spec.kind for k in plan.kernels] == ["decode_paged"]
    values = decode_values(splits=splits)
    plan.run(-1, values)
    (decode,) = driver.launches
    assert decode["dependent"]  # sm_90a: it may start before the kernel ahead of it ends
    partials, counts = values["partials"], values["counters"]
    assert partials.shape == (splits * 2 * 8 * 1 * (128 + 1),) and partials.dtype == torch.float32
    assert counts.dtype == torch.int32 and counts.numel() >= 2 * 2 * 1 and not counts.any()  # (batch, kv head, row tile)
    assert decode["grid"] == (splits, 2, 2) and decode["block"] == (128, 1, 1)
    got = unpack(plan.kernels[0].spec, decode["params"])
    assert got["partials"] == partials.data_ptr() and got["counters"] == counts.data_ptr()
    assert got["splits"] == splits and got["lse"] == values["lse"].data_ptr()
    assert got["k_new"] == values["k"].data_ptr() and got["seqlen_new"] == 1 and got["kv_group"] == 4
    assert (got["k_new_batch"], got["k_new_row"], got["k_new_head"]) == values["k"].stride()[:3]
    assert got["capacity"] == 40 * 16 and got["page_size"] == 16 and got["num_pages"] == 100
    assert (got["page_magic"], got["page_shift"]) == fast_divisor(16) and got["causal"] == 1
    assert got["cache_seqlens"] == values["cache_seqlens"].data_ptr() and got["block_table_batch"] == 40
    assert got["k_cache_page"] == 16 * 2 * 128 and got["k_cache_row"] == 2 * 128 and got["k_cache_head"] == 128
    plan.run(-1, values)  # the stream's counts and partials again, not new ones
    assert values["counters"] is counts and values["partials"].data_ptr() == partials.data_ptr()


def test_unsplit_decode_plan_takes_no_scratch(driver, stub_kernels, cpu_device):
    plan, splits = plans.decode(-1, 128, BF16, True, 4, 64, 8, 640 + 1)  # 512 blocks fill the GPU
    assert splits == 1 and plan.scratch == ()
    values = decode_values(batch=64, splits=1)
    plan.run(-1, values)
    assert unpack(plan.kernels[0].spec, driver.launches[0]["params"])["counters"] == 0


def test_counts_are_one_buffer_per_stream_and_per_capture(driver, monkeypatch):
    """Eager calls share their stream's counts (its kernels run one after another); each stream of
    each CUDA graph capture gets counts of its own, cut from zeros made outside any capture while
    there are some, so no two kernels that may run at once count in one place."""
    monkeypatch.setattr(workspace, "_counts", {})
    monkeypatch.setattr(workspace, "_reserves", {})
    cpu = torch.device("cpu")
    first = workspace.counts(-1, 0xABC0, 0, 10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert workspace.counts(-1, 0xABC0, 0, 12, cpu) is first  # same stream: the same buffer
    grown = workspace.counts(-1, 0xABC0, 0, first.numel() + 1, cpu)
    assert grown.numel() > first.numel() and not grown.any()  # grown when too small
    assert workspace.counts(-1, 0xDEF0, 0, 10, cpu).data_ptr() not in (first.data_ptr(), grown.data_ptr())
    reserve = workspace._reserves[-1]
    in_seven = workspace.counts(-1, 0xABC0, 7, 20, cpu)  # capture 7 on the first stream
    assert in_seven.numel() == 20 and in_seven.data_ptr() == reserve.data_ptr()  # the reserve's first counts
    assert workspace.counts(-1, 0xABC0, 7, 20, cpu) is in_seven  # the capture's calls on that stream share them
    other_stream = workspace.counts(-1, 0xDEF0, 7, 20, cpu)  # a stream joined to capture 7: may run at once
    in_eight = workspace.counts(-1, 0xABC0, 8, 20, cpu)
    assert (other_stream.data_ptr(), in_eight.data_ptr()) == (reserve.data_ptr() + 80, reserve.data_ptr() + 160)
    monkeypatch.setitem(workspace._reserves, -1, reserve[:5])  # too few left: zeros of the capture's own
    own = workspace.counts(-1, 0xABC0, 9, 20, cpu)
    assert own.numel() == 20 and not own.any()
    assert own.data_ptr() not in (in_seven.data_ptr(), other_stream.data_ptr(), in_eight.data_ptr())
    assert (-1, 0xABC0, 9) not in workspace._counts  # a temporary of the capture (zeroed in each replay), never kept


def test_kept_buffers_are_made_on_a_thread_of_their_own(monkeypatch):
    """Counts, the reserve and kept scratch outlive the call, so they are allocated off the calling
    thread: PyTorch sends that thread's allocations to a CUDA-graph pool while torch.compile's CUDA
    graphs warm up, and reuses that pool's memory for other tensors later. A call's temporaries
    (scratch too big to keep) stay on the calling thread."""
    monkeypatch.setattr(workspace, "_counts", {})
    monkeypatch.setattr(workspace, "_reserves", {})
    monkeypatch.setattr(workspace, "_scratch", {})
    made_on = []
    real_zeros, real_empty = torch.zeros, torch.empty
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made_on.append(threading.get_ident()) or real_zeros(*a, **k))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made_on.append(threading.get_ident()) or real_empty(*a, **k))
    cpu, caller = torch.device("cpu"), threading.get_ident()
    workspace.counts(-1, 0xABC0, 0, 10, cpu)  # the stream's counts and the device's reserve
    workspace.scratch(-1, 0xABC0, 0, "partials", 100, torch.float32, cpu)
    assert len(made_on) == 3 and caller not in made_on
    made_on.clear()
    workspace.scratch(-1, 0xABC0, 0, "partials", workspace.KEEP_BYTES // 4 + 1, torch.float32, cpu)
    workspace.scratch(-1, 0xABC0, 5, "partials", 100, torch.float32, cpu)  # captured: the graph's own
    assert made_on == [caller, caller]


def test_eager_scratch_is_the_streams_own_and_a_capture_allocates(driver, monkeypatch):
    monkeypatch.setattr(workspace, "_scratch", {})
    cpu = torch.device("cpu")
    first = workspace.scratch(-1, 0xABC0, 0, "partials", 100, torch.float32, cpu)
    again = workspace.scratch(-1, 0xABC0, 0, "partials", 60, torch.float32, cpu)
    assert again.numel() == 60 and again.data_ptr() == first.data_ptr()  # reused, cut to size
    assert workspace.scratch(-1, 0xDEF0, 0, "partials", 60, torch.float32, cpu).data_ptr() != first.data_ptr()
    assert workspace.scratch(-1, 0xABC0, 3, "partials", 60, torch.float32, cpu).data_ptr() != first.data_ptr()  # captured
    big = workspace.KEEP_BYTES // 4 + 1
    assert workspace.scratch(-1, 0xABC0, 0, "partials", big, torch.float32, cpu).numel() == big
    assert workspace._scratch[(-1, 0xABC0, "partials")].data_ptr() == first.data_ptr()  # too big to keep


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_dependent_launches_wait_before_they_read(arch):
    """On sm_90a the decode kernel is a programmatic dependent launch: it waits for the grid ahead
    of it before its first read of global memory, and lets the next one be scheduled. Other
    targets have no such launch and render neither instruction."""
    from flashgen.compile import compile_ptx

    for spec in (tuning.decode_spec(128, "bf16", arch, True, rows=4),):
        assert spec.family.dependent_launch(spec) == (arch == "sm_90a")
        ptx = compile_ptx(spec, render(spec)).decode()
        if arch != "sm_90a":
            assert "griddepcontrol" not in ptx
            continue
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" not in ptx[:wait] and "cp.async" not in ptx[:wait], spec.name
        assert "griddepcontrol.launch_dependents" in ptx
    merge = tuning.merge_spec("merge", 128, "bf16", "sm_90a")  # merge_attention_states: an ordinary launch
    assert not merge.family.dependent_launch(merge) and "griddepcontrol" not in render(merge)


def test_the_paged_decode_reads_its_block_table_a_tile_ahead():
    """Each tile's block-table entries are read while the tile before it is computed, so that no
    copy waits on the table, one a 16-row group (its rows share a page); the contiguous kernel has
    no table."""
    source = render(tuning.decode_spec(128, "bf16", "sm_90a", True, rows=4))
    assert "if (next + 1 < n_tiles) read_pages((t_begin + next + 1) * BLOCK_N, pages);" in source
    assert "if (j == 0) in_page = cache.row_in(pages[g], pos, k_offset, v_offset);" in source
    assert source.count("cache.page_of(") == 1
    assert "read_pages" not in render(tuning.decode_spec(128, "bf16", "sm_90a", False, rows=4))


@pytest.mark.parametrize("paged", (False, True))
def test_tiles_of_cached_rows_copy_without_per_row_tests(paged):
    """Each tile but the one that holds the sequence's end takes the copy path with no per-row
    tests: its rows a row stride apart (within a 16-row group's page, paged)."""
    source = render(tuning.decode_spec(128, "bf16", "sm_90a", paged, rows=4))
    fast = source[source.index("if (n0 + BLOCK_N <= cached) {"):source.index("// The tile that holds the sequence's end")]
    assert "j * KV_ROWS_PER_PASS * cache.k_row" in fast and "return;" in fast
    assert "pos < cached" not in fast and "k_new" not in fast and "seqlen_k" not in fast
    assert ("cache.row_in(pages[g]" in fast) == paged


def test_unsplit_decode_writes_o_directly(driver, stub_kernels, cpu_device):
    plan, splits = plans.decode(-1, 128, BF16, True, 4, 64, 8, 641)
    assert splits == 1 and len(plan.kernels) == 1 and not plan.scratch  # 512 blocks fill the GPU
    values = decode_values(batch=64, kv_heads=8, heads=32, lse=False)
    plan.run(-1, values)
    (launch,) = driver.launches
    got = unpack(plan.kernels[0].spec, launch["params"])
    assert got["o"] == values["o"].data_ptr() and got["lse"] == 0 and got["partials"] == 0
    assert launch["grid"] == (1, 8, 64)


def test_forced_splits_and_contiguous_cache_without_append(driver, stub_kernels, cpu_device):
    q = torch.zeros(3, 5, 4, 64, dtype=FP16)
    cache = torch.zeros(3, 1000, 1, 64, dtype=FP16)
    plan, splits = plans.decode(-1, 64, FP16, False, 20, 3, 1, 1000, splits=7)
    assert splits == 7 and plan.kernels[0].spec.block_m == 64  # 20 packed rows: one 64-row block
    values = ops.decode_values(q, cache, cache, None, None, 700, None, 1000, 0, torch.empty_like(q), None, 7, False, 1.0)
    plan.run(-1, values)
    got = unpack(plan.kernels[0].spec, driver.launches[0]["params"])
    assert got["k_new"] == 0 and got["seqlen_new"] == 0 and got["cache_seqlens"] == 0 and got["cache_len"] == 700
    assert got["capacity"] == 1000 and got["k_cache_batch"] == 1000 * 64 and driver.launches[0]["grid"] == (7, 1, 3)


def test_variant_decode_plan_packs_the_values_per_row(driver, stub_kernels, cpu_device):
    from flashgen import variants

    plan, splits = plans.decode(-1, 128, BF16, True, 4, 2, 2, 640 + 1, 0, ("window", "softcap", "alibi"))
    spec = plan.kernels[0].spec
    assert spec.kind == "decode_paged" and spec.variants == ("window", "softcap", "alibi")
    slopes = torch.ones(2, 8)
    chosen = variants.Variant({"window_left": 100, "window_right": 0, "softcap": 7.0, "alibi_slopes": slopes})
    values = decode_values(splits=splits)
    values.update(chosen.values())
    plan.run(-1, values)
    got = unpack(spec, driver.launches[0]["params"])
    assert (got["window_left"], got["window_right"]) == (100, 0) and got["softcap_scale"] == pytest.approx(0.125 / 7.0)
    assert got["scale_log2"] == pytest.approx(7.0 * 1.4426950408889634) and got["alibi_scale"] == pytest.approx(1 / 7.0)
    assert got["alibi_slopes"] == slopes.data_ptr() and got["alibi_batch_stride"] == 8
    assert plans.decode(-1, 128, BF16, True, 4, 2, 2, 641)[0].kernels[0].spec.variants == ()  # the plain kernel apart


def test_rotary_and_cache_rows_are_packed(driver, stub_kernels, cpu_device):
    """The rotary kernel takes the tables (copied when they do not start on a 16-byte boundary)
    and their sizes; the contiguous kernel the cache rows, the left pads and the cache's rows."""
    plan, splits = plans.decode(-1, 64, BF16, False, 4, 2, 2, 101, 0, (), "interleaved")
    spec = plan.kernels[0].spec
    assert spec.kind == "decode" and spec.rotary == "interleaved" and spec.name.endswith("_rope_interleaved")
    assert plans.decode(-1, 64, BF16, False, 4, 2, 2, 101)[0].kernels[0].spec.rotary == ""  # the plain kernel apart
    q, k = torch.zeros(2, 1, 8, 64, dtype=BF16), torch.zeros(2, 1, 2, 64, dtype=BF16)
    k_cache = torch.zeros(5, 100, 2, 64, dtype=BF16)
    values = ops.decode_values(q, k_cache, k_cache, k, k, torch.zeros(2, dtype=torch.int32), None, 100, 1, torch.empty_like(q),
                                   None, splits, True, 0.125)
    cos, sin = torch.zeros(101, 16, dtype=BF16), torch.zeros(102, 16, dtype=BF16)[1:]  # sin starts 32 bytes in: fine
    odd = torch.zeros(102 * 16 + 4, dtype=BF16)[4:].view(102, 16)[1:]  # 8 bytes off a 16-byte boundary: copied
    idx, pads = torch.tensor([4, 0], dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)[:, 1]  # pads: stride 2, copied
    values.update(ops.decode_extras(idx, pads, cos, odd))
    plan.run(-1, values)
    got = unpack(spec, driver.launches[0]["params"])
    assert got["rotary_cos"] == cos.data_ptr() and got["rotary_sin"] not in (0, odd.data_ptr()) and got["rotary_sin"] % 16 == 0
    assert (got["rotary_dim"], got["rotary_rows"]) == (32, 101)
    assert got["cache_batch_idx"] == idx.data_ptr() and got["cache_batches"] == 5
    assert got["cache_leftpad"] not in (0, pads.data_ptr())
    assert ops.decode_extras(None, None, sin, sin)["rotary_sin"] is sin
    paged_spec = plans.decode(-1, 64, BF16, True, 4, 2, 2, 101, 0, (), "halves")[0].kernels[0].spec
    names = {p.name for p in paged_spec.family.params(paged_spec).params}
    assert {"rotary_cos", "rotary_dim"} <= names and not {"cache_batch_idx", "cache_leftpad"} & names


def test_paged_varlen_runs_the_decode_kernels_varlen_form(driver, stub_kernels, cpu_device):
    """attention_varlen over a block table: one decode_paged launch over the sequences (grid z), its
    rows sized by max_seqlen_q, the offsets read on the device, lse in the varlen layout."""
    from flashgen import variants

    q = torch.zeros(9, 32, 128, dtype=BF16)  # 32 query heads on 8 KV heads
    k_cache = torch.zeros(40, 16, 8, 128, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3, 3, 9], dtype=torch.int32), torch.tensor([0, 100, 140, 500], dtype=torch.int32)
    table = torch.zeros(3, 40, dtype=torch.int32)
    o, lse = ops.paged_varlen(q, k_cache, k_cache, cu_q, cu_k, 6, 500, table, True, 0.125, variants.PLAIN, True)
    assert o.shape == q.shape and lse.shape == (32, 9)
    (launch,) = driver.launches
    plan, splits = plans.decode(-1, 128, BF16, True, 6 * 4, 3, 8, 500, 0, (), "", True)
    spec = plan.kernels[0].spec
    assert spec.kind == "decode_paged" and spec.varlen and spec.name.endswith("_varlen") and spec.block_m == 64
    got = unpack(spec, launch["params"])
    assert (got["cu_seqlens_q"], got["cu_seqlens_k"], got["total_q"], got["seqlen_q"]) == (cu_q.data_ptr(), cu_k.data_ptr(), 9, 6)
    assert got["lse"] == lse.data_ptr() and got["o"] == o.data_ptr() and got["seqlen_new"] == 0 and got["capacity"] == 640
    assert (got["q_row"], got["q_head"]) == (32 * 128, 128)
    assert launch["grid"] == (splits, 8, 3)  # one row tile (24 rows) x splits, KV heads, sequences
    driver.launches.clear()
    ops.paged_varlen(q, k_cache, k_cache, cu_q, cu_k, 4000, 500, table, True, 0.125, variants.PLAIN, True)
    assert unpack(spec, driver.launches[0]["params"])["seqlen_q"] == 9  # an inflated max_seqlen_q: at most total_q


@pytest.mark.parametrize("fields, message", [
    (dict(kind="decode", varlen=True), "a decode kernel takes packed sequences over a paged cache"),
    (dict(kind="decode_paged", varlen=True, rotary="halves"), "rotary embedding turns appended keys, and packed sequences append none"),
])
def test_decode_varlen_specs_are_paged_and_append_nothing(fields, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(head_dim=64, block_m=16, block_n=64, num_stages=3, **fields)


@pytest.mark.parametrize("variant", [("alibi",), ("window", "alibi"), ("softcap", "alibi")], ids="-".join)
def test_varlen_decode_aligns_each_sequence_to_its_own_queries(variant):
    """In the varlen form the seqlen_q parameter is the longest sequence's query count: past the
    line that reads the sequence's own (q_len), it only sizes the partials' layout, so ALiBi's
    distances and the masks are aligned to each sequence's own length (query i at key position
    i + seqlen_k - q_len)."""
    source = render(tuning.decode_spec(128, "bf16", "sm_90a", True, 4, variant, varlen=True))
    body = source.split("const int q_len =", 1)[1].split("\n", 1)[1]
    uses = [line.strip() for line in body.splitlines() if re.search(r"\bseqlen_q\b", line.split("//")[0])]
    assert uses and all(re.search(r"\* seqlen_q\b", line) for line in uses), uses
    assert "alibi_scale, seqlen_k - q_len)" in body


def test_a_kernel_without_rotary_renders_no_trace_of_it():
    plain = render(tuning.decode_spec(64, "bf16", "sm_90a", False, 4))
    assert "otary" not in plain
    for style in ("interleaved", "halves"):
        source = render(tuning.decode_spec(64, "bf16", "sm_90a", True, 4, rotary=style))
        assert "struct Rotary" in source and f"({style})" in source.splitlines()[1]


def test_a_window_splits_only_the_keys_it_sees(driver, stub_kernels, cpu_device, monkeypatch):
    """attention_with_kvcache sizes the split count by the keys one block's windows can see (the
    shapes and the window, never the lengths): a 256-key window over a 64k cache splits like a
    short cache."""
    seen = []
    real = plans.decode
    monkeypatch.setattr(plans, "decode", lambda *args, **kw: seen.append(args) or real(*args, **kw))
    monkeypatch.setattr(serving, "check_kvcache_inputs", lambda *args: (True, 65536, 1, serving._variant(args[0], *args[8:12], 65536), ""))
    q, k_cache, v_cache, k, v = t(1, 1, 8, 128), t(4096, 16, 2, 128), t(4096, 16, 2, 128), t(1, 1, 2, 128), t(1, 1, 2, 128)
    table = torch.zeros(1, 4096, dtype=torch.int32)
    for window in ((-1, -1), (256, 0), (256, -1)):
        flashgen.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.zeros(1, dtype=torch.int32), block_table=table,
                                        causal=False, window_size=window)
    assert [args[7] for args in seen] == [65537, 1 + 256 + 0, 65537]  # the last: unbounded on the right
    assert seen[1][9] == ("window",) and seen[0][9] == ()
    whole, windowed = (real(*args)[1] for args in seen[:2])
    assert windowed < whole


def test_merge_reads_both_states_as_one_tensor(driver, stub_kernels, cpu_device):
    o_a, o_b = torch.zeros(2, 7, 3, 64), torch.zeros(2, 7, 3, 64)
    lse_a, lse_b = torch.zeros(2, 3, 7).transpose(1, 2), torch.zeros(2, 3, 7).transpose(1, 2)  # FlashAttention's lse, transposed
    o, lse = torch.empty_like(o_a), torch.empty(2, 7, 3)
    plan = plans.merge(-1, 64, torch.float32)
    assert plan.kernels[0].spec.kind == "merge_fp32"
    plan.run(-1, {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b, "o": o, "lse": lse})
    got = unpack(plan.kernels[0].spec, driver.launches[0]["params"])
    assert got["parts_split"] * 4 == o_b.data_ptr() - o_a.data_ptr()
    assert got["parts_lse_split"] * 4 == lse_b.data_ptr() - lse_a.data_ptr()
    assert (got["parts_lse_x"], got["parts_lse_y"], got["parts_lse_z"]) == lse_a.stride()
    assert (got["size_y"], got["size_z"], got["rows"]) == (7, 3, 42) and driver.launches[0]["grid"] == (-(-42 // 4), 1, 1)


# ---- input errors ------------------------------------------------------------------------------


def t(*shape, dtype=BF16, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def inputs(paged=False, **changes):
    """A valid call's arguments (on the CPU): B=2, 1 query token, 8 heads on 2 KV heads, d=64."""
    args = {
        "q": t(2, 1, 8, 64), "k_cache": t(2, 100, 2, 64), "v_cache": t(2, 100, 2, 64), "k": t(2, 1, 2, 64),
        "v": t(2, 1, 2, 64), "cache_seqlens": torch.tensor([3, 5], dtype=torch.int32), "block_table": None,
    }
    if paged:
        args.update(k_cache=t(30, 16, 2, 64), v_cache=t(30, 16, 2, 64), block_table=torch.zeros(2, 7, dtype=torch.int32))
    args.update(changes)
    return args


VARIANT_ARGUMENTS = ("window_size", "softcap", "alibi_slopes")
ROW_ARGUMENTS = ("rotary_cos", "rotary_sin", "rotary_interleaved", "cache_batch_idx", "cache_leftpad")


def kvcache_error(error, match, paged=False, **changes):
    args = inputs(paged, **changes)
    keywords = {name: args.pop(name) for name in ("cache_seqlens", "block_table")}
    keywords.update({name: args.pop(name) for name in ("softmax_scale", "num_splits", "causal", *VARIANT_ARGUMENTS, *ROW_ARGUMENTS)
                     if name in args})
    with pytest.raises(error, match=match):
        flashgen.attention_with_kvcache(*args.values(), **keywords)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_valid_call_reaches_the_device_check(paged):
    kvcache_error(ValueError, "attention_with_kvcache runs on NVIDIA GPUs: q, k_cache, v_cache.* are on cpu", paged)


ERRORS = [
    (TypeError, "q must be a torch.Tensor, got list", dict(q=[1.0])),
    (ValueError, r"q must have 4 dimensions \(batch, seqlen_q, heads, head_dim\)", dict(q=t(2, 8, 64))),
    (ValueError, r"k_cache must have 4 dimensions \(batch, seqlen_cache, heads_kv, head_dim\)", dict(k_cache=t(2, 100, 128))),
    (TypeError, "q has dtype torch.float32", dict(q=t(2, 1, 8, 64, dtype=torch.float32))),
    (TypeError, "q, k_cache, v_cache must share one dtype; got q torch.bfloat16, k_cache torch.bfloat16, v_cache torch.float16", dict(v_cache=t(2, 100, 2, 64, dtype=FP16))),
    (ValueError, "k_cache and v_cache must have the same shape", dict(v_cache=t(2, 99, 2, 64))),
    (ValueError, "same head_dim; got q 64, k_cache 32", dict(k_cache=t(2, 100, 2, 32), v_cache=t(2, 100, 2, 32))),
    (ValueError, r"head_dim=100 is not supported", dict(q=t(2, 1, 8, 100), k_cache=t(2, 100, 2, 100), v_cache=t(2, 100, 2, 100),
                                                     k=t(2, 1, 2, 100), v=t(2, 1, 2, 100))),
    (ValueError, "q has 8 heads and the caches have 3: .* multiple", dict(k_cache=t(2, 100, 3, 64), v_cache=t(2, 100, 3, 64))),
    (ValueError, "k and v are appended together: got k a tensor and v None", dict(v=None)),
    (ValueError, "k and v are appended together: got k None and v a tensor", dict(k=None)),
    (TypeError, "q, k, v must share one dtype; got q torch.bfloat16, k torch.float16", dict(k=t(2, 1, 2, 64, dtype=FP16))),
    (ValueError, "k and v must have the same shape", dict(v=t(2, 2, 2, 64))),
    (ValueError, r"k and v must be \(batch, seqlen_new, heads_kv, head_dim\) = \(2, seqlen_new, 2, 64\)", dict(k=t(2, 1, 8, 64), v=t(2, 1, 8, 64))),
    (ValueError, "k and v are appended at cache_seqlens: pass cache_seqlens", dict(cache_seqlens=None)),
    (TypeError, "cache_seqlens must have dtype torch.int32, got torch.int64", dict(cache_seqlens=torch.tensor([3, 5]))),
    (ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\)", dict(cache_seqlens=torch.tensor([3], dtype=torch.int32))),
    (TypeError, "cache_seqlens must be None, an int or an int32 tensor, got float", dict(cache_seqlens=3.0)),
    (ValueError, r"cache_seqlens=101: must be in \[0, 100\]", dict(cache_seqlens=101)),
    (ValueError, r"cache_seqlens=-1: must be in \[0, 100\]", dict(cache_seqlens=-1)),
    (ValueError, "k_cache has batch 3 and q 2: a contiguous cache", dict(k_cache=t(3, 100, 2, 64), v_cache=t(3, 100, 2, 64))),
    (ValueError, r"num_splits=-1: must be an int in \[0, 128\]", dict(num_splits=-1)),
    (ValueError, r"num_splits=129: must be an int in \[0, 128\]", dict(num_splits=129)),
    (ValueError, r"num_splits=2.0", dict(num_splits=2.0)),
    (ValueError, "q's last dimension must be contiguous", dict(q=t(2, 1, 64, 8).transpose(-1, -2))),
    (ValueError, r"q has shape \(2, 0, 8, 64\), no query rows, and k, v hold 1 new tokens", dict(q=t(2, 0, 8, 64))),
    (ValueError, "k_cache must have 16-byte aligned rows .* written in place", dict(k_cache=t(2, 100, 2, 68)[..., :64])),
    (ValueError, "q, k_cache, v_cache.* must be on one device; got q cpu, k_cache meta", dict(k_cache=t(2, 100, 2, 64, device="meta"))),
]


@pytest.mark.parametrize("error, match, changes", ERRORS, ids=[m[:40] for _, m, _ in ERRORS])
def test_contiguous_cache_errors(error, match, changes):
    kvcache_error(error, match, **changes)


PAGED_ERRORS = [
    (TypeError, "block_table must have dtype torch.int32, got torch.int64", dict(block_table=torch.zeros(2, 7, dtype=torch.long))),
    (TypeError, "block_table must be a torch.Tensor, got list", dict(block_table=[[0]])),
    (ValueError, r"block_table must be \(batch, max_blocks_per_sequence\) with batch 2", dict(block_table=torch.zeros(3, 7, dtype=torch.int32))),
    (ValueError, r"page_size=24 \(k_cache.shape\[1\]\) is not supported: .* multiple of 16 tokens from 16 to 256",
     dict(k_cache=t(30, 24, 2, 64), v_cache=t(30, 24, 2, 64))),
    (ValueError, r"page_size=512", dict(k_cache=t(30, 512, 2, 64), v_cache=t(30, 512, 2, 64))),
    (ValueError, r"cache_seqlens=113: must be in \[0, 112\]", dict(cache_seqlens=113)),
    (ValueError, r"k_cache must have 4 dimensions \(num_blocks, page_size, heads_kv, head_dim\) with a block_table", dict(k_cache=t(30, 16, 128))),
]


@pytest.mark.parametrize("error, match, changes", PAGED_ERRORS, ids=[m[:40] for _, m, _ in PAGED_ERRORS])
def test_paged_cache_errors(error, match, changes):
    kvcache_error(error, match, paged=True, **changes)


def test_every_page_size_the_kernels_take_passes_the_checks():
    for page_size in PAGE_SIZES:
        kvcache_error(ValueError, "runs on NVIDIA GPUs", paged=True, k_cache=t(30, page_size, 2, 64), v_cache=t(30, page_size, 2, 64))


VARIANT_ERRORS = [
    (ValueError, r"window_size=\(3,\): must be \(left, right\)", dict(window_size=(3,))),
    (ValueError, r"window_size=\(0, -2\)", dict(window_size=(0, -2))),
    (ValueError, r"window_size=\(1.5, 0\)", dict(window_size=(1.5, 0))),
    (ValueError, "softcap=-2.0: must be a finite number >= 0", dict(softcap=-2.0)),
    (ValueError, "softcap=inf", dict(softcap=float("inf"))),
    (ValueError, r"alibi_slopes has shape \(2,\); it must be \(8,\) or \(2, 8\)", dict(alibi_slopes=torch.ones(2))),
    (ValueError, r"alibi_slopes has shape \(8, 2\); it must be \(8,\) or \(2, 8\)", dict(alibi_slopes=torch.ones(8, 2))),
    (TypeError, "alibi_slopes has dtype torch.bfloat16; it must be torch.float32", dict(alibi_slopes=torch.ones(8, dtype=BF16))),
    (ValueError, "alibi_slopes' last dimension must be contiguous", dict(alibi_slopes=torch.ones(2, 16)[:, ::2])),
    (ValueError, "alibi_slopes is on meta, the inputs on cpu", dict(alibi_slopes=torch.ones(8, device="meta"))),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("error, match, changes", VARIANT_ERRORS, ids=[m[:40] for _, m, _ in VARIANT_ERRORS])
def test_variant_errors(error, match, changes, paged):
    """Named before the device check (CPU tensors), in attention_with_kvcache and its reference."""
    kvcache_error(error, match, paged, **changes)
    args = inputs(paged)
    keywords = {name: args.pop(name) for name in ("cache_seqlens", "block_table")}
    with pytest.raises(error, match=match):
        reference.attention_with_kvcache(*args.values(), **keywords, **changes)


COS = t(100, 16)  # rotary tables: 100 positions, rotary_dim 32
ROW_ERRORS = [
    (TypeError, "cache_batch_idx must have dtype torch.int32, got torch.int64", dict(cache_batch_idx=torch.tensor([0, 1]))),
    (ValueError, r"cache_batch_idx must have shape \(batch,\) = \(2,\); got \(3,\)", dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32))),
    (TypeError, "cache_leftpad must be a torch.Tensor, got list", dict(cache_leftpad=[0, 1])),
    (TypeError, "cache_leftpad must have dtype torch.int32, got torch.float32", dict(cache_leftpad=torch.zeros(2))),
    (ValueError, "rotary_cos and rotary_sin come together: pass both or neither", dict(rotary_cos=COS)),
    (ValueError, "rotary_cos and rotary_sin come together", dict(rotary_sin=COS)),
    (ValueError, r"rotary_sin must have 2 dimensions \(seqlen_ro, rotary_dim / 2\)", dict(rotary_cos=COS, rotary_sin=t(100))),
    (TypeError, "q, rotary_cos, rotary_sin must share one dtype; got q torch.bfloat16, rotary_cos torch.float32",
     dict(rotary_cos=t(100, 16, dtype=torch.float32), rotary_sin=COS)),
    (ValueError, "rotary_cos and rotary_sin must have the same shape", dict(rotary_cos=COS, rotary_sin=t(100, 8))),
    (ValueError, "pass the new k and v as well", dict(rotary_cos=COS, rotary_sin=COS, k=None, v=None)),
    (ValueError, r"rotary_dim=24 \(2 \* rotary_cos.shape\[1\]\): must be a multiple of 16", dict(rotary_cos=t(100, 12), rotary_sin=t(100, 12))),
    (ValueError, "rotary_dim=80 .* at most head_dim=64", dict(rotary_cos=t(100, 40), rotary_sin=t(100, 40))),
    (ValueError, "rotary_dim=0", dict(rotary_cos=t(100, 0), rotary_sin=t(100, 0))),
    (ValueError, "rotary_cos has 99 positions: it needs at least the cache's capacity, 100", dict(rotary_cos=t(99, 16), rotary_sin=t(99, 16))),
    (TypeError, "rotary_interleaved must be True or False, got 'yes'", dict(rotary_cos=COS, rotary_sin=COS, rotary_interleaved="yes")),
    (ValueError, "must be on one device; got .* rotary_sin meta", dict(rotary_cos=COS, rotary_sin=t(100, 16, device="meta"))),
    (ValueError, "must be on one device; got .* cache_leftpad meta",
     dict(cache_leftpad=torch.zeros(2, dtype=torch.int32, device="meta"))),
]


@pytest.mark.parametrize("error, match, changes", ROW_ERRORS, ids=[m[:40] for _, m, _ in ROW_ERRORS])
def test_rotary_and_cache_row_errors(error, match, changes):
    kvcache_error(error, match, **changes)


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
def test_cache_rows_take_a_contiguous_cache(name):
    kvcache_error(ValueError, f"{name} takes a contiguous cache: a paged sequence's rows are the ones its block_table names",
                  paged=True, **{name: torch.zeros(2, dtype=torch.int32)})


def test_good_rotary_and_cache_rows_reach_the_device_check():
    idx = torch.tensor([2, 0], dtype=torch.int32)
    for changes in (dict(rotary_cos=COS, rotary_sin=COS), dict(rotary_cos=COS, rotary_sin=COS, rotary_interleaved=False, causal=True),
                    dict(rotary_cos=t(100, 32)[:, :16], rotary_sin=t(101, 16)[1:]),  # strided or offset tables are fine
                    dict(cache_batch_idx=idx, k_cache=t(3, 100, 2, 64), v_cache=t(3, 100, 2, 64)),  # a cache of 3 rows for 2 sequences
                    dict(cache_leftpad=torch.tensor([1, 2], dtype=torch.int32))):
        kvcache_error(ValueError, "runs on NVIDIA GPUs", **changes)
    kvcache_error(ValueError, "runs on NVIDIA GPUs", True, rotary_cos=t(112, 16), rotary_sin=t(112, 16))  # paged: 7 pages of 16


def test_good_variants_reach_the_device_check():
    for changes in (dict(window_size=(100, 0), causal=True), dict(softcap=30.0), dict(alibi_slopes=torch.ones(2, 8)),
                    dict(window_size=(7, 3), softcap=1.0, alibi_slopes=torch.ones(8))):
        kvcache_error(ValueError, "runs on NVIDIA GPUs", True, **changes)


MERGE_ERRORS = [
    (TypeError, "o_b must be a torch.Tensor", dict(o_b=None)),
    (TypeError, "o_a has dtype torch.float64", dict(o_a=t(2, 3, 64, dtype=torch.float64), o_b=t(2, 3, 64, dtype=torch.float64))),
    (TypeError, "o_a and o_b must share one dtype", dict(o_b=t(2, 3, 64, dtype=FP16))),
    (TypeError, "lse_b must have dtype torch.float32, got torch.bfloat16", dict(lse_b=t(2, 3))),
    (ValueError, "o_a and o_b must have one shape", dict(o_b=t(2, 4, 64))),
    (ValueError, r"lse_a must have shape o.shape\[:-1\] = \(2, 3\) .* lse.transpose\(1, 2\)", dict(lse_a=t(3, 2, dtype=torch.float32))),
    (ValueError, r"head_dim=12 \(o's last dimension\) is not supported", dict(o_a=t(2, 3, 12), o_b=t(2, 3, 12))),
    (ValueError, "merge_attention_states runs on NVIDIA GPUs", {}),
]


@pytest.mark.parametrize("error, match, changes", MERGE_ERRORS, ids=[m[:40] for _, m, _ in MERGE_ERRORS])
def test_merge_errors(error, match, changes):
    args = {"o_a": t(2, 3, 64), "lse_a": t(2, 3, dtype=torch.float32), "o_b": t(2, 3, 64), "lse_b": t(2, 3, dtype=torch.float32), **changes}
    with pytest.raises(error, match=match):
        flashgen.merge_attention_states(**args)


# ---- flashgen bench --decode's report (the numbers need a GPU) ---------------------------------


def test_decode_report_renders_as_markdown():
    from flashgen import bench

    row = {"B": 1, "T": 65536, "layout": "paged 16", "cache": "bf16", "flashgen_us": 70.0, "flash_us": 80.2, "cudnn_us": None,
           "floor_us": 62.4, "vs_floor": 70 / 62.4, "vs_best_sdpa": 70 / 80.2, "vs_bf16_cache": None, "tbs": 3.8, "splits": 32,
           "kernels": "decode_paged_d128_m16_n64_bf16_w4_s3_sm90a + combine_d128_bf16_sm90a"}
    fp8 = {**row, "cache": "e4m3", "flashgen_us": 38.0, "floor_us": 31.2, "vs_floor": 38 / 31.2, "vs_bf16_cache": 38 / 70,
           "vs_best_sdpa": 38 / 80.2, "kernels": "decode_paged_d128_m16_n64_bf16_kve4m3_w4_s3_sm90a"}
    text = bench.decode_markdown({"copy_rate_tbs": 4.3, "decode": [row, fp8], "decode_host_us": {"flashgen": 19.5, "sdpa": 24.0},
                                  "decode_rotary_us": {"T": 8192, "plain": 12.4, "rotary": 12.61}})
    assert "| 1 | 64k | paged 16 | bf16 | 70.0 | 80.2 | - | 62.4 | 1.12 | 0.87 | - | 3.80 | 32 | decode_paged" in text
    assert "| 1 | 64k | paged 16 | e4m3 | 38.0 | 80.2 | - | 31.2 | 1.22 | 0.47 | 0.54 | 3.80 | 32 | decode_paged_d128_m16_n64_bf16_kve4m3" in text
    assert "4.30 TB/s" in text and "flashgen 19.5 us, one SDPA call 24.0 us" in text
    assert "(B = 1, 8k contiguous, rotary_cos / rotary_sin): 12.6 us against 12.4 us without" in text


def test_bench_decode_refuses_a_plot():
    from click.testing import CliRunner

    from flashgen.cli import main

    result = CliRunner().invoke(main, ["bench", "--decode", "--plot", "x.png"])
    assert result.exit_code == 1 and "--decode has none" in result.output


def test_a_serving_plan_is_never_sliced(driver, stub_kernels, cpu_device, monkeypatch):
    """Its grid puts batch and KV heads where the checks keep them (at most 65,535 each), so
    70,000 query tokens (q.shape[1], where the forward's plans keep heads) are one launch."""
    monkeypatch.setattr(plans, "slices", lambda values: pytest.fail("a serving plan was sliced"))
    q = torch.zeros(1, 1, 8, 64, dtype=BF16).expand(1, 70_000, 8, 64)
    cache = torch.zeros(1, 16, 2, 64, dtype=BF16)
    plan, splits = plans.decode(-1, 64, BF16, False, 70_000 * 4, 1, 2, 16)
    assert plan.whole and splits == 1
    plan.run(-1, ops.decode_values(q, cache, cache, None, None, None, None, 16, 0, torch.empty(1, 1, 8, 64, dtype=BF16), None, 1, True, 1.0))
    (launch,) = driver.launches
    assert launch["grid"] == (-(-70_000 * 4 // 64), 2, 1)


# ---- torch.compile: the serving functions trace as custom ops (fake CUDA tensors, no GPU) ---------


def test_serving_functions_trace_as_custom_ops_under_torch_compile():
    """fullgraph=True: attention_with_kvcache (rotary tables, an int length), merge_attention_states and
    attention_varlen over pages each become one op in the graph dynamo captures; the caches are
    declared mutated (the appends)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k_cache, v_cache, k, v, cos, table, cu, packed_q):
        out, lse = flashgen.attention_with_kvcache(q, k_cache, v_cache, k, v, cos, cos, cache_seqlens=7, causal=True,
                                                   window_size=(64, 0), return_softmax_lse=True)
        merged, _ = flashgen.merge_attention_states(out, lse.transpose(1, 2), out, lse.transpose(1, 2))
        packed = flashgen.attention_varlen(packed_q, k_cache, v_cache, cu, cu, 1, 100, causal=True, block_table=table)
        return merged * 2, packed

    compiled = torch.compile(step, backend=capture, fullgraph=True)
    with FakeTensorMode():
        cuda = dict(device="cuda", dtype=BF16)
        q, k = torch.empty(2, 1, 8, 64, **cuda), torch.empty(2, 1, 2, 64, **cuda)
        k_cache, v_cache = torch.empty(10, 16, 2, 64, **cuda), torch.empty(10, 16, 2, 64, **cuda)
        table, cu = torch.empty(2, 5, device="cuda", dtype=torch.int32), torch.empty(3, device="cuda", dtype=torch.int32)
        merged, packed = compiled(q, k_cache, v_cache, k, torch.empty(2, 1, 2, 64, **cuda), torch.empty(80, 32, **cuda), table, cu,
                                  torch.empty(2, 8, 64, **cuda))
    assert merged.shape == q.shape and packed.shape == (2, 8, 64)
    (graph,) = graphs
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function" and "flashgen" in str(node.target)]
    assert ops == ["flashgen.attention_with_kvcache.default", "flashgen.merge_attention_states.default",
                   "flashgen.attention_varlen_paged.default"]
    mutated = {a.name for a in torch.ops.flashgen.attention_with_kvcache.default._schema.arguments if a.alias_info and a.alias_info.is_write}
    assert mutated == {"k_cache", "v_cache"}


def test_the_signatures_are_flash_attns():
    """Parameter names and order of FlashAttention-2's flash_attn_with_kvcache and
    flash_attn_varlen_func (return_attn_probs is return_lse here, issue 10's name), so calls swap
    whether they pass arguments by position or by name."""
    import inspect

    kvcache = ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
               "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved",
               "alibi_slopes", "num_splits", "return_softmax_lse"]
    varlen = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
              "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_lse", "block_table"]
    fp8 = ["q_descale", "k_descale", "v_descale", "out_dtype"]  # (FlashAttention-3's FP8 names, by name)
    for fn, names, by_name in ((flashgen.attention_with_kvcache, kvcache, ["k_descale", "v_descale"]), (flashgen.attention_varlen, varlen, fp8)):
        parameters = inspect.signature(fn).parameters.values()
        assert [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD] == names
        assert [p.name for p in parameters if p.kind == p.KEYWORD_ONLY] == ["learnable_sink", *by_name]  # (flashgen's own, by name)
    assert inspect.signature(flashgen.attention_with_kvcache).parameters["rotary_interleaved"].default is True


@pytest.mark.parametrize("style", ["interleaved", "halves"])
def test_rotary_rounds_each_product_and_sum_on_its_own(style):
    """What makes the stored keys bitwise reference.apply_rotary's (torch rounds x * cos, y * sin and
    their sum each to fp32): the rotation is mul.rn / add.rn / sub.rn in the PTX, which ptxas never
    fuses, and it adds no fused multiply-add to the kernel's."""
    from flashgen.compile import compile_ptx

    def ptx(rotary):
        spec = tuning.decode_spec(128, "bf16", "sm_90a", False, 4, rotary=rotary)
        return compile_ptx(spec, render(spec)).decode()

    plain, turned = ptx(""), ptx(style)
    assert "mul.rn.f32" not in plain and turned.count("mul.rn.f32") >= 8
    assert "add.rn.f32" in turned and "sub.rn.f32" in turned
    assert turned.count("fma.rn.f32") == plain.count("fma.rn.f32")


@pytest.mark.parametrize("cache_seqlens", [torch.tensor([100, 630], dtype=torch.int32), 50, None], ids=["tensor", "int", "none"])
def test_a_long_chunk_with_an_append_stores_it_then_runs_the_paged_hopper_forward(driver, stub_kernels, cpu_device, monkeypatch,
                                                                                cache_seqlens):
    """attention_with_kvcache with 2048 new queries, keys and values over a paged cache: the append
    kernel stores the new rows into the pages (seqlen_new of them, from cache_seqlens), then the
    paged Hopper forward reads every key through the block table, each sequence cache_seqlens[b]
    (clamped to the capacity) + seqlen_new keys long, the rows past the pages from k and v."""
    from flashgen.families import hopper

    maps = hopper.HopperForward.helpers
    fake_map = lambda t, rows, cols=64: t.data_ptr().to_bytes(8, "little") * 15 + rows.to_bytes(8, "little")  # noqa: E731
    monkeypatch.setattr(hopper.HopperForward, "helpers", lambda self, spec: {**maps(self, spec), "tensor_map": fake_map})
    seen, run = {}, ops._run_paged_prefill
    monkeypatch.setattr(ops, "_run_paged_prefill", lambda *args, **kw: (seen.update(cu_seqlens_k=args[5].clone()), run(*args, **kw)))
    batch, new, heads, kv_heads, d, page_size = 2, 2048, 8, 2, 128, 16
    q = torch.zeros(batch, new, heads, d, dtype=BF16)
    k_cache, v_cache = (torch.zeros(400, page_size, kv_heads, d, dtype=BF16) for _ in range(2))
    k, v = (torch.zeros(batch, new, kv_heads, d, dtype=BF16) for _ in range(2))
    table = torch.zeros(batch, 40, dtype=torch.int32)  # capacity 640
    o, lse = ops.kvcache(q, k_cache, v_cache, k, v, cache_seqlens, table, True, 640, new, 0.125, True, variants.PLAIN, "",
                         None, None, None, None, 0, True)
    assert o.shape == q.shape and lse.shape == (batch, heads, new)
    append, forward = driver.launches
    append_spec = plans.kv_append(-1, d, BF16).kernels[0].spec
    got = unpack(append_spec, append["params"])
    assert append_spec.kind == "append_paged" and append["grid"] == (64, kv_heads, batch)
    assert (got["k_new"], got["v_new"], got["seqlen_new"], got["capacity"]) == (k.data_ptr(), v.data_ptr(), new, 640)
    assert got["cache_seqlens"] == (cache_seqlens.data_ptr() if isinstance(cache_seqlens, torch.Tensor) else 0)
    forward_spec = plans.paged_prefill(-1, d, BF16, True, new).kernels[0].spec
    got = unpack(forward_spec, forward["params"])
    assert forward_spec.paged and got["seqlen_new"] == new and got["max_blocks"] == 40 and got["page_size"] == page_size
    assert got["k_new_map"][:8] == k.data_ptr().to_bytes(8, "little") and got["v_new_map"][:8] == v.data_ptr().to_bytes(8, "little")
    cached = [100, 630] if isinstance(cache_seqlens, torch.Tensor) else [50, 50] if cache_seqlens else [640, 640]
    assert seen["cu_seqlens_k"].tolist() == [0, cached[0] + new, cached[0] + cached[1] + 2 * new]


def test_a_long_chunk_with_no_new_rows_appends_nothing(driver, stub_kernels, cpu_device, monkeypatch):
    """k and v of zero rows over a paged cache: no append launch, and no map made of them."""
    from flashgen.families import hopper

    maps = hopper.HopperForward.helpers
    fake_map = lambda t, rows, cols=64: t.data_ptr().to_bytes(8, "little") * 15 + rows.to_bytes(8, "little")  # noqa: E731
    monkeypatch.setattr(hopper.HopperForward, "helpers", lambda self, spec: {**maps(self, spec), "tensor_map": fake_map})
    q = torch.zeros(2, 300, 8, 128, dtype=BF16)
    k_cache = torch.zeros(100, 16, 2, 128, dtype=BF16)
    k = torch.zeros(2, 0, 2, 128, dtype=BF16)
    ops.kvcache(q, k_cache, k_cache, k, k, 40, torch.zeros(2, 40, dtype=torch.int32), True, 640, 0, 0.125, True, variants.PLAIN,
                "", None, None, None, None, 0, False)
    (forward,) = driver.launches
    spec = plans.paged_prefill(-1, 128, BF16, True, 300).kernels[0].spec
    got = unpack(spec, forward["params"])
    assert got["seqlen_new"] == 0 and got["k_new_map"][:8] == k_cache.data_ptr().to_bytes(8, "little")
