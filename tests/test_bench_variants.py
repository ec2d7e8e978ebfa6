"""`flashgen bench --variants` without a GPU: FlexAttention gets the same variants flashgen runs
(its score_mod / mask_mod through the oracle equal attention()'s keywords), the tile fraction of a
sliding window is counted on the kernels' own tiles, and the report's tables print and draw."""

import math

import pytest
import torch
from click.testing import CliRunner

from flashgen import bench, cli, tuning
from flashgen.reference import naive_attention, visited_tiles


def qkv(heads=4, length=40, d=16):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, heads, length, d, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_flex_gets_the_variants_flashgen_runs(causal):
    """Each case's score_mod (FlexAttention's convention: the scaled score in, the new score out),
    with the causal mask_mod, gives what attention()'s keywords give, through the oracle."""
    q, k, v = qkv()
    for name, (kwargs, score_mod) in bench.variant_cases(heads=4, device="cpu").items():
        ours = naive_attention(q, k, v, causal=causal, **kwargs)
        theirs = naive_attention(q, k, v, score_mod=score_mod, mask_mod=bench._causal_mask if causal else None)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        if score_mod is not None:  # the variant does change the output here
            assert (ours - naive_attention(q, k, v, causal=causal)).abs().max() > 1e-3, name
    assert set(bench.variant_cases(4, "cpu")) == {"plain", "softcap 50", "alibi"}


def test_flex_s_window_mask_is_the_window_flashgen_runs():
    q, k, v = qkv(length=70)
    ours = naive_attention(q, k, v, causal=True, window_size=(16 - 1, 0))
    torch.testing.assert_close(naive_attention(q, k, v, mask_mod=bench._window_mask(16)), ours)
    assert (ours - naive_attention(q, k, v, causal=True)).abs().max() > 1e-3


def test_the_alibi_slopes_are_geometric():
    slopes = bench.alibi_slopes(16, device="cpu")
    assert slopes.dtype == torch.float32 and slopes.shape == (16,)
    assert math.isclose(slopes[0].item(), 2 ** -0.5, rel_tol=1e-6) and slopes[-1].item() == 2 ** -8


def test_tile_fraction_of_a_window_on_the_kernels_own_tiles():
    """The window's kernels at d = 128 on sm_90a: the mma.sync forward (query-major) and the
    key-major backward, each with its own tiles; the fraction is visited / causal tile pairs."""
    window, seqlen = (4095, 0), 16384
    fwd = tuning.forward_spec(128, "bf16", True, "sm_90a", seqlen, variant=("window",))
    bwd = tuning.backward_specs(128, "bf16", True, "sm_90a", False, variant=("window",))
    assert "window" in fwd.variants and all("window" in spec.variants for spec in bwd)
    m, n = fwd.block_m, fwd.block_n
    expected = visited_tiles(seqlen, seqlen, m, n, True, window) / visited_tiles(seqlen, seqlen, m, n, True)
    assert bench.tile_fraction([fwd], seqlen, window) == expected
    if (m, n) == (64, 64):  # each query tile visits at most the 65 key tiles its rows reach
        assert expected == sum(min(t + 1, 65) for t in range(256)) / (256 * 257 / 2)
    fraction = bench.tile_fraction(bwd, seqlen, window)
    assert 0.4 < fraction < 0.5 and 0.4 < expected < 0.5  # about 2 W / T minus the first window's triangle
    for spec in bwd:  # the key-major count by query_tiles agrees with the query-major one on the same tiles
        tiles = (seqlen, seqlen, spec.block_m, spec.block_n, True)
        assert visited_tiles(*tiles, window, key_major=True) == visited_tiles(*tiles, window)
    assert bench.tile_fraction([fwd], seqlen, (seqlen - 1, 0)) == 1.0  # a window as long as the keys: all of causal


def report():
    row = dict(d=128, T=8192, B=2, heads=16, flashgen=500.0, flashgen_ms=2.2, flex=400.0, flex_ms=2.75, vs_plain=1.0,
               flex_first_s=12.3, kernel="fwd_sm90_d128_m128_n128_bf16_s2_sm90a")
    variants = [{**row, "variant": name, "causal": causal, "mode": mode,
                 "vs_plain": 1.0 if name == "plain" else 1.2, "flex": None if name == "alibi" and mode == "bwd" else 400.0}
                for causal in (False, True) for name in ("plain", "softcap 50", "alibi") for mode in ("fwd", "bwd")]
    window = [dict(variant="window 4096", causal=True, mode=mode, d=128, T=16384, B=1, heads=16, window=4096,
                   flashgen=450.0, flashgen_ms=3.0, causal_same_kernel_ms=6.1, causal_ms=5.0, flex=300.0, flex_ms=4.5,
                   flex_causal_ms=7.0, fraction=0.47, expected_ms=2.87, vs_expected=1.045, flex_first_s=20.0,
                   kernel="fwd_d128_m64_n64_bf16_causal_w4_s2_sm90a_window", causal_kernel="fwd_sm90_d128_m128_n128_bf16_causal_s2_sm90a")
              for mode in ("fwd", "bwd")]
    compiles = [dict(variant=name, T=8192, flashgen_cold_s=2.5, kernels=3, flex_first_s=12.3) for name in ("plain", "alibi")]
    return {"gpu": "test GPU", "date": "2026-12-04", "variants": variants, "window": window, "variant_compile": compiles}


