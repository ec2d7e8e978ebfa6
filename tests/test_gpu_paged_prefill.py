"""GPU tier: chunked prefill over a paged cache on the Hopper forward (attention_varlen with a
block_table and query chunks of more than 64 rows): its producer reads the pages through the block
table with TMA, or pages of 16 and 32 rows with cp.async gathers. Against the fp32 oracle by the numerics rule, over page sizes smaller than, equal
to and larger than the key tile (and one no power of two), GQA, causal and not, variants, table
entries past a sequence's pages that point anywhere; and the plan is the Hopper one."""

import pytest
import torch
from test_gpu_decode import PagedVarlen

from flashgen import plans

pytestmark = pytest.mark.gpu

LONG = ([200, 700, 65, 0], [150, 4000, 65, 9])  # every chunk over 64 rows but one empty; a chunk longer than its keys


def needs_hopper():
    if plans.device_arch(0) != "sm_90a":
        pytest.skip("the paged Hopper forward runs on sm_90a (elsewhere the decode kernels' varlen form does)")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 48, 128, 256])
@pytest.mark.parametrize("shape", [(16, 4, 128), (8, 8, 64), (8, 1, 192)], ids=["gqa-d128", "mha-d64", "mqa-d192"])
def test_paged_prefill_on_the_hopper_forward(shape, page_size, causal):
    needs_hopper()
    heads, kv_heads, head_dim = shape
    problem = PagedVarlen(*LONG, heads, kv_heads, head_dim, page_size, seed=page_size + head_dim)
    problem.run(causal=causal)
    plan = plans.paged_prefill(0, head_dim, torch.bfloat16, causal, problem.max_q)
    assert plan is not None and "paged" in plan.steps[0].kernel.spec.name


@pytest.mark.parametrize("options", [dict(window_size=(300, 0)), dict(softcap=20.0, learnable_sink=True),
                                     dict(window_size=(100, 0), softcap=30.0)], ids=["window", "softcap-sink", "gemma"])
def test_paged_prefill_variants(options):
    needs_hopper()
    problem = PagedVarlen(*LONG, 8, 2, 128, 32, dtype=torch.float16, seed=5)
    if options.pop("learnable_sink", False):
        options["learnable_sink"] = torch.linspace(-2.0, 3.0, 8, device="cuda")
    problem.run(causal=True, **options)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("shape", [(8, 2, 128), (8, 8, 64), (4, 1, 256), (4, 4, 80)], ids=["d128", "d64", "d256", "d80"])
def test_small_pages_gathered_as_tma_would_load_them(shape, page_size, monkeypatch):
    """The cp.async gathers fill the same swizzled tiles as TMA boxes of the same pages would (zeros
    past the sequence and the head dim): the two paths give bitwise the same output and lse."""
    needs_hopper()
    from flashgen.families import hopper

    heads, kv_heads, head_dim = shape
    problem = PagedVarlen(*LONG, heads, kv_heads, head_dim, page_size, seed=page_size + head_dim)
    monkeypatch.setattr(hopper, "GATHER_PAGES", hopper.GATHERABLE)
    gathered = problem.run(causal=True)
    monkeypatch.setattr(hopper, "GATHER_PAGES", ())  # every page size through TMA
    tma = problem.run(causal=True)
    assert torch.equal(gathered[0], tma[0]) and torch.equal(gathered[1], tma[1])


def test_table_entries_past_a_sequence_s_pages_are_never_read():
    needs_hopper()
    problem = PagedVarlen(*LONG, 8, 2, 128, 16, seed=9)
    used = -(-torch.tensor(LONG[1]) // 16)  # pages each sequence's keys take
    for b, count in enumerate(used.tolist()):
        tail = problem.block_table[b, count:]  # alternately before the cache's first page and far past its last
        tail.copy_(torch.where(torch.arange(tail.numel(), device="cuda") % 2 == 0, -1, 1 << 30))
    problem.run(causal=True)


# ---- attention_with_kvcache: a long chunk over a paged cache that holds its keys -------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 256])
def test_kvcache_chunk_over_pages_on_the_hopper_forward(page_size, causal):
    """Chunked prefill as vLLM runs it: the chunk's keys already written into the pages, the lengths
    (cache_seqlens) including them; 300 query rows per sequence (one past 64 would do); out of range
    lengths are clamped as the decode kernels clamp them."""
    needs_hopper()
    from test_gpu_decode import Problem

    problem = Problem(4, 300, 16, 4, 128, [300, 1000, 4097, 5000], page_size=page_size, capacity=4200, seed=page_size)
    problem.run(causal=causal)
    assert plans.paged_prefill(0, 128, torch.bfloat16, causal, 300) is not None


def test_kvcache_chunk_with_variants_and_the_lse():
    needs_hopper()
    from test_gpu_decode import Problem

    problem = Problem(3, 200, 8, 2, 64, [200, 900, 3000], page_size=32, dtype=torch.float16, seed=4)
    problem.run(causal=True, window_size=(256, 0), softcap=25.0, learnable_sink=torch.linspace(-1.0, 2.0, 8, device="cuda"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_kvcache_chunk_with_an_append_on_the_hopper_forward(page_size, causal):
    """Chunked prefill with the chunk's own keys and values (flash_attn_with_kvcache's k, v): the
    append kernel stores them into the pages and the Hopper forward reads them back with the rest.
    A sequence that starts empty, one that ends exactly at the capacity, and one whose new keys run
    past it (cached length clamped to the capacity): it attends to all of them and stores none
    past the capacity, the oracle's rule, the last ones read from k and v; so are new keys whose
    page lies outside the cache."""
    needs_hopper()
    from test_gpu_decode import Problem

    problem = Problem(4, 300, 16, 4, 128, [0, 1000, 3900, 5000], new=300, page_size=page_size, capacity=4200, seed=page_size)
    problem.block_table[1, 1100 // page_size] = -1  # a page outside the cache where sequence 1's new keys go: not
    problem.run(causal=causal)                      # stored, still attended to (its old keys there read as zeros)
    assert plans.paged_prefill(0, 128, torch.bfloat16, causal, 300) is not None


def test_kvcache_chunk_with_an_append_and_variants():
    needs_hopper()
    from test_gpu_decode import Problem

    problem = Problem(3, 129, 8, 2, 64, [10, 700, 2980], new=129, page_size=64, capacity=3000, dtype=torch.float16, seed=6)
    problem.run(causal=True, window_size=(200, 0), softcap=25.0, learnable_sink=torch.linspace(-1.0, 2.0, 8, device="cuda"))
