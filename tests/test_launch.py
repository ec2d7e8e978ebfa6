"""The launch path without a GPU: each family's parameter list matches what NVRTC compiled (read
from the PTX), a launch packs every value at its place, launch plans wire kernels and scratch
buffers together, and grids past 65,535 heads or batches run in slices (the driver is stubbed)."""

import ctypes
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from flashgen import kernels, plans, runtime, tuning
from flashgen.compile import compile_ptx
from flashgen.kernels import Kernel
from flashgen.params import LOG2E, Params, scalar, tensor, tensormap
from flashgen.render import render
from flashgen.spec import KernelSpec, SpecError

ONE_OF_EACH_KIND = [
    KernelSpec(head_dim=64, causal=True),
    KernelSpec(head_dim=96, block_m=128, block_n=128, causal=True, kind="fwd_sm90"),
    KernelSpec(head_dim=128, block_m=128, block_n=128, causal=True, kind="fwd_sm90", persistent=True),
    tuning.backward_prep(96, "fp16", "sm_90a"),
    *(tuning.tuned_spec(kind, 128, "bf16", True, "sm_90a") for kind in ("bwd_kvq", "bwd_kv", "bwd_q", "bwd_sm90_kvq", "bwd_sm90_kv")),
    tuning.tuned_spec("bwd_sm90_kvq", 64, "fp16", False, "sm_90a"),
    *(tuning.tuned_spec(kind, 256, "bf16", False, "sm_90a") for kind in ("bwd_v", "bwd_kq", "bwd_k")),
    tuning.tuned_spec("bwd_kvq", 64, "bf16", False, "sm_80"),
    tuning.decode_spec(128, "bf16", "sm_90a", False, 4), tuning.decode_spec(80, "fp16", "sm_80", True, 40),
    *(tuning.merge_spec(kind, 64, "fp16", "sm_90a") for kind in tuning.MERGE_KINDS),
]
PTX_TYPES = {"ptr": ".u64", "i64": ".u64", "int": ".u32", "float": ".f32"}


@pytest.mark.parametrize("spec", ONE_OF_EACH_KIND, ids=lambda spec: spec.name)
def test_parameter_list_matches_the_compiled_kernel(spec):
    """The kernel's parameters as NVRTC laid them out (PTX: type and alignment of each, in order)
    against the family's list, from which the host packing is made."""
    ptx = compile_ptx(spec, render(spec)).decode()
    entry = re.search(rf"\.entry {spec.name}\((.*?)\)", ptx, re.S).group(1)
    compiled = re.findall(r"\.param (\.align \d+ \.b8|\.\w+)(?: \.ptr[^ ]*)? (\w+?)(\[\d+\])?,?\n", entry)
    params = spec.family.params(spec).params
    assert [(ptype, size) for ptype, _, size in compiled] == [
        (PTX_TYPES[p.kind], "") if p.kind != "tensormap" else (".align 64 .b8", "[128]") for p in params
    ]


def test_offsets_follow_c_alignment_including_tensor_maps():
    params = Params(["q", "m", "n"], [*tensor("q"), scalar("n", "int"), tensormap("q_map", "m"), scalar("scale", "float", "1.0")])
    assert params.offsets == [0, 8, 16, 24, 32, 64, 192]  # the map starts at the next 64-byte boundary
    assert params.struct.size == 196
    q = torch.zeros(2, 3, 5, 8)
    buffer = ctypes.create_string_buffer(params.struct.size)
    params.packer("(1, 2, 3)")(buffer, dict(q=q, m=bytes(range(128)), n=7))
    assert struct.unpack_from("=Qqqqi", buffer) == (q.data_ptr(), 120, 40, 8, 7)
    assert buffer.raw[64:192] == bytes(range(128)) and struct.unpack_from("=f", buffer, 192) == (1.0,)


