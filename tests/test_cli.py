"""The `flashgen` command through click's CliRunner (and, where a fresh process matters, for real);
the build folder it writes loads, and checks, with no GPU."""

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from itertools import product
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import flashgen
from flashgen import aot, cli, tuning
from flashgen.spec import KernelSpec

ROOT = Path(__file__).resolve().parent.parent


def tuned(head_dim, causal=False):
    """The spec the CLI picks when only --d (and the mask) are given: the table's long-sequence choice."""
    return tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", seqlen_q=4096)


D64 = tuned(64, causal=True)  # what `build --d 64 --causal` picks: the Hopper forward
assert D64.kind == "fwd_sm90"


def run(*args, env=None):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env=env)


def blocks(markdown: Path, language: str) -> list[str]:
    """The fenced code blocks of one language in a Markdown file, in order."""
    parts = markdown.read_text().split("```")
    return [part[len(language) + 1:] for part in parts[1::2] if part.startswith(language + "\n")]


GENERATED_README = ROOT / "generated" / "README.md"
# The build command generated/README.md gives first: what the folder the tests load is built by.
BUILD_WORDS = blocks(GENERATED_README, "bash")[0].splitlines()[0].split()


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    assert BUILD_WORDS == ["flashgen", "build", "--d", "64", "--causal"]  # (D64 and the tests below say what it makes)
    out = tmp_path_factory.mktemp("cli") / "generated"
    result = run(*BUILD_WORDS[1:], "--out", out)
    assert result.exit_code == 0, result.output
    return out


def cubin_of(folder, name):
    """The cubin a built kernel's JSON names: <name>.<checksum>.cubin."""
    meta = json.loads((folder / f"{name}.json").read_text())
    assert meta["cubin"] == f"{name}.{meta['cubin_sha256'][:16]}.cubin"
    return folder / meta["cubin"]


def test_build_writes_an_importable_folder(gen):
    name = D64.name
    assert {p.name for p in gen.iterdir()} >= {f"{name}{ext}" for ext in (".cu", ".json", ".py")} | {"__init__.py"}
    assert 'extern "C" __global__' in (gen / f"{name}.cu").read_text()
    assert cubin_of(gen, name).read_bytes().startswith(b"\x7fELF")
    assert not (gen / f"{name}.cubin").exists()


def test_an_interrupted_rebuild_leaves_the_kernel_as_it_was_and_a_finished_one_leaves_no_stale_cubin(gen, tmp_path):
    """The JSON is the switch: a new cubin written without its JSON (a crash in between) changes
    nothing; a build that finishes removes the cubins of the builds before it."""
    folder = tmp_path / "gen"
    shutil.copytree(gen, folder)
    (folder / f"{D64.name}.0123456789abcdef.cubin").write_bytes(b"\x7fELF half of another build")
    (folder / f"{D64.name}.cubin").write_bytes(b"\x7fELF an older layout's")
    assert flashgen.load(folder / f"{D64.name}.json").spec == D64
    result = run("build", "--d", 64, "--causal", "--out", folder)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.glob(f"{D64.name}.*cubin")) == [cubin_of(folder, D64.name).name]


def test_backward_kernels_are_written_before_the_forward_kernels_that_name_them(gen, tmp_path):
    written = []
    aot.build([D64], tmp_path / "gen", jobs=2, progress=lambda meta: written.append(meta["name"]))
    forward = written.index(D64.name)
    meta = json.loads((tmp_path / "gen" / f"{D64.name}.json").read_text())
    assert meta["backward"] and all(written.index(name) < forward for name in meta["backward"])


def test_load_refuses_a_kernel_of_another_version_or_a_missing_backward_piece(gen, tmp_path):
    folder = tmp_path / "gen"
    shutil.copytree(gen, folder)
    forward = folder / f"{D64.name}.json"
    meta = json.loads(forward.read_text())
    (folder / f"{meta['backward'][0]}.json").unlink()
    with pytest.raises(FileNotFoundError, match="is missing: the build in .* is incomplete; run `flashgen build` again"):
        flashgen.load(forward)
    forward.write_text(json.dumps({**meta, "flashgen": "0.0.9"}))
    with pytest.raises(ValueError, match="built by flashgen 0.0.9, and this is flashgen .* rebuild it"):
        flashgen.load(forward)
    # a folder of that version, whose specs have a field this one lacks: the same message, no TypeError
    forward.write_text(json.dumps({**meta, "flashgen": "0.0.9", "spec": {**meta["spec"], "retired_field": 1}}))
    with pytest.raises(ValueError, match="built by flashgen 0.0.9"):
        flashgen.load(folder)


