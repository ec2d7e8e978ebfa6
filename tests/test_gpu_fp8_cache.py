"""GPU tier: attention_with_kvcache and paged attention_varlen over an FP8 KV cache (float8_e4m3fn
with k_descale and v_descale), against the oracle on the same stored bytes and descales, by
test_gpu_decode's numerics rule (the low-precision reference dequantizes into q's dtype). The
appended keys and values are compared bitwise with the oracle's (stored divided by their descale,
rounded to nearest e4m3, saturated)."""

import pytest
import torch
from test_gpu_decode import VARIANTS, Problem, check, replayed_steps, rotary_tables, with_slopes

import flashgen
from flashgen import reference

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


class Fp8Problem(Problem):
    """test_gpu_decode's Problem with its caches stored in e4m3: each (sequence, KV head) with a
    descale of its own, so a cached value is its stored one times the descale."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        gen = torch.Generator(device="cuda").manual_seed(kw.get("seed", 0) + 1000)
        batch, kv_heads = self.q.shape[0], self.k_cache.shape[2]
        # Descales near 1/64: stored values up to ~300, a few past 448 (saturated when stored).
        self.k_descale, self.v_descale = ((torch.rand(batch, kv_heads, device="cuda", generator=gen) + 0.5) / 64 for _ in range(2))
        self.k_cache, self.v_cache = (self.stored(cache, descale) for cache, descale in
                                      ((self.k_cache, self.k_descale), (self.v_cache, self.v_descale)))

    def stored(self, cache, descale):
        """The cache's values quantized with its sequences' descales (a paged cache's pages with the
        descales of the sequences whose tables name them; spare pages with the first's)."""
        if self.block_table is None:
            return torch.stack([reference.quantize(cache[b], descale[b]) for b in range(cache.shape[0])])
        owner = torch.zeros(cache.shape[0], dtype=torch.long, device="cuda")
        for b in range(self.block_table.shape[0]):
            owner[self.block_table[b].long()] = b
        return torch.stack([reference.quantize(cache[p], descale[owner[p]]) for p in range(cache.shape[0])])

    def run(self, **options):
        return super().run(k_descale=self.k_descale, v_descale=self.v_descale, **options)


LENGTHS = [1, 17, 1000, 4097]


@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["contiguous", "page16", "page64"])
@pytest.mark.parametrize("new", [0, 1], ids=["no-append", "append"])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                             (torch.bfloat16, 256), (torch.float16, 96)], ids=str)
def test_fp8_cache_decode(dtype, head_dim, new, page_size):
    Fp8Problem(4, 1, 8, 2, head_dim, LENGTHS, new=new, page_size=page_size, capacity=4200, dtype=dtype,
               seed=head_dim + new).run(causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, kv_heads, seqlen_q", [(8, 2, 5), (32, 8, 3), (32, 1, 3)], ids=["gqa-5", "gqa-3", "mqa-3"])
def test_fp8_cache_several_query_tokens(heads, kv_heads, seqlen_q, causal, paged):
    """Speculative decoding and chunked prefill over an FP8 cache: the new tokens quantized on
    their way in (and attended to as stored), 64-row blocks where the packed rows need them."""
    problem = Fp8Problem(3, seqlen_q, heads, kv_heads, 128, [0, 30, 777], new=seqlen_q, page_size=16 if paged else None,
                         seed=seqlen_q + heads)
    problem.run(causal=causal)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_fp8_cache_forced_splits(num_splits):
    Fp8Problem(2, 1, 8, 2, 128, [100, 3000], new=1, page_size=16, capacity=3100, seed=num_splits).run(num_splits=num_splits)


@pytest.mark.parametrize("name", ["everything", "window_tiny", "alibi"])
def test_fp8_cache_variants(name):
    problem = Fp8Problem(4, 3, 8, 2, 128, [0, 30, 777, 3000], new=3, page_size=16, capacity=3100, seed=77)
    problem.run(causal=True, **with_slopes(VARIANTS[name], 4, 8))


def test_fp8_cache_sink_and_rotary():
    problem = Fp8Problem(3, 2, 8, 2, 128, [0, 30, 1500], new=2, capacity=1600, seed=78)
    cos, sin = rotary_tables(1700, 128)
    sink = torch.linspace(-1, 2, 8, device="cuda")
    problem.run(rotary_cos=cos, rotary_sin=sin, causal=True, learnable_sink=sink)


def test_unit_descales_give_the_16_bit_kernel_s_output_bitwise():
    """With descales of 1 the FP8 cache's kernel is the 16-bit one over the same values (the
    widening is exact, the descale products are by 1): one split each, bitwise one output. (A
    64-row block, which widens the tiles in shared memory: the decode block's register path
    permutes Q's dims inside each mma, which may sum the scores in another order.)"""
    problem = Fp8Problem(2, 3, 32, 2, 128, [333, 2000], capacity=2100, seed=5)
    ones = torch.ones_like(problem.k_descale)
    args = dict(cache_seqlens=problem.cache_seqlens, causal=True, num_splits=1, return_softmax_lse=True)
    out, lse = flashgen.attention_with_kvcache(problem.q, problem.k_cache, problem.v_cache, k_descale=ones, v_descale=ones, **args)
    wide_k, wide_v = problem.k_cache.to(torch.bfloat16), problem.v_cache.to(torch.bfloat16)
    out16, lse16 = flashgen.attention_with_kvcache(problem.q, wide_k, wide_v, **args)
    assert torch.equal(out, out16) and torch.equal(lse, lse16)


def test_appends_saturate_and_never_make_nan():
    """New keys far past the range (and infinite ones) are stored as +-448, never NaN; the
    attention over them stays finite."""
    problem = Fp8Problem(2, 1, 8, 2, 64, [10, 20], new=2, capacity=64, seed=9)
    problem.k[:, 0] = 1e6
    problem.k[:, 1] = -float("inf")
    problem.v[:, 0] = -1e6
    out = problem.run(causal=True)[0]
    assert out.isfinite().all()
    stored = problem.k_cache[0, 10].float()
    assert (stored == 448).all() and (problem.k_cache[0, 11].float() == -448).all()
    assert (problem.v_cache[0, 10].float() == -448).all()


def test_fp8_decode_step_replays_from_a_cuda_graph():
    problem = Fp8Problem(3, 1, 8, 2, 128, [5, 100, 1000], new=1, page_size=16, capacity=1100, seed=21)
    replayed_steps(problem, dict(k_descale=problem.k_descale, v_descale=problem.v_descale),
                   [[1, 1 + step, 0] for step in range(3)], seed=5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_varlen_over_an_fp8_cache(causal):
    """flash_attn_varlen_func's block table over an FP8 cache: packed 16-bit queries (short and
    long chunks: the decode kernel's varlen form runs both), each sequence's keys its pages' first
    cu_seqlens_k positions."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens_q, lens_k, page, kv_heads, heads, d = [1, 7, 300], [50, 1000, 700], 16, 2, 8, 128
    per_seq = -(-max(lens_k) // page)
    pages = len(lens_q) * per_seq + 3
    table = torch.randperm(pages, device="cuda", generator=gen)[: len(lens_q) * per_seq].view(len(lens_q), per_seq).int()
    k_descale, v_descale = ((torch.rand(len(lens_q), kv_heads, device="cuda", generator=gen) + 0.5) / 64 for _ in range(2))
    raw = torch.randn(2, pages, page, kv_heads, d, device="cuda", generator=gen)
    k_cache = (raw[0] * 64).clamp(-448, 448).to(E4M3)
    v_cache = (raw[1] * 64).clamp(-448, 448).to(E4M3)
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    call = (q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k))
    options = dict(causal=causal, block_table=table, return_lse=True, k_descale=k_descale, v_descale=v_descale)
    out, lse = flashgen.attention_varlen(*call, **options)
    cpu = [t.cpu() for t in call[:5]]
    cpu_options = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    ref, ref_lse = reference.attention_varlen(*cpu, *call[5:], **cpu_options)
    ref_lp = reference.attention_varlen(*cpu, *call[5:], **cpu_options, upcast=False)[0]
    check(out, lse, ref, ref_lse, ref_lp)
