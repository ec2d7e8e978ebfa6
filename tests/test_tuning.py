"""The tuning table: its format, how problems find their entries, and `flashgen tune`'s pieces."""

import json

import pytest
from click.testing import CliRunner

from flashgen import tune, tuning
from flashgen.cli import main
from flashgen.families import BY_KIND
from flashgen.settings import SettingError
from flashgen.spec import KernelSpec, SpecError


def test_table_is_well_formed_and_written_canonically():
    text = tuning.TABLE_PATH.read_text()
    doc = json.loads(text)
    assert tuning.format_table(doc) == text  # a re-tune rewrites it in the same form
    for entry in doc["entries"]:
        assert entry["kind"] in BY_KIND, entry
        assert set(tuning.KEY_FIELDS) | {"tiles", "source"} <= set(entry), entry
        assert entry["causal"] in (True, False, "*") and entry["dtype"] in ("bf16", "fp16", "e4m3", "*")
        assert entry["bucket"] in ("short", "long", "*")
        assert entry.get("varlen", "*") in (True, False, "*") and set(entry) <= set(tuning.KEY_FIELDS + tuning.OPTIONAL_FIELDS) | {"head_dim_v", "tiles", "source", "tflops"}
        for tiles in entry["tiles"]:
            assert set(tiles) <= set(tuning.TILE_FIELDS), tiles