def test_a_cubin_runs_on_its_own_major_version_and_sm90a_on_sm90a_only():
    assert aot.runs_on("sm_80", "sm_86") and aot.runs_on("sm_86", "sm_86") and aot.runs_on("sm_90a", "sm_90a")
    assert not aot.runs_on("sm_86", "sm_80") and not aot.runs_on("sm_80", "sm_90a") and not aot.runs_on("sm_90a", "sm_80")


def test_built_files_are_readable_by_everyone(gen):
    for path in gen.iterdir():
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path.name  # a deployment folder


def test_build_and_list_print_whole_names(gen):
    """Names are what `import <folder>.<name>` takes: never cut, also in a pipe of 80 columns."""
    names = [meta["name"] for meta in aot.built(gen)]
    for result in (run("list", "--out", gen), run("build", "--d", 64, "--causal", "--out", gen)):
        assert result.exit_code == 0, result.output
        assert "…" not in result.stdout
        for name in names:
            assert f"  {name}  " in result.stdout


def test_list_of_an_empty_folder(tmp_path):
    result = run("list", "--out", tmp_path)
    assert result.exit_code == 0 and "no kernels" in result.output


def test_build_every_combination_in_parallel(tmp_path):
    out = tmp_path / "gen"
    result = run("build", "--d", "64", "--causal", "both", "--jobs", 2, "--no-backward", "--out", out)
    assert result.exit_code == 0, result.output
    metas = aot.built(out)
    assert len(list(out.glob("*.json"))) == len(metas) == 4  # short and long queries, both masks
    assert all(m["backward"] == [] for m in metas)
    result = run("build", "--d", "64,128", "--causal", "both", "--dtype", "both", "--no-backward", "--dry-run")
    assert result.exit_code == 0, result.output
    names = result.output.splitlines()[1:]
    for d, dtype, mask in product((64, 128), ("fp16", "bf16"), ("full", "causal")):
        picked = [name for name in names if f"_d{d}_" in name and f"_{dtype}_{mask}_" in name]
        assert len(picked) == 2, (d, dtype, mask, names)


def test_build_includes_the_backward_kernels_by_default(gen):
    metas = {m["name"]: m for m in aot.built(gen)}
    (forward,) = [m for m in metas.values() if m["spec"]["kind"] == D64.kind]
    backward = [metas[name]["spec"] for name in forward["backward"]]
    assert {spec["kind"] for spec in backward} == {"bwd_prep", "bwd_sm90_kvq", "bwd_sm90_kv", "bwd_q"}  # sm_90a's tables
    short = tuning.forward_spec(64, "bf16", True, "sm_90a", seqlen_q=64)  # queries of 64 rows or fewer
    assert set(forward["backward"]) | {forward["name"], short.name} == set(metas)
    assert metas[short.name]["backward"] == forward["backward"]
    assert all(spec["causal"] for spec in backward if spec["kind"] != "bwd_prep")
    assert not (gen / f"{forward['backward'][0]}.py").exists()  # only forward kernels get an importable module


@pytest.mark.parametrize(
    "flags, mask",
    [(["--causal"], "_causal_"), (["--no-causal"], "_full_"), (["--causal", "yes"], "_causal_")],
)
def test_causal_flags(tmp_path, flags, mask):
    out = tmp_path / "gen"
    result = run("build", "--d", 64, *flags, "--no-backward", "--dry-run", "--out", out)  # bare --causal before another option
    assert result.exit_code == 0, result.output
    names = result.output.splitlines()[1:]
    assert len(names) == 2 and all(mask in name for name in names)


def test_bare_causal_as_last_argument():
    result = run("show", "--d", 64, "--causal")
    assert result.exit_code == 0 and "_causal_" in result.output