class StubDriver:
    """Records cuLaunchKernel's and cuLaunchKernelEx's grid and parameter bytes; every call succeeds."""

    def __init__(self):
        self.launches = []

    def cuCtxGetCurrent(self, ref):
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        """Reads each parameter through its kernelParams pointer, as the driver does."""
        assert extra is None
        # 128 bytes from each pointer: a parameter's own bytes (4, 8 or a 128-byte tensor map) and
        # what follows it in the 4 KiB launch buffer
        values = [ctypes.string_at(pointer, 128) for pointer in params]
        self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
                              "stream": stream.value, "params": values, "dependent": False})
        return 0

    def cuStreamGetCaptureInfo(self, stream, status, capture):
        """No capture under way (status 0), unless a test sets self.capture to (status, id)."""
        status._obj.value, capture._obj.value = getattr(self, "capture", (0, 0))
        return 0

    def cuLaunchKernelEx(self, config, function, params, extra):
        """A launch with attributes: only a programmatic dependent launch is ever asked for."""
        config = config._obj
        (attribute,) = config.attrs[: config.num_attrs]
        assert (attribute.id, attribute.value) == (6, 1)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.cuLaunchKernel(function, *config.grid, *config.block, config.smem, ctypes.c_void_p(config.stream), params, extra)
        self.launches[-1]["dependent"] = True
        return 0


@pytest.fixture
def driver(monkeypatch):
    stub = StubDriver()
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setitem(runtime._contexts, -1, None)  # CPU tensors report device -1; nothing current
    monkeypatch.setattr(runtime.Module, "function", lambda self, device, symbol, smem: ctypes.c_void_p(0x77))
    return stub


class ContextStub(StubDriver):
    """A driver that keeps the thread's current context, as the CUDA runtime reads it."""

    def __init__(self, current):
        super().__init__()
        self.current, self.during = current, []

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.current
        return 0

    def cuCtxSetCurrent(self, context):
        self.current = context.value if isinstance(context, ctypes.c_void_p) else context
        return 0

    def cuLaunchKernel(self, *args):
        self.during.append(self.current)
        return super().cuLaunchKernel(*args)


def test_a_launch_on_another_gpu_leaves_the_callers_context_current(monkeypatch):
    """Tensors on cuda:1 while PyTorch's current device is 0: the launch runs in device 1's context
    and then puts device 0's back, so torch.cuda.current_device() does not move."""
    stub = ContextStub(current=0x100)
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_current_stream", lambda device: 0xABC0)
    monkeypatch.setattr(runtime, "_contexts", {0: 0x100, 1: 0x200})
    slot = runtime.launch_slot()
    pointers = runtime.param_pointers(slot, (0,))
    runtime.launch(ctypes.c_void_p(0x77), 1, 1, 1, 32, 0, 1, slot, pointers, "k")
    runtime.launch(ctypes.c_void_p(0x77), 1, 1, 1, 32, 0, 0, slot, pointers, "k")
    assert stub.during == [0x200, 0x100] and stub.current == 0x100
    stub.current = None  # a thread with no context at all keeps none
    runtime.launch(ctypes.c_void_p(0x77), 1, 1, 1, 32, 0, 1, slot, pointers, "k")
    assert stub.during[-1] == 0x200 and stub.current is None


def test_a_tensor_map_is_encoded_under_its_devices_context(monkeypatch):
    """The autograd thread may have no context current (the driver then refuses to encode with
    CUDA_ERROR_INVALID_CONTEXT): the encoding runs in the tensor's device's context, and the
    thread keeps what it had."""
    stub = ContextStub(current=None)
    during = []
    stub.cuTensorMapEncodeTiled = lambda *args: during.append(stub.current) or 0
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_contexts", {-1: 0x100})  # a CPU tensor reports device -1
    monkeypatch.setattr(runtime, "_tensor_maps", {})
    runtime.tensor_map(torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16), 64)
    assert during == [0x100] and stub.current is None
    stub.current = 0x100  # PyTorch's context current: it stays
    runtime.tensor_map(torch.zeros(1, 2, 32, 64, dtype=torch.bfloat16), 64)
    assert during == [0x100, 0x100] and stub.current == 0x100


def test_a_module_loads_in_its_devices_context_once(monkeypatch):
    """Loading and the function's attributes run under the device's context (a thread may have
    none, or another device's); the thread gets its own back, and a second function is not loaded again."""
    stub = ContextStub(current=0x300)  # another device's context is current
    calls = []

    def record(name, result=0):
        def call(*args):
            calls.append((name, stub.current))
            if name == "load":
                args[0]._obj.value = 0x55
            return result
        return call

    stub.cuModuleLoadData, stub.cuModuleGetFunction, stub.cuFuncSetAttribute = record("load"), record("find"), record("attribute")
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_contexts", {0: 0x100, 1: 0x300})
    module = runtime.Module(b"image", "kernel")
    module.function(0, "a", 1024)
    module.function(0, "b", 1024)
    assert [name for name, _ in calls] == ["load", "find", "attribute", "attribute", "find", "attribute", "attribute"]
    assert {context for _, context in calls} == {0x100} and stub.current == 0x300


