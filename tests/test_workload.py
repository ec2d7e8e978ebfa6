"""Ahead of time, completely: whatever the launch plans can pick for a workload, `flashgen build`
makes; a kernel a deployment lacks is named with the command that builds it; a recorded run
builds exactly what it loaded. (The same paths run for real under FLASHGEN_NO_JIT on the GPU tier:
tests/test_gpu_deploy.py.)"""

import shlex
from itertools import product
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import flashgen
from flashgen import cli, kernels, plans, tuning
from flashgen.spec import KernelSpec, SpecError
from flashgen.workload import ENTRIES, Workload, command, read_recorded

VARIANTS = ((), ("window",), ("softcap", "alibi"), ("window", "softcap", "alibi"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture
def picked(monkeypatch):
    """The specs the plans ask flashgen.kernels for (loaded or prefetched), with no GPU: the plans
    are made for a device of `arch` with 132 SMs."""
    found = SimpleNamespace(arch="sm_90a", specs=set())

    def get(spec):
        found.specs.add(spec)
        return spec

    monkeypatch.setattr(kernels, "get", get)
    monkeypatch.setattr(kernels, "prefetch", lambda specs: found.specs.update(specs))
    monkeypatch.setattr(plans, "device_arch", lambda device: found.arch)
    monkeypatch.setattr(plans, "sm_count", lambda device: 132)
    plans.clear()
    yield found
    plans.clear()


def run_every_plan(head_dim, dtype, causal, variant):
    """Every plan the public functions make for a problem: attention and varlen over short and long
    queries, forward (warming its backward) and backward in both modes; decode over contiguous and
    paged caches for every row count, rotary style and split count; varlen over pages; merge."""
    torch_dtype = DTYPES[dtype]
    for seqlen_q in (1, 17, 64, 65, 4096):
        for deterministic in (False, True):
            plans.warm_backward(0, head_dim, torch_dtype, causal, deterministic, "", variant)
            plans.warm_backward(0, head_dim, torch_dtype, causal, deterministic, "", variant, varlen=True)
            plans.backward(0, head_dim, torch_dtype, causal, deterministic, "", variant)
            plans.backward_varlen(0, head_dim, torch_dtype, causal, deterministic, "", variant)
        plans.forward(0, head_dim, torch_dtype, causal, seqlen_q, "", variant)
        plans.forward_varlen(0, head_dim, torch_dtype, causal, seqlen_q, "", variant)
    for paged, rows, rotary, splits in product((False, True), (1, 8, 16, 17, 64, 200), ("", "interleaved", "halves"), (0, 1, 7)):
        plans.decode(0, head_dim, torch_dtype, paged, rows, 2, 2, 8192, splits, variant, rotary)
    for rows in (1, 16, 17, 300):
        plans.decode(0, head_dim, torch_dtype, True, rows, 3, 1, 4096, 0, variant, "", True)
        if plans.paged_prefill(0, head_dim, torch_dtype, causal, rows, variant):  # (and with new keys, the append first)
            plans.kv_append(0, head_dim, torch_dtype)
    plans.merge(0, head_dim, torch_dtype)
    plans.merge(0, head_dim, torch.float32)


@pytest.mark.parametrize("arch, head_dim", [("sm_90a", 64), ("sm_90a", 256), ("sm_80", 128)])
def test_the_build_makes_every_kernel_the_plans_pick(picked, arch, head_dim):
    picked.arch = arch
    workload = Workload(head_dims=(head_dim,), dtypes=("bf16", "fp16"), causal=(False, True), archs=(arch,),
                        entries=ENTRIES, variants=VARIANTS, rotary=("", "interleaved", "halves"))
    for dtype, causal, variant in product(("bf16", "fp16"), (False, True), VARIANTS):
        run_every_plan(head_dim, dtype, causal, variant)
    built = set(workload.specs())
    assert picked.specs, "the plans asked for no kernel"
    assert picked.specs <= built, sorted(spec.name for spec in picked.specs - built)


def test_a_kvcache_build_makes_a_long_chunk_s_kernels(picked):
    """attention_with_kvcache alone over a paged cache: a chunk of more than 64 rows runs the
    paged Hopper forward, after the append kernel where it brings new keys."""
    workload = Workload(head_dims=(128,), dtypes=("bf16",), causal=(True,), archs=("sm_90a",), entries=("kvcache",),
                        layouts=("paged",))
    plans.paged_prefill(0, 128, torch.bfloat16, True, 300)
    plans.kv_append(0, 128, torch.bfloat16)
    assert {spec.kind for spec in picked.specs} == {"fwd_sm90", "append_paged"}
    assert picked.specs <= set(workload.specs())


def test_the_default_build_is_attention_forward_and_backward_for_every_query_length(picked):
    for seqlen_q, deterministic in product((1, 64, 65, 4096), (False, True)):
        plans.forward(0, 64, torch.bfloat16, True, seqlen_q, "")
        plans.backward(0, 64, torch.bfloat16, True, deterministic, "")
    result = CliRunner().invoke(cli.main, ["build", "--d", "64", "--causal", "--dry-run"])
    assert result.exit_code == 0, result.output
    listed = {line.strip() for line in result.output.splitlines()[1:]}
    assert listed == {spec.name for spec in picked.specs}
    assert any(name.startswith("fwd_d64_m64") for name in listed)  # the short-query forward (64 rows or fewer)


def test_a_build_with_v_s_own_head_dim_makes_what_the_plans_pick(picked):
    for seqlen_q, deterministic in product((1, 64, 65, 4096), (False, True)):
        plans.forward(0, 192, torch.bfloat16, True, seqlen_q, "", head_dim_v=128)
        plans.forward_varlen(0, 192, torch.bfloat16, True, seqlen_q, "", head_dim_v=128)
        plans.backward(0, 192, torch.bfloat16, True, deterministic, "", head_dim_v=128)
        plans.backward_varlen(0, 192, torch.bfloat16, True, deterministic, "", head_dim_v=128)
    built = set(Workload(head_dims=(192,), causal=(True,), entries=("attention", "varlen"), layouts=("contiguous",),
                         head_dim_v=128).specs())
    assert picked.specs == built
    assert tuning.backward_prep(128, "bf16", "sm_90a") in built  # the prep reads O and dO, at V's head dim
    with pytest.raises(SpecError, match="head_dim_v=128: V of its own head dim goes through attention and varlen"):
        Workload(head_dims=(192,), entries=("kvcache",), head_dim_v=128)


# ---- the command a NoJitError names -----------------------------------------------------------------

RULE = '{"cuda":"kv_idx <= q_idx + 3","per_batch":false,"per_head":false,"tensors":[]}'
MISSING = [
    tuning.decode_spec(64, "bf16", "sm_90a", paged=False, rows=1),
    tuning.decode_spec(128, "fp16", "sm_90a", paged=True, rows=40, variant=("window",), rotary="halves"),
    tuning.decode_spec(64, "bf16", "sm_90a", paged=True, rows=1, varlen=True),
    tuning.forward_spec(64, "bf16", True, "sm_90a", seqlen_q=64),
    tuning.forward_spec(128, "bf16", False, "sm_80", seqlen_q=4096, variant=("softcap",)),
    tuning.backward_specs(64, "bf16", True, "sm_90a", deterministic=True, varlen=True)[-1],
    tuning.merge_spec("merge_fp32", 128, "bf16", "sm_90a"),
    tuning.forward_spec(192, "bf16", True, "sm_90a", seqlen_q=4096, head_dim_v=128),  # V of its own head dim
    tuning.paged_forward_spec(128, "bf16", True, "sm_90a", seqlen_q=2048, variant=("window",)),  # a long chunk over pages
    tuning.backward_specs(192, "bf16", False, "sm_90a", deterministic=True, varlen=True, head_dim_v=128)[-1],
    KernelSpec(head_dim=64, block_m=128, block_n=32, kind="fwd", arch="sm_80"),  # a tile the tables never pick
    KernelSpec(head_dim=8, kind="block_mask", block_m=64, block_n=64, causal=True, mask_mod=RULE),  # a user rule's
]


def no_jit_error(spec, monkeypatch, tmp_path, loaded=()) -> str:
    from flashgen import aot

    monkeypatch.setattr(aot, "LOADED_FOLDERS", list(loaded))
    monkeypatch.setenv("FLASHGEN_NO_JIT", "1")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    kernels.clear()
    with pytest.raises(flashgen.NoJitError) as error:
        kernels.get(spec)
    return str(error.value)


@pytest.mark.parametrize("spec", MISSING, ids=lambda spec: spec.name)
def test_a_missing_kernel_is_named_with_the_command_that_builds_it(spec, monkeypatch, tmp_path):
    message = no_jit_error(spec, monkeypatch, tmp_path)
    assert f"kernel {spec.name} is not prebuilt and FLASHGEN_NO_JIT is set" in message
    assert "no build folder is loaded" in message
    (line,) = [line.strip() for line in message.splitlines() if line.strip().startswith("flashgen build")]
    words = shlex.split(line)
    assert words[words.index("--out") + 1] == "generated"
    result = CliRunner().invoke(cli.main, [*words[1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"  {spec.name}\n" in result.output


def test_a_missing_kernel_is_built_into_the_folder_the_process_loaded(monkeypatch, tmp_path):
    message = no_jit_error(MISSING[0], monkeypatch, tmp_path, loaded=[tmp_path / "deploy"])
    assert f"the folders this process loaded ({tmp_path / 'deploy'}) do not hold it" in message
    assert f"--out {tmp_path / 'deploy'}" in message and f"flashgen.load('{tmp_path / 'deploy'}')" in message


# ---- recording a run ----------------------------------------------------------------------------


def test_a_recorded_run_builds_exactly_what_it_loaded(monkeypatch, tmp_path):
    record = tmp_path / "kernels.jsonl"
    monkeypatch.setenv("FLASHGEN_RECORD", str(record))
    monkeypatch.setattr(kernels, "_recorded", set())
    monkeypatch.setenv("FLASHGEN_NO_JIT", "1")  # (loading fails at once: the record is made before)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    for spec in (MISSING[0], MISSING[-1], MISSING[0]):
        with pytest.raises(flashgen.NoJitError):
            kernels.get(spec)
    kernels.prefetch([MISSING[3]])
    assert read_recorded(record) == [MISSING[0], MISSING[-1], MISSING[3]]
    assert len(record.read_text().splitlines()) == 3  # once per process
    result = CliRunner().invoke(cli.main, ["build", "--from", str(record), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "3 kernel(s) for generated/"  # exactly those: no backward added
    assert {line.strip() for line in result.output.splitlines()[1:]} == {MISSING[0].name, MISSING[-1].name, MISSING[3].name}


def test_a_bad_record_is_named_by_file_and_line(tmp_path):
    record = tmp_path / "kernels.jsonl"
    record.write_text(MISSING[0].canonical() + "\n" + '{"head_dim": 7}\n')
    with pytest.raises(SpecError, match=f"{record}, line 2: not a recorded kernel spec .*head_dim=7"):
        read_recorded(record)
    record.write_text("")
    with pytest.raises(SpecError, match="records no kernels: run the application with FLASHGEN_RECORD="):
        read_recorded(record)
    result = CliRunner().invoke(cli.main, ["build", "--from", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 1 and result.output.startswith("error:") and "cannot read the recorded kernels" in result.output


def test_from_and_spec_are_exact_and_d_is_required_otherwise():
    result = CliRunner().invoke(cli.main, ["build", "--d", "64", "--spec", MISSING[0].canonical()])
    assert result.exit_code == 2 and "leave out --d" in result.output
    result = CliRunner().invoke(cli.main, ["build"])
    assert result.exit_code == 2 and "Missing option '--d' (or --from FILE / --spec JSON)" in result.output
    result = CliRunner().invoke(cli.main, ["build", "--spec", '{"head_dim": 64, "kind": "nope"}'])
    assert result.exit_code == 1 and "--spec" in result.output and "kind='nope'" in result.output


def test_workload_options_are_checked_by_name():
    with pytest.raises(SpecError, match="entries: 'serve' not among"):
        Workload(head_dims=(64,), entries=("serve",))
    result = CliRunner().invoke(cli.main, ["build", "--d", "64", "--entry", "kvcache", "--block", "128"])
    assert result.exit_code == 2 and "pick attention's forward tiles: not with --entry kvcache" in result.output
    result = CliRunner().invoke(cli.main, ["build", "--d", "64", "--kvcache", "paged"])
    assert result.exit_code == 2 and "add --entry kvcache or varlen" in result.output
    result = CliRunner().invoke(cli.main, ["build", "--d", "64", "--variant", "window,sinks"])
    assert result.exit_code == 2 and "'sinks': must be one of window, softcap, alibi" in result.output


def test_a_build_with_sinks_has_the_prep_that_sums_their_gradient():
    """A deployment under FLASHGEN_NO_JIT=1 that trains sinks runs this prep (plans.backward)."""
    built = Workload(head_dims=(128,), archs=("sm_90a",), variants=(("window", "sink"),)).specs()
    assert tuning.backward_prep(128, "bf16", "sm_90a", variant=("sink",)) in built
    assert not any(spec.variants and spec.kind.startswith("bwd") and spec.kind != "bwd_prep" and "sink" in spec.variants
                   for spec in built)


def test_repeated_variants_build_each_combination():
    result = CliRunner().invoke(cli.main, ["build", "--d", "128", "--entry", "kvcache", "--kvcache", "paged",
                                           "--variant", "none", "--variant", "window,softcap", "--dry-run"])
    assert result.exit_code == 0, result.output
    names = [line.strip() for line in result.output.splitlines()[1:]]
    decode = [name for name in names if name.startswith("decode_paged_d128")]  # (both row buckets, each variant)
    assert len(decode) == 4 and sum(name.endswith("_window_softcap") for name in decode) == 2
    # and a long chunk's kernels: the append, and the paged Hopper forward for each variant
    assert sorted(set(names) - set(decode)) == ["append_paged_d128_bf16_sm90a", "fwd_sm90_d128_m128_n128_bf16_full_s2_sm90a_varlen_paged",
                                                "fwd_sm90_d128_m128_n128_bf16_full_s2_sm90a_varlen_paged_window_softcap"]
    assert command(tuning.decode_spec(128, "bf16", "sm_90a", True, 1, ("window", "softcap"))).split()[2:] == [
        "--d", "128", "--entry", "kvcache", "--variant", "window,softcap", "--kvcache", "paged", "--out", "generated"]