def failed(result, *texts):
    """A refusal: exit status 1, the message on stderr (not stdout), no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert all(text in result.stderr for text in texts), result.stderr
    assert "Traceback" not in result.stderr and "error" not in result.stdout.lower()
    return True


@pytest.mark.parametrize("d", [100, 264])
def test_bad_head_dim_is_named_as_the_problem(tmp_path, d):
    result = run("build", "--d", d, "--out", tmp_path / "gen")
    assert failed(result, f"head_dim={d}: must be a multiple of 8 in [8, 256]")
    assert "tile" not in result.stderr  # the head dim is the problem, not the tile shapes
    assert not (tmp_path / "gen").exists()


@pytest.mark.parametrize("args, text", [
    (["--d", "64,"], "expected integers separated by commas"),
    (["--d", "0"], "positive integer"),
    (["--d", "64", "--jobs", "0"], "0 is not in the range x>=1"),
    (["--d", "64", "--dtype", "fp32"], "'fp32': must be one of fp16, bf16, e4m3, both"),
    (["--d", "64", "--causal", "--no-causal"], "contradicts"),
])
def test_bad_options_are_refused(tmp_path, args, text):
    result = run("build", *args, "--out", tmp_path / "gen")
    assert result.exit_code == 2 and text in result.stderr, result.stderr  # click's usage errors
    assert not (tmp_path / "gen").exists()


@pytest.mark.parametrize("block", [96, 192])
def test_a_tile_no_warp_count_fits_is_named_not_a_warp_count_the_user_never_gave(tmp_path, block):
    result = run("build", "--d", 64, "--arch", "sm_80", "--block", block, "--out", tmp_path / "gen")
    assert failed(result, f"block_m={block} with num_warps=4"), result.stderr  # (it said num_warps=3 / 6)
    assert "must be one of (1, 2, 4, 8)" not in result.stderr


def test_show_prints_the_source():
    name = tuned(64, causal=True).name
    result = run("show", "--d", 64, "--causal")
    assert result.exit_code == 0
    assert 'extern "C" __global__' in result.output and name in result.output
    assert "diag" in result.output and "cp.async.bulk.tensor" in result.output
    ampere = run("show", "--d", 64, "--causal", "--arch", "sm_80")
    assert ampere.exit_code == 0 and "fwd_d64_" in ampere.output and "cp.async.bulk.tensor" not in ampere.output
    mma = run("show", "--d", 64, "--kind", "fwd", "--block", 64)
    assert mma.exit_code == 0 and "fwd_d64_m64_n64_bf16_full_w4_s3_sm90a(" in mma.output


def test_show_a_backward_kernel():
    spec = tuning.tuned_spec("bwd_kvq", 64, "bf16", True, "sm_90a")
    result = run("show", "--d", 64, "--causal", "--kind", "bwd_kvq")
    assert result.exit_code == 0, result.output
    assert f"{spec.name}(" in result.output and "wgmma.mma_async" in result.output
    on_ampere = run("show", "--d", 64, "--kind", "bwd_kvq", "--arch", "sm_80")
    assert on_ampere.exit_code == 0 and "wgmma" not in on_ampere.output and "mma.sync" in on_ampere.output
    explicit = run("show", "--d", 128, "--kind", "bwd_q", "--block", 64, "--block-n", 32)
    assert explicit.exit_code == 0 and "bwd_q_d128_m64_n32_bf16_full_w4_s2_sm90a" in explicit.output
    prep = run("show", "--d", 96, "--kind", "bwd_prep")
    assert prep.exit_code == 0 and "bwd_prep_d96_bf16_sm90a(" in prep.output
    assert run("show", "--d", 64, "--kind", "bwd").exit_code != 0  # not a kind
    assert failed(run("show", "--d", 64, "--kind", "bwd_prep", "--block", 64), "a bwd_prep kernel does not use block_m")


def test_show_a_rotary_decode_kernel():
    result = run("show", "--d", 128, "--kind", "decode_paged", "--rotary", "halves")
    assert result.exit_code == 0, result.output
    assert "_rope_halves(" in result.output and "struct Rotary" in result.output
    assert "struct Rotary" not in run("show", "--d", 128, "--kind", "decode").output
    assert failed(run("show", "--d", 64, "--rotary", "interleaved"), "a fwd_sm90 kernel does not use rotary")
    assert run("show", "--d", 64, "--kind", "decode", "--rotary", "sideways").exit_code != 0
    assert run("build", "--d", 64, "--rotary", "halves").exit_code == 2  # attention's kernels take no rotary


def test_show_resources_compiles():
    result = run("show", "--d", 64, "--resources")
    assert result.exit_code == 0, result.output
    assert f"// {tuned(64).name}: " in result.output and '"registers"' in result.output


def test_show_resources_compiles_under_no_jit_as_build_does():
    """An explicit request to compile, like `flashgen build`: it printed the whole source, then
    failed with FLASHGEN_NO_JIT's advice (build and load it), which did not apply."""
    result = run("show", "--d", 64, "--kind", "bwd_prep", "--resources", env={"FLASHGEN_NO_JIT": "1"})
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    assert result.stdout.splitlines()[-1].startswith('// bwd_prep_d64_bf16_sm90a: {"registers": ')
    assert "FLASHGEN_NO_JIT" in cli.show.params[-1].help


