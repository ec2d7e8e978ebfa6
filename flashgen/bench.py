"""`flashgen bench`: flashgen next to PyTorch SDPA's backends, measured in one process on the same
inputs, in the convention of FlashAttention's own benchmark (see ANCHORS.md): batch x seqlen = 16k
tokens, model dim 2048 (heads = 2048 / d), bf16, forward FLOPs = 4 * B * H * T^2 * d (halved when
causal), backward = 2.5x forward; the median of 20 timed calls after 5 warm-ups, each timed with
CUDA events around GPU work alone (the GPU is kept busy while the host queues the call, so no
backend's host cost counts; `flashgen bench` reports host cost on its own line). The backward is
timed as `out.backward(dout, retain_graph=True)` with the gradients cleared before each call, as
FlashAttention's benchmark does. flashgen's output is checked against an SDPA backend's before any
of its rows is timed: a wrong kernel gets no number.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import product

import torch
import torch.nn.functional as F

TOKENS = 16 * 1024
MODEL_DIM = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)


def forward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """4 * B * H * Tq * Tk * d, of the (query, key) pairs causal attention sees: half when Tq = Tk
    (FlashAttention's convention), else the pairs bottom-right alignment leaves."""
    pairs = seqlen_q * seqlen_k
    if causal:
        if seqlen_q == seqlen_k:
            pairs /= 2
        elif seqlen_q < seqlen_k:
            pairs -= seqlen_q * (seqlen_q - 1) // 2
        else:
            pairs = seqlen_k * (seqlen_k + 1) // 2
    return 4.0 * batch * heads * pairs * head_dim


HOST_MARGIN_CYCLES = 2_000_000  # about a millisecond of GPU sleep, longer than any call's host work


def time_ms(fn, warmup: int = 5, rep: int = 20) -> float:
    """Median milliseconds of GPU work of `rep` calls, each between its own pair of CUDA events.
    The GPU sleeps while the host queues the start event and the call, so that the events time
    the call's kernels, not the host's cost of launching them (which would count one backend's
    Python or dispatcher against another's)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_MARGIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_backends() -> dict:
    """name -> a context manager that pins F.scaled_dot_product_attention to that backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return {
        "flash": lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        "cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
        "efficient": lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
    }


def _inputs(seqlen, head_dim, dtype=torch.bfloat16, device="cuda", heads=None, kv_heads=None):
    batch, heads = TOKENS // seqlen, heads or MODEL_DIM // head_dim
    gen = torch.Generator(device=device).manual_seed(seqlen * 1000 + head_dim)
    q = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, kv_heads or heads, seqlen, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    return [q, k, v]


def _kernel_specs(q, causal, mode="fwd", variant: tuple[str, ...] = ()) -> list:
    """The specs of the kernels flashgen runs for these inputs in this mode: the forward's, and for
    a backward its main kernels after the prep (the plans are kept after the first call);
    `variant` names the variant fields (flashgen.variants), as the plans key them."""
    from . import plans

    specs = []
    if mode != "bwd":
        specs.append(plans.forward(q.get_device(), q.shape[3], q.dtype, causal, q.shape[2], "", variant).kernels[0].spec)
    if mode != "fwd":
        specs += [k.spec for k in plans.backward(q.get_device(), q.shape[3], q.dtype, causal, False, "", variant).kernels[1:]]
    return specs


def _kernel_name(q, causal, mode="fwd", variant: tuple[str, ...] = ()) -> str:
    return " + ".join(spec.name for spec in _kernel_specs(q, causal, mode, variant))


MODES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # FLOPs relative to the forward


def _timer(attention, q, k, v, causal, mode):
    """A no-argument callable running one `mode` pass of `attention`."""
    if mode == "fwd":
        return lambda: attention(q, k, v, causal=causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    d_o = torch.randn_like(q)
    if mode == "bwd":
        out = attention(*leaves, causal=causal)
        return lambda: _fresh(leaves) or out.backward(d_o, retain_graph=True)
    return lambda: _fresh(leaves) or attention(*leaves, causal=causal).backward(d_o)


def training_step(fn, tensors):
    """A no-argument callable running fn's forward and backward over fresh leaves of `tensors`
    (the output's gradient drawn once, the leaves' gradients cleared each time): what a bench
    times as forward + backward of any attention function."""
    leaves = [t.detach().requires_grad_() for t in tensors]  # (sharing the tensors' memory: nothing is copied)
    d_o = torch.randn_like(fn(*leaves))
    return lambda: _fresh(leaves) or fn(*leaves).backward(d_o)


def _fresh(leaves) -> None:
    """Clear the leaves' gradients: a timed backward must not include accumulating into them."""
    for t in leaves:
        t.grad = None


def table(mode="fwd", head_dims=HEAD_DIMS, seqlens=SEQLENS, causals=(False, True)):
    """TFLOPS of flashgen and each SDPA backend for every (d, causal, T), for one mode."""
    rows = []
    for head_dim in head_dims:
        for causal in causals:
            for seqlen in seqlens:
                rows.append(_row(mode, _inputs(seqlen, head_dim), causal))
    return rows


def gqa_rows(modes, seqlen=16384, head_dim=128, heads=32, kv_heads=8):
    """The GQA case of ANCHORS.md: 32 query heads on 8 key/value heads, causal, d = 128."""
    return [_row(mode, _inputs(seqlen, head_dim, heads=heads, kv_heads=kv_heads), True) for mode in modes]


def _row(mode, inputs, causal) -> dict:
    from .api import attention as flashgen_attention

    peers = {"flashgen": lambda q, k, v, causal: flashgen_attention(q, k, v, causal=causal)}
    for name, pin in sdpa_backends().items():
        peers[name] = _pinned(pin)
    q, k, v = inputs
    batch, heads, seqlen, head_dim = q.shape
    flops = MODES[mode] * forward_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    row = {"mode": mode, "d": head_dim, "causal": causal, "T": seqlen, "heads": f"{heads}:{k.shape[1]}"}
    wrong = _wrong(peers, q, k, v, causal)
    for name, attention in peers.items():
        if name == "flashgen" and wrong:
            row[name], row["flashgen_error"] = None, wrong
            continue
        try:
            row[name] = flops / time_ms(_timer(attention, q, k, v, causal, mode)) / 1e9
        except RuntimeError as error:  # a peer without a kernel for this shape or GPU; flashgen's own failures are kept
            row[name] = None
            if name == "flashgen":
                row["flashgen_error"] = f"{type(error).__name__}: {error}"[:300]
    row["kernel"] = _kernel_name(q, causal, mode) if row["flashgen"] else "-"
    return row


GATE = 0.05  # largest |flashgen - SDPA| of the outputs (values of order 1) that two exact kernels in bf16 stay under


def _wrong(peers, q, k, v, causal) -> str:
    """Why flashgen's output on these inputs is not attention's ("" when it is): compared with the
    first SDPA backend that runs them, before any timing."""
    try:
        ours = peers["flashgen"](q, k, v, causal=causal).float()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"[:300]
    for name, attention in peers.items():
        if name == "flashgen":
            continue
        try:
            theirs = attention(q, k, v, causal=causal).float()
        except RuntimeError:
            continue
        error = (ours - theirs).abs().max().item()
        return "" if error <= GATE else f"wrong output: max |flashgen - {name}| = {error:.3g} > {GATE}"
    return ""


def _pinned(pin):
    def run(q, k, v, causal):
        with pin():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return run


def backward_memory_mib(seqlen=4096, head_dims=HEAD_DIMS, causals=(False, True)) -> list[dict]:
    """Peak memory a backward pass allocates beyond what is held before it (gradients included)."""
    from .api import attention as flashgen_attention

    peers = {"flashgen": lambda q, k, v, causal: flashgen_attention(q, k, v, causal=causal)}
    peers["flash"] = _pinned(sdpa_backends()["flash"])
    rows = []
    for head_dim in head_dims:
        for causal in causals:
            row = {"d": head_dim, "causal": causal, "T": seqlen}
            for name, attention in peers.items():
                q, k, v = (t.requires_grad_() for t in _inputs(seqlen, head_dim))
                row[name] = backward_peak_bytes(attention(q, k, v, causal), (q, k, v)) / 2**20
                del q, k, v
            rows.append(row)
    return rows


def backward_peak_bytes(out, leaves) -> int:
    """Peak memory one backward of `out` allocates beyond what is held before it (gradients
    included), after a warm-up backward that leaves nothing behind."""
    d_o = torch.randn_like(out)
    out.backward(d_o, retain_graph=True)
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(d_o)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


HOST_CALLS, HOST_ROUNDS = 1000, 5


def interleaved_host_us(ops: dict, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS, sync=None) -> dict:
    """Microseconds of wall time per call of each of `ops` (name -> function): the median over
    `rounds` rounds of `calls` calls, after 100 warm-up calls each, the ops' rounds interleaved so
    that all see the same machine state; `sync` (default torch.cuda.synchronize) brackets a round."""
    sync = sync or torch.cuda.synchronize
    times = {name: [] for name in ops}
    for _ in range(100):
        for fn in ops.values():
            fn()
    for _ in range(rounds):
        for name, fn in ops.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def host_overhead_us(calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> dict:
    """Wall time per call on a tiny causal input (1x1x128x64), where launch cost dominates,
    flashgen's and SDPA's (interleaved_host_us)."""
    from .api import attention

    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ops = {
        "flashgen": lambda: attention(q, k, v, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    return interleaved_host_us(ops, calls, rounds)


_WARM_LOAD = r"""
import time, torch, flashgen
from flashgen import cache, kernels  # the library's modules, imported before the clock starts
spec = flashgen.KernelSpec.from_json({canonical!r})
torch.zeros(1, device="cuda")  # a CUDA context exists, as in any program that has GPU tensors
start = time.perf_counter()
kernels.get(spec).function(0)
print((time.perf_counter() - start) * 1e3)
"""


def compile_and_load_times(spec=None) -> dict:
    """Cold compile of one spec into an empty cache, then its load from disk in a fresh process."""
    from .cache import KernelCache

    if spec is None:  # the forward the tables pick here for d = 128, causal
        from .plans import device_arch
        from .tuning import forward_spec

        spec = forward_spec(128, "bf16", True, device_arch(0), seqlen_q=4096)
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        KernelCache(root).get(spec)
        cold = time.perf_counter() - start
        env = {**os.environ, "FLASHGEN_CACHE_DIR": root}
        code = _WARM_LOAD.format(canonical=spec.canonical())
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        warm_ms = float(out.stdout.strip().splitlines()[-1])
    return {"spec": spec.name, "cold_compile_s": cold, "warm_load_ms": warm_ms}


COLUMNS = ("d", "causal", "T", "flashgen", "flash", "cudnn", "efficient", "vs flash", "vs cudnn", "kernel")


def _ratio(a, b) -> str:
    return "-" if not (a and b) else f"{a / b:.2f}"


def _cells(row) -> list[str]:
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    return [
        str(row["d"]), "yes" if row["causal"] else "no", str(row["T"]), fmt(row["flashgen"]),
        fmt(row["flash"]), fmt(row["cudnn"]), fmt(row["efficient"]),
        _ratio(row["flashgen"], row["flash"]), _ratio(row["flashgen"], row["cudnn"]), row.get("kernel", "-"),
    ]


def markdown(report: dict) -> str:
    """The report's tables as Markdown, the form BENCHMARKS.md records them in."""
    lines = []
    for title, rows in _titled_tables(report):
        lines += [title, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
        lines += ["", *_errors(rows)] if _errors(rows) else []
        lines.append("")
    return "\n".join(lines)


def _errors(rows) -> list[str]:
    """Why flashgen has no number in a row (a wrong output, or its error), one line each."""
    return [f"- d={row['d']} causal={row['causal']} T={row['T']}: flashgen {row['flashgen_error']}"
            for row in rows if row.get("flashgen_error")]


def _titled_tables(report: dict):
    for mode, rows in report["tables"].items():
        yield f"{mode} (TFLOPS)", rows
    if report.get("gqa"):
        row = report["gqa"][0]
        yield f"GQA {row['heads']}, causal, {' / '.join(r['mode'] for r in report['gqa'])} (TFLOPS)", report["gqa"]


def run(head_dims=HEAD_DIMS, seqlens=SEQLENS, modes=tuple(MODES), json_path=None, console=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not torch.cuda.is_available():
        raise RuntimeError("flashgen bench needs an NVIDIA GPU: PyTorch sees none on this machine")
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "tables": {mode: table(mode, head_dims, seqlens) for mode in modes},
        "gqa": gqa_rows(modes),
        "backward_memory_mib": backward_memory_mib(head_dims=head_dims) if "bwd" in modes else [],
        "host_overhead_us": host_overhead_us(),
        "compile": compile_and_load_times(),
    }
    for title, rows in _titled_tables(report):
        out = Table(title=f"{title}, bf16, {report['gpu']} (B*T=16k)")
        for column in COLUMNS:
            out.add_column(column, justify="right")
        for row in rows:
            out.add_row(*_cells(row))
        console.print(out)
        for line in _errors(rows):
            console.print(line, markup=False)
    for row in report["backward_memory_mib"]:
        console.print(
            f"backward extra memory d={row['d']} causal={row['causal']} T={row['T']}: flashgen "
            f"{row['flashgen']:.0f} MiB, flash {row['flash']:.0f} MiB ({_ratio(row['flashgen'], row['flash'])}x)"
        )
    overhead, comp = report["host_overhead_us"], report["compile"]
    console.print(
        f"host overhead per call (1x1x128x64 causal, median of {HOST_ROUNDS} rounds of {HOST_CALLS}): "
        f"flashgen {overhead['flashgen']:.1f} us, "
        f"SDPA {overhead['sdpa']:.1f} us"
    )
    console.print(
        f"{comp['spec']}: cold compile {comp['cold_compile_s']:.2f} s, "
        f"warm load from disk {comp['warm_load_ms']:.1f} ms (fresh process)"
    )
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=2)
    return report


# ---- flashgen bench --dtype fp8 -------------------------------------------------------------------

FP8_HEAD_DIMS = (64, 128, 256)


def fp8_matmul_tflops(size: int = 8192) -> float:
    """The GPU's measured FP8 matrix-product rate: torch._scaled_mm on size^3 e4m3 operands (the
    ceiling an FP8 attention forward is held against), in TFLOPS."""
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()  # (column-major, as _scaled_mm takes it)
    one = torch.ones((), device="cuda")
    ms = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * size**3 / ms / 1e9


def fp8_rows(head_dims=FP8_HEAD_DIMS, seqlens=SEQLENS, causals=(False, True)) -> list[dict]:
    """Forward TFLOPS of flashgen's FP8 kernel beside its bf16 one and SDPA's cuDNN bf16 backend on
    the same problem (the bf16 inputs quantized per batch and KV head, FlashAttention-3's descales),
    and the share of the FP8 call that V's transpose on the device (ops.fp8_values) takes."""
    import torch.nn.functional as F

    from . import attention, ops

    def quantized(x):
        descale = x.float().abs().amax(dim=(2, 3)).clamp_min(1e-12) / 448.0
        return (x.float() / descale[:, :, None, None]).to(torch.float8_e4m3fn), descale.contiguous()

    cudnn = sdpa_backends()["cudnn"]
    rows = []
    for head_dim in head_dims:
        for seqlen in seqlens:
            q, k, v = _inputs(seqlen, head_dim)
            (q8, qd), (k8, kd), (v8, vd) = quantized(q), quantized(k), quantized(v)
            for causal in causals:
                flops = forward_flops(q.shape[0], q.shape[1], seqlen, seqlen, head_dim, causal)
                with torch.no_grad():
                    times = {
                        "fp8": time_ms(lambda: attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)),
                        "bf16": time_ms(lambda: attention(q, k, v, causal=causal)),
                    }
                    try:
                        with cudnn():
                            times["cudnn"] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    except RuntimeError:  # cuDNN does not take the shape
                        times["cudnn"] = float("nan")
                    transpose_ms = time_ms(lambda: ops.fp8_values(v8))  # (inside the fp8 call: V, K-major for P V)
                rows.append({"d": head_dim, "T": seqlen, "causal": causal,
                             **{name: flops / ms / 1e9 for name, ms in times.items()},
                             "v_transpose_share": transpose_ms / times["fp8"]})
    return rows


def run_fp8(head_dims=FP8_HEAD_DIMS, seqlens=SEQLENS, json_path=None, console=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not torch.cuda.is_available():
        raise RuntimeError("flashgen bench needs an NVIDIA GPU: PyTorch sees none on this machine")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "fp8_matmul_tflops": fp8_matmul_tflops(), "rows": fp8_rows(head_dims, seqlens)}
    out = Table(title=f"forward TFLOPS, FP8 e4m3 (bf16 output) beside bf16, {report['gpu']} (B*T=16k)")
    for column in ("d", "T", "causal", "flashgen fp8", "flashgen bf16", "cuDNN bf16", "fp8 / cuDNN", "fp8 / matmul",
                   "V transpose share"):
        out.add_column(column, justify="right")
    for row in report["rows"]:
        out.add_row(str(row["d"]), str(row["T"]), "yes" if row["causal"] else "no", f"{row['fp8']:.0f}", f"{row['bf16']:.0f}",
                    f"{row['cudnn']:.0f}", _ratio(row["fp8"], row["cudnn"]), f"{row['fp8'] / report['fp8_matmul_tflops']:.2f}",
                    f"{row['v_transpose_share']:.1%}")
    console.print(out)
    console.print(f"FP8 matrix products on this GPU (torch._scaled_mm, 8192^3): {report['fp8_matmul_tflops']:.0f} TFLOPS")
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=2)
    return report


# ---- flashgen bench --varlen ----------------------------------------------------------------------

VARLEN_SEQUENCES, VARLEN_SHORTEST, VARLEN_LONGEST = 16, 128, 4096
VARLEN_HEADS, VARLEN_HEAD_DIM = 16, 128


def varlen_lengths() -> list[int]:
    """16 sequence lengths from 128 to 4096 (both ends included), 32k tokens give or take 1k: the
    first seed (from 0) whose uniform draw lands there, so the batch is the same on every run."""
    for seed in range(1000):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(VARLEN_SHORTEST, VARLEN_LONGEST + 1, (VARLEN_SEQUENCES,), generator=gen).tolist()
        lengths[0], lengths[1] = VARLEN_SHORTEST, VARLEN_LONGEST
        if abs(sum(lengths) - 32 * 1024) <= 1024:
            return lengths
    raise AssertionError("no seed gives 32k tokens")


def _varlen_inputs(lengths, heads=VARLEN_HEADS, head_dim=VARLEN_HEAD_DIM, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    return q, k, v, cu


def _time_modes(forward, leaves, flops) -> dict:
    """TFLOPS of the forward and of the backward (out.backward(dout, retain_graph=True))."""
    result = {"fwd": flops / time_ms(forward) / 1e9}
    with torch.enable_grad():
        for t in leaves:
            t.requires_grad_()
        out = forward()
        d_o = torch.randn_like(out)

        result["bwd"] = MODES["bwd"] * flops / time_ms(lambda: _fresh(leaves) or out.backward(d_o, retain_graph=True)) / 1e9
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
    return result


def varlen_report(causal: bool = True) -> dict:
    """attention_varlen on 16 mixed-length sequences against attention on a uniform batch of as
    many tokens (16 x the mean length), d = 128, 16 heads, bf16: TFLOPS counted on real tokens only
    (4 H L^2 d per sequence, halved when causal; backward 2.5x), their ratio, the kernels that ran,
    and the host cost of one eager call on a tiny input."""
    from . import plans
    from .api import attention
    from .varlen import attention_varlen

    lengths = varlen_lengths()
    q, k, v, cu = _varlen_inputs(lengths)
    longest, total = max(lengths), sum(lengths)
    flops = sum(forward_flops(1, VARLEN_HEADS, n, n, VARLEN_HEAD_DIM, causal) for n in lengths)
    with torch.no_grad():
        varlen = _time_modes(lambda: attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal), (q, k, v), flops)
    seqlen = round(total / VARLEN_SEQUENCES)
    uq, uk, uv = (t[: VARLEN_SEQUENCES * seqlen].view(VARLEN_SEQUENCES, seqlen, VARLEN_HEADS, VARLEN_HEAD_DIM).transpose(1, 2)
                  for t in (q, k, v))
    uniform_flops = forward_flops(VARLEN_SEQUENCES, VARLEN_HEADS, seqlen, seqlen, VARLEN_HEAD_DIM, causal)
    with torch.no_grad():
        uniform = _time_modes(lambda: attention(uq, uk, uv, causal=causal), (uq, uk, uv), uniform_flops)
    device, dtype = q.get_device(), q.dtype
    kernels = {
        "varlen fwd": [s.name for s in (k_.spec for k_ in plans.forward_varlen(device, VARLEN_HEAD_DIM, dtype, causal, longest, "").kernels)],
        "varlen bwd": [k_.spec.name for k_ in plans.backward_varlen(device, VARLEN_HEAD_DIM, dtype, causal, False, "").kernels],
        "uniform fwd": [_kernel_name(uq, causal)],
    }
    return {
        "lengths": lengths, "tokens": total, "uniform": f"{VARLEN_SEQUENCES} x {seqlen}", "causal": causal,
        "varlen": varlen, "attention": uniform, "ratio": {m: varlen[m] / uniform[m] for m in varlen},
        "kernels": kernels, "host_us": varlen_host_us(),
    }


def varlen_host_us(calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> dict:
    """Wall time per eager call on tiny inputs (4 sequences of 32 tokens, 1 head, d = 64; and
    attention() and SDPA on a 4 x 1 x 32 x 64 batch), where launch cost dominates; median of rounds."""
    from .api import attention
    from .varlen import attention_varlen

    q, k, v, cu = _varlen_inputs([32] * 4, heads=1, head_dim=64)
    dense = [t.view(4, 32, 1, 64).transpose(1, 2) for t in (q, k, v)]
    ops = {
        "attention_varlen": lambda: attention_varlen(q, k, v, cu, cu, 32, 32, causal=True),
        "attention": lambda: attention(*dense, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(*dense, is_causal=True),
    }
    with torch.no_grad():
        return interleaved_host_us(ops, calls, rounds)


def run_varlen(json_path=None, console=None) -> dict:
    """`flashgen bench --varlen`: the varlen report, printed (and written as JSON)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not torch.cuda.is_available():
        raise RuntimeError("flashgen bench needs an NVIDIA GPU: PyTorch sees none on this machine")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              **varlen_report()}
    out = Table(title=f"varlen: {VARLEN_SEQUENCES} sequences of {VARLEN_SHORTEST}-{VARLEN_LONGEST} tokens "
                      f"({report['tokens']:,} in all), d={VARLEN_HEAD_DIM}, {VARLEN_HEADS} heads, causal, bf16, {report['gpu']}")
    for column in ("mode", "attention_varlen", f"attention {report['uniform']}", "ratio (target >= 0.9)"):
        out.add_column(column, justify="right")
    for mode in ("fwd", "bwd"):
        out.add_row(mode, f"{report['varlen'][mode]:.0f}", f"{report['attention'][mode]:.0f}", f"{report['ratio'][mode]:.2f}")
    console.print(out)
    console.print("TFLOPS on real tokens only; lengths " + ", ".join(map(str, report["lengths"])))
    for label, names in report["kernels"].items():
        console.print(f"{label}: {', '.join(names)}", highlight=False)
    host = report["host_us"]
    console.print("host cost per eager call (tiny inputs): " + ", ".join(f"{name} {us:.1f} us" for name, us in host.items()))
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=2)
    return report


# ---- flashgen bench --decode ---------------------------------------------------------------------

DECODE_CASES = ((1, 1024), (1, 8192), (1, 65536), (8, 131072))  # (batch, cache length)
DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, DECODE_PAGE = 32, 8, 128, 16
GRAPH_CALLS, GRAPH_REPS = 20, 10


def graph_time_us(fns, calls: int = GRAPH_CALLS, reps: int = GRAPH_REPS) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph (so no host cost counts),
    the median of `reps` replays timed with CUDA events, divided by `calls`. `fns` is one callable,
    or several over copies of the inputs, called in turn (l2_copies: so that a cache smaller than
    L2 is read from memory, as each layer's is in a model's decoding step)."""
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, load and allocate outside the graph
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            fns[call % len(fns)]()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def l2_copies(nbytes: int, calls: int = GRAPH_CALLS) -> int:
    """Copies of a problem of `nbytes` that, read in turn, are twice the L2 cache together (at most
    one per call): none of them is still in L2 when its turn comes again."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(calls, -(-2 * l2 // nbytes)))


def copy_rate_tbs(size: int = 2**30) -> float:
    """Device-to-device copy rate, counting the bytes read and the bytes written (TB/s)."""
    src, dst = torch.empty(size, dtype=torch.uint8, device="cuda"), torch.empty(size, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: dst.copy_(src), warmup=3, rep=10)
    return 2 * size / (ms * 1e-3) / 1e12


DECODE_CACHES = ("bf16", "e4m3")  # the KV cache's element type: q's, or FP8 with descales


def _decode_step(batch, seqlen, paged, gen, cache="bf16"):
    """A decode step's inputs for flashgen: q (B, 1, H, d), a cache holding seqlen - 1 tokens (the
    step appends the seqlen-th), contiguous or in shuffled 16-token pages; with cache "e4m3" an FP8
    cache and its descales."""
    heads, kv_heads, d = DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM
    bf16 = torch.bfloat16
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=bf16, generator=gen)
    k, v = (torch.randn(batch, 1, kv_heads, d, device="cuda", dtype=bf16, generator=gen) for _ in range(2))
    block_table = None
    if paged:
        per_seq = seqlen // DECODE_PAGE
        shape = (batch * per_seq, DECODE_PAGE, kv_heads, d)
        block_table = torch.randperm(batch * per_seq, device="cuda", generator=gen).view(batch, per_seq).to(torch.int32)
    else:
        shape = (batch, seqlen, kv_heads, d)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=bf16, generator=gen) for _ in range(2))
    lengths = torch.full((batch,), seqlen - 1, device="cuda", dtype=torch.int32)
    step = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=lengths, block_table=block_table)
    if cache == "e4m3":  # stored at 64x with descales of 1/64
        step.update(k_cache=(k_cache * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                    v_cache=(v_cache * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                    k_descale=torch.full((batch, kv_heads), 1 / 64, device="cuda"),
                    v_descale=torch.full((batch, kv_heads), 1 / 64, device="cuda"))
    return step


def _flashgen_step(inputs):
    from .serving import attention_with_kvcache

    return lambda: attention_with_kvcache(**inputs, causal=True)


def _sdpa_inputs(batch, seqlen, gen):
    """SDPA's layout of the same problem: q (B, H, 1, d), k and v (B, H_kv, T, d), enable_gqa=True."""
    bf16 = torch.bfloat16
    q = torch.randn(batch, DECODE_HEADS, 1, DECODE_HEAD_DIM, device="cuda", dtype=bf16, generator=gen)
    k, v = (torch.randn(batch, DECODE_KV_HEADS, seqlen, DECODE_HEAD_DIM, device="cuda", dtype=bf16, generator=gen) for _ in range(2))
    return q, k, v


def _sdpa_step(pin, q, k, v):
    def run():
        with pin():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def decode_rows(cases=DECODE_CASES, rate: float | None = None) -> list[dict]:
    """GPU time per decode step (graph replay) of flashgen (append, attention, the splits' merge),
    contiguous and paged, over a bf16 cache and an FP8 one (e4m3 with descales: half the bytes),
    next to SDPA's FLASH and CUDNN (bf16) and to the memory floor: the cache's K and V bytes at the
    measured copy rate. Caches smaller than L2 are read from memory (steps over copies in turn), as
    in a model, where every other layer's cache passes through L2 between two steps."""
    from . import plans

    rate = rate or copy_rate_tbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, seqlen in cases:
        kv_bytes = 2 * batch * DECODE_KV_HEADS * seqlen * DECODE_HEAD_DIM * 2
        copies = l2_copies(kv_bytes)  # every backend reads its K and V from memory, as in a model
        sdpa = {}
        problems = [_sdpa_inputs(batch, seqlen, gen) for _ in range(copies)]
        for name in ("flash", "cudnn"):
            try:
                sdpa[name] = graph_time_us([_sdpa_step(sdpa_backends()[name], *problem) for problem in problems])
            except RuntimeError:  # the backend refuses this shape or GPU
                sdpa[name] = None
        del problems
        for paged, cache in product((False, True), DECODE_CACHES):
            inputs = [_decode_step(batch, seqlen, paged, gen, cache) for _ in range(copies)]
            us = graph_time_us([_flashgen_step(problem) for problem in inputs])
            kv_dtype = "" if cache == "bf16" else cache
            plan, splits = plans.decode(0, DECODE_HEAD_DIM, torch.bfloat16, paged, DECODE_HEADS // DECODE_KV_HEADS, batch,
                                        DECODE_KV_HEADS, seqlen + 1, kv_dtype=kv_dtype)
            cache_bytes = kv_bytes // (2 if kv_dtype else 1)
            floor = cache_bytes / (rate * 1e12) * 1e6
            measured = [t for t in sdpa.values() if t]
            best = min(measured) if measured else None
            same = [row for row in rows if (row["B"], row["T"], row["paged"], row["cache"]) == (batch, seqlen, paged, "bf16")]
            rows.append({
                "B": batch, "T": seqlen, "layout": f"paged {DECODE_PAGE}" if paged else "contiguous", "paged": paged,
                "cache": cache, "flashgen_us": us, "flash_us": sdpa["flash"], "cudnn_us": sdpa["cudnn"], "floor_us": floor,
                "vs_floor": us / floor, "vs_best_sdpa": us / best if best else None,
                "vs_bf16_cache": us / same[0]["flashgen_us"] if kv_dtype and same else None,
                "tbs": cache_bytes / (us * 1e-6) / 1e12, "splits": splits, "kernels": " + ".join(k.spec.name for k in plan.kernels),
            })
            del inputs
    return rows


def decode_rotary_us(seqlen: int = 8192) -> dict:
    """GPU time of the B = 1 contiguous decode step with and without rotary tables (Llama's,
    GPT-NeoX halves over all of d): what turning q and the new key inside the kernel costs."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    inputs = _decode_step(1, seqlen, False, gen)
    angles = torch.arange(seqlen, device="cuda")[:, None] * 10000.0 ** (-torch.arange(0, DECODE_HEAD_DIM, 2, device="cuda") / DECODE_HEAD_DIM)
    tables = dict(rotary_cos=angles.cos().to(torch.bfloat16), rotary_sin=angles.sin().to(torch.bfloat16), rotary_interleaved=False)
    return {"T": seqlen, "plain": graph_time_us(_flashgen_step(inputs)), "rotary": graph_time_us(_flashgen_step({**inputs, **tables}))}


def decode_host_us(calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> dict:
    """Wall time per eager call of one decode step (B = 1, 32:8 heads, d = 128, a 1k paged cache,
    append + attention), where the host cost dominates, against one SDPA call on the same shape
    (interleaved_host_us)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    step = _flashgen_step(_decode_step(1, 1024, True, gen))
    q, k, v = _sdpa_inputs(1, 1024, gen)
    ops = {"flashgen": step, "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    return interleaved_host_us(ops, calls, rounds)


DECODE_COLUMNS = ("B", "cache", "layout", "KV", "flashgen us", "flash us", "cudnn us", "floor us", "vs floor",
                  "vs best SDPA", "vs bf16 KV", "TB/s", "splits", "kernels")


def _decode_cells(row) -> list[str]:
    fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    return [
        str(row["B"]), f"{row['T'] // 1024}k", row["layout"], row.get("cache", "bf16"), fmt(row["flashgen_us"]),
        fmt(row["flash_us"]), fmt(row["cudnn_us"]), fmt(row["floor_us"]), fmt(row["vs_floor"], ".2f"),
        fmt(row["vs_best_sdpa"], ".2f"), fmt(row.get("vs_bf16_cache"), ".2f"), fmt(row["tbs"], ".2f"), str(row["splits"]),
        row["kernels"],
    ]


def decode_markdown(report: dict) -> str:
    lines = [
        f"Decode, GPU time per step through CUDA-graph replay ({DECODE_HEADS}:{DECODE_KV_HEADS} heads, d = "
        f"{DECODE_HEAD_DIM}, bf16 q, Tq = 1; flashgen appends the step's token, to a bf16 KV cache or an e4m3 one "
        f"with descales; SDPA (bf16) with enable_gqa=True; floor = the cache's K + V bytes at the measured copy rate, "
        f"{report['copy_rate_tbs']:.2f} TB/s)",
        "", "| " + " | ".join(DECODE_COLUMNS) + " |", "|" + "---|" * len(DECODE_COLUMNS),
    ]
    lines += ["| " + " | ".join(_decode_cells(row)) + " |" for row in report["decode"]]
    rotary = report.get("decode_rotary_us")
    if rotary:
        lines += ["", f"Rotary embedding inside the step (B = 1, {rotary['T'] // 1024}k contiguous, rotary_cos / rotary_sin): "
                      f"{rotary['rotary']:.1f} us against {rotary['plain']:.1f} us without"]
    host = report["decode_host_us"]
    lines += ["", f"Eager host cost of a decode step (B = 1, 1k paged cache, append + attention; median of {HOST_ROUNDS} "
                  f"rounds of {HOST_CALLS}): flashgen {host['flashgen']:.1f} us, one SDPA call {host['sdpa']:.1f} us", ""]
    return "\n".join(lines)


def run_decode(json_path=None, console=None) -> dict:
    """`flashgen bench --decode`: the decode table and the eager host cost (well under a minute)."""
    from rich.console import Console

    console = console or Console()
    if not torch.cuda.is_available():
        raise RuntimeError("flashgen bench needs an NVIDIA GPU: PyTorch sees none on this machine")
    rate = copy_rate_tbs()
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "copy_rate_tbs": rate, "decode": decode_rows(rate=rate), "decode_rotary_us": decode_rotary_us(),
        "decode_host_us": decode_host_us(),
    }
    console.print(decode_markdown(report), highlight=False)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=2)
    return report


# ---- flashgen bench --variants -------------------------------------------------------------------

VARIANT_SEQLEN, VARIANT_HEAD_DIM, SOFTCAP = 8192, 128, 50.0
WINDOW, WINDOW_SEQLEN = 4096, 16384
VARIANT_MODES = ("fwd", "bwd")


def alibi_slopes(heads: int, device="cuda"):
    """ALiBi's geometric slopes, 2^(-8 (h + 1) / heads), fp32 (one per head)."""
    return torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device, dtype=torch.float32)


def variant_cases(heads: int, device="cuda") -> dict:
    """name -> (flashgen.attention's keywords, the same variant as a FlexAttention score_mod, or
    None): softcap 50 * tanh(s / 50); ALiBi -slope[h] * |q - kv| (FlashAttention's, Tq = Tk)."""
    slopes = alibi_slopes(heads, device)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return {"plain": ({}, None), f"softcap {SOFTCAP:g}": ({"softcap": SOFTCAP}, softcap), "alibi": ({"alibi_slopes": slopes}, alibi)}


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window_mask(window: int):
    def mask(b, h, q_idx, kv_idx):  # itself and the window - 1 keys before it
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask


def variant_fields(q, causal: bool, kwargs: dict) -> tuple[str, ...]:
    """The variant fields flashgen's kernels get for attention(q, ..., causal, **kwargs)."""
    from . import variants

    return variants.make(variants.Call(causal, q.shape[0], q.shape[1], q.device), **kwargs).fields


def _flashgen(kwargs: dict):
    from .api import attention

    return lambda q, k, v, causal: attention(q, k, v, causal=causal, **kwargs)


_flex_compiled = None


def _flex(score_mod, mask_mod, seqlen: int):
    """FlexAttention under torch.compile (static shapes), with mask_mod's block mask; None where
    this torch has no FlexAttention."""
    global _flex_compiled
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if _flex_compiled is None:
        import torch._dynamo

        # every case is a recompile of flex_attention (a new score_mod or block mask): keep them all compiled
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
    compiled = _flex_compiled
    return lambda q, k, v, causal: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def first_use_s(attention, q, k, v) -> float:
    """Seconds of the first forward and backward of `attention` (its compiles included), with
    inductor's caches off so that nothing compiled by an earlier run is reused."""
    import torch._inductor.config as inductor

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with inductor.patch(force_disable_caches=True):
        out = attention(*leaves, causal=None)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cold_compile_s(specs) -> float:
    """Seconds to render and compile `specs` into an empty cache (flashgen's first use of them)."""
    from .cache import KernelCache

    with tempfile.TemporaryDirectory() as root:
        cache = KernelCache(root)
        start = time.perf_counter()
        for spec in specs:
            cache.get(spec)
        return time.perf_counter() - start


def tile_fraction(specs, seqlen: int, window_size) -> float:
    """The share of the causal (query tile, key tile) pairs that kernels of these specs visit under
    the causal window `window_size` at Tq = Tk = seqlen: each spec's own tiles, walked as its
    template walks them (reference.visited_tiles mirrors the Mask); the mean over the specs."""
    from .families import HopperBackward, KeyMajorBackward, family
    from .reference import visited_tiles

    shares = []
    for spec in specs:
        key_major = isinstance(family(spec.kind), (KeyMajorBackward, HopperBackward))
        tiles = (seqlen, seqlen, spec.block_m, spec.block_n, True)
        shares.append(visited_tiles(*tiles, window_size, key_major) / visited_tiles(*tiles, key_major=key_major))
    return sum(shares) / len(shares)


def _measure(name, attention, q, k, v, causal, mode, flops) -> dict:
    """{name: TFLOPS, name_ms: milliseconds} of one mode; None for both where it cannot run."""
    if attention is None:
        return {name: None, f"{name}_ms": None}
    try:
        ms = time_ms(_timer(attention, q, k, v, causal, mode))
    except RuntimeError:
        if mode != "bwd":
            return {name: None, f"{name}_ms": None}
        # A compiled graph's backward runs once (FlexAttention's refuses retain_graph): time it as
        # forward + backward less the forward.
        try:
            ms = time_ms(_timer(attention, q, k, v, causal, "fwd+bwd")) - time_ms(_timer(attention, q, k, v, causal, "fwd"))
        except RuntimeError:
            return {name: None, f"{name}_ms": None}
    return {name: flops / ms / 1e9, f"{name}_ms": ms}


def variant_rows(modes=VARIANT_MODES, seqlen=VARIANT_SEQLEN, head_dim=VARIANT_HEAD_DIM, flex=True) -> list[dict]:
    """Plain, softcap and ALiBi, full and causal, for each mode: flashgen and FlexAttention in
    TFLOPS (the plain count: a variant costs no extra FLOPs) and ms, the time against plain
    flashgen's, the kernels that ran, and Flex's first use (compiles) of each case."""
    q, k, v = _inputs(seqlen, head_dim)
    batch, heads = q.shape[:2]
    rows = []
    for causal in (False, True):
        plain_ms = {}
        for name, (kwargs, score_mod) in variant_cases(heads, q.device).items():  # plain first
            theirs = _flex(score_mod, _causal_mask if causal else None, seqlen) if flex else None
            first = first_use_s(theirs, q, k, v) if theirs else None
            ours = _flashgen(kwargs)
            fields = variant_fields(q, causal, kwargs)
            for mode in modes:
                flops = MODES[mode] * forward_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                row = {"variant": name, "causal": causal, "mode": mode, "d": head_dim, "T": seqlen, "B": batch, "heads": heads,
                       "fields": list(fields)}
                row.update(_measure("flashgen", ours, q, k, v, causal, mode, flops))
                row.update(_measure("flex", theirs, q, k, v, causal, mode, flops))
                plain_ms.setdefault(mode, row["flashgen_ms"])
                row["vs_plain"] = row["flashgen_ms"] / plain_ms[mode] if row["flashgen_ms"] and plain_ms[mode] else None
                row["flex_first_s"] = first
                row["kernel"] = _kernel_name(q, causal, mode, fields)
                rows.append(row)
    return rows


def window_rows(modes=VARIANT_MODES, seqlen=WINDOW_SEQLEN, window=WINDOW, head_dim=VARIANT_HEAD_DIM, flex=True) -> list[dict]:
    """A causal sliding window (a query sees itself and window - 1 keys back) against full causal,
    at seqlen: flashgen's window time next to the time it should take if only the visited tiles
    cost, the tile fraction (its kernels' own tiles, exactly as the Mask skips them) times full
    causal on the same kernel (window_size=(seqlen - 1, 0): every causal tile, the same code);
    the plain causal kernel's time, and FlexAttention's window (block mask) and causal. TFLOPS
    count the kept (query, key) pairs only (4 d FLOPs per pair and head; backward 2.5x)."""
    from .reference import visible_pairs

    q, k, v = _inputs(seqlen, head_dim)
    batch, heads = q.shape[:2]
    window_size, whole = (window - 1, 0), (seqlen - 1, 0)
    ours = {"window": _flashgen({"window_size": window_size}), "same": _flashgen({"window_size": whole}), "causal": _flashgen({})}
    theirs = {"window": None, "causal": None}
    first = None
    if flex:
        theirs = {"window": _flex(None, _window_mask(window), seqlen), "causal": _flex(None, _causal_mask, seqlen)}
        first = first_use_s(theirs["window"], q, k, v) if theirs["window"] else None
    pairs = visible_pairs(seqlen, seqlen, True, window_size)
    fields = variant_fields(q, True, {"window_size": window_size})
    rows = []
    for mode in modes:
        flops = MODES[mode] * 4.0 * batch * heads * head_dim * pairs
        row = {"variant": f"window {window}", "causal": True, "mode": mode, "d": head_dim, "T": seqlen, "B": batch,
               "heads": heads, "window": window, "fields": list(fields)}
        row.update(_measure("flashgen", ours["window"], q, k, v, True, mode, flops))
        same = _measure("same", ours["same"], q, k, v, True, mode, flops)
        causal = _measure("causal", ours["causal"], q, k, v, True, mode, flops)
        row["causal_same_kernel_ms"], row["causal_ms"] = same["same_ms"], causal["causal_ms"]
        row.update(_measure("flex", theirs["window"], q, k, v, True, mode, flops))
        row["flex_causal_ms"] = _measure("flex_causal", theirs["causal"], q, k, v, True, mode, flops)["flex_causal_ms"]
        specs = _kernel_specs(q, True, mode, fields)
        row["fraction"] = tile_fraction(specs, seqlen, window_size)
        row["expected_ms"] = row["fraction"] * row["causal_same_kernel_ms"] if row["causal_same_kernel_ms"] else None
        row["vs_expected"] = row["flashgen_ms"] / row["expected_ms"] if row["flashgen_ms"] and row["expected_ms"] else None
        row["flex_first_s"] = first
        row["kernel"] = " + ".join(spec.name for spec in specs)
        row["causal_kernel"] = _kernel_name(q, True, mode)
        rows.append(row)
    return rows


def variant_compile_rows(variant_table: list[dict], window_table: list[dict]) -> list[dict]:
    """Each causal case's first use: flashgen's cold compile of every kernel its forward and
    backward run (prep included) next to FlexAttention's first forward + backward (compiles)."""
    from . import tuning
    from .plans import device_arch

    arch = device_arch(0)
    rows = []
    cases = {row["variant"]: row for row in variant_table + window_table if row["causal"]}  # one row per case
    for row in cases.values():
        fields = tuple(row["fields"])
        specs = [tuning.forward_spec(row["d"], "bf16", True, arch, row["T"], variant=fields), tuning.backward_prep(row["d"], "bf16", arch, variant=fields),
                 *tuning.backward_specs(row["d"], "bf16", True, arch, False, variant=fields)]
        rows.append({"variant": row["variant"], "T": row["T"], "flashgen_cold_s": cold_compile_s(specs),
                     "kernels": len(specs), "flex_first_s": row["flex_first_s"]})
    return rows


RULE_SEQLEN, RULE_HEAD_DIM, RULE_PREFIX, RULE_DOCUMENTS = 8192, 64, 1024, 4


def rule_cases(batch: int, heads: int, seqlen: int, device="cuda") -> dict:
    """name -> (causal, flashgen.attention's keywords with a user rule, the same rule as FlexAttention's
    (score_mod, mask_mod)): ALiBi as a score rule, document masking (RULE_DOCUMENTS equal documents
    per row, causal) and prefix-LM (the first RULE_PREFIX tokens bidirectional)."""
    from .modifiers import MaskMod, ScoreMod

    slopes = alibi_slopes(heads, device)
    doc = torch.repeat_interleave(torch.arange(RULE_DOCUMENTS, device=device, dtype=torch.int32),
                                  seqlen // RULE_DOCUMENTS).repeat(batch, 1)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def documents(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def prefix(b, h, q_idx, kv_idx):
        return (kv_idx < RULE_PREFIX) | (kv_idx <= q_idx)

    return {
        "alibi (score rule)": (True, {"score_mod": ScoreMod("score - slope[h] * fabsf(float(q_idx - kv_idx))", alibi, grad="1.f",
                                                            tensors={"slope": slopes})}, (alibi, _causal_mask)),
        "documents (mask rule)": (True, {"mask_mod": MaskMod(f"doc[b * {seqlen} + q_idx] == doc[b * {seqlen} + kv_idx]",
                                                             documents, tensors={"doc": doc}, per_head=False)}, (None, documents)),
        "prefix-LM (mask rule)": (False, {"mask_mod": MaskMod(f"kv_idx < {RULE_PREFIX} || kv_idx <= q_idx", prefix,
                                                              per_batch=False, per_head=False)}, (None, prefix)),
    }


def flashgen_first_use_s(attention, q, k, v, causal: bool) -> float:
    """Seconds of flashgen's first forward and backward of a call: an empty disk cache and no kernel
    or plan in memory, so every kernel it runs is rendered, compiled and loaded (and a rule's block
    mask made)."""
    import os

    from . import blockmask, kernels, plans

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    previous = os.environ.get("FLASHGEN_CACHE_DIR")
    with tempfile.TemporaryDirectory() as root:
        os.environ["FLASHGEN_CACHE_DIR"] = root
        kernels.clear(), plans.clear(), blockmask.clear()
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = attention(*leaves, causal=causal)
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            return time.perf_counter() - start
        finally:
            if previous is None:
                os.environ.pop("FLASHGEN_CACHE_DIR")
            else:
                os.environ["FLASHGEN_CACHE_DIR"] = previous
            kernels.clear(), plans.clear()


def rule_fields(kwargs: dict) -> tuple:
    return tuple((field, kwargs[field].source) for field in ("score_mod", "mask_mod") if field in kwargs)


def rule_rows(modes=VARIANT_MODES, seqlen=RULE_SEQLEN, head_dim=RULE_HEAD_DIM, flex=True) -> list[dict]:
    """User rules next to FlexAttention running the same rules: TFLOPS on the plain count (causal or
    full, whichever the rule's call is), ms, first use of each (compiles included) and the kernels."""
    q, k, v = _inputs(seqlen, head_dim)
    batch, heads = q.shape[:2]
    rows = []
    for name, (causal, kwargs, (score_mod, mask_mod)) in rule_cases(batch, heads, seqlen, q.device).items():
        theirs = _flex(score_mod, mask_mod, seqlen) if flex else None
        first = first_use_s(theirs, q, k, v) if theirs else None
        ours = _flashgen(kwargs)
        fields = rule_fields(kwargs)
        mine_first = flashgen_first_use_s(ours, q, k, v, causal)
        for mode in modes:
            flops = MODES[mode] * forward_flops(batch, heads, seqlen, seqlen, head_dim, causal)
            row = {"variant": name, "causal": causal, "mode": mode, "d": head_dim, "T": seqlen, "B": batch, "heads": heads}
            row.update(_measure("flashgen", ours, q, k, v, causal, mode, flops))
            row.update(_measure("flex", theirs, q, k, v, causal, mode, flops))
            row["flex_first_s"], row["flashgen_first_s"] = first, mine_first
            row["kernel"] = _kernel_name(q, causal, mode, fields)
            rows.append(row)
    return rows


def variants_report(modes=VARIANT_MODES, flex=True) -> dict:
    variants = variant_rows(modes, flex=flex)
    window = window_rows(modes, flex=flex)
    return {"variants": variants, "window": window, "variant_compile": variant_compile_rows(variants, window),
            "rules": rule_rows(modes, flex=flex)}


def _fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


VARIANT_COLUMNS = ("variant", "causal", "mode", "flashgen", "ms", "Flex", "Flex ms", "vs Flex", "time vs plain", "kernel")
WINDOW_COLUMNS = ("mode", "window ms", "expected ms", "window / expected", "tile fraction", "causal ms (same kernel)",
                  "causal ms", "TFLOPS", "Flex window ms", "Flex causal ms", "kernel")
VARIANT_COMPILE_COLUMNS = ("variant (causal)", "T", "flashgen cold compile s", "kernels", "Flex first use s")
RULE_COLUMNS = ("rule", "causal", "mode", "flashgen", "ms", "Flex", "Flex ms", "vs Flex", "first use s", "Flex first use s", "kernel")


BWD_AS_DIFFERENCE = "a backward that cannot rerun on one graph (Flex's) is timed as fwd+bwd less fwd"


def _table(columns, cells) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(c) + " |" for c in cells)]


def variants_markdown(report: dict) -> str:
    """The --variants report's three tables as Markdown (also what the console shows)."""
    variants, window, compiles = report["variants"], report["window"], report["variant_compile"]
    lines = []
    if variants:
        r = variants[0]
        lines += [f"Variants, d = {r['d']}, T = {r['T']}, B = {r['B']}, {r['heads']} heads, bf16 (TFLOPS; "
                  f"plain FLOPs for every variant; Flex = FlexAttention compiled, the variant as score_mod; {BWD_AS_DIFFERENCE})", ""]
        lines += _table(VARIANT_COLUMNS, ([
            r["variant"], "yes" if r["causal"] else "no", r["mode"], _fmt(r["flashgen"]), _fmt(r["flashgen_ms"], ".2f"),
            _fmt(r["flex"]), _fmt(r["flex_ms"], ".2f"), _ratio(r["flashgen"], r["flex"]), _fmt(r["vs_plain"], ".2f"), r["kernel"],
        ] for r in variants))
        lines.append("")
    if window:
        r = window[0]
        lines += [f"Sliding window {r['window']} (causal, window_size = ({r['window'] - 1}, 0)) at T = {r['T']}, B = {r['B']}, "
                  f"{r['heads']} heads, d = {r['d']}: expected = tile fraction (of the causal tiles, the kernel's own tiles) "
                  f"x causal on the same kernel; TFLOPS on the kept pairs; Flex with its block mask", ""]
        lines += _table(WINDOW_COLUMNS, ([
            r["mode"], _fmt(r["flashgen_ms"], ".2f"), _fmt(r["expected_ms"], ".2f"), _fmt(r["vs_expected"], ".2f"),
            _fmt(r["fraction"], ".3f"), _fmt(r["causal_same_kernel_ms"], ".2f"), _fmt(r["causal_ms"], ".2f"), _fmt(r["flashgen"]),
            _fmt(r["flex_ms"], ".2f"), _fmt(r["flex_causal_ms"], ".2f"), r["kernel"],
        ] for r in window))
        lines += ["", "plain causal kernels: " + "; ".join(f"{r['mode']} {r['causal_kernel']}" for r in window), ""]
    if compiles:
        lines += ["First use: flashgen's cold compile (forward, prep and backward kernels into an empty cache) "
                  "and FlexAttention's first forward + backward (inductor's caches off)", ""]
        lines += _table(VARIANT_COMPILE_COLUMNS, ([
            r["variant"], str(r["T"]), _fmt(r["flashgen_cold_s"], ".1f"), str(r["kernels"]), _fmt(r["flex_first_s"], ".1f"),
        ] for r in compiles))
        lines.append("")
    rules = report.get("rules") or []
    if rules:
        r = rules[0]
        lines += [f"User rules, d = {r['d']}, T = {r['T']}, B = {r['B']}, {r['heads']} heads, bf16 (TFLOPS on the plain count; "
                  f"first use = the first forward + backward, compiles included, each side's caches cold; {BWD_AS_DIFFERENCE})", ""]
        lines += _table(RULE_COLUMNS, ([
            r["variant"], "yes" if r["causal"] else "no", r["mode"], _fmt(r["flashgen"]), _fmt(r["flashgen_ms"], ".2f"),
            _fmt(r["flex"]), _fmt(r["flex_ms"], ".2f"), _ratio(r["flashgen"], r["flex"]), _fmt(r["flashgen_first_s"], ".1f"),
            _fmt(r["flex_first_s"], ".1f"), r["kernel"],
        ] for r in rules))
        lines.append("")
    return "\n".join(lines)


def run_variants(json_path=None, console=None, flex=True) -> dict:
    """`flashgen bench --variants`: the variants next to plain and FlexAttention, the sliding
    window against its tile fraction of causal, and the first-use costs; printed (and as JSON)."""
    from rich.console import Console

    console = console or Console()
    if not torch.cuda.is_available():
        raise RuntimeError("flashgen bench needs an NVIDIA GPU: PyTorch sees none on this machine")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              **variants_report(flex=flex)}
    console.print(variants_markdown(report), highlight=False)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=2)
    return report
