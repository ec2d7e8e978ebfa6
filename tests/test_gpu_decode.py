"""GPU tier: attention_with_kvcache and merge_attention_states against the CPU oracle
(flashgen.reference), by FlashAttention's numerics rule: max|out - ref| <= 2 * max|ref_lp - ref| +
1e-5, ref in fp32 and ref_lp in the kernel's dtype, both computed from the same inputs. Appends are
compared bitwise with the oracle's (it appends in place exactly as the kernel does), reads and
writes past the caches are caught by guard regions around them, and a decode step is replayed from
a CUDA graph as the cache grows."""

import math

import pytest
import torch
from conftest import in_a_thread_with_no_context

import flashgen
from flashgen import plans, reference, tuning, workspace

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="session", autouse=True)
def prebuilt(tmp_path_factory):
    """Compile every serving spec in parallel processes before the tests run."""
    flashgen.build(tuning.serving_specs(plans.device_arch(0)), tmp_path_factory.mktemp("prebuilt-serving"), backward=False)


def randn(*shape, dtype, gen):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


class Problem:
    """A decode problem on the GPU and its copy for the oracle; run() checks the kernel's output,
    lse and caches against it."""

    def __init__(self, batch, seqlen_q, heads, kv_heads, head_dim, lengths, new=0, page_size=None, capacity=None,
                 dtype=torch.bfloat16, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        capacity = capacity or max(lengths) + new
        self.q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype, gen=gen)
        self.k = self.v = None
        if new:
            self.k, self.v = (randn(batch, new, kv_heads, head_dim, dtype=dtype, gen=gen) for _ in range(2))
        self.block_table = None
        if page_size is None:
            self.k_cache, self.v_cache = (randn(batch, capacity, kv_heads, head_dim, dtype=dtype, gen=gen) for _ in range(2))
        else:
            per_seq = -(-capacity // page_size)
            pages = batch * per_seq + 5
            order = torch.randperm(pages, device="cuda", generator=gen)[: batch * per_seq]
            self.block_table = order.view(batch, per_seq).to(torch.int32)  # shuffled: the table is really followed
            self.k_cache, self.v_cache = (randn(pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen) for _ in range(2))
        self.cache_seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)

    def arguments(self):
        return (self.q, self.k_cache, self.v_cache, self.k, self.v), {"cache_seqlens": self.cache_seqlens, "block_table": self.block_table}

    def oracle(self, upcast=True, **options):
        """(out, lse, k_cache, v_cache) of the oracle on CPU copies of the current state."""
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
        k_cache, v_cache = self.k_cache.cpu(), self.v_cache.cpu()
        options = {name: cpu(value) if isinstance(value, torch.Tensor) else value for name, value in options.items()}
        out, lse = reference.attention_with_kvcache(
            cpu(self.q), k_cache, v_cache, cpu(self.k), cpu(self.v), cache_seqlens=cpu(self.cache_seqlens),
            block_table=cpu(self.block_table), return_softmax_lse=True, upcast=upcast, **options,
        )
        return out, lse, k_cache, v_cache

    def run(self, **options):
        ref, ref_lse, ref_k, ref_v = self.oracle(**options)
        ref_lp = self.oracle(upcast=False, **options)[0]
        args, keywords = self.arguments()
        out, lse = flashgen.attention_with_kvcache(*args, **keywords, return_softmax_lse=True, **options)
        check(out, lse, ref, ref_lse, ref_lp)
        assert torch.equal(self.k_cache.cpu(), ref_k) and torch.equal(self.v_cache.cpu(), ref_v), "the appends differ"
        return out, lse


def check(out, lse, ref, ref_lse, ref_lp):
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any(), "NaN in output"
    err = (out.float() - ref.float()).abs().max().item()
    bound = 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows with no visible key differ"
    finite = ref_lse.isfinite()
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-3


LENGTHS = [1, 17, 1000, 4097]