def test_cache_info_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert run("build", "--d", 32, "--no-backward", "--out", tmp_path / "gen").exit_code == 0  # (short and long queries)
    info = run("cache", "info")
    assert info.exit_code == 0 and "2 kernel(s)" in info.output and str(tmp_path / "cache") in info.output
    cleared = run("cache", "clear")
    assert cleared.exit_code == 0 and "removed 2 kernel(s)" in cleared.output
    assert "0 kernel(s)" in run("cache", "info").output


def test_a_cache_directory_others_can_write_is_refused_cleanly(tmp_path):
    unsafe = tmp_path / "shared"
    unsafe.mkdir(mode=0o777)
    os.chmod(unsafe, 0o777)
    result = run("build", "--d", 32, "--no-backward", "--out", tmp_path / "gen", env={"FLASHGEN_CACHE_DIR": str(unsafe)})
    assert failed(result, "is writable by other users")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the message on a machine with no GPU")
def test_bench_without_gpu_fails_clearly():
    assert failed(run("bench"), "needs an NVIDIA GPU")
    assert failed(run("bench", "--varlen"), "needs an NVIDIA GPU")


def test_bench_varlen_batch_is_fixed_mixed_and_32k():
    from flashgen.bench import varlen_lengths

    lengths = varlen_lengths()
    assert lengths == varlen_lengths() and len(lengths) == 16
    assert min(lengths) == 128 and max(lengths) == 4096 and abs(sum(lengths) - 32768) <= 1024