def test_variants_markdown_tables():
    text = bench.variants_markdown(report())
    lines = text.splitlines()
    assert lines[2] == "| " + " | ".join(bench.VARIANT_COLUMNS) + " |"
    assert "| softcap 50 | yes | fwd | 500 | 2.20 | 400 | 2.75 | 1.25 | 1.20 | fwd_sm90_d128_m128_n128_bf16_s2_sm90a |" in lines
    assert "| alibi | no | bwd | 500 | 2.20 | - | 2.75 | - | 1.20 | fwd_sm90_d128_m128_n128_bf16_s2_sm90a |" in lines
    assert ("| fwd | 3.00 | 2.87 | 1.04 | 0.470 | 6.10 | 5.00 | 450 | 4.50 | 7.00 | "
            "fwd_d128_m64_n64_bf16_causal_w4_s2_sm90a_window |") in lines
    assert "| alibi | 8192 | 2.5 | 3 | 12.3 |" in lines
    assert any(line.startswith("Sliding window 4096 (causal, window_size = (4095, 0)) at T = 16384") for line in lines)


def test_variants_report_draws(tmp_path):
    pytest.importorskip("matplotlib")
    from flashgen.plot import plot

    picture = plot(report(), tmp_path / "variants.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / "variants.json"
    import json

    path.write_text(json.dumps(report()))
    result = CliRunner().invoke(cli.main, ["plot", str(path), str(tmp_path / "again.png")])
    assert result.exit_code == 0, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine with no GPU")
def test_bench_variants_without_gpu_fails_clearly():
    result = CliRunner().invoke(cli.main, ["bench", "--variants"])
    assert result.exit_code == 1 and "needs an NVIDIA GPU" in result.output


@pytest.mark.parametrize("args, message", [
    (["--variants", "--decode"], "separate benchmarks"),
    (["--no-flex"], "--no-flex goes with --variants"),
])
def test_bench_variants_usage_errors(args, message):
    result = CliRunner().invoke(cli.main, ["bench", *args])
    assert result.exit_code == 1 and message in result.output


def test_window_flops_count_the_kept_pairs():
    from flashgen.reference import visible_pairs

    pairs = visible_pairs(16384, 16384, True, (4095, 0))
    assert pairs == 4096 * 4097 // 2 + (16384 - 4096) * 4096
    assert math.isclose(pairs / (16384 * 16385 / 2), 0.4375, rel_tol=0.01)


def test_the_report_builds_its_tables_with_stand_ins(monkeypatch):
    """The whole --variants report on the CPU: the oracle in place of flashgen and of Flex, a
    clock that counts calls, the tables' kernel choices for sm_90a, no compiles; then every row
    has its numbers, and the window's expected time is its tile fraction of causal on its kernel."""
    from flashgen import plans

    monkeypatch.setattr(bench, "TOKENS", 1024)
    monkeypatch.setattr(bench, "MODEL_DIM", 64)
    inputs = bench._inputs
    monkeypatch.setattr(bench, "_inputs", lambda seqlen, head_dim: inputs(seqlen, head_dim, dtype=torch.float32, device="cpu"))

    def oracle(kwargs):
        return lambda q, k, v, causal: naive_attention(q, k, v, causal=causal, **kwargs)

    def flex(score_mod, mask_mod, seqlen):
        return lambda q, k, v, causal: naive_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)

    calls = []

    def clock(fn, warmup=5, rep=20):
        fn()
        calls.append(fn)
        return float(len(calls))  # every case a different time

    def specs(q, causal, mode, variant=()):
        fwd = [tuning.forward_spec(q.shape[3], "bf16", causal, "sm_90a", q.shape[2], variant=variant)]
        return fwd if mode == "fwd" else tuning.backward_specs(q.shape[3], "bf16", causal, "sm_90a", False, variant=variant)

    monkeypatch.setattr(bench, "_flashgen", oracle)
    monkeypatch.setattr(bench, "_flex", flex)
    monkeypatch.setattr(bench, "time_ms", clock)
    monkeypatch.setattr(bench, "first_use_s", lambda attention, q, k, v: 7.0)
    monkeypatch.setattr(bench, "_kernel_specs", specs)
    monkeypatch.setattr(bench, "cold_compile_s", lambda specs: 0.5 * len(specs))
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_90a")

    variants = bench.variant_rows(seqlen=128, head_dim=32)
    window = bench.window_rows(seqlen=1024, window=128, head_dim=32)
    compiles = bench.variant_compile_rows(variants, window)
    assert [(r["variant"], r["causal"], r["mode"]) for r in variants] == [
        (name, causal, mode) for causal in (False, True) for name in ("plain", "softcap 50", "alibi") for mode in ("fwd", "bwd")]
    for r in variants:
        assert r["flashgen"] > 0 and r["flex"] > 0 and r["flex_first_s"] == 7.0 and (r["B"], r["heads"], r["T"]) == (8, 2, 128)
        plain = next(p for p in variants if p["variant"] == "plain" and (p["causal"], p["mode"]) == (r["causal"], r["mode"]))
        assert r["vs_plain"] == r["flashgen_ms"] / plain["flashgen_ms"]
        # plain forward kernels without a mask run persistent (the tuning table), variants one tile per CTA
        plain_end = "sm90a_persistent" if r["mode"] == "fwd" and not r["causal"] else "sm90a"
        assert r["kernel"].endswith("_alibi" if r["variant"] == "alibi" else "_softcap" if "softcap" in r["variant"] else plain_end)
    for r in window:
        assert r["fraction"] == bench.tile_fraction(specs(torch.empty(1, 2, 1024, 32), True, r["mode"], ("window",)), 1024, (127, 0))
        assert 0 < r["fraction"] < 1 and r["expected_ms"] == r["fraction"] * r["causal_same_kernel_ms"]
        assert r["vs_expected"] == r["flashgen_ms"] / r["expected_ms"] and r["kernel"].endswith("_window")
        flops = bench.MODES[r["mode"]] * 4 * 1 * 2 * 32 * (128 * 129 // 2 + (1024 - 128) * 128)
        assert math.isclose(r["flashgen"], flops / r["flashgen_ms"] / 1e9)
    assert [(r["variant"], r["kernels"]) for r in compiles] == [("plain", 3), ("softcap 50", 3), ("alibi", 3), ("window 128", 3)]
    text = bench.variants_markdown({"variants": variants, "window": window, "variant_compile": compiles})
    assert sum(line.startswith("| ") for line in text.splitlines()) == 3 + len(variants) + len(window) + len(compiles)  # 3 headers


def test_flex_gets_the_user_rules_flashgen_runs():
    """Each rule case's FlexAttention (score_mod, mask_mod) gives, through the oracle, what
    flashgen's call (its rule's Python twin, and causal) gives."""
    monkey_seqlen = 64
    q, k, v = qkv(length=monkey_seqlen)
    cases = bench.rule_cases(batch=2, heads=4, seqlen=monkey_seqlen, device="cpu")
    assert set(cases) == {"alibi (score rule)", "documents (mask rule)", "prefix-LM (mask rule)"}
    for name, (causal, kwargs, (score_mod, mask_mod)) in cases.items():
        twins = {key: rule.python for key, rule in kwargs.items()}
        ours = naive_attention(q, k, v, causal=causal, **twins)
        theirs = naive_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        assert bench.rule_fields(kwargs)[0][1] == next(iter(kwargs.values())).source, name


def test_host_timing_interleaves_the_ops_rounds():
    """Each op's rounds alternate with the others' (so all see one machine state), each bracketed by a
    sync; the result is the median round per call, in microseconds."""
    events = []
    ops = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    times = bench.interleaved_host_us(ops, calls=3, rounds=2, sync=lambda: events.append("|"))
    assert events[:200] == ["a", "b"] * 100  # warm-up
    assert "".join(events[200:]) == "|aaa||bbb||aaa||bbb|"
    assert set(times) == {"a", "b"} and all(0 < us < 1e6 for us in times.values())


def test_forward_flops_count_the_pairs_bottom_right_causal_attention_sees():
    from flashgen.reference import visible_pairs

    assert bench.forward_flops(2, 3, 100, 100, 64, True) == 4.0 * 2 * 3 * 100 * 100 * 64 / 2  # FlashAttention's convention
    for seqlen_q, seqlen_k in ((64, 1000), (1, 8192), (300, 40)):
        pairs = visible_pairs(seqlen_q, seqlen_k, True)
        assert bench.forward_flops(1, 1, seqlen_q, seqlen_k, 1, True) == 4.0 * pairs, (seqlen_q, seqlen_k)
    assert bench.forward_flops(1, 1, 64, 1000, 1, False) == 4.0 * 64 * 1000


def test_the_backward_is_timed_without_gradient_accumulation():
    """Each timed backward starts from cleared gradients: the same gradient every call, not a sum."""
    leaves = []

    def attention(q, k, v, causal):
        leaves.append(q)
        return naive_attention(q, k, v, causal=causal)

    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for mode in ("bwd", "fwd+bwd"):
        step = bench._timer(attention, q, k, v, True, mode)
        step()
        first = leaves[-1].grad.clone()
        step()
        assert torch.equal(leaves[-1].grad, first), mode


def test_a_row_without_a_flashgen_number_says_why():
    row = {"d": 64, "causal": True, "T": 512, "flashgen": None, "flash": 300.0, "cudnn": None, "efficient": None,
           "kernel": "-", "flashgen_error": "wrong output: max |flashgen - flash| = 0.9 > 0.05"}
    text = bench.markdown({"tables": {"fwd": [row]}})
    assert "- d=64 causal=True T=512: flashgen wrong output: max |flashgen - flash| = 0.9 > 0.05" in text
