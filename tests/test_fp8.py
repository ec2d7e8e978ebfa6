"""FP8 (e4m3) forward on the CPU: its specs, what their kernels hold (wgmma with e4m3 operands, P
rounded to e4m3, no spills), transposed V's key order, and the call's errors. The GPU tier
(tests/test_gpu_fp8.py) runs it against the oracle."""

import re

import pytest
import torch

import flashgen
from flashgen import ops, reference, tuning
from flashgen.compile import compile_ptx, compile_source
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError
from sweeps import sweep

FP8_VARIANTS = [(), ("window",), ("softcap",), ("alibi",), ("sink",), ("window", "softcap", "alibi", "sink")]


def fp8_specs():
    """Every FP8 spec the tables pick on sm_90a: each head dim, both outputs, causal and not, the
    variants (those that fit beside d = 256's accumulators)."""
    specs = []
    for head_dim in [d for d in tuning.TEST_HEAD_DIMS if not d % 16]:  # (FP8 head dims: multiples of 16)
        for out in ("bf16", "fp16"):
            for causal in (False, True):
                for variant in FP8_VARIANTS if out == "bf16" else [()]:
                    try:
                        specs.append(tuning.fp8_forward_spec(head_dim, out, causal, "sm_90a", variant))
                    except SpecError:
                        assert head_dim == 256 and variant not in ((), ("sink",)), (head_dim, variant)
    specs.append(tuning.fp8_forward_spec(192, "bf16", True, "sm_90a", head_dim_v=128))  # V's own head dim
    specs += [tuning.fp8_forward_spec(head_dim, "bf16", causal, "sm_90a", variant, varlen=True)  # packed sequences
              for head_dim in (64, 128, 256) for causal in (False, True) for variant in ((), ("window", "sink"))
              if head_dim != 256 or not variant]
    return specs


FP8_SPECS = fp8_specs()


def test_fp8_specs_name_their_types_and_refuse_what_they_cannot_run():
    spec = tuning.fp8_forward_spec(128, "bf16", True, "sm_90a", ("window",))
    assert spec.name == "fwd_sm90_d128_m128_n128_e4m3_obf16_causal_s2_sm90a_window"
    assert KernelSpec.from_json(spec.canonical()) == spec
    with pytest.raises(SpecError, match="kernels do not write e4m3; name the output's type"):
        spec.replace(out_dtype="")
    with pytest.raises(SpecError, match="block_n=128"):
        spec.replace(block_n=64)
    with pytest.raises(SpecError, match="FP8 head dims are multiples of 16"):
        spec.replace(head_dim=40)
    with pytest.raises(SpecError, match="not pages"):
        spec.replace(varlen=True, paged=True)
    with pytest.raises(SpecError, match="a fwd kernel takes fp16, bf16"):
        KernelSpec(head_dim=128, dtype="e4m3", out_dtype="bf16", arch="sm_90a")
    with pytest.raises(SpecError, match="needs sm_90a"):
        tuning.fp8_forward_spec(128, "bf16", True, "sm_80")
    with pytest.raises(SpecError, match="at this head dim, block_m=128 or fewer variants"):
        tuning.fp8_forward_spec(256, "bf16", True, "sm_90a", ("window",))
    assert KernelSpec(head_dim=64, kind="fwd_sm90", block_m=128, block_n=128, out_dtype="bf16").out_dtype == ""  # (bf16's own)