def test_the_default_stream_is_never_asked_for_a_capture(monkeypatch):
    """The legacy default stream (0) cannot be captured: no driver call (which would need a current
    context) for the common eager case."""
    monkeypatch.setattr(runtime, "driver", lambda: (_ for _ in ()).throw(AssertionError("the driver was asked")))
    assert runtime.capture_of(0, 0) == 0


def test_a_thread_with_no_context_asks_for_a_capture_in_the_devices(monkeypatch):
    """A driver that wants a current context to answer for a stream: a thread with none (the
    autograd thread may be one) asks again in the stream's device's context, and keeps none."""
    stub = ContextStub(current=None)
    asked = []

    def capture_info(stream, status, capture):
        asked.append(stub.current)
        if stub.current is None:
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        status._obj.value, capture._obj.value = 1, 42  # capturing, id 42
        return 0

    stub.cuStreamGetCaptureInfo = capture_info
    monkeypatch.setattr(runtime, "driver", lambda: stub)
    monkeypatch.setattr(runtime, "_contexts", {0: 0x100})
    assert runtime.capture_of(0xABC0, 0) == 42
    assert asked == [None, 0x100] and stub.current is None


def unpack(spec, values) -> dict:
    """Each parameter's value, from the bytes its kernelParams pointer showed."""
    codes = {"ptr": "Q", "i64": "q", "int": "i", "float": "f", "tensormap": "128s"}
    return {p.name: struct.unpack_from("=" + codes[p.kind], raw)[0] for p, raw in zip(spec.family.params(spec).params, values)}