def _entry(kind="fwd", head_dim=64, tiles=None, **fields):
    base = {"kind": kind, "arch": "*", "head_dim": head_dim, "dtype": "*", "causal": "*", "bucket": "*",
            "tiles": tiles or [{"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}], "source": "test"}
    return {**base, **fields}


@pytest.fixture
def table(monkeypatch):
    """A private table the tuning module reads instead of the shipped one."""
    doc = {"about": "test", "entries": []}
    monkeypatch.setattr(tuning, "_table", doc)
    yield doc["entries"]
    tuning.reload()


def test_exact_entries_beat_wildcards_and_the_smallest_bound_wins(table):
    wide = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2}
    exact = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    table += [_entry(head_dim=128, tiles=[wide]),
              _entry(head_dim=128, tiles=[exact], arch="sm_90a", dtype="bf16", causal=True, bucket="long")]
    spec = tuning.mma_forward_spec(96, "bf16", True, "sm_90a", seqlen_q=4096)
    assert (spec.block_m, spec.num_stages) == (64, 3)
    # another dtype, mask or target matches only the wildcard entry
    assert tuning.mma_forward_spec(96, "fp16", True, "sm_90a", seqlen_q=4096).block_m == 128
    assert tuning.mma_forward_spec(96, "bf16", False, "sm_90a", seqlen_q=4096).block_m == 128
    assert tuning.mma_forward_spec(96, "bf16", True, "sm_80", seqlen_q=4096).block_m == 128
    # a smaller bound covering the head dim wins over a more exact larger one
    table.append(_entry(head_dim=64))
    assert tuning.mma_forward_spec(64, "bf16", True, "sm_90a", seqlen_q=4096).block_n == 32


def test_an_entry_naming_v_s_head_dim_serves_only_that_v(table):
    plain, own_v = {"block_m": 128, "block_n": 96, "num_stages": 2}, {"block_m": 128, "block_n": 128, "num_stages": 2}
    table += [_entry(kind="fwd_sm90", head_dim=192, tiles=[plain]), _entry(kind="fwd_sm90", head_dim=192, head_dim_v=128, tiles=[own_v])]
    assert tuning.candidates("fwd_sm90", 192, "bf16", True, "sm_90a", "long", head_dim_v=128)[0] == own_v
    assert tuning.candidates("fwd_sm90", 192, "bf16", True, "sm_90a", "long")[0] == plain
    assert tuning.candidates("fwd_sm90", 192, "bf16", True, "sm_90a", "long", head_dim_v=64)[0] == plain
    assert tuning.forward_spec(192, "bf16", True, "sm_90a", 4096, head_dim_v=128).block_n == 128
    assert tuning.forward_spec(192, "bf16", True, "sm_90a", 4096).block_n == 96
    # a tune of the plain problem keeps it
    merged = tune.merge({"about": "x", "entries": list(table)}, [_entry(kind="fwd_sm90", head_dim=192, tiles=[own_v])])
    assert sum("head_dim_v" in e for e in merged["entries"]) == 1 and len(merged["entries"]) == 2


def test_invalid_shapes_fall_through_to_the_next(table):
    too_big = {"block_m": 256, "block_n": 256, "num_warps": 4, "num_stages": 3}  # 64 rows per warp: not a valid spec
    table += [_entry(head_dim=64, tiles=[too_big]), _entry(head_dim=256)]
    spec = tuning.mma_forward_spec(64, "bf16", False, "sm_90a", seqlen_q=4096)
    assert (spec.block_m, spec.block_n) == (64, 32)


def test_no_entry_is_a_named_error(table):
    with pytest.raises(ValueError, match="no fwd tile shape fits head_dim=64 on sm_90a"):
        tuning.mma_forward_spec(64, "bf16", False, "sm_90a", seqlen_q=4096)


def test_override_goes_first_and_is_undone(table):
    table.append(_entry())
    override = _entry(tiles=[{"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}], arch="sm_80")
    with tuning.override([override]):
        assert tuning.mma_forward_spec(64, "bf16", False, "sm_80", seqlen_q=4096).num_warps == 8
    assert tuning.mma_forward_spec(64, "bf16", False, "sm_80", seqlen_q=4096).num_warps == 4


def test_environment_names_another_table(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(tuning.format_table({"about": "mine", "entries": [_entry(head_dim=256)]}))
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.reload()
    try:
        assert tuning.table()["about"] == "mine"
        assert tuning.mma_forward_spec(128, "bf16", False, "sm_90a", seqlen_q=9).block_n == 32
    finally:
        monkeypatch.delenv(tuning.TABLE_ENV)
        tuning.reload()


def test_problems_cover_what_the_tables_run():
    found = tune.problems([128], ["bf16"], [True], "sm_90a")
    kinds = {p.kind for p in found}
    assert {"fwd_sm90", "fwd", "bwd_sm90_kv", "bwd_q", "bwd_sm90_kvq"} <= kinds
    short = [p for p in found if p.kind == "fwd"]
    assert [p.bucket for p in short] == ["short"]
    assert next(p for p in found if p.kind == "bwd_q").deterministic
    assert not next(p for p in found if p.kind == "bwd_sm90_kvq").deterministic
    assert not next(p for p in found if p.kind == "fwd_sm90").deterministic


@pytest.mark.parametrize("kind", ["fwd", "fwd_sm90", "bwd_kvq", "bwd_q"])
def test_candidates_are_valid_specs_of_the_kind(kind):
    problem = tune.Problem(kind, 128, "bf16", True, "sm_90a", "long")
    specs = tune.candidates(problem)
    assert len(specs) > 3
    assert all(isinstance(s, KernelSpec) and s.kind == kind and s.head_dim == 128 for s in specs)
    assert len(set(specs)) == len(specs)


def test_merge_replaces_entries_of_the_same_key():
    problem = tune.Problem("fwd_sm90", 128, "bf16", True, "sm_90a", "long")
    old = tune.entry_for(problem, [{"block_m": 128, "block_n": 64, "num_stages": 2}], source="old")
    other = tune.entry_for(tune.Problem("fwd_sm90", 64, "bf16", True, "sm_90a", "long"), [], source="other")
    new = tune.entry_for(problem, [{"block_m": 192, "block_n": 96, "num_stages": 2}], source="new")
    merged = tune.merge({"about": "x", "entries": [old, other]}, [new])
    assert [e["source"] for e in merged["entries"]] == ["new", "other"]


def test_a_tuned_entry_serves_only_the_plain_fixed_length_calls_it_was_timed_on():
    """It would otherwise outrank the table's entries for variants and varlen (more of its fields
    are exact), which the tune never measured."""
    problem = tune.Problem("fwd_sm90", 64, "bf16", True, "sm_90a", "long")
    tiles = {"block_m": 64, "block_n": 64, "num_stages": 2}
    with tuning.override([tune.entry_for(problem, [tiles])]):
        assert tuning.candidates("fwd_sm90", 64, "bf16", True, "sm_90a", "long")[0] == tiles
        for flags in (dict(variant=True), dict(variant=True, softcap=True), dict(varlen=True)):
            assert tuning.candidates("fwd_sm90", 64, "bf16", True, "sm_90a", "long", **flags)[0] != tiles, flags


def test_a_spilling_candidate_is_ruled_out(monkeypatch):
    """precompile's verdict: a candidate that spills is never timed (the CPU tier's rule for what ships)."""
    from concurrent.futures import Future

    class Pool:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *args):
            return False

        def submit(self, fn, canonical):
            future = Future()
            future.set_result(24 if '"block_m":192' in canonical else 0)
            return future

    monkeypatch.setattr(tune, "ProcessPoolExecutor", Pool)
    specs = tune.candidates(tune.Problem("fwd_sm90", 64, "bf16", True, "sm_90a", "long"))
    failed = tune.precompile(specs)
    assert failed and all(spec.block_m == 192 and "spills: 24 bytes" in why for spec, why in failed.items())


def test_cli_dry_run_lists_problems_without_a_gpu():
    result = CliRunner().invoke(main, ["tune", "--d", "64", "--mask", "causal", "--kinds", "fwd_sm90", "--dry-run"])
    assert result.exit_code == 0, result.output
    count = len(tune.candidates(tune.Problem("fwd_sm90", 64, "bf16", True, "sm_90a", "long")))
    assert count > 20 and f"fwd_sm90 d=64 bf16 causal long: {count} candidates" in result.output


def test_cli_refuses_to_tune_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = CliRunner().invoke(main, ["tune", "--d", "64"])
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output


def test_tune_of_kinds_the_tables_do_not_run_here_is_refused_by_name():
    """It printed nothing and exited 0 (a real run would have rewritten the table with no entries)."""
    result = CliRunner().invoke(main, ["tune", "--d", "64", "--kinds", "decode", "--dry-run"])
    assert result.exit_code == 1 and "--kinds decode: none of them is tuned on sm_90a; its tables run" in result.output
    assert "fwd_sm90" in result.output


def test_a_candidate_counts_only_where_the_tables_would_run_it():
    problem = tune.Problem("fwd_sm90", 128, "bf16", True, "sm_90a", "long")
    spec = tune.candidates(problem)[-1]
    assert not tune.runs(problem, spec)  # the shipped table picks another shape
    with tuning.override([tune.entry_for(problem, [tune.tiles_of(spec)])]):
        assert tune.runs(problem, spec)
    mma = tune.Problem("fwd", 128, "bf16", True, "sm_90a", "long")  # on sm_90a long queries run fwd_sm90
    spec = tune.candidates(mma)[0]
    with tuning.override([tune.entry_for(mma, [tune.tiles_of(spec)])]):
        assert not tune.runs(mma, spec)


def test_mask_rule_entries_apply_to_mask_rules_alone():
    """An entry with "mask_rule": true (the Hopper forward's 128 x 128 at d = 64) is picked for a
    call with a mask rule and for no other variant."""
    rule = ("mask_mod", '{"cuda":"kv_idx <= q_idx","per_batch":false,"per_head":false,"tensors":[]}')
    masked = tuning.forward_spec(64, "bf16", True, "sm_90a", 8192, variant=(rule,))
    capped = tuning.forward_spec(64, "bf16", True, "sm_90a", 8192, variant=("softcap",))
    assert (masked.block_m, masked.block_n) == (128, 128) and (capped.block_m, capped.block_n) == (192, 112)
    assert tuning.candidates("fwd_sm90", 64, "bf16", True, "sm_90a", "long", variant=True, mask_rule=True)[0] == \
        {"block_m": 128, "block_n": 128, "num_stages": 2}


def test_softcap_entries_apply_to_softcap_alone(table):
    """An entry with "softcap": true (an exp2_fma for softcap's forward, say) goes first for a
    softcap call, with or without other variants, and for no other call."""
    plain = {"block_m": 128, "block_n": 128, "num_stages": 2}
    table += [_entry("fwd_sm90", 128, [plain], arch="sm_90a"),
              _entry("fwd_sm90", 128, [{**plain, "exp2_fma": 3}], arch="sm_90a", variant=True, softcap=True)]
    for variant, share in (((), 0), (("alibi",), 0), (("softcap",), 3), (("window", "softcap"), 3)):
        assert tuning.forward_spec(128, "bf16", True, "sm_90a", 8192, variant=variant).exp2_fma == share, variant


def test_a_new_winner_replaces_the_tables_pick_only_beyond_the_noise(monkeypatch):
    """tune's ranking pass times each shape once; a winner that is not the table's pick is timed
    against it again, interleaved, and goes first only if its slowest round beats the pick's fastest."""
    problem = tune.Problem("fwd_sm90", 128, "bf16", False, "sm_90a", "long")
    pick = tune.current_pick(problem)
    other = next(spec for spec in tune.candidates(problem) if spec != pick)
    results = [(610.0, [610.0], other), (600.0, [600.0], pick)]  # the ranking pass: `other` ahead
    lines = []
    close = {other: iter([605, 601, 604]), pick: iter([602, 606, 603])}  # interleaved rounds, within noise
    settled = tune.settle(problem, list(results), pick, lambda _, spec: [next(close[spec])], lines.append)
    assert [r[2] for r in settled] == [pick, other] and "stays first" in lines[0]
    apart = {other: iter([640, 645, 642]), pick: iter([602, 606, 603])}  # clearly ahead in every round
    lines.clear()
    settled = tune.settle(problem, list(results), pick, lambda _, spec: [next(apart[spec])], lines.append)
    assert [r[2] for r in settled] == [other, pick] and lines == []
    # the pick already first, or not among the results: nothing is timed again
    untimed = lambda *_: pytest.fail("timed again")  # noqa: E731
    assert tune.settle(problem, results[::-1], pick, untimed, lines.append) == results[::-1]
    assert tune.settle(problem, results[:1], pick, untimed, lines.append) == results[:1]
    assert tune.confirmed([641, 640], [639, 600]) and not tune.confirmed([641, 620], [630, 600])


def test_knobs_are_tried_on_the_best_shapes_and_kept_only_where_set():
    problem = tune.Problem("fwd_sm90", 64, "bf16", True, "sm_90a", "long")
    shapes = tune.candidates(problem)
    assert shapes and all(spec.exp2_fma == 0 for spec in shapes)  # the shapes rank with knobs at their defaults
    knobs = tune.knob_candidates(shapes[:2])
    assert [spec.exp2_fma for spec in knobs] == [1, 2, 3, 1, 2, 3]
    assert [spec.replace(exp2_fma=0) for spec in knobs] == [shapes[0]] * 3 + [shapes[1]] * 3
    assert "exp2_fma" not in tune.tiles_of(shapes[0]) and tune.tiles_of(knobs[1])["exp2_fma"] == 2
    with tuning.override([tune.entry_for(problem, [tune.tiles_of(knobs[1])])]):
        assert tune.runs(problem, knobs[1])  # the table builds the knob back from its entry
    assert tune.knob_candidates([KernelSpec(head_dim=64, kind="bwd_sm90_kvq", block_m=64, block_n=128)]) == []


def test_tune_tries_the_knobs_on_its_best_shapes(monkeypatch):
    """The shapes rank first (knobs at their defaults); the knobs then run on the best TOP of them,
    and a knob that wins is in the entry."""
    from flashgen import kernels

    problem = tune.Problem("fwd_sm90", 128, "bf16", False, "sm_90a", "long")
    shapes = tune.candidates(problem)
    favourite = shapes[5]  # made fastest below, and fastest of all with exp2_fma = 2
    timed = []

    def shape_tflops(shape):
        return 500.0 if shape == favourite else 400.0 - shapes.index(shape)

    def fake_tflops(problem, seqlen):
        spec = KernelSpec(head_dim=128, kind="fwd_sm90", **tuning._overrides[0]["tiles"][0])
        timed.append(spec)
        return shape_tflops(spec.replace(exp2_fma=0)) + {0: 0, 1: 5, 2: 20, 3: -10}[spec.exp2_fma]

    monkeypatch.setattr(tune, "precompile", lambda specs, jobs=None: {})
    monkeypatch.setattr(kernels, "get", lambda spec: None)
    monkeypatch.setattr(tune, "check", lambda problem: None)
    monkeypatch.setattr(tune, "runs", lambda problem, spec: True)
    monkeypatch.setattr(tune, "measure", fake_tflops)
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda: "test")
    entries = tune.tune([problem], seqlens=(2048,), log=lambda line: None)
    assert entries[0]["tiles"][0] == {**tune.tiles_of(favourite), "exp2_fma": 2}
    best_shapes = sorted(shapes, key=shape_tflops, reverse=True)[: tune.TOP]
    assert {spec.replace(exp2_fma=0) for spec in timed if spec.exp2_fma} == set(best_shapes)  # and no other shape


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a"])
def test_every_head_dim_has_kernels_on_every_arch(arch):
    """What README promises, without compiling: for every multiple of 8 up to 256, both dtypes and
    masks, the tables pick a valid forward, backward (both modes) and decode kernel on each target."""
    for head_dim in range(8, 257, 8):
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                tuning.forward_spec(head_dim, dtype, causal, arch, 4096)
                for deterministic in (False, True):
                    assert tuning.backward_specs(head_dim, dtype, causal, arch, deterministic)
            for paged in (False, True):
                for rows in (4, 64):
                    tuning.decode_spec(head_dim, dtype, arch, paged, rows)


@pytest.mark.parametrize("kind", ["fwd_sm90", "bwd_sm90_kvq", "bwd_sm90_kv"])
def test_a_kind_asked_for_on_a_target_it_does_not_build_for_names_the_target_it_needs(kind):
    """It said "no fwd_sm90 tile shape fits head_dim=64 on sm_80: the tuning table has no entry"."""
    with pytest.raises(SpecError) as raised:
        tuning.tuned_spec(kind, 64, "bf16", False, "sm_80")
    assert str(raised.value) == f"arch='sm_80': a {kind} kernel needs sm_90a (TMA, wgmma, setmaxnreg)"
    with pytest.raises(SpecError) as raised:
        KernelSpec(head_dim=64, kind=kind, arch="sm_86", block_m=128, block_n=128)
    assert str(raised.value) == f"arch='sm_86': a {kind} kernel needs sm_90a (TMA, wgmma, setmaxnreg)"


_PLAIN = '{"kind": "fwd", "arch": "*", "head_dim": 64, "dtype": "*", "causal": "*", "bucket": "*", '


@pytest.mark.parametrize("text, why", [
    (None, "no such file"),
    ("nope", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ("{}", 'not a tuning table: it must be a JSON object with an "entries" list'),
    ('{"entries": {}}', 'not a tuning table: it must be a JSON object with an "entries" list'),
    ('{"entries": [7]}', "entry 0 is not a JSON object"),
    ('{"entries": [{"kind": "fwd", "head_dim": 64}]}',
     "entry 0 lacks arch, dtype, causal, bucket, tiles (an entry has kind, arch, head_dim, dtype, causal, bucket and tiles)"),
    ('{"entries": [' + _PLAIN + '"tiles": {}}]}',
     'entry 0 (\'fwd\', head_dim 64): tiles: must be a list of objects like {"block_m": 128, "block_n": 64}'),
    ('{"entries": [' + _PLAIN + '"tiles": [{"block_m": 64, "warps": 4}]}]}',
     "entry 0 ('fwd', head_dim 64): tiles {\"block_m\": 64, \"warps\": 4}: warps is not a tile field "
     "(block_m, block_n, num_warps, num_stages, persistent, exp2_fma)"),
    ('{"entries": [' + _PLAIN.replace('"*", "bucket"', '"yes", "bucket"') + '"tiles": []}]}',
     "entry 0 ('fwd', head_dim 64): causal 'yes': must be one of true, false, \"*\""),
    ('{"entries": [' + _PLAIN.replace('"fwd"', '"fwdd"') + '"tiles": []}]}',
     "entry 0 ('fwdd', head_dim 64): kind 'fwdd': must be one of " + ", ".join(BY_KIND)),
    ('{"entries": [' + _PLAIN.replace("64", '"64"') + '"tiles": []}]}', "entry 0 ('fwd', head_dim '64'): head_dim '64': must be an integer"),
    ('{"entries": [' + _PLAIN + '"head_dim_v": "128", "tiles": []}]}',
     "entry 0 ('fwd', head_dim 64): head_dim_v '128': must be an integer (V's own head dim) or left out"),
])
def test_a_bad_table_is_one_error_naming_the_variable_and_the_file(tmp_path, monkeypatch, text, why):
    """It was a FileNotFoundError, JSONDecodeError or KeyError from deep inside, from any call."""
    path = tmp_path / "mine.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.reload()
    try:
        for call in (tuning.table, lambda: tuning.forward_spec(64, "bf16", False, "sm_90a", 4096)):
            with pytest.raises(SettingError) as raised:
                call()
            assert str(raised.value) == f"FLASHGEN_TUNING_TABLE={str(path)!r}: {why}"
            assert isinstance(raised.value, ValueError)
        for args in (["show", "--d", "64"], ["build", "--d", "64", "--out", str(tmp_path / "gen")], ["tune", "--dry-run"]):
            result = CliRunner().invoke(main, args)  # (the CLI: one line, status 1, from any command)
            assert result.exit_code == 1 and result.stderr == f"error: FLASHGEN_TUNING_TABLE={str(path)!r}: {why}\n", result.stderr
            assert result.stdout == ""
    finally:
        monkeypatch.delenv(tuning.TABLE_ENV)
        tuning.reload()


def test_the_shipped_table_passes_the_check():
    assert tuning.table_problem(json.loads(tuning.TABLE_PATH.read_text())) is None


def test_tune_refuses_an_out_file_that_is_not_a_table_before_timing_anything(tmp_path, monkeypatch):
    """It read the file it merges into after the minutes of timing, as bare JSON (a traceback)."""
    import torch

    from flashgen import plans

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plans, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: pytest.fail("timed before checking --out"))
    out = tmp_path / "mine.json"
    out.write_text('{"about": "mine"}')
    result = CliRunner().invoke(main, ["tune", "--d", "64", "--kinds", "fwd_sm90", "--out", str(out)])
    assert result.exit_code == 1 and result.stderr == (
        f'error: --out {out}: not a tuning table: it must be a JSON object with an "entries" list (an existing file '
        f"there is the table the new entries merge into)\n"), result.stderr