@pytest.mark.parametrize("spec", sweep(FP8_SPECS))
def test_fp8_spec_compiles_to_e4m3_wgmma_without_spills(spec):
    source = render(spec)
    binary = compile_source(spec, source)
    res = binary.resources
    assert res.spills == 0 and res.stack_frame == 0, binary.log
    assert "serialized" not in binary.log and "setmaxnreg" not in binary.log, binary.log
    ptx = compile_ptx(spec, source).decode()
    d_v_pad = -(-spec.d_v // 64) * 64
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n{d_v_pad}k32.f32.e4m3.e4m3" in ptx  # O += P V, P from registers
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # P rounded to e4m3, saturating
    assert f"cvt.rn.{spec.output_element.ptx}x2.f32" in ptx  # O in the output's type
    assert not re.search(r"wgmma[^;]*\.(bf16|f16)\.", ptx)


def test_packed_transposed_v_starts_each_sequence_on_a_group_of_16():
    """attention_varlen's V: sequence b from position 16 (ceil(cu_k[b] / 16) + b), its keys in
    FP8_KEY_ORDER within each 16, zeros elsewhere; made on the device without a sync."""
    lengths = [5, 0, 37, 16, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    v = torch.randn(sum(lengths), 2, 24).to(torch.float8_e4m3fn)
    vt = reference.fp8_values_varlen(v, cu).float()[0]
    assert vt.shape[-1] % 16 == 0 and vt.shape[-1] >= 16 * (-(-sum(lengths) // 16) + len(lengths))
    expected = torch.zeros_like(vt)
    for b, length in enumerate(lengths):
        start = 16 * ((int(cu[b]) + 15) // 16 + b)
        for j in range(length):
            position = start + j - j % 16 + ops.FP8_KEY_ORDER.index(j % 16)
            expected[:, :, position] = v[int(cu[b]) + j].float()
    assert torch.equal(vt, expected)
    # rows past the last sequence's end belong to none: the layout is the same without them
    extra = torch.cat([v, torch.randn(7, 2, 24).to(torch.float8_e4m3fn)])
    assert torch.equal(reference.fp8_values_varlen(extra, cu).float()[0][..., : vt.shape[-1]], vt)


def test_transposed_v_holds_each_16_keys_in_the_order_p_registers_hold_them():
    """Position 4 t + b of 16 keys holds key 2 t + b % 2 + 8 (b / 2); past the keys, zeros."""
    assert ops.FP8_KEY_ORDER == (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
    v = torch.randn(2, 3, 37, 24).to(torch.float8_e4m3fn)
    vt = reference.fp8_values(v)
    assert vt.shape == (2, 3, 24, 48) and vt.dtype == torch.float8_e4m3fn and vt.is_contiguous()
    padded = torch.cat([v.float(), torch.zeros(2, 3, 11, 24)], dim=2)
    for position in range(48):
        group, k = divmod(position, 16)
        assert torch.equal(vt[:, :, :, position].float(), padded[:, :, 16 * group + ops.FP8_KEY_ORDER[k]])


def fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("changes, error, message", [
    (dict(k=torch.randn(2, 2, 37, 64, dtype=torch.bfloat16)), TypeError, r"k has dtype torch.bfloat16; with FP8 inputs"),
    (dict(q_descale=torch.ones(2, 4)), ValueError, r"q_descale must be float32 of shape \(batch, heads_kv\) = \(2, 2\)"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float64)), ValueError, r"v_descale must be float32"),
    (dict(out_dtype=torch.float32), TypeError, r"out_dtype=torch.float32: the output of an FP8 forward is"),
    (dict(v=fp8(2, 2, 36, 64)), ValueError, r"k and v must have the same sequence length"),
    (dict(q=fp8(2, 4, 40, 40), k=fp8(2, 2, 37, 40), v=fp8(2, 2, 37, 40)), ValueError, r"head_dim=40 with FP8 inputs: it must be a multiple of 16"),
])
def test_fp8_input_errors_are_named(changes, error, message):
    arguments = {"q": fp8(2, 4, 40, 64), "k": fp8(2, 2, 37, 64), "v": fp8(2, 2, 37, 64), **changes}
    with pytest.raises(error, match=message):
        flashgen.attention(**arguments)


def test_fp8_arguments_with_16_bit_inputs_are_refused():
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q_descale, k_descale, v_descale and out_dtype are for FP8 inputs"):
        flashgen.attention(q, q, q, out_dtype=torch.float16)


def test_fp8_with_gradients_is_refused_by_name(monkeypatch):
    """Forward-only, as FlashAttention-3's: inputs (or a sink) that require grad are refused while
    grad mode is on (the device check is passed by a stub: the CPU has no GPU)."""
    from flashgen import inputs

    monkeypatch.setattr(inputs, "on_one_cuda_device", lambda *args: None)
    q, k, v = fp8(1, 2, 8, 64), fp8(1, 2, 8, 64), fp8(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="q requires grad: FP8 attention is forward-only"):
        flashgen.attention(q.requires_grad_(), k, v)
    with pytest.raises(RuntimeError, match="learnable_sink requires grad: FP8 attention is forward-only"):
        flashgen.attention(q.detach(), k, v, learnable_sink=torch.zeros(2, requires_grad=True))


def test_autocast_leaves_fp8_inputs_as_they_are(monkeypatch):
    """FP8 inputs are quantized already (with their descales): autocast casts the others only."""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: torch.bfloat16)
    q, x = fp8(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    cast = ops.autocast_inputs(q, x, q)
    assert cast[0] is q and cast[2] is q and cast[1].dtype == torch.bfloat16


def test_fp8_forward_is_one_custom_op_for_torch_compile():
    """What torch.compile records: flashgen::attention_fp8, whose fake gives the output in out_dtype
    with V's head dim and the (B, H, Tq) lse."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert hasattr(torch.ops.flashgen, "attention_fp8")
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 9, 64, dtype=torch.float8_e4m3fn), torch.empty(2, 2, 7, 64, dtype=torch.float8_e4m3fn),
                   torch.empty(2, 2, 7, 32, dtype=torch.float8_e4m3fn))
        o, lse = ops._attention_fp8_fake(q, k, v, None, None, None, None, None, 0, True, 0.125, torch.float16, "")
        packed = torch.empty(9, 4, 64, dtype=torch.float8_e4m3fn), torch.empty(3, dtype=torch.int32)
        o_packed, lse_packed = ops._attention_fp8_fake(packed[0], packed[0], packed[0][..., :32], None, None, None, packed[1],
                                                       packed[1], 5, True, 0.125, torch.bfloat16, "")
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((2, 4, 9, 32), torch.float16, (2, 4, 9), torch.float32)
    assert (o_packed.shape, o_packed.dtype, lse_packed.shape) == ((9, 4, 32), torch.bfloat16, (4, 9))


def test_bench_dtype_fp8_is_a_benchmark_of_its_own(monkeypatch):
    """`flashgen bench --dtype fp8` times the FP8 forward (at d = 64, 128, 256 unless --d says) and
    goes with no other benchmark; without a GPU it says so."""
    from click.testing import CliRunner

    from flashgen import bench, cli

    asked = {}
    monkeypatch.setattr(bench, "run_fp8", lambda **kw: asked.update(kw) or {})
    assert CliRunner().invoke(cli.main, ["bench", "--dtype", "fp8"]).exit_code == 0
    assert asked["head_dims"] == (64, 128, 256)
    assert CliRunner().invoke(cli.main, ["bench", "--dtype", "fp8", "--d", "128"]).exit_code == 0
    assert tuple(asked["head_dims"]) == (128,)
    result = CliRunner().invoke(cli.main, ["bench", "--dtype", "fp8", "--decode"])
    assert result.exit_code != 0 and "separate benchmarks" in result.output


def test_build_makes_the_fp8_forward_for_each_output_type_and_no_backward():
    """A deployment that calls attention with FP8 inputs under FLASHGEN_NO_JIT=1 finds its kernels
    (V's layout kernel and the forward) in what `flashgen build --dtype e4m3` makes; FP8 goes
    through attention and varlen only."""
    from click.testing import CliRunner

    from flashgen import cli
    from flashgen.workload import Workload, describing

    result = CliRunner().invoke(cli.main, ["build", "--d", "128", "--dtype", "e4m3", "--causal", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert sorted(result.output.split()[-3:]) == ["fp8_v_d128_sm90a",  # V laid out for the P V product
                                                  "fwd_sm90_d128_m128_n128_e4m3_obf16_causal_s2_sm90a",
                                                  "fwd_sm90_d128_m128_n128_e4m3_ofp16_causal_s2_sm90a"]
    spec = tuning.fp8_forward_spec(64, "fp16", False, "sm_90a", ("window",))
    assert spec in describing(spec).specs()
    with pytest.raises(SpecError, match="FP8 inputs go through attention and varlen only"):
        Workload(head_dims=(128,), dtypes=("e4m3",), entries=("attention", "kvcache"))
    varlen = Workload(head_dims=(128,), dtypes=("e4m3",), entries=("varlen",)).specs()
    assert {(spec.kind, spec.varlen, spec.out_dtype) for spec in varlen} == {
        ("fp8_v", True, ""), ("fwd_sm90", True, "bf16"), ("fwd_sm90", True, "fp16")}


def test_fp8_varlen_input_errors_are_named():
    q, k = fp8(30, 4, 64), fp8(40, 2, 64)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 15, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="with FP8 queries reads packed keys; over a paged FP8 cache \\(block_table\\) q is"):
        flashgen.attention_varlen(q, k, k, *cu, 20, 25, block_table=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"k_descale must be float32 of shape \(batch, heads_kv\) = \(2, 2\)"):
        flashgen.attention_varlen(q, k, k, *cu, 20, 25, k_descale=torch.ones(3, 2))
    with pytest.raises(TypeError, match="v has dtype torch.bfloat16; with FP8 inputs"):
        flashgen.attention_varlen(q, k, k.to(torch.bfloat16), *cu, 20, 25)


def test_tune_sweeps_fp8_tiles_and_the_tables_e4m3_entries_pick_them():
    """`flashgen tune --dtype e4m3`: the FP8 forward's problems (no backward, one length bucket),
    its candidates (128 keys wide; block_m 128 or 192, 2 or 3 stages, persistent or not), and the
    entry it writes (dtype e4m3) is what fp8_forward_spec picks; entries for any dtype are not."""
    from flashgen import tune

    problems = tune.problems((64,), ("e4m3",), (True,), "sm_90a")
    assert [problem.label() for problem in problems] == ["fwd_sm90 d=64 e4m3 causal long"] and problems[0].fp8
    shapes = {(spec.block_m, spec.block_n, spec.num_stages, spec.persistent) for spec in tune.candidates(problems[0])}
    assert {(128, 128, 2, False), (192, 128, 3, True)} <= shapes and {n for _, n, _, _ in shapes} == {128}
    entry = tune.entry_for(problems[0], [{"block_m": 192, "block_n": 128, "num_stages": 3}])
    assert tuning.table_problem({"entries": [entry]}) is None
    with tuning.override([entry]):
        assert tuning.fp8_forward_spec(64, "bf16", True, "sm_90a").block_m == 192
    anything = {**entry, "dtype": "*", "tiles": [{"block_m": 192, "block_n": 128, "num_stages": 3}]}
    with tuning.override([anything]):
        assert tuning.fp8_forward_spec(64, "bf16", True, "sm_90a").block_m == 128  # (16-bit tiles do not count)


def test_an_fp8_call_s_values_reach_its_kernel(monkeypatch):
    """The FP8 plans, fixed-length and packed, with the driver stubbed: the packer finds every value
    (descales, cu_seqlens), V's tensor map is over transposed V (d_v_pad rows by 128 keys a box),
    Q's and K's boxes are 128 elements wide, O's 64, and the grid is the forward's."""
    import ctypes

    from test_launch import StubDriver

    from flashgen import kernels, plans, runtime
    from flashgen.families import hopper
    from flashgen.kernels import Kernel

    stub = StubDriver()
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setitem(runtime._contexts, -1, None)
    monkeypatch.setattr(runtime.Module, "function", lambda self, device, symbol, smem: ctypes.c_void_p(0x77))
    monkeypatch.setattr(kernels, "get", lambda spec: Kernel(spec, b""))
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setitem(plans._arch, -1, "sm_90a")
    maps = []
    monkeypatch.setattr(hopper, "tensor_map_helper", lambda: {"tensor_map": lambda t, rows, cols=None: maps.append(
        (tuple(t.shape), t.dtype, rows, cols or 128 // t.element_size())) or bytes(128)})
    q, k, v = fp8(2, 4, 300, 128), fp8(2, 2, 333, 128), fp8(2, 2, 333, 96)
    descale = torch.ones(2, 2)
    o, lse = ops.fp8_forward(q, k, v, descale, descale, None, None, None, 0, True, 0.1, torch.bfloat16, True, ())
    assert o.shape == (2, 4, 300, 96) and o.dtype == torch.bfloat16 and lse.shape == (2, 4, 300)
    assert maps == [((2, 4, 300, 128), torch.float8_e4m3fn, 128, 128), ((2, 2, 333, 128), torch.float8_e4m3fn, 128, 128),
                    ((2, 2, 96, 336), torch.float8_e4m3fn, 128, 128), ((2, 4, 300, 96), torch.bfloat16, 64, 64)]
    assert stub.launches[-1]["grid"] == (3, 4, 2)
    maps.clear()
    cu_q, cu_k = torch.tensor([0, 100, 300], dtype=torch.int32), torch.tensor([0, 33, 333], dtype=torch.int32)
    o, lse = ops.fp8_forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), descale, None, None, cu_q, cu_k,
                             200, False, 0.1, torch.float16, True, ())
    assert o.shape == (300, 4, 96) and o.dtype == torch.float16 and lse.shape == (4, 300)
    assert maps[2] == ((1, 2, 96, 16 * (-(-333 // 16) + 3)), torch.float8_e4m3fn, 128, 128)  # packed transposed V
    assert stub.launches[-1]["grid"] == (2, 4, 2)
