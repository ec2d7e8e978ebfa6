"""NVRTC: every shipped spec compiles to a cubin with no spills, and failures carry what reproduces them."""

import re

import numpy as np
import pytest

import flashgen
from flashgen import tuning
from flashgen.compile import Resources, compile_ptx, compile_source, parse_resources
from flashgen.render import render
from flashgen.spec import SMEM_LIMIT, KernelSpec
from sweeps import sweep

# Every spec the tables pick on the H200, forward and backward; sm_80 for the most common head dims
# and for 256, where its backward is the key-major kernels that take dV and dK in separate passes.
SHIPPED = tuning.shipped_specs("sm_90a") + tuning.shipped_specs("sm_80", head_dims=(64, 128, 256))
SHIPPED += tuning.serving_specs("sm_90a", kv_dtypes=("", "e4m3")) + tuning.serving_specs("sm_80", head_dims=(64, 128))
# The FP8 forward's first step, V laid out for its P V product (its forwards: tests/test_fp8.py).
SHIPPED += [tuning.fp8_values_spec(d, "sm_90a", varlen) for d in (64, 128, 256) for varlen in (False, True)]
# The block mask of a mask rule (one spec per tile shape the attention kernels above pick).
_RULE = '{"cuda":"kv_idx <= q_idx + 3","per_batch":false,"per_head":false,"tensors":[]}'
SHIPPED += [KernelSpec(head_dim=8, kind="block_mask", block_m=m, block_n=n, causal=c, mask_mod=_RULE)
            for m, n, c in ((64, 64, True), (128, 64, False), (32, 128, True))]


def test_sweep_covers_both_targets_and_every_kind():
    assert len(set(SHIPPED)) == len(SHIPPED)
    assert {spec.arch for spec in SHIPPED} == {"sm_90a", "sm_80"}
    assert {spec.head_dim for spec in SHIPPED if spec.kind != "block_mask"} == set(tuning.TEST_HEAD_DIMS)  # (its is unused)
    varlen_only = {"bwd_dq_sm90"}  # the varlen Hopper backward's dQ reader: tests/test_varlen.py compiles it
    assert {spec.kind for spec in SHIPPED} == set(flashgen.families.KINDS) - varlen_only


@pytest.mark.parametrize("spec", sweep(SHIPPED))
def test_shipped_spec_compiles_without_spills(spec):
    binary = compile_source(spec, render(spec))  # the static_asserts hold: layout and template agree
    assert isinstance(binary.cubin, bytes) and binary.cubin.startswith(b"\x7fELF")
    res = binary.resources
    assert 0 < res.registers <= 255, binary.log
    assert res.spills == 0, binary.log
    assert res.stack_frame == 0, binary.log
    assert "setmaxnreg" not in binary.log, binary.log  # ptxas warns when it cannot honour setmaxnreg
    assert "serialized" not in binary.log, binary.log  # ptxas made a wgmma wait for the one before it
    assert spec.smem_bytes + res.static_smem <= SMEM_LIMIT[spec.arch]
    assert f"-arch={spec.arch}" in binary.options


# One Hopper forward per head-dim bucket (the sweep above compiles all of them).
HOPPER = [tuning.tuned_spec("fwd_sm90", d, "bf16", c, "sm_90a") for d, c in ((64, False), (96, True), (192, False), (256, True))]
HOPPER += [spec.replace(persistent=True) for spec in HOPPER[::3]]


@pytest.mark.parametrize("spec", HOPPER, ids=lambda spec: spec.name)
def test_hopper_forward_holds_the_hopper_instructions(spec):
    """The instructions that make it a Hopper kernel, in what NVRTC emits (PTX): warpgroup MMA,
    bulk tensor copies completing on mbarriers, register reallocation between warpgroups."""
    ptx = compile_ptx(spec, render(spec)).decode()
    for instruction in (
        "wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "cp.async.bulk.tensor.4d.global.shared::cta", "setmaxnreg.inc.sync.aligned.u32", "setmaxnreg.dec.sync.aligned.u32",
        "mbarrier.try_wait.parity",
    ):
        assert instruction in ptx, instruction
    assert "mma.sync" not in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("variant", [{}, {"causal": True}, {"variants": ("softcap",)}], ids=["full", "causal", "softcap"])
def test_exp2_fma_moves_that_share_of_the_exponentials_off_the_multi_function_unit(variant):
    """exp2_fma = k takes k of every 8 of the softmax's exponentials from ex2.approx to the FMA
    polynomial (one round-down add each); the rescale factors stay on ex2."""
    counts = {}
    for share in (0, 3, 8):
        spec = KernelSpec(head_dim=64, block_m=192, block_n=128, kind="fwd_sm90", exp2_fma=share, **variant)
        ptx = compile_ptx(spec, render(spec)).decode()
        counts[share] = ptx.count("ex2.approx"), ptx.count("add.rm.f32")
    (plain, none), (some_ex2, some), (rest, every) = counts[0], counts[3], counts[8]
    assert none == 0 and every == 8 * some // 3 > 0 and 8 * some % 3 == 0
    assert some_ex2 + some == plain and rest + every == plain