def test_bench_markdown_tables():
    from flashgen.bench import markdown

    row = {"mode": "bwd", "d": 64, "causal": True, "T": 4096, "flashgen": 250.4, "flash": 200.0, "cudnn": None,
           "efficient": 100.0, "kernel": "fwd_sm90_d64_m192_n128_bf16_causal_s2_sm90a"}
    gqa = {**row, "d": 128, "T": 16384, "heads": "32:8", "cudnn": 500.0}
    text = markdown({"tables": {"bwd": [row]}, "gqa": [gqa]})
    assert text.splitlines()[:4] == [
        "bwd (TFLOPS)", "", "| d | causal | T | flashgen | flash | cudnn | efficient | vs flash | vs cudnn | kernel |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    assert "| 64 | yes | 4096 | 250 | 200 | - | 100 | 1.25 | - | fwd_sm90_d64_m192_n128_bf16_causal_s2_sm90a |" in text
    assert "GQA 32:8, causal, bwd (TFLOPS)" in text and "| 128 | yes | 16384 | 250 | 200 | 500 | 100 | 1.25 | 0.50 |" in text


def test_doctor_reports_nvrtc_and_the_gpu_situation():
    result = run("doctor")
    assert result.exit_code == 0 and "NVRTC 13." in result.output
    assert ("GPU 0:" in result.output) == torch.cuda.is_available()


def fresh(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)


@pytest.mark.parametrize("args", [["--help"], ["show", "--d", "64"], ["list"], ["cache", "info"]])
def test_commands_that_run_no_kernel_do_not_import_torch(args, tmp_path):
    code = (
        "import sys; from flashgen.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as done:\n    assert not done.code, done.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = fresh(code, FLASHGEN_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]


def test_build_does_not_import_torch(tmp_path):
    code = (
        "import sys; from flashgen.cli import main\n"
        f"try:\n    main(['build', '--d', '32', '--no-backward', '--out', {str(tmp_path / 'gen')!r}])\n"
        "except SystemExit as done:\n    assert not done.code, done.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = fresh(code, FLASHGEN_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_root_cli_script_runs_the_same_app():
    result = subprocess.run([sys.executable, "cli.py", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "build" in result.stdout and "show" in result.stdout


def test_the_package_installs_no_generic_top_level_module():
    text = (ROOT / "pyproject.toml").read_text()
    assert "py-modules" not in text and 'flashgen = "flashgen.cli:main"' in text


def test_reference_is_reachable_from_the_package():
    result = fresh("import flashgen; print(flashgen.reference.naive_attention.__name__)")
    assert result.returncode == 0 and result.stdout.strip() == "naive_attention", result.stderr


def test_load_without_gpu(gen):
    forward = gen / f"{D64.name}.json"
    for path in (forward, cubin_of(gen, D64.name), gen / D64.name):  # .json, .cubin or stem
        kernel = flashgen.load(path)
        assert isinstance(kernel, flashgen.PrebuiltKernel)
        assert kernel.spec == D64 and repr(kernel) == f"PrebuiltKernel({D64.name}, {forward})"


def test_load_a_folder_gives_its_forward_kernels_by_name_and_registers_every_kernel(gen, monkeypatch):
    registered = []
    monkeypatch.setattr(aot, "_register", lambda spec, cubin: registered.append(spec))
    kernels = flashgen.load(gen)
    short = tuning.forward_spec(64, "bf16", True, "sm_90a", seqlen_q=64)
    assert sorted(kernels) == sorted([D64.name, short.name]) and kernels[D64.name].spec == D64
    assert {spec.name for spec in registered} == {meta["name"] for meta in aot.built(gen)}  # the backward too


def test_load_an_empty_folder_says_what_it_expects(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no kernels built by `flashgen build`"):
        flashgen.load(tmp_path)


def test_load_a_backward_piece_alone_says_what_it_is_for(gen):
    name = next(meta["name"] for meta in aot.built(gen) if meta["spec"]["kind"] == "bwd_sm90_kvq")
    with pytest.raises(ValueError, match=f"{name} is a bwd_sm90_kvq kernel, not a forward kernel of attention\\(\\): load its folder"):
        flashgen.load(gen / f"{name}.json")


def test_generated_module_imports(gen):
    module_spec = importlib.util.spec_from_file_location("gen_kernel", gen / f"{D64.name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    assert module.spec == D64 and isinstance(module.attention, flashgen.PrebuiltKernel)


def test_load_rejects_altered_cubin(gen, tmp_path):
    cubin = tmp_path / cubin_of(gen, D64.name).name
    (tmp_path / f"{D64.name}.json").write_bytes((gen / f"{D64.name}.json").read_bytes())
    cubin.write_bytes(cubin_of(gen, D64.name).read_bytes())
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01  # same length: only the checksum can tell
    cubin.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        flashgen.load(tmp_path / f"{D64.name}.json")


def test_check_loads_the_built_kernels_and_never_compiles(gen, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "flashgen.check", str(gen)], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "FLASHGEN_NO_JIT": "1", "FLASHGEN_CACHE_DIR": str(tmp_path / "empty-cache")},
    )
    assert result.returncode == 0, result.stderr
    assert f"{D64.name}: loaded from {gen / D64.name}.json" in result.stdout
    if not torch.cuda.is_available():
        assert "no CUDA GPU visible" in result.stdout
    assert not (tmp_path / "empty-cache").exists()


def test_check_of_a_folder_with_nothing_built_fails_cleanly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "flashgen.check", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1 and "flashgen build" in result.stderr and "Traceback" not in result.stderr


def test_generated_folder_holds_its_readme_and_loader_and_ignores_builds():
    """The tracked generated/ package is what a build would write, so building leaves git clean."""
    assert (ROOT / "generated" / "__init__.py").read_text() == aot.PACKAGE_INIT
    assert "flashgen build" in (ROOT / "generated" / "README.md").read_text()
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    built = [f"generated/{D64.name}{ext}" for ext in (".cu", ".0123456789abcdef.cubin", ".json", ".py")]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *built], capture_output=True, text=True, cwd=ROOT)
    assert ignored.stdout.split() == built
    tracked = subprocess.run(["git", "ls-files", "generated"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert tracked == ["generated/README.md", "generated/__init__.py"]


def _report(tmp_path):
    rows = [{"d": d, "causal": c, "T": t, "flashgen": 300.0 + t / 100, "flash": 250.0, "cudnn": 320.0, "efficient": None}
            for d in (64, 128) for c in (False, True) for t in (512, 1024, 2048)]
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"gpu": "test GPU", "date": "2026-12-02", "tables": {"fwd": rows, "bwd": rows[:6]}}))
    return path


def test_plot_draws_a_saved_report(tmp_path):
    picture = tmp_path / "bench.png"
    result = CliRunner().invoke(cli.main, ["plot", str(_report(tmp_path)), str(picture)])
    assert result.exit_code == 0, result.output
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(picture).size
    assert width > 4 * height / 2  # four panels (d x mask) across, two modes down


def test_plot_names_a_file_that_is_not_a_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu": "x"}')
    result = CliRunner().invoke(cli.main, ["plot", str(bad), str(tmp_path / "x.png")])
    assert result.exit_code == 1 and "not a flashgen bench report" in result.output


def test_check_calls_a_variant_kernel_with_its_variants():
    """`python -m flashgen.check` called every kernel as kernel(q, k, v): a window, softcap or ALiBi
    kernel refused such a call ("built for variants"), so check failed every one of them."""
    from flashgen.check import variant_arguments

    q = torch.zeros(2, 8, 16, 64)
    base = KernelSpec(head_dim=64, block_m=64, block_n=64, causal=True)
    assert variant_arguments(base, q) == {}
    got = variant_arguments(base.replace(variants=("window", "softcap", "alibi")), q)
    assert got["window_size"] == (256, 0) and got["softcap"] == 30.0
    assert got["alibi_slopes"].shape == (8,) and got["alibi_slopes"].dtype == torch.float32
    assert variant_arguments(base.replace(causal=False, variants=("window",)), q)["window_size"] == (256, 64)


def test_a_prebuilt_kernel_with_more_shared_memory_than_the_gpu_allows_is_refused_by_name(monkeypatch):
    """sm_80 code runs on sm_86 / sm_89, whose blocks get 99 KiB of shared memory, not 163: an sm_80
    build's tiles (here d = 192, or the backward it carries) are refused there with the fix named."""
    import types

    from flashgen import plans

    spec = tuning.tuned_spec("fwd", 192, "bf16", False, "sm_80")
    assert spec.smem_bytes > 99 * 1024
    kernel = aot.PrebuiltKernel(spec, {"resources": {"registers": 1, "static_smem": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0}},
                                Path("x.json"))
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_86")
    fake_q = types.SimpleNamespace(is_cuda=True, get_device=lambda: 0, device="cuda:0")
    with pytest.raises(ValueError, match=r"KiB of shared memory a block; this GPU \(cuda:0, sm_86\) allows 99 KiB: build it "
                                         r"with `flashgen build --arch sm_86`"):
        kernel(fake_q, fake_q, fake_q)


@pytest.mark.parametrize("kind", ["bwd_prep", "bwd_dq_sm90", "bwd_sm90_kvq", "fwd"])
def test_show_takes_every_kind_the_readme_names(kind):
    result = run("show", "--d", 64, "--kind", kind)
    assert result.exit_code == 0 and f"// {kind}_d64" in result.stdout, result.stderr


def test_load_of_a_folder_with_a_damaged_kernel_fails_naming_it(gen, tmp_path):
    """A deployment must not start with a kernel silently left out: built() skipped a corrupt JSON
    (or a JSON whose cubin is gone), and load(folder) handed out the rest."""
    folder = tmp_path / "gen"
    shutil.copytree(gen, folder)
    backward = json.loads((folder / f"{D64.name}.json").read_text())["backward"][0]
    (folder / f"{D64.name}.json").write_text('{"name": "cut short')
    cubin_of(folder, backward).unlink()
    names = {meta["name"] for meta in aot.built(gen)}
    metas, damaged = aot.scan(folder)
    assert {meta["name"] for meta in metas} == names - {D64.name, backward}
    assert damaged == [
        f"{folder / backward}.json is damaged (its cubin {cubin_of(gen, backward).name} is missing): "
        f"rebuild it with `flashgen build --out {folder}`",
        f"{folder / D64.name}.json is damaged (not valid JSON: Unterminated string starting at: line 1 column 10 (char 9)): "
        f"rebuild it with `flashgen build --out {folder}`",
    ]
    with pytest.raises(ValueError) as raised:
        flashgen.load(folder)
    assert str(raised.value) == f"{folder} holds damaged kernels: " + "; ".join(damaged)
    (folder / "notes.json").write_text("not a kernel's, not JSON")  # other files are left alone
    assert aot.scan(folder)[1] == damaged


def test_load_of_a_path_that_is_not_there_names_that_path(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        flashgen.load(tmp_path / "nothere")
    assert str(raised.value) == (f"{tmp_path / 'nothere'} does not exist: flashgen.load takes a build folder, or a "
                                 f"kernel's .json, .cubin or .py (or that path without its suffix)")


def check(*args, **env):
    return subprocess.run([sys.executable, "-m", "flashgen.check", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env})


def test_check_of_a_folder_that_is_not_there_says_so(tmp_path):
    """It said "nothere.json does not exist"."""
    result = check("nothere")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == ("error: nothere does not exist: python -m flashgen.check takes a build folder (what "
                             "`flashgen build --out` writes; generated/ by default)\n")
    (tmp_path / "file").write_text("")
    assert check(tmp_path / "file").stderr.startswith(f"error: {tmp_path / 'file'} is not a folder: ")


def test_check_rejects_a_no_jit_value_it_does_not_know(gen):
    """FLASHGEN_NO_JIT=garbage passed: nothing in check asked whether it may compile."""
    result = check(gen, FLASHGEN_NO_JIT="garbage")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0] == ("error: FLASHGEN_NO_JIT='garbage': must be 1, true, yes or on (never "
                                             "compile), or 0, false, no, off or empty")


def test_list_names_a_damaged_kernel_and_fails(gen, tmp_path):
    """It listed the rest and left the damaged one out, with status 0."""
    folder = tmp_path / "gen"
    shutil.copytree(gen, folder)
    (folder / f"{D64.name}.json").write_text("{")
    result = run("list", "--out", folder)
    assert result.exit_code == 1
    assert result.stderr == (f"error: {folder / D64.name}.json is damaged (not valid JSON: Expecting property name enclosed "
                             f"in double quotes: line 1 column 2 (char 1)): rebuild it with `flashgen build --out {folder}`\n")
    others = [meta["name"] for meta in aot.built(folder)]
    assert others and all(f"  {name}  " in result.stdout for name in others) and D64.name not in result.stdout


def first_error(result, *texts):
    """A refusal whose first line of stderr is the error (nothing left before it by the progress bar)."""
    assert failed(result, *texts)
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    return True


def test_a_build_into_an_out_under_a_file_names_the_output_folder(tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "gen"
    result = run("build", "--d", 32, "--no-backward", "--out", out)
    assert first_error(result, f"cannot write the build's output folder --out {out}: Not a directory ({out})")


def test_a_build_with_a_cache_under_a_file_names_the_cache_directory(tmp_path):
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    result = run("build", "--d", 32, "--no-backward", "--out", tmp_path / "gen", env={"FLASHGEN_CACHE_DIR": str(cache)})
    assert first_error(result, f"cannot write into the flashgen cache directory {cache}: {tmp_path / 'file'} is not a "
                               f"directory. Set FLASHGEN_CACHE_DIR to a directory you can write.")


@pytest.mark.parametrize("command", ["build", "list"])
def test_an_empty_out_is_refused(tmp_path, monkeypatch, command):
    """`build --out ""` wrote into the current directory."""
    monkeypatch.chdir(tmp_path)
    result = run(command, *(["--d", 32, "--no-backward"] if command == "build" else []), "--out", "")
    assert result.exit_code == 2 and "Invalid value for '--out': must name a folder" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["info", "clear"])
def test_cache_info_and_clear_refuse_what_the_cache_refuses(tmp_path, command):
    """They took a file or a directory others can write as an empty cache: "0 kernel(s)", status 0."""
    (tmp_path / "file").write_text("")
    result = run("cache", command, env={"FLASHGEN_CACHE_DIR": str(tmp_path / "file")})
    assert first_error(result, f"flashgen cache directory {tmp_path / 'file'} exists and is not a directory. "
                               "Set FLASHGEN_CACHE_DIR")
    shared = tmp_path / "shared"
    (shared / flashgen.__version__ / "sm_90a").mkdir(parents=True)
    shared.chmod(0o777)
    result = run("cache", command, env={"FLASHGEN_CACHE_DIR": str(shared)})
    assert first_error(result, f"flashgen cache directory {shared} is writable by other users (mode 0o777)")
    assert (shared / flashgen.__version__ / "sm_90a").is_dir()


@pytest.mark.parametrize("command", ["info", "clear"])
def test_cache_info_and_clear_say_when_there_is_no_cache_yet(tmp_path, command):
    result = run("cache", command, env={"FLASHGEN_CACHE_DIR": str(tmp_path / "none")})
    assert result.exit_code == 0 and "kernel(s)" not in result.stdout
    assert result.stdout == (f"no cache yet: {tmp_path / 'none'} does not exist (the first compile creates it; "
                             f"FLASHGEN_CACHE_DIR chooses where)\n")
    assert not (tmp_path / "none").exists()


def test_doctor_shows_every_variable_and_rejects_bad_values(tmp_path):
    """FLASHGEN_NO_JIT=garbage passed doctor; a bad tuning table and cache were not looked at."""
    good = run("doctor")
    assert good.exit_code == 0, good.stderr
    for line in ("FLASHGEN_NO_JIT unset: kernels compile on first use",
                 f"FLASHGEN_TUNING_TABLE unset: the tuning table {tuning.TABLE_PATH}, {len(tuning.table()['entries'])} entries",
                 f"FLASHGEN_CACHE_DIR={os.environ['FLASHGEN_CACHE_DIR']!r}: the kernel cache, {os.environ['FLASHGEN_CACHE_DIR']}"):
        assert line in good.stdout, good.stdout
    (tmp_path / "file").write_text("")
    (tmp_path / "table.json").write_text("[]")
    env = {"FLASHGEN_NO_JIT": "garbage", "FLASHGEN_CACHE_DIR": str(tmp_path / "file"),
           "FLASHGEN_TUNING_TABLE": str(tmp_path / "table.json")}
    tuning.reload()
    try:
        bad = run("doctor", env=env)
    finally:
        tuning.reload()
    assert bad.exit_code == 1 and "Traceback" not in bad.stderr
    for name, value in env.items():
        assert f"{name}={value!r}: set wrong (the error below)" in bad.stdout
    assert bad.stderr.splitlines() == [
        f"error: flashgen cache directory {tmp_path / 'file'} exists and is not a directory. Set FLASHGEN_CACHE_DIR to a "
        "directory (or remove the file).",
        "error: FLASHGEN_NO_JIT='garbage': must be 1, true, yes or on (never compile), or 0, false, no, off or empty",
        f"error: FLASHGEN_TUNING_TABLE={str(tmp_path / 'table.json')!r}: not a tuning table: it must be a JSON object "
        'with an "entries" list',
    ]


def test_show_offers_every_kind_it_can_render_and_lists_them_in_its_help():
    """--kind's help was hand-written (forward and backward pieces only); block_mask was offered but
    needs a mask rule's source, which no option gives."""
    from flashgen.families import BY_KIND, KINDS

    (kind_option,) = [param for param in cli.show.params if param.name == "kind"]
    shown = [kind for kind in KINDS if kind != "block_mask"]
    assert list(kind_option.type.choices) == shown and BY_KIND["block_mask"].needs_rule
    assert f"the kernel kind: {', '.join(shown)} (default: " in kind_option.help
    assert "block_mask kernels are made from a user rule, in Python" in kind_option.help
    refused = run("show", "--d", 64, "--kind", "block_mask")
    assert refused.exit_code == 2 and "'block_mask' is not one of" in refused.stderr


@pytest.mark.parametrize("kind, arch", [("fwd_sm90", "sm_80"), ("bwd_sm90_kvq", "sm_86")])
def test_show_of_a_kind_on_a_target_it_does_not_build_for_names_the_target_it_needs(kind, arch):
    result = run("show", "--d", 64, "--kind", kind, "--arch", arch)
    assert first_error(result, f"arch='{arch}': a {kind} kernel needs sm_90a (TMA, wgmma, setmaxnreg)")
    assert "tuning table" not in result.stderr and result.stdout == ""


def _commands(group, prefix=()):
    for name, command in group.commands.items():
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))