def test_forward_launch_packs_every_value_at_its_place(driver):
    spec = KernelSpec(head_dim=64, block_m=128, causal=True)
    # (B, T, H, d) storage seen as (B, H, T, d), like x.view(B, T, H, d).transpose(1, 2); GQA 2:1.
    q = torch.zeros(2, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.zeros(2, 200, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.zeros(2, 2, 200, 64, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    Kernel(spec, b"").launch(-1, dict(q=q, k=k, v=v, o=o, lse=lse, scale=0.125))

    (launch,) = driver.launches
    assert launch["grid"] == (3, 4, 2) and launch["block"] == (128, 1, 1)
    assert launch["smem"] == spec.smem_bytes and launch["stream"] == 0xABC0
    values = unpack(spec, launch["params"])
    assert values == pytest.approx({
        "q": q.data_ptr(), "q_batch": 300 * 4 * 64, "q_head": 64, "q_row": 4 * 64,
        "k": k.data_ptr(), "k_batch": 200 * 2 * 64, "k_head": 64, "k_row": 2 * 64,
        "v": v.data_ptr(), "v_batch": 2 * 200 * 64, "v_head": 200 * 64, "v_row": 64,
        "o": o.data_ptr(), "o_batch": 300 * 4 * 64, "o_head": 64, "o_row": 4 * 64,
        "lse": lse.data_ptr(), "seqlen_q": 300, "seqlen_k": 200, "heads": 4, "kv_group": 2,
        "scale_log2": 0.125 * LOG2E,
    })


def test_forward_without_lse_passes_a_null_pointer(driver):
    spec = KernelSpec(head_dim=64)
    q = torch.zeros(1, 1, 17, 64, dtype=torch.bfloat16)
    Kernel(spec, b"").launch(-1, dict(q=q, k=q, v=q, o=torch.empty_like(q), lse=None, scale=1.0))
    assert unpack(spec, driver.launches[0]["params"])["lse"] == 0


def test_a_failed_launch_raises_with_the_kernel_name(driver, monkeypatch):
    spec = KernelSpec(head_dim=64)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: 1, raising=False)

    def error_name(result, ref):
        ref._obj.value = b"CUDA_ERROR_INVALID_VALUE"  # ref is ctypes.byref(c_char_p)
        return 0

    driver.cuGetErrorName = error_name
    q = torch.zeros(1, 1, 17, 64, dtype=torch.bfloat16)
    with pytest.raises(runtime.CudaError, match=f"launching {spec.name} failed: CUDA_ERROR_INVALID_VALUE"):
        Kernel(spec, b"").launch(-1, dict(q=q, k=q, v=q, o=torch.empty_like(q), lse=None, scale=1.0))


@pytest.fixture
def stub_kernels(monkeypatch):
    """kernels.get hands out kernels with no image (the driver is stubbed): no compiles."""
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "get", lambda spec: Kernel(spec, b""))
    monkeypatch.setattr(plans, "_plans", {})


@pytest.fixture
def stub_tensor_maps(monkeypatch):
    """Tensor maps need the driver's encoder: stand in a map that names its tensor and box."""
    from flashgen.families import hopper_backward

    fake = lambda t, rows, cols=64: t.data_ptr().to_bytes(8, "little") * 15 + rows.to_bytes(8, "little")  # noqa: E731
    monkeypatch.setattr(hopper_backward.HopperBackward, "helpers", lambda self, spec: {"tensor_map": fake})


BACKWARD_KINDS = {  # (arch, deterministic) -> the kernels the plan runs
    ("sm_90a", False): ["bwd_prep", "bwd_sm90_kvq"], ("sm_90a", True): ["bwd_prep", "bwd_sm90_kv", "bwd_q"],
    ("sm_80", False): ["bwd_prep", "bwd_kvq"], ("sm_80", True): ["bwd_prep", "bwd_kv", "bwd_q"],
}


@pytest.mark.parametrize("arch, deterministic", BACKWARD_KINDS)
def test_backward_plan_wires_prep_kernels_and_scratch(driver, stub_kernels, stub_tensor_maps, arch, deterministic):
    batch, heads, seqlen, d = 2, 3, 100, 64
    q = torch.zeros(batch, heads, seqlen, d, dtype=torch.bfloat16)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    forward = KernelSpec(head_dim=d, causal=True, arch=arch).canonical()
    plan = plans.backward(-1, d, torch.bfloat16, True, deterministic, forward)
    values = dict(q=q, k=q, v=q, o=q, d_o=q, lse=torch.zeros(batch, heads, seqlen), d_lse=None,
                  dq=dq, dk=dk, dv=dv, scale=0.125, dq_accum=None)
    plan.run(-1, values)

    kinds = [step.kernel.spec.kind for step in plan.steps if isinstance(step, plans.Launch)]
    assert kinds == BACKWARD_KINDS[arch, deterministic]
    prep, *others = driver.launches
    assert values["delta"].shape == values["lse_log2"].shape == (batch, heads, 128)  # padded to a whole tile
    rows_per_block = 128 // 8  # 128 threads, 8 lanes a row (64 / 8 chunks of 16 bytes)
    assert prep["grid"] == (128 // rows_per_block, heads, batch)  # every padded row, exactly once
    prep_values = unpack(plan.kernels[0].spec, prep["params"])
    assert prep_values["delta"] == values["delta"].data_ptr() and prep_values["d_lse"] == 0
    main = unpack(plan.kernels[1].spec, others[0]["params"])
    assert main["delta"] == values["delta"].data_ptr() and main["lse_log2"] == values["lse_log2"].data_ptr()
    if arch == "sm_90a":  # tensor maps of the right tensors, with the tiles' rows per box
        spec = plan.kernels[1].spec
        for name, tensor, rows in (("q_map", q, spec.block_m), ("do_map", q, spec.block_m), ("dk_map", dk, 64), ("dv_map", dv, 64)):
            assert main[name] == tensor.data_ptr().to_bytes(8, "little") * 15 + rows.to_bytes(8, "little"), name
    if deterministic:
        assert values["dq_accum"] is None and unpack(plan.kernels[2].spec, others[1]["params"])["dq"] == dq.data_ptr()
        assert prep_values["dq_accum"] == prep_values["dq_accum_size"] == 0  # no sum to zero
    else:
        accum = values["dq_accum"]
        assert accum.dtype == torch.float32 and accum.numel() >= q.numel()
        # the prep writes the sum's zeros (no fill of its own): all of it, whatever its layout
        assert prep_values["dq_accum"] == accum.data_ptr() and prep_values["dq_accum_size"] == accum.numel()
        if arch == "sm_90a":  # added into through TMA reductions: a tensor map of it, 64-row boxes
            assert main["dq_map"] == accum.data_ptr().to_bytes(8, "little") * 15 + (64).to_bytes(8, "little")
        else:
            assert main["dq_accum"] == accum.data_ptr()
        assert isinstance(plan.steps[-1], plans.Convert)  # the fp32 sum becomes dq at the end


@pytest.mark.parametrize("batch, heads, kv_heads", [(1, 70_000, 70_000), (1, 140_000, 35_000), (70_000, 2, 1)])
def test_grids_past_65535_heads_or_batches_run_in_slices(driver, stub_kernels, batch, heads, kv_heads):
    spec = KernelSpec(head_dim=32)
    q = torch.zeros(batch, heads, 8, 32, dtype=torch.bfloat16)
    k = torch.zeros(batch, kv_heads, 8, 32, dtype=torch.bfloat16)
    lse = torch.zeros(batch, heads, 8)
    plan = plans.Plan((plans.Launch(Kernel(spec, b"")),))
    plan.run(-1, dict(q=q, k=k, v=k, o=q, lse=lse, scale=1.0))

    covered = 0
    for launch in driver.launches:
        x, y, z = launch["grid"]
        assert y <= 65535 and z <= 65535
        values = unpack(spec, launch["params"])
        first = (values["q"] - q.data_ptr()) // (8 * 32 * 2)  # the (batch, head) this slice starts at
        assert first == covered  # slices are contiguous, in order, without gaps
        assert values["k"] - k.data_ptr() == first // (heads // kv_heads) * 8 * 32 * 2
        assert values["lse"] - lse.data_ptr() == first * 8 * 4
        assert values["heads"] == y and values["kv_group"] == heads // kv_heads
        covered += y * z
    assert covered == batch * heads and len(driver.launches) > 1


def test_tensor_maps_reach_the_kernel_whole_through_their_own_pointers(driver, monkeypatch):
    """kernelParams, not one packed blob: the compiled kernel keeps a 64-byte-aligned CUtensorMap
    aligned in the constant bank (its parameter space starts at 0x210), so the first map sits at
    0x30 there, not at 0; the driver puts each parameter where the kernel has it."""
    from flashgen.families import hopper

    fake_map = lambda t, rows: bytes([rows % 256]) * 64 + t.data_ptr().to_bytes(8, "little") * 8  # noqa: E731
    monkeypatch.setattr(hopper.HopperForward, "helpers", lambda self, spec: {"tensor_map": fake_map})
    spec = KernelSpec(head_dim=128, block_m=128, block_n=96, causal=True, kind="fwd_sm90")
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 300, 128, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    params = spec.family.params(spec)
    captured = {}
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: captured.setdefault("params", args[9]) and 0, raising=False)
    Kernel(spec, b"").launch(-1, dict(q=q, k=k, v=k, o=o, lse=None, scale=0.1))
    pointers = captured["params"]
    assert len(pointers) == len(params.params)
    for param, pointer, (tensor, rows) in zip(params.params, pointers, [(q, 128), (k, 96), (k, 96), (o, 64)]):
        assert param.kind == "tensormap"
        assert ctypes.string_at(pointer, 128) == bytes([rows]) * 64 + tensor.data_ptr().to_bytes(8, "little") * 8
    seqlen_q = struct.unpack("=i", ctypes.string_at(pointers[5], 4))[0]
    assert seqlen_q == 300 and struct.unpack("=Q", ctypes.string_at(pointers[4], 8))[0] == 0  # lse: null


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty kernel memo and cache directory, and a count of the cache's loads by spec."""
    from flashgen import cache

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_pending", {})
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    loads = []
    real_get = cache.KernelCache.get

    def counted(self, spec, **kw):
        loads.append(spec)
        return real_get(self, spec, **kw)

    monkeypatch.setattr(cache.KernelCache, "get", counted)
    return loads


def test_a_prefetched_kernel_is_compiled_once_and_get_returns_it(fresh_kernels):
    spec = tuning.backward_prep(64, "bf16", "sm_90a")
    kernels.prefetch([spec, spec])
    kernels.prefetch([spec])  # already under way
    kernel = kernels.get(spec)  # waits for the prefetch
    assert kernel.spec == spec and kernels.get(spec) is kernel
    assert fresh_kernels == [spec]
    kernels.prefetch([spec])  # loaded: nothing to do
    assert fresh_kernels == [spec] and not kernels._pending


def test_a_failed_prefetch_raises_in_get_and_the_next_get_tries_again(fresh_kernels, monkeypatch):
    from flashgen import cache

    spec = tuning.backward_prep(64, "bf16", "sm_90a")
    real_get = cache.KernelCache.get
    monkeypatch.setattr(cache.KernelCache, "get", lambda self, spec, **kw: (_ for _ in ()).throw(RuntimeError("nvrtc failed")))
    kernels.prefetch([spec])
    with pytest.raises(RuntimeError, match="nvrtc failed"):
        kernels.get(spec)
    monkeypatch.setattr(cache.KernelCache, "get", real_get)
    assert kernels.get(spec).spec == spec


def test_a_prefetch_from_before_clear_leaves_the_memo_empty(fresh_kernels):
    spec = tuning.backward_prep(64, "bf16", "sm_90a")
    kernels.prefetch([spec])
    future = kernels._pending[spec]
    kernels.clear()
    future.result()
    assert spec not in kernels._loaded


@pytest.mark.parametrize("varlen", (False, True))
@pytest.mark.parametrize("deterministic", (False, True))
def test_a_differentiated_forward_warms_its_backward_plan_once(monkeypatch, varlen, deterministic):
    """warm_backward prefetches exactly the kernels the backward plan then runs (the varlen dQ
    reader included), once per plan, and nothing once the plan exists."""
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_warmed", set())
    monkeypatch.setitem(plans._arch, -1, "sm_90a")
    asked = []
    monkeypatch.setattr(kernels, "prefetch", lambda specs: asked.append(list(specs)))
    for _ in range(2):
        plans.warm_backward(-1, 128, torch.bfloat16, True, deterministic, "", (), varlen=varlen)
    assert len(asked) == 1
    monkeypatch.setattr(kernels, "get", lambda spec: Kernel(spec, b""))
    build = plans.backward_varlen if varlen else plans.backward
    plan = build(-1, 128, torch.bfloat16, True, deterministic, "")
    assert asked[0] == [kernel.spec for kernel in plan.kernels]
    monkeypatch.setattr(plans, "_warmed", set())
    plans.warm_backward(-1, 128, torch.bfloat16, True, deterministic, "", (), varlen=varlen)
    assert len(asked) == 1  # the plan exists


def test_a_forward_without_a_backward_kernel_warms_nothing_and_runs(monkeypatch):
    """A shape the tables have no backward for (sm_86/89 at d = 248, 256 had none until 5ec9d1a):
    the warm-up of a differentiated forward skips the plan (the backward names the reason when it
    runs) instead of failing the forward."""
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_warmed", set())
    monkeypatch.setitem(plans._arch, -1, "sm_86")

    def no_backward(*args, **keywords):
        raise SpecError("no bwd_v tile shape fits head_dim=256 on sm_86")

    monkeypatch.setattr(plans, "_backward_kernels", no_backward)
    asked = []
    monkeypatch.setattr(kernels, "prefetch", lambda specs: asked.append(list(specs)))
    plans.warm_backward(-1, 256, torch.bfloat16, False, False, "")
    assert asked == []
    with pytest.raises(SpecError, match="no bwd_v tile shape fits head_dim=256 on sm_86"):
        plans.backward(-1, 256, torch.bfloat16, False, False, "")


def test_get_loads_a_queued_prefetch_itself_instead_of_waiting_behind_others(fresh_kernels, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    busy, release = threading.Event(), threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(lambda: busy.set() or release.wait(30))  # the only worker is taken by another compile
    busy.wait(30)
    monkeypatch.setattr(kernels, "_pool", pool)
    spec = tuning.backward_prep(64, "bf16", "sm_90a")
    kernels.prefetch([spec])
    queued = kernels._pending[spec]
    try:
        assert kernels.get(spec).spec == spec and queued.cancelled()
    finally:
        release.set()
        pool.shutdown()


def test_exit_drops_the_prefetches_not_yet_started(tmp_path):
    """A script that prefetches and ends does not wait for the queued compiles: only those under
    way (one per worker) ever start."""
    import subprocess
    import sys

    started = tmp_path / "started"
    script = f"""
import time
from flashgen import cache, kernels, tuning
def slow(self, spec, **kw):
    with open({str(started)!r}, "a") as f:
        f.write("x")
    time.sleep(1.0)
    raise RuntimeError("not needed")
cache.KernelCache.get = slow
kernels.prefetch([tuning.backward_prep(d, "bf16", "sm_90a") for d in range(8, 136, 8)])
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=str(tmp_path),
                   env={**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])})
    assert 1 <= len(started.read_text()) <= min(4, os.cpu_count() or 1) < 16


def test_a_forked_child_prefetches_with_threads_of_its_own(fresh_kernels):
    import multiprocessing

    spec = tuning.backward_prep(64, "bf16", "sm_90a")
    kernels.prefetch([spec])
    kernels.get(spec)
    kernels._pending[spec.replace(head_dim=128)] = None  # as if under way in the parent
    with kernels._lock:  # as if a compile thread held it at the fork: the child takes a new one
        child = multiprocessing.get_context("fork").Process(target=_prefetch_in_child)
        child.start()
    child.join(60)
    assert child.exitcode == 0
    kernels._pending.clear()


def _prefetch_in_child():
    spec = tuning.backward_prep(128, "bf16", "sm_90a")
    assert not kernels._pending and kernels._pool is None
    kernels.prefetch([spec])
    assert kernels.get(spec).spec == spec


@pytest.mark.parametrize("varlen", [False, True])
def test_the_fp8_plan_lays_v_out_before_its_forward(driver, stub_kernels, monkeypatch, varlen):
    """The FP8 forward's plan: fp8_v reads V as given (`v_keys`) and writes the scratch `v`, in the
    layout flashgen.reference.fp8_values says, over every position of it (one block per 64, per
    KV head and batch); then the forward's V tensor map is that scratch."""
    from flashgen.families import hopper

    fake = lambda t, rows, cols=64: t.data_ptr().to_bytes(8, "little") * 15 + rows.to_bytes(8, "little")  # noqa: E731
    monkeypatch.setattr(hopper.HopperForward, "helpers", lambda self, spec: {"tensor_map": fake, "sm_count": lambda *a: 132,
                                                                             "page_rows": None, "page_gather": None})
    e4m3 = torch.float8_e4m3fn
    spec = KernelSpec(kind="fwd_sm90", head_dim=128, block_m=128, block_n=128, dtype="e4m3", out_dtype="bf16", varlen=varlen)
    plan = plans.forward_fp8(-1, 128, torch.bfloat16, False, (), 0, spec.canonical(), varlen)
    assert [step.kernel.spec.kind for step in plan.steps] == ["fp8_v", "fwd_sm90"] and plan.whole == varlen
    if varlen:
        cu = torch.tensor([0, 5, 5, 90], dtype=torch.int32)
        q, k, v = (torch.zeros(90, 2, 128).to(e4m3) for _ in range(3))
        values = dict(q=q, k=k, v_keys=v, o=torch.empty(90, 2, 128, dtype=torch.bfloat16), lse=torch.empty(2, 90), scale=0.1,
                      cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=85, q_descale=None, k_descale=None, v_descale=None)
        expected = (1, 2, 128, 16 * (-(-90 // 16) + 3 + 1))
    else:
        q, k = torch.zeros(2, 4, 100, 128).to(e4m3), torch.zeros(2, 2, 77, 128).to(e4m3)
        v = torch.zeros(2, 77, 2, 128).to(e4m3).transpose(1, 2)  # V as a strided view
        values = dict(q=q, k=k, v_keys=v, o=torch.empty(2, 4, 100, 128, dtype=torch.bfloat16), lse=torch.empty(2, 4, 100),
                      scale=0.1, q_descale=None, k_descale=None, v_descale=None)
        expected = (2, 2, 128, 80)  # 77 keys in whole 16s
    plan.run(-1, values)
    scratch = values["v"]
    assert scratch.shape == expected and scratch.dtype == e4m3 and scratch.is_contiguous()
    from flashgen import reference

    assert expected == (reference.fp8_values_varlen(v, cu) if varlen else reference.fp8_values(v)).shape
    layout, forward = driver.launches
    packed = unpack(plan.kernels[0].spec, layout["params"])
    assert packed["src"] == v.data_ptr() and packed["dst"] == scratch.data_ptr() and packed["width"] == expected[-1]
    assert layout["grid"] == (-(-expected[-1] // 64), 2, 1 if varlen else 2)
    if varlen:
        assert packed["cu_seqlens_k"] == cu.data_ptr() and packed["sequences"] == 3 and packed["total_k"] == 90
    else:
        assert (packed["keys"], packed["src_batch"], packed["src_head"], packed["src_row"]) == (77, 77 * 2 * 128, 128, 256)
    assert unpack(plan.kernels[1].spec, forward["params"])["v_map"] == fake(scratch, 128, 128)
