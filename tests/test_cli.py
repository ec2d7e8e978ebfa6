"""The `flashgen` command through click's CliRunner; the build folder it writes loads with no GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

import flashgen
from flashgen import aot, tuning
from flashgen.spec import KernelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # cli.py lives at the repo root
import cli  # noqa: E402


def tuned(head_dim, causal=False):
    """The spec the CLI picks when only --d (and the mask) are given: the table's long-sequence choice."""
    return tuning.forward_spec(head_dim, "bf16", causal, "sm_90a", seqlen_q=4096)


D64 = tuned(64).replace(block_m=128)  # what `build --d 64 --block 128` picks


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """rich wraps at 80 columns when not on a terminal; a wide console keeps each line whole."""
    monkeypatch.setattr(cli, "console", Console(width=250))


def run(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "gen"
    result = run("build", "--d", 64, "--block", 128, "--no-backward", "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_build_writes_an_importable_folder(gen):
    name = D64.name
    assert {p.name for p in gen.iterdir()} >= {f"{name}{ext}" for ext in (".cu", ".cubin", ".json", ".py")} | {"__init__.py"}
    assert f'extern "C" __global__' in (gen / f"{name}.cu").read_text()
    assert (gen / f"{name}.cubin").read_bytes().startswith(b"\x7fELF")


def test_list_shows_the_kernel(gen):
    result = run("list", "--out", gen)
    assert result.exit_code == 0 and D64.name in result.output


def test_list_of_an_empty_folder(tmp_path):
    result = run("list", "--out", tmp_path)
    assert result.exit_code == 0 and "no kernels" in result.output


def test_build_every_combination_in_parallel(tmp_path):
    out = tmp_path / "gen"
    result = run("build", "--d", "64,128", "--causal", "both", "--dtype", "both", "--jobs", 2,
                 "--no-backward", "--out", out)
    assert result.exit_code == 0, result.output
    metas = aot.built(out)
    assert len(list(out.glob("*.json"))) == len(metas) == 8
    specs = {KernelSpec(**m["spec"]) for m in metas}
    assert {(s.head_dim, s.dtype, s.causal) for s in specs} == {
        (d, t, c) for d in (64, 128) for t in ("fp16", "bf16") for c in (False, True)
    }
    assert all(m["backward"] == [] for m in metas)


def test_build_includes_the_backward_kernels_by_default(tmp_path):
    out = tmp_path / "gen"
    result = run("build", "--d", "64", "--causal", "--out", out)
    assert result.exit_code == 0, result.output
    metas = {m["name"]: m for m in aot.built(out)}
    (forward,) = [m for m in metas.values() if m["spec"]["kind"] == "fwd"]
    backward = forward["backward"]
    assert {KernelSpec.from_name(name).kind for name in backward} == {"bwd_kvq", "bwd_kv", "bwd_q"}
    assert set(backward) | {forward["name"]} == set(metas)
    assert all(KernelSpec.from_name(name).causal for name in backward)
    assert not (out / f"{backward[0]}.py").exists()  # only forward kernels get an importable module


@pytest.mark.parametrize(
    "flags, mask",
    [(["--causal"], "_causal_"), (["--no-causal"], "_full_"), (["--causal", "yes"], "_causal_")],
)
def test_causal_flags(tmp_path, flags, mask):
    out = tmp_path / "gen"
    result = run("build", "--d", 64, *flags, "--no-backward", "--out", out)  # bare --causal before another option
    assert result.exit_code == 0, result.output
    (meta,) = aot.built(out)
    assert mask in meta["name"]


def test_bare_causal_as_last_argument(tmp_path):
    result = run("show", "--d", 64, "--causal")
    assert result.exit_code == 0 and "_causal_" in result.output


@pytest.mark.parametrize("d", [100, 264])
def test_bad_head_dim_is_named(tmp_path, d):
    result = run("build", "--d", d, "--out", tmp_path / "gen")
    assert result.exit_code != 0
    assert f"head_dim={d}" in result.output
    assert not (tmp_path / "gen").exists()


def test_bad_dtype_names_the_allowed_values(tmp_path):
    result = run("build", "--d", 64, "--dtype", "fp32", "--out", tmp_path / "gen")
    assert result.exit_code != 0
    assert "'fp32': must be one of fp16, bf16, both" in result.output


def test_show_prints_the_source():
    name = tuned(64, causal=True).name
    result = run("show", "--d", 64, "--causal")
    assert result.exit_code == 0
    assert 'extern "C" __global__' in result.output and name in result.output
    assert "diag" in result.output


def test_show_a_backward_kernel():
    from flashgen import tuning

    spec = tuning.tuned_spec("bwd_kvq", 64, "bf16", True, "sm_90a")
    result = run("show", "--d", 64, "--causal", "--kind", "bwd_kvq")
    assert result.exit_code == 0, result.output
    assert f"{spec.name}_prep(" in result.output and "wgmma.mma_async" in result.output
    on_ampere = run("show", "--d", 64, "--kind", "bwd_kvq", "--arch", "sm_80")
    assert on_ampere.exit_code == 0 and "wgmma" not in on_ampere.output and "mma.sync" in on_ampere.output
    explicit = run("show", "--d", 128, "--kind", "bwd_q", "--block", 64, "--block-n", 32)
    assert explicit.exit_code == 0 and "bwd_q_d128_m64_n32_bf16_full_w4_s2_sm90a" in explicit.output
    assert run("show", "--d", 64, "--kind", "bwd").exit_code != 0  # not a kind


def test_show_resources_compiles():
    result = run("show", "--d", 64, "--resources")
    assert result.exit_code == 0, result.output
    assert f"// {tuned(64).name}: " in result.output and '"registers"' in result.output


def test_cache_info_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert run("build", "--d", 32, "--no-backward", "--out", tmp_path / "gen").exit_code == 0
    info = run("cache", "info")
    assert info.exit_code == 0 and "1 kernel(s)" in info.output and str(tmp_path / "cache") in info.output
    cleared = run("cache", "clear")
    assert cleared.exit_code == 0 and "removed 1 kernel(s)" in cleared.output
    assert "0 kernel(s)" in run("cache", "info").output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the message on a machine with no GPU")
def test_bench_without_gpu_fails_clearly():
    result = run("bench")
    assert result.exit_code != 0
    assert "needs an NVIDIA GPU" in result.output


def test_bench_markdown_tables():
    from flashgen.bench import markdown

    row = {"mode": "bwd", "d": 64, "causal": True, "T": 4096, "flashgen": 250.4, "flash": 200.0, "cudnn": None, "efficient": 100.0}
    text = markdown({"tables": {"bwd": [row]}})
    assert text.splitlines()[:4] == [
        "bwd (TFLOPS)", "", "| d | causal | T | flashgen | flash | cudnn | efficient | vs flash | vs cudnn |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    assert "| 64 | yes | 4096 | 250 | 200 | - | 100 | 1.25 | - |" in text


def test_doctor():
    result = run("doctor")
    assert result.exit_code == 0 and "NVRTC" in result.output


def test_load_without_gpu(gen):
    (meta,) = aot.built(gen)
    assert meta["name"] == D64.name and KernelSpec(**meta["spec"]) == D64
    for path in (meta["path"], gen / f"{D64.name}.cubin", gen / D64.name):  # .json, .cubin or stem
        kernel = flashgen.load(path)
        assert isinstance(kernel, flashgen.PrebuiltKernel)
        assert kernel.spec == D64 and kernel.kernel.cubin == (gen / f"{D64.name}.cubin").read_bytes()
        assert kernel.kernel._functions == {}  # loading to a device waits for the first call


def test_generated_module_imports(gen):
    module_spec = importlib.util.spec_from_file_location("gen_kernel", gen / f"{D64.name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    assert module.spec == D64 and isinstance(module.attention, flashgen.PrebuiltKernel)


def test_load_rejects_altered_cubin(gen, tmp_path):
    for ext in (".json", ".cubin"):
        (tmp_path / f"{D64.name}{ext}").write_bytes((gen / f"{D64.name}{ext}").read_bytes())
    cubin = tmp_path / f"{D64.name}.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01  # same length: only the checksum can tell
    cubin.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        flashgen.load(tmp_path / f"{D64.name}.json")


def test_contradicting_mask_options_are_refused(tmp_path):
    result = run("build", "--d", 64, "--causal", "--no-causal", "--out", tmp_path / "gen")
    assert result.exit_code != 0 and "contradicts" in result.output