def test_every_command_is_in_the_module_docstring_and_every_option_has_help():
    """The docstring listed build | list | show | bench | cache | doctor (not plot, tune); bench's
    --d, --seqlens, --modes, tune's --d, --dtype, --mask and list's --out had no help."""
    names = [path for path, _ in _commands(cli.main)]
    assert {path[0] for path in names} == {"build", "list", "show", "bench", "plot", "tune", "cache", "doctor"}
    for path in names:
        assert path[-1] in cli.__doc__.splitlines()[0], path
    for path, command in _commands(cli.main):
        assert command.help, path
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help and param.help.strip(), (path, param.opts)


def test_the_generated_readme_loads_what_its_own_build_command_made(gen, tmp_path):
    """generated/README.md's first Python block, as written, in a fresh process beside the folder its
    build command made, with FLASHGEN_NO_JIT set, an empty cache and the compiler refused; every
    build command it shows is one `flashgen build` takes (its GPU half runs in tests/test_gpu_deploy.py)."""
    code = "import flashgen.cache, flashgen.compile\n" \
           "def refuse(*a, **k):\n    raise AssertionError('NVRTC was called')\n" \
           "flashgen.compile.compile_source = flashgen.cache.compile_source = refuse\n" + blocks(GENERATED_README, "python")[0] + \
           "import generated\nassert sorted(generated.load()) == sorted(flashgen.load('generated'))\n" \
           "from flashgen import kernels\n" \
           "print(sorted(spec.name for spec in kernels._loaded))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=gen.parent,
                            env={**os.environ, "FLASHGEN_NO_JIT": "1", "FLASHGEN_CACHE_DIR": str(tmp_path / "empty")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted(meta["name"] for meta in aot.built(gen)))  # every kernel, registered
    for block in blocks(GENERATED_README, "bash"):
        for line in block.splitlines():
            words = line.split("#")[0].split()
            if "flashgen" in words and words[words.index("flashgen") + 1] == "build":
                words = words[words.index("flashgen") + 2:]
                if "--from" not in words:
                    result = run("build", *words, "--dry-run")
                    assert result.exit_code == 0, (line, result.output)