@pytest.mark.parametrize("new", [0, 1], ids=["no-append", "append"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_cache(dtype, head_dim, new):
    Problem(4, 1, 8, 2, head_dim, LENGTHS, new=new, capacity=4200, dtype=DTYPES[dtype], seed=head_dim + new).run(causal=True)


@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_cache_with_a_shuffled_block_table(page_size, head_dim):
    Problem(4, 1, 8, 2, head_dim, LENGTHS, new=1, page_size=page_size, capacity=4200, seed=page_size).run(causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_several_query_tokens(seqlen_q, causal, paged):
    """Speculative decoding / chunked prefill: seqlen_q new tokens appended and attended to, the
    causal mask aligned to each sequence's end."""
    problem = Problem(3, seqlen_q, 8, 2, 128, [0, 30, 777], new=seqlen_q, page_size=16 if paged else None, seed=seqlen_q)
    problem.run(causal=causal)


@pytest.mark.parametrize("heads, kv_heads, seqlen_q", [(32, 8, 1), (32, 8, 3), (32, 1, 1), (32, 1, 3), (6, 6, 2)],
                         ids=["gqa", "gqa-3", "mqa", "mqa-3", "mha"])
def test_grouped_and_multi_query(heads, kv_heads, seqlen_q):
    """The query heads of a KV head (x query tokens) share a block: 4, 12, 32 and 96 packed rows
    (two 64-row blocks), and 2 without grouping."""
    Problem(2, seqlen_q, heads, kv_heads, 64, [300, 1500], new=seqlen_q, page_size=64, seed=heads * seqlen_q).run(causal=True)


@pytest.mark.parametrize("num_splits", [1, 3, 64, 128])
def test_forced_splits_match_the_reference(num_splits):
    """Forced split counts, past the number of key tiles too (empty splits: lse -inf partials)."""
    problem = Problem(2, 1, 8, 2, 128, [100, 3000], new=1, page_size=16, capacity=3100, seed=num_splits)
    problem.run(num_splits=num_splits)


def test_a_split_step_on_a_side_stream_of_a_thread_with_no_context():
    """A serving thread, or the autograd thread, may have no context current: the split step still
    asks the driver whether its stream is being captured (its counts are the stream's) and runs right."""
    problem = Problem(2, 1, 8, 2, 128, [100, 3000], new=1, page_size=16, capacity=3100, seed=11)
    ref, ref_lse, ref_k, ref_v = problem.oracle()
    ref_lp = problem.oracle(upcast=False)[0]
    stream = torch.cuda.Stream()

    def step():
        with torch.cuda.stream(stream):
            args, keywords = problem.arguments()
            out, lse = flashgen.attention_with_kvcache(*args, **keywords, num_splits=8, return_softmax_lse=True)
        stream.synchronize()
        return out, lse

    out, lse = in_a_thread_with_no_context(step)
    check(out, lse, ref, ref_lse, ref_lp)
    assert torch.equal(problem.k_cache.cpu(), ref_k) and torch.equal(problem.v_cache.cpu(), ref_v), "the appends differ"


def test_the_issue_shape_with_its_split_count():
    """B = 1, 32 query heads on 8 KV heads, an 8k paged cache: split across the GPU."""
    problem = Problem(1, 1, 32, 8, 128, [8191], new=1, page_size=16, seed=7)
    assert plans.decode(0, 128, torch.bfloat16, True, 4, 1, 8, 8192 + 1)[1] > 1
    problem.run()


def test_no_keys_gives_zero_and_minus_inf():
    problem = Problem(2, 1, 4, 2, 64, [0, 0], seed=1)
    args, keywords = problem.arguments()
    out, lse = flashgen.attention_with_kvcache(*args, **keywords, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_cache_seqlens_as_int_or_none_and_strided_q():
    problem = Problem(2, 1, 8, 2, 128, [500, 500], seed=3)
    whole, lse = flashgen.attention_with_kvcache(problem.q, problem.k_cache, problem.v_cache, return_softmax_lse=True)
    assert torch.equal(flashgen.attention_with_kvcache(problem.q, problem.k_cache, problem.v_cache, cache_seqlens=500), whole)
    ref, ref_lse, _, _ = problem.oracle()  # cache_seqlens [500, 500]: the whole cache
    check(whole, lse, ref, ref_lse, problem.oracle(upcast=False)[0])
    strided = problem.q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, T, H, d) view of a (B, H, T, d) tensor
    assert torch.equal(flashgen.attention_with_kvcache(strided, problem.k_cache, problem.v_cache), whole)


def test_merged_halves_equal_the_whole():
    """Two halves of a cache merged by merge_attention_states (FlashAttention's lse transposed)."""
    problem = Problem(2, 1, 8, 2, 128, [2000, 2000], seed=9)
    q, k_cache, v_cache = problem.q, problem.k_cache, problem.v_cache
    whole = flashgen.attention_with_kvcache(q, k_cache, v_cache)
    a, lse_a = flashgen.attention_with_kvcache(q, k_cache[:, :700].contiguous(), v_cache[:, :700].contiguous(), return_softmax_lse=True)
    b, lse_b = flashgen.attention_with_kvcache(q, k_cache[:, 700:].contiguous(), v_cache[:, 700:].contiguous(), return_softmax_lse=True)
    o, _ = flashgen.merge_attention_states(a, lse_a.transpose(1, 2), b, lse_b.transpose(1, 2))
    # a and b are rounded to bf16 before the merge: a few units in the last place of the output
    assert (o.float() - whole.float()).abs().max().item() <= 4 * 2**-8 * whole.float().abs().max().item()


GUARD = 4096  # elements of poison on each side of every tensor a kernel may write


def guarded(shape, dtype, gen):
    """A random tensor of `shape` inside a buffer with random guard regions on both sides."""
    numel = math.prod(shape)
    buffer = randn(GUARD + numel + GUARD, dtype=dtype, gen=gen)
    return buffer, buffer[GUARD:GUARD + numel].view(shape)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_out_of_range_lengths_and_pages_stay_inside_the_caches(paged):
    """cache_seqlens past the capacity or negative, block-table entries outside [0, num_pages):
    nothing outside the caches is read into the result or written, and the result is the
    oracle's (lengths clamped, bad pages read as zeros, their writes and writes past the capacity
    dropped)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch, kv_heads, head_dim, page_size, per_seq = 4, 2, 64, 16, 4
    capacity = page_size * per_seq
    shape = (batch * per_seq + 2, page_size, kv_heads, head_dim) if paged else (batch, capacity, kv_heads, head_dim)
    k_buffer, k_cache = guarded(shape, torch.bfloat16, gen)
    v_buffer, v_cache = guarded(shape, torch.bfloat16, gen)
    before_k, before_v = k_buffer.clone(), v_buffer.clone()
    q = randn(batch, 2, 8, head_dim, dtype=torch.bfloat16, gen=gen)
    k, v = (randn(batch, 2, kv_heads, head_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2))
    cache_seqlens = torch.tensor([-5, capacity + 100, capacity - 1, 2**31 - 1], device="cuda", dtype=torch.int32)
    block_table = None
    if paged:
        block_table = torch.arange(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
        block_table[0, 0], block_table[1, 3], block_table[2, 3], block_table[3, 1] = -1, shape[0], 2**30, -(2**31)
    table_before = None if block_table is None else block_table.clone()
    out, lse = flashgen.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                               block_table=block_table, causal=True, return_softmax_lse=True)
    for buffer, old in ((k_buffer, before_k), (v_buffer, before_v)):
        assert torch.equal(buffer[:GUARD], old[:GUARD]) and torch.equal(buffer[-GUARD:], old[-GUARD:]), "a guard was written"
    if paged:
        assert torch.equal(block_table, table_before)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    ref_k, ref_v = before_k[GUARD:-GUARD].view(shape).cpu(), before_v[GUARD:-GUARD].view(shape).cpu()
    ref_lp_k, ref_lp_v = ref_k.clone(), ref_v.clone()
    options = dict(cache_seqlens=cpu(cache_seqlens), block_table=cpu(block_table), causal=True, return_softmax_lse=True)
    ref, ref_lse = reference.attention_with_kvcache(q.cpu(), ref_k, ref_v, k.cpu(), v.cpu(), **options)
    ref_lp, _ = reference.attention_with_kvcache(q.cpu(), ref_lp_k, ref_lp_v, k.cpu(), v.cpu(), **options, upcast=False)
    check(out, lse, ref, ref_lse, ref_lp)
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v), "the appends differ from the oracle's"


def test_split_counts_are_back_to_zero_after_every_kernel():
    """The last split block of each row tile merges and sets its count back to zero, whatever the
    split count: calls with 2 to 128 splits in a row on one stream share the stream's counts."""
    problem = Problem(2, 3, 8, 2, 128, [100, 3000], new=3, page_size=16, capacity=3100, seed=3)
    for num_splits in (2, 128, 7, 64, 3):
        problem.run(num_splits=num_splits, causal=True)
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream().cuda_stream
        assert not workspace._counts[(0, stream, 0)].any(), f"counts left after {num_splits} splits"


def test_graphs_captured_on_one_stream_replay_at_once():
    """Two graphs captured one after the other on one stream (torch.cuda.graph's default), replayed
    at the same time on two streams: each capture counts in its own place, so neither merge sees the
    other's blocks."""
    problems = [Problem(4, 1, 32, 8, 128, [3000, 1, 2500, 4000], new=1, page_size=16, capacity=4100, seed=40 + i) for i in range(2)]
    warm = Problem(4, 1, 32, 8, 128, [10, 10, 10, 10], new=1, page_size=16, capacity=4100, seed=39)
    warm.run(causal=True)  # the kernels load, and the stream's counts and the captures' reserve are made
    assert plans.decode(0, 128, torch.bfloat16, True, 4, 4, 8, 4100 + 1)[1] > 1
    refs = [(p.oracle(causal=True), p.oracle(upcast=False, causal=True)[0]) for p in problems]
    graphs, outs = [], []
    for problem in problems:
        graph = torch.cuda.CUDAGraph()
        args, keywords = problem.arguments()
        with torch.cuda.graph(graph):
            outs.append(flashgen.attention_with_kvcache(*args, **keywords, causal=True, return_softmax_lse=True))
        graphs.append(graph)
    streams = [torch.cuda.Stream() for _ in graphs]
    for _ in range(20):  # the appends write the same values each time
        for graph, stream in zip(graphs, streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for (out, lse), ((ref, ref_lse, _, _), ref_lp) in zip(outs, refs):
            check(out, lse, ref, ref_lse, ref_lp)


@pytest.mark.parametrize("num_splits", [0, 1], ids=["split", "unsplit"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_replays_from_a_cuda_graph(paged, num_splits):
    """Capture one decode step (append, attention, the splits' merge) once, then replay it with
    new tokens, new queries and growing lengths written into the captured tensors in place."""
    problem = Problem(3, 1, 8, 2, 128, [5, 100, 1000], new=1, page_size=16 if paged else None, capacity=1100, seed=21)
    args, keywords = problem.arguments()
    options = dict(causal=True, num_splits=num_splits, return_softmax_lse=True)
    if num_splits == 0:
        capacity = problem.block_table.shape[1] * 16 if paged else 1100
        assert plans.decode(0, 128, torch.bfloat16, paged, 4, 3, 2, capacity + 1)[1] > 1  # the graph holds the merge too
    warm = [t.clone() if t is not None else None for t in args]  # load every kernel first, off the graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashgen.attention_with_kvcache(*warm, **keywords, **options)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashgen.attention_with_kvcache(*args, **keywords, **options)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(4):
        for t in (problem.q, problem.k, problem.v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        ref, ref_lse, ref_k, ref_v = problem.oracle(causal=True)
        ref_lp = problem.oracle(upcast=False, causal=True)[0]
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, ref, ref_lse, ref_lp)
        assert torch.equal(problem.k_cache.cpu(), ref_k) and torch.equal(problem.v_cache.cpu(), ref_v), f"step {step}"
        problem.cache_seqlens += torch.tensor([1, 1 + step, 0], device="cuda", dtype=torch.int32)



@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_chained_steps_read_what_the_step_before_wrote(graphed):
    """Each step's query and new key/value are the previous step's output, with no kernel between:
    on sm_90a the decode kernel is a programmatic dependent launch, scheduled before the one ahead
    of it ends, so a missing wait (or a merge that is not done when its kernel ends) would read a
    stale output here."""
    batch, heads, kv_heads, head_dim, length, steps = 2, 8, 2, 128, 1500, 4
    problem = Problem(batch, 1, heads, kv_heads, head_dim, [length] * batch, capacity=2048, seed=31)
    assert plans.decode(0, head_dim, torch.bfloat16, False, heads // kv_heads, batch, kv_heads, 2048 + 1)[1] > 1
    k_cache, v_cache = problem.k_cache.clone(), problem.v_cache.clone()

    def chain():
        q, outs = problem.q, []
        for step in range(steps):
            new = q[:, :, :kv_heads]
            q, lse = flashgen.attention_with_kvcache(q, problem.k_cache, problem.v_cache, new, new, cache_seqlens=length + step,
                                                     causal=True, return_softmax_lse=True)
            outs.append((q, lse))
        return outs

    if graphed:
        chain()  # load every kernel first, off the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
        problem.k_cache.copy_(k_cache), problem.v_cache.copy_(v_cache)
        graph.replay()
    else:
        outs = chain()
    torch.cuda.synchronize()
    ref_k, ref_v, q = k_cache.cpu(), v_cache.cpu(), problem.q.cpu()
    for step, (out, lse) in enumerate(outs):
        new = q[:, :, :kv_heads]
        lp_k, lp_v = ref_k.clone(), ref_v.clone()
        ref, ref_lse = reference.attention_with_kvcache(q, ref_k, ref_v, new, new, cache_seqlens=length + step, causal=True,
                                                        return_softmax_lse=True)
        ref_lp = reference.attention_with_kvcache(q, lp_k, lp_v, new, new, cache_seqlens=length + step, causal=True,
                                                  upcast=False)
        check(out, lse, ref, ref_lse, ref_lp)
        q = out.cpu()  # the next step's query: what this step wrote
    assert torch.equal(problem.k_cache.cpu(), ref_k) and torch.equal(problem.v_cache.cpu(), ref_v), "the appends differ"

# ---- the variants (window_size, softcap, alibi_slopes), aligned to each sequence's own length -------


def slopes(batch, heads, per_sequence=False):
    base = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    return torch.stack([base * (1 + 0.5 * b) for b in range(batch)]) if per_sequence else base


def with_slopes(variant, batch, heads):
    """The variant's values, its slopes made for the problem ("heads" or "batch")."""
    if "alibi_slopes" in variant:
        variant = {**variant, "alibi_slopes": slopes(batch, heads, variant["alibi_slopes"] == "batch")}
    return variant


VARIANTS = {
    "window": dict(window_size=(200, 0)),
    "window_both": dict(window_size=(300, 2)),
    "window_tiny": dict(window_size=(0, 0)),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi_slopes="heads"),
    "alibi_batch": dict(alibi_slopes="batch"),
    "everything": dict(window_size=(1000, 0), softcap=10.0, alibi_slopes="batch"),
}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("name", VARIANTS)
def test_variants(name, seqlen_q, causal, paged):
    """The window and ALiBi relative to each sequence's cache plus its new tokens (bottom-right),
    GQA 4:1 (a row's query head, and so its slope, is its own), one and several query tokens."""
    problem = Problem(4, seqlen_q, 8, 2, 128, [0, 30, 777, 3000], new=seqlen_q, page_size=16 if paged else None, capacity=3100,
                      seed=seqlen_q + 7 * paged)
    problem.run(causal=causal, **with_slopes(VARIANTS[name], 4, 8))


@pytest.mark.parametrize("heads, kv_heads, seqlen_q", [(32, 8, 3), (32, 1, 3), (6, 6, 2)], ids=["gqa-3", "mqa-3", "mha"])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_variants_with_grouped_rows(head_dim, heads, kv_heads, seqlen_q):
    """Packed rows of several query heads and tokens (12, 96 and 2 a KV head): every row's query
    token and head, for the window, the cap and the slopes (per sequence and head)."""
    problem = Problem(2, seqlen_q, heads, kv_heads, head_dim, [300, 1500], new=seqlen_q, page_size=64, seed=heads * seqlen_q)
    problem.run(causal=True, **with_slopes(VARIANTS["everything"], 2, heads))


@pytest.mark.parametrize("num_splits", [0, 1, 3, 64])
@pytest.mark.parametrize("window", [(256, 0), (1000, 40), (0, 0)], ids=str)
def test_split_windows_see_only_their_tiles(window, num_splits):
    """The splits cut only the key tiles a block's window sees (past them: empty partials); the
    new keys are appended whatever the window, also those no query sees (5 new, 1 query)."""
    problem = Problem(3, 1, 8, 2, 128, [100, 3000, 6000], new=5, page_size=16, capacity=6100, seed=num_splits)
    problem.run(window_size=window, softcap=8.0, num_splits=num_splits)
    problem.run(window_size=window, causal=True, num_splits=num_splits)


def replayed_steps(problem, options: dict, growth: list, seed: int) -> None:
    """Capture one decode step of `problem` (attention_with_kvcache with `options`, causal) in a CUDA
    graph, after a call off the graph that loads its kernels; then per entry of `growth` write new
    q, k, v into the captured tensors, replay, check against the oracle (output, lse, the appends),
    and grow each sequence's length by the entry's."""
    args, keywords = problem.arguments()
    options = dict(causal=True, **options)
    warm = [t.clone() if t is not None else None for t in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashgen.attention_with_kvcache(*warm, **keywords, return_softmax_lse=True, **options)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashgen.attention_with_kvcache(*args, **keywords, return_softmax_lse=True, **options)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for step, grow in enumerate(growth):
        for t in (problem.q, problem.k, problem.v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        ref, ref_lse, ref_k, ref_v = problem.oracle(**options)
        ref_lp = problem.oracle(upcast=False, **options)[0]
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, ref, ref_lse, ref_lp)
        assert torch.equal(problem.k_cache.cpu(), ref_k) and torch.equal(problem.v_cache.cpu(), ref_v), f"step {step}"
        problem.cache_seqlens += torch.tensor(grow, device="cuda", dtype=torch.int32)


def test_a_windowed_decode_step_replays_from_a_cuda_graph():
    """The window, cap and slopes are kernel arguments: one captured step replays as the cache grows,
    the window following each sequence's end."""
    problem = Problem(3, 1, 8, 2, 128, [5, 500, 1000], new=1, page_size=16, capacity=1100, seed=23)
    variant = dict(window_size=(300, 0), softcap=6.0, alibi_slopes=slopes(3, 8, per_sequence=True))
    assert plans.decode(0, 128, torch.bfloat16, True, 4, 3, 2, 1 + 300, 0, ("window", "softcap", "alibi"))[1] > 1  # split
    replayed_steps(problem, variant, [[1, 1 + 100 * step, 0] for step in range(4)], seed=6)


def test_variant_errors_on_the_gpu():
    from test_decode import VARIANT_ERRORS, inputs

    def cuda(value):  # the same shape, strides and dtype on the GPU (a strided view stays one)
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda").fill_(1)

    for error, match, changes in VARIANT_ERRORS:
        if "meta" in match:
            continue
        args = {name: cuda(value) for name, value in inputs(**changes).items()}
        keywords = {name: args.pop(name) for name in ("cache_seqlens", "block_table", "window_size", "softcap", "alibi_slopes")
                    if name in args}
        with pytest.raises(error, match=match):
            flashgen.attention_with_kvcache(*args.values(), **keywords)


# ---- rotary embedding, cache rows and left pads (flash_attn_with_kvcache's rotary_cos / rotary_sin,
# cache_batch_idx, cache_leftpad) ------------------------------------------------------------------


def rotary_tables(rows, rotary_dim, dtype=torch.bfloat16):
    """Llama's tables (base 10000) for positions 0 .. rows - 1, rounded to the inputs' dtype."""
    inverse = 10000.0 ** (-torch.arange(0, rotary_dim, 2, device="cuda", dtype=torch.float32) / rotary_dim)
    angles = torch.arange(rows, device="cuda", dtype=torch.float32)[:, None] * inverse
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("num_splits", [0, 1, 5], ids=["split", "unsplit", "five"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_rotary_turns_q_and_the_new_keys(interleaved, paged, causal, num_splits):
    """The new keys are stored turned (bitwise the oracle's) and attended to turned, by every split
    that holds them; q turns at its own positions with causal, at the cache's end without."""
    problem = Problem(3, 2, 8, 2, 128, [0, 30, 1500], new=2, page_size=16 if paged else None, capacity=1600, seed=50 + num_splits)
    cos, sin = rotary_tables(1700, 128)
    problem.run(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (64, 16), (80, 32), (256, 256)])
def test_rotary_of_part_of_the_head(head_dim, rotary_dim):
    """Only the first rotary_dim dimensions turn (GPT-NeoX's partial rotary); the rest pass through."""
    problem = Problem(2, 1, 8, 2, head_dim, [700, 3], new=1, page_size=64, capacity=800, seed=head_dim)
    cos, sin = rotary_tables(900, rotary_dim)  # the paged capacity: 13 pages of 64
    problem.run(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, causal=True)


def test_rotary_with_a_window_and_fp16():
    """A window turns each query at its own position even without causal (FlashAttention's rule)."""
    problem = Problem(2, 3, 8, 2, 64, [400, 90], new=3, capacity=500, dtype=torch.float16, seed=9)
    cos, sin = rotary_tables(600, 64, torch.float16)
    problem.run(rotary_cos=cos, rotary_sin=sin, window_size=(64, 8))


@pytest.mark.parametrize("num_splits", [0, 1, 7], ids=["split", "unsplit", "seven"])
def test_cache_rows_and_left_pads(num_splits):
    """Sequence b reads and appends to row cache_batch_idx[b] of a 6-row cache, from position
    cache_leftpad[b] on; a row outside the cache holds nothing and takes no appends (guard regions
    around the caches catch any write outside them)."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    problem = Problem(4, 2, 8, 2, 128, [1200, 40, 777, 0], new=2, capacity=1300, seed=12)
    shape = (6, 1300, 2, 128)
    k_buffer, problem.k_cache = guarded(shape, torch.bfloat16, gen)
    v_buffer, problem.v_cache = guarded(shape, torch.bfloat16, gen)
    before_k, before_v = k_buffer.clone(), v_buffer.clone()
    rows = torch.tensor([5, 0, -1, 2], device="cuda", dtype=torch.int32)
    pads = torch.tensor([100, 40, 3, 7], device="cuda", dtype=torch.int32)  # 40: no cached key; 7 > 0: clamped
    cos, sin = rotary_tables(1300, 128)
    for options in (dict(), dict(rotary_cos=cos, rotary_sin=sin)):
        problem.run(cache_batch_idx=rows, cache_leftpad=pads, causal=True, num_splits=num_splits, **options)
        for buffer, old in ((k_buffer, before_k), (v_buffer, before_v)):
            assert torch.equal(buffer[:GUARD], old[:GUARD]) and torch.equal(buffer[-GUARD:], old[-GUARD:]), "a guard was written"
        assert torch.equal(problem.k_cache[[1, 3, 4]], before_k[GUARD:-GUARD].view(shape)[[1, 3, 4]]), "an unused row changed"


def test_a_rotary_decode_step_replays_from_a_cuda_graph():
    """One captured step with rotary tables and left pads, replayed as the lengths grow: the
    positions come from cache_seqlens on the device."""
    problem = Problem(3, 1, 8, 2, 128, [5, 100, 1000], new=1, capacity=1100, seed=22)
    cos, sin = rotary_tables(1100, 128)
    pads = torch.tensor([0, 50, 3], device="cuda", dtype=torch.int32)
    args, keywords = problem.arguments()
    options = dict(rotary_cos=cos, rotary_sin=sin, cache_leftpad=pads, causal=True)
    warm = [t.clone() if t is not None else None for t in args]
    flashgen.attention_with_kvcache(*warm, **keywords, **options, return_softmax_lse=True)  # load the kernel off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashgen.attention_with_kvcache(*args, **keywords, **options, return_softmax_lse=True)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for step in range(4):
        for t in (problem.q, problem.k, problem.v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        ref, ref_lse, ref_k, ref_v = problem.oracle(**options)
        ref_lp = problem.oracle(upcast=False, **options)[0]
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, ref, ref_lse, ref_lp)
        assert torch.equal(problem.k_cache.cpu(), ref_k) and torch.equal(problem.v_cache.cpu(), ref_v), f"step {step}"
        problem.cache_seqlens += 1


def test_rotary_and_cache_row_errors_on_the_gpu():
    from test_decode import ROW_ERRORS, ROW_ARGUMENTS, inputs

    for error, match, changes in ROW_ERRORS:
        if "meta" in match:
            continue
        args = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in inputs(**changes).items()}
        keywords = {name: args.pop(name) for name in ("cache_seqlens", "block_table", *ROW_ARGUMENTS) if name in args}
        with pytest.raises(error, match=match):
            flashgen.attention_with_kvcache(*args.values(), **keywords)


# ---- attention_varlen over a paged cache (flash_attn_varlen_func's block_table): the decode kernels'
# varlen form -----------------------------------------------------------------------------------------


class PagedVarlen:
    """Packed queries of sequences of lens_q over their first lens_k keys in shuffled pages."""

    def __init__(self, lens_q, lens_k, heads, kv_heads, head_dim, page_size=16, dtype=torch.bfloat16, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        cumsum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)  # noqa: E731
        self.cu_q, self.cu_k = cumsum(lens_q), cumsum(lens_k)
        self.max_q, self.max_k = max(lens_q), max(lens_k)
        per_seq = max(-(-self.max_k // page_size), 1)
        pages = len(lens_q) * per_seq + 3
        self.q = randn(sum(lens_q), heads, head_dim, dtype=dtype, gen=gen)
        self.k_cache, self.v_cache = (randn(pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen) for _ in range(2))
        order = torch.randperm(pages, device="cuda", generator=gen)[: len(lens_q) * per_seq]
        self.block_table = order.view(len(lens_q), per_seq).to(torch.int32)

    def run(self, **options):
        cpu = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in options.items()}
        args = (self.q, self.k_cache, self.v_cache, self.cu_q, self.cu_k, self.max_q, self.max_k)
        ref_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        ref, ref_lse = reference.attention_varlen(*ref_args, block_table=self.block_table.cpu(), return_lse=True, **cpu)
        ref_lp = reference.attention_varlen(*ref_args, block_table=self.block_table.cpu(), upcast=False, **cpu)
        before = self.k_cache.clone(), self.v_cache.clone()
        out, lse = flashgen.attention_varlen(*args, block_table=self.block_table, return_lse=True, **options)
        check(out, lse, ref, ref_lse, ref_lp)
        assert torch.equal(self.k_cache, before[0]) and torch.equal(self.v_cache, before[1]), "a cache was written"
        counts = workspace._counts.get((0, torch.cuda.current_stream().cuda_stream, 0))
        assert counts is None or not counts.any(), "split counts left behind (a row tile that left early counted?)"
        return out, lse


PAGED_VARLEN = [  # lens_q, lens_k: chunks over cached prefixes, an empty sequence, a query longer than its keys
    ([3, 0, 5, 1, 64], [10, 4, 1000, 0, 300]),
    ([1] * 7, [17, 1, 4096, 33, 250, 999, 2]),  # a batch of decode steps: split-KV at work
    ([200, 7], [150, 4000]),  # causal: the first 50 queries of sequence 0 see no key
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", PAGED_VARLEN, ids=["chunks", "steps", "long"])
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (6, 6, 64, 64), (8, 1, 256, 32)], ids=["gqa-d128", "mha-d64", "mqa-d256"])
def test_paged_varlen(shape, lens, causal):
    heads, kv_heads, head_dim, page_size = shape
    PagedVarlen(*lens, heads, kv_heads, head_dim, page_size, seed=head_dim).run(causal=causal)


@pytest.mark.parametrize("name", ["window", "softcap", "alibi-batch", "gemma"])
def test_paged_varlen_variants(name):
    problem = PagedVarlen(*PAGED_VARLEN[0], 8, 2, 128, 16, dtype=torch.float16, seed=3)
    options = {"window": dict(window_size=(40, 0)), "softcap": dict(softcap=20.0),
               "alibi-batch": dict(alibi_slopes=slopes(5, 8, per_sequence=True)),
               "gemma": dict(window_size=(100, 0), softcap=30.0)}[name]
    problem.run(causal=True, **options)


def test_paged_varlen_replays_from_a_cuda_graph():
    """Captured once with the longest lengths, replayed with other cu_seqlens (no longer)."""
    problem = PagedVarlen([4, 9, 1], [300, 2000, 50], 16, 4, 128, 16, seed=8)
    problem.max_q = 14  # the bound the replays stay within (max_k: 2000 already)
    args = (problem.q, problem.k_cache, problem.v_cache, problem.cu_q, problem.cu_k, problem.max_q, problem.max_k)
    flashgen.attention_varlen(*args, causal=True, block_table=problem.block_table)  # load the kernel off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashgen.attention_varlen(*args, causal=True, block_table=problem.block_table, return_lse=True)
    for lens_q, lens_k in (([4, 9, 1], [300, 2000, 50]), ([2, 9, 3], [1, 1999, 0]), ([14, 0, 0], [2000, 7, 7])):
        problem.cu_q.copy_(torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32))
        problem.cu_k.copy_(torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        ref, ref_lse = reference.attention_varlen(*ref_args[:5], 14, 2000, causal=True, block_table=problem.block_table.cpu(),
                                                  return_lse=True)
        ref_lp = reference.attention_varlen(*ref_args[:5], 14, 2000, causal=True, block_table=problem.block_table.cpu(), upcast=False)
        check(out, lse, ref, ref_lse, ref_lp)


# ---- torch.compile ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda-graphs"])
def test_torch_compile_fullgraph_decode_step(mode):
    """A decode step compiled whole (fullgraph=True; inductor, and with CUDA graphs) gives the eager
    step's outputs bitwise, and its appends land in the caches (the op declares them mutated)."""
    problem = Problem(2, 1, 8, 2, 128, [100, 700], new=1, page_size=16, capacity=800, seed=60)
    cos, sin = rotary_tables(800, 128)
    eager_k, eager_v = problem.k_cache.clone(), problem.v_cache.clone()

    def step(q, k_cache, v_cache, k, v, lengths):
        out, lse = flashgen.attention_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lengths,
                                                   block_table=problem.block_table, causal=True, return_softmax_lse=True)
        merged, merged_lse = flashgen.merge_attention_states(out, lse.transpose(1, 2), out, lse.transpose(1, 2))
        return merged.float() * 2, merged_lse

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(4):
        for t in (problem.q, problem.k, problem.v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        got = compiled(problem.q, problem.k_cache, problem.v_cache, problem.k, problem.v, problem.cache_seqlens)
        want = step(problem.q, eager_k, eager_v, problem.k, problem.v, problem.cache_seqlens)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(problem.k_cache, eager_k) and torch.equal(problem.v_cache, eager_v), "the compiled appends differ"
        problem.cache_seqlens += 1


def test_torch_compile_fullgraph_paged_varlen():
    problem = PagedVarlen(*PAGED_VARLEN[0], 8, 2, 128, 16, seed=61)
    args = (problem.q, problem.k_cache, problem.v_cache, problem.cu_q, problem.cu_k, problem.max_q, problem.max_k)

    def call(*args):
        return flashgen.attention_varlen(*args, causal=True, block_table=problem.block_table, return_lse=True)

    got, want = torch.compile(call, fullgraph=True)(*args), call(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reduce_overhead_graphs_of_two_shapes_keep_their_counts_apart():
    """torch.compile's CUDA graphs (mode="reduce-overhead") warm each new shape up with the calling
    thread's allocations sent to the graphs' pool, and reuse that pool for other tensors as they
    record the next shape. The split counts and kept scratch must live outside it
    (flashgen/workspace.py): alternating two shapes, every call equals the eager one, and the
    eager counts are back to zero."""
    problems = [PagedVarlen([1] * 7, [17, 1, 4096, 33, 250, 999, 2], 32, 8, 128, 16, seed=62),
                PagedVarlen([3, 0, 5, 1, 64], [10, 4, 1000, 0, 300], 32, 8, 128, 16, seed=63)]

    def call(q, k_cache, v_cache, cu_q, cu_k, table, max_q, max_k):
        out, lse = flashgen.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, causal=True, block_table=table,
                                             return_lse=True)
        return out.float() + 1, lse * 2  # something of the pool's own after the op

    compiled = torch.compile(call, mode="reduce-overhead", dynamic=False)
    for round_ in range(4):
        for p in problems:
            args = (p.q, p.k_cache, p.v_cache, p.cu_q, p.cu_k, p.block_table, p.max_q, p.max_k)
            got = [t.clone() for t in compiled(*args)]
            want = call(*args)
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"round {round_}: differs from eager"
    for (device, stream, capture), counts in workspace._counts.items():
        if not capture:
            assert not counts.any(), f"counts of stream {stream:#x} left non-zero"


# ---- merge_attention_states ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_merge_matches_the_reference(dtype, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    batch, seqlen, heads = 3, 37, 5
    o_a, o_b = (randn(batch, seqlen, heads, head_dim, dtype=dtype, gen=gen) for _ in range(2))
    lse_a, lse_b = (randn(batch, heads, seqlen, dtype=torch.float32, gen=gen) * 4 for _ in range(2))  # FlashAttention's layout
    lse_a[0, 0, :5] = -math.inf  # one side empty
    lse_b[0, 0, 3:8] = -math.inf  # and both, for rows 3 and 4
    o_b[0, 3:8, 0] = float("nan")  # an empty state's output is never read
    o, lse = flashgen.merge_attention_states(o_a, lse_a.transpose(1, 2), o_b, lse_b.transpose(1, 2))
    assert o.shape == o_a.shape and o.dtype == dtype and lse.shape == (batch, seqlen, heads) and lse.dtype == torch.float32
    o, lse = o.cpu(), lse.cpu()
    check_merge(o, lse, (o_a, lse_a.transpose(1, 2), o_b, lse_b.transpose(1, 2)))
    assert torch.isneginf(lse[0, 3:5, 0]).all() and torch.equal(o[0, 3:5, 0], torch.zeros_like(o[0, 3:5, 0]))


def check_merge(o, lse, states):
    """The numerics rule against the oracle in float64, ref_lp the oracle in the states' dtype."""
    states = [t.cpu() for t in states]
    ref, ref_lse = reference.merge_attention_states(*(t.double() for t in states))
    ref_lp, _ = reference.merge_attention_states(*states)
    o, lse = o.cpu(), lse.cpu()
    assert not o.isnan().any()
    err = (o.double() - ref).abs().max().item()
    assert err <= 2 * (ref_lp.double() - ref).abs().max().item() + 1e-5, err
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ref_lse.isfinite()
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-4


def test_merge_takes_other_ranks_and_strides():
    gen = torch.Generator(device="cuda").manual_seed(0)
    o_a = randn(7, 2, 3, 4, 64, dtype=torch.bfloat16, gen=gen)  # four leading dimensions
    o_b = randn(7, 2, 3, 4, 128, dtype=torch.bfloat16, gen=gen)[..., ::2].contiguous()
    lse_a, lse_b = randn(7, 2, 3, 4, dtype=torch.float32, gen=gen), randn(4, 3, 2, 7, dtype=torch.float32, gen=gen).permute(3, 2, 1, 0)
    o, lse = flashgen.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.shape == o_a.shape and lse.shape == lse_a.shape
    check_merge(o, lse, (o_a, lse_a, o_b, lse_b))
    flat = randn(10, 64, dtype=torch.float32, gen=gen)
    o, lse = flashgen.merge_attention_states(flat, torch.zeros(10, device="cuda"), flat, torch.zeros(10, device="cuda"))
    assert (o - flat).abs().max().item() <= 1e-5 and (lse - math.log(2)).abs().max().item() <= 1e-5


def test_input_errors_on_the_gpu():
    """The CPU tier's input errors, with the tensors on the GPU: the fast path of the checks lets
    none of them through."""
    from test_decode import ERRORS, PAGED_ERRORS, inputs

    def cuda(value):  # the same shape, strides and dtype on the GPU (a strided view stays one)
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda").zero_()

    for paged, cases in ((False, ERRORS), (True, PAGED_ERRORS)):
        for error, match, changes in cases:
            if "device" in match:
                continue
            args = {name: cuda(value) for name, value in inputs(paged, **changes).items()}
            keywords = {name: args.pop(name) for name in ("cache_seqlens", "block_table", "num_splits") if name in args}
            with pytest.raises(error, match=match):
                flashgen.attention_with_kvcache(*args.values(), **keywords)