def _exp2_fma_twin(x: np.ndarray, source: str) -> np.ndarray:
    """exp2_fma of the rendered source, step by step in numpy (its coefficients read from the
    source); FFMA's single rounding is the one difference."""
    body = source[source.index("DEVICE float exp2_fma"):]
    c3, c2, c1 = (np.float32(c) for c in re.search(r"fmaf\(fmaf\(fmaf\(([\d.e-]+)f, f, ([\d.e-]+)f\), f, ([\d.e-]+)f\)", body).groups())
    x = x.astype(np.float32)
    clamped = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127)))  # max.NaN
    with np.errstate(invalid="ignore"):
        shifted = (np.float64(12582912) + np.floor(clamped.astype(np.float64))).astype(np.float32)  # add.rm
        f = clamped - (shifted - np.float32(12582912))
        p = ((c3 * f + c2) * f + c1) * f + np.float32(1)
    scale = ((shifted.view(np.uint32).astype(np.uint64) << 23) + 0x3F800000).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return p * scale


def test_exp2_fma_is_exact_enough_and_keeps_zero_and_nan():
    spec = KernelSpec(head_dim=64, block_m=192, block_n=128, kind="fwd_sm90", exp2_fma=2)
    source = render(spec)
    x = np.concatenate([np.linspace(-126, 0, 2_000_001, dtype=np.float32), -np.float32(2) ** -np.arange(1, 24, dtype=np.float32)])
    y = _exp2_fma_twin(x, source)
    relative = np.abs(y.astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert relative.max() < 1e-4  # a 16-bit P rounds at 2^-12 (fp16) or 2^-9 (bf16)
    assert _exp2_fma_twin(np.float32([0]), source)[0] == 1
    edges = _exp2_fma_twin(np.float32([-127, -200, -np.inf, np.nan]), source)
    assert edges[:3].tolist() == [0.0, 0.0, 0.0] and np.isnan(edges[3])  # masked keys add nothing; NaN shows


def test_compile_error_carries_log_options_and_source(tmp_path):
    spec = KernelSpec(head_dim=64)
    path = tmp_path / "x.cu"
    with pytest.raises(flashgen.CompileError) as caught:
        compile_source(spec, "this is not cuda", source_path=path)
    error = caught.value
    assert error.log.strip()
    assert "-arch=sm_90a" in error.options
    assert error.spec_name == spec.name
    assert error.source_path == path
    assert spec.name in str(error)
    assert str(path) in str(error)


SAMPLE_LOG = """\
ptxas info    : 68 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
"""


def test_parse_resources_picks_the_named_function():
    two = SAMPLE_LOG + SAMPLE_LOG.replace("'k'", "'k_prep'").replace(" k\n", " k_prep\n").replace("255 registers", "25 registers")
    assert parse_resources(two, "k_prep").registers == 25
    assert parse_resources(two, "k").registers == 255
    with pytest.raises(ValueError):
        parse_resources(two, "other")


def test_parse_resources_reads_the_ptxas_report():
    res = parse_resources(SAMPLE_LOG)
    assert res == Resources(registers=255, static_smem=1024, stack_frame=24, spill_stores=8, spill_loads=12)
    assert res.spills == 20


def test_parse_resources_without_smem_line_means_zero():
    log = SAMPLE_LOG.replace(", 1024 bytes smem", "").replace("24 bytes stack", "0 bytes stack")
    res = parse_resources(log)
    assert (res.registers, res.static_smem, res.stack_frame) == (255, 0, 0)


@pytest.mark.parametrize("log", ["", "ptxas info    : Compile time = 158.788 ms\n"])
def test_parse_resources_without_report_raises(log):
    with pytest.raises(ValueError, match="no ptxas resource report"):
        parse_resources(log)


@pytest.mark.parametrize("spec", [KernelSpec(head_dim=64), tuning.tuned_spec("bwd_kvq", 64, "bf16", True, "sm_90a")], ids=lambda s: s.name)
def test_a_layout_that_disagrees_with_the_template_does_not_compile(spec):
    """The kernel checks its use of shared memory against the family's layout (static_assert):
    a layout one row short is a compile error, not a kernel that overruns its neighbour."""
    layout = spec.family.smem(spec)
    name = layout.regions[1].name.upper()
    honest = f"SMEM_{name}_BYTES = {layout.regions[1].bytes};"
    source = render(spec)
    assert honest in source
    with pytest.raises(flashgen.CompileError, match="static assertion failed"):
        compile_source(spec, source.replace(honest, f"SMEM_{name}_BYTES = {layout.regions[1].bytes - 16};"))


def test_the_same_source_compiled_twice_still_reports_its_resources():
    """NVRTC 12.9+ caches compiles itself, and a hit there skips ptxas and its report (seen on the
    H200's NVRTC 13.0: a rebuilt cache entry then failed). flashgen turns that cache off."""
    from flashgen.compile import compile_options, nvrtc_version

    spec = KernelSpec(head_dim=64, kind="bwd_prep")
    major, minor = (int(p) for p in nvrtc_version().split(".")[:2])
    assert ("--no-cache" in compile_options(spec)) == ((major, minor) >= (12, 9))
    source = render(spec)
    first, second = compile_source(spec, source), compile_source(spec, source)
    assert first.resources == second.resources and first.resources.registers > 0
