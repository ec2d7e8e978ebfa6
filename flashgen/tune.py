"""`flashgen tune`: measure candidate tile shapes on this GPU and write the tuning table.

For every (kind, head dim, dtype, causal, length bucket) asked for, each candidate the kind's family
offers (`Family.tune_space`) that is a valid spec is compiled, run through `flashgen.attention`
with the candidate put ahead of the table (`tuning.override`), checked against the fp32 reference
by the numerics rule, and only then timed at the bench's shapes (16k tokens, model dim 2048) at a
few sequence lengths. The family's code knobs (`Family.tune_knobs`, such as the Hopper forward's
exp2_fma) stay at their defaults for that pass; each is then tried on the best few shapes, which
rank again with them. The specs with the best geometric mean over those lengths become one exact
table entry, best first, with the numbers that chose them (a knob is named only where it is not
at its default). One pass ranks shapes a few percent apart by noise, so a winner that is not the
table's current pick is timed again against it, interleaved, and replaces it only if its slowest
round beats the current pick's fastest.
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from . import bench, tuning
from .axes import ELEMENT_TYPES
from .reference import fp8_emulated, naive_attention
from .spec import DEFAULTS, KernelSpec, SpecError

TOP = 3  # shapes kept per entry: the best, and fallbacks for targets where it is not valid
CONFIRM_ROUNDS = 3  # interleaved rounds of a new winner against the table's current pick
CHECK_SHAPE = {"long": (2, 3, 200, 333), "short": (2, 3, 37, 333)}  # batch, heads, Tq, Tk: odd on purpose
TIMED_SEQLEN_Q = {"long": None, "short": 64}  # None: the timing length itself


@dataclass
class Problem:
    """One tuning table key."""

    kind: str
    head_dim: int
    dtype: str
    causal: bool
    arch: str
    bucket: str  # "long" or "short" (query rows <= tuning.SHORT_QUERY)

    @property
    def fp8(self) -> bool:
        """FP8 inputs: the FP8 forward (bf16 output), checked by the FP8 rule, timed on quantized inputs."""
        return not ELEMENT_TYPES[self.dtype].output

    @property
    def backward(self) -> bool:
        return self.kind.startswith("bwd")

    @property
    def deterministic(self) -> bool:
        """The backward mode whose kernels include this kind."""
        return self.backward and self.kind not in tuning.backward_kinds(self.head_dim, self.arch, False)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.kind} d={self.head_dim} {self.dtype} {mask} {self.bucket}"


def problems(head_dims, dtypes, causals, arch: str, kinds=None) -> list[Problem]:
    """The kinds the tables run on `arch` (forward for long and short queries, every backward
    piece of both modes), or just `kinds`."""
    found = []
    for head_dim, dtype, causal in itertools.product(head_dims, dtypes, causals):
        if not ELEMENT_TYPES[dtype].output:  # FP8: its forward alone (no backward), whatever the length
            picked = [(tuning.forward_spec(head_dim, dtype, causal, arch, 4096).kind, "long")]
        else:
            picked = [(tuning.forward_spec(head_dim, dtype, causal, arch, t).kind, tuning.bucket_name(t)) for t in (4096, 1)]
        for deterministic in (False, True) if ELEMENT_TYPES[dtype].output else ():
            picked += [(s.kind, "*") for s in tuning.backward_specs(head_dim, dtype, causal, arch, deterministic)]
        for kind, bucket in dict.fromkeys(picked):
            if kinds is None or kind in kinds:
                found.append(Problem(kind, head_dim, dtype, causal, arch, "long" if bucket == "*" else bucket))
    return found


def candidates(problem: Problem) -> list[KernelSpec]:
    """Every valid spec in the family's tuning space for this problem (its knobs at their defaults)."""
    from .families import family

    space = family(problem.kind).tune_space
    specs = []
    for values in itertools.product(*space.values()):
        try:
            specs.append(KernelSpec(head_dim=problem.head_dim, dtype=problem.dtype, causal=problem.causal,
                                    arch=problem.arch, kind=problem.kind, **({"out_dtype": "bf16"} if problem.fp8 else {}),
                                    **dict(zip(space, values))))
        except SpecError:
            continue
    return specs


def knob_candidates(specs: list[KernelSpec]) -> list[KernelSpec]:
    """The specs with each of their family's tuning knobs set to each of its other values, one knob at
    a time (the valid ones)."""
    found = []
    for spec in specs:
        for field, values in spec.family.tune_knobs.items():
            for value in values:
                try:
                    found.append(spec.replace(**{field: value}))
                except SpecError:
                    continue
    return list(dict.fromkeys(found))


def entry_for(problem: Problem, tiles: list[dict], **extra) -> dict:
    """A table entry for what was measured: plain fixed-length calls (the tune's inputs), so that it
    never ranks above the table's entries for variants, rules or varlen, which it was not timed on."""
    return {
        "kind": problem.kind, "arch": problem.arch, "head_dim": problem.head_dim, "dtype": problem.dtype,
        "causal": problem.causal, "bucket": "*" if problem.backward else problem.bucket, "varlen": False, "variant": False,
        "tiles": tiles, **extra,
    }


def tiles_of(spec: KernelSpec) -> dict:
    """What a table entry holds of a spec: its tile shape, and its knobs where they are not at their
    defaults."""
    family = spec.family
    knobs = {field: getattr(spec, field) for field in family.tune_knobs if getattr(spec, field) != DEFAULTS[field]}
    return {**{field: getattr(spec, field) for field in family.tune_space}, **knobs}


def _fp8_inputs(q, k, v):
    """q, k, v quantized to e4m3 with a descale per batch and head (FlashAttention-3's)."""
    quantized = []
    for t in (q, k, v):
        descale = t.float().abs().amax(dim=(2, 3)).clamp_min(1e-12) / 448.0
        quantized += [(t.float() / descale[:, :, None, None]).to(torch.float8_e4m3fn), descale.contiguous()]
    return quantized


def _check_fp8(problem: Problem, q, k, v) -> str | None:
    """The FP8 rule (README): the error against the fp32 oracle at most 1.5x reference.fp8_emulated's."""
    from .api import attention

    q8, qd, k8, kd, v8, vd = _fp8_inputs(q, k, v)
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    with torch.no_grad():
        got = attention(q8, k8, v8, causal=problem.causal, **descales)
    exact = naive_attention(q8, k8, v8, problem.causal, **descales, out_dtype=torch.float32)
    emulated = fp8_emulated(q8, k8, v8, problem.causal, **descales)
    error, bound = ((x.float() - exact).pow(2).mean().sqrt().item() for x in (got, emulated))
    return None if error <= 1.5 * bound else f"out: RMSE {error:.3g} > 1.5 x {bound:.3g}"


def check(problem: Problem) -> str | None:
    """None when the overridden kernels agree with the reference by the numerics rule, else why not."""
    batch, heads, seqlen_q, seqlen_k = CHECK_SHAPE[problem.bucket]
    if problem.fp8:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, heads, seqlen_q, problem.head_dim, device="cuda", generator=gen)
        k, v = (torch.randn(batch, heads, seqlen_k, problem.head_dim, device="cuda", generator=gen) for _ in range(2))
        return _check_fp8(problem, q, k, v)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seqlen_q, problem.head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, heads, seqlen_k, problem.head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    d_o = torch.randn_like(q)

    def grads(fn, dtype=dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        if not problem.backward:
            return [out]
        out.backward(d_o.to(dtype))
        return [t.grad for t in leaves]

    from .api import attention

    got = grads(lambda a, b, c: attention(a, b, c, causal=problem.causal, deterministic=problem.deterministic))
    ref = grads(lambda a, b, c: naive_attention(a, b, c, problem.causal), torch.float32)
    ref_lp = grads(lambda a, b, c: naive_attention(a, b, c, problem.causal, upcast=False))
    factor = 3 if problem.backward else 2
    for name, g, r, r_lp in zip(("dq", "dk", "dv") if problem.backward else ("out",), got, ref, ref_lp):
        error = (g.float() - r.float()).abs().max().item()
        bound = factor * (r_lp.float() - r.float()).abs().max().item() + 1e-5
        if not error <= bound:  # NaN fails too
            return f"{name}: max error {error:.3g} > {bound:.3g}"
    return None


def current_pick(problem: Problem) -> KernelSpec | None:
    """The spec the tables run for the problem now (no override), or None if they have none."""
    try:
        if problem.backward:
            specs = tuning.backward_specs(problem.head_dim, problem.dtype, problem.causal, problem.arch, problem.deterministic)
            return next((spec for spec in specs if spec.kind == problem.kind), None)
        return tuning.forward_spec(problem.head_dim, problem.dtype, problem.causal, problem.arch, CHECK_SHAPE[problem.bucket][2])
    except (LookupError, SpecError):
        return None


def confirmed(winner: list[float], current: list[float]) -> bool:
    """Whether a new winner's interleaved rounds beat the current pick's beyond their spread: its
    slowest round above the current pick's fastest."""
    return min(winner) > max(current)


def runs(problem: Problem, spec: KernelSpec) -> bool:
    """Whether the tables, with the override in place, run `spec` for the problem."""
    if problem.backward:
        return spec in tuning.backward_specs(problem.head_dim, problem.dtype, problem.causal, problem.arch, problem.deterministic)
    seqlen_q = CHECK_SHAPE[problem.bucket][2]
    return spec == tuning.forward_spec(problem.head_dim, problem.dtype, problem.causal, problem.arch, seqlen_q)


def measure(problem: Problem, seqlen: int) -> float:
    """TFLOPS of the problem's pass at the bench's shapes (16k tokens, model dim 2048)."""
    dtype = torch.bfloat16 if problem.fp8 else {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.dtype]
    q, k, v = bench._inputs(seqlen, problem.head_dim, dtype)
    if TIMED_SEQLEN_Q[problem.bucket]:
        q = q[:, :, : TIMED_SEQLEN_Q[problem.bucket]].contiguous()
    from .api import attention

    def run(q, k, v, causal):
        return attention(q, k, v, causal=causal, deterministic=problem.deterministic)

    if problem.fp8:  # the FP8 forward on the same inputs, quantized
        q, qd, k, kd, v, vd = _fp8_inputs(q, k, v)

        def run(q, k, v, causal):  # noqa: F811  (the FP8 call)
            with torch.no_grad():
                return attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    batch, heads, seqlen_q, _ = q.shape
    mode = "bwd" if problem.backward else "fwd"
    flops = bench.MODES[mode] * bench.forward_flops(batch, heads, seqlen_q, seqlen, problem.head_dim, problem.causal)
    fn = bench._timer(run, q, k, v, problem.causal, mode)
    return flops / bench.time_ms(fn) / 1e9


def _compile(canonical: str) -> int:
    """Compile one spec into the disk cache; its spilled and stack bytes."""
    from .cache import default_cache

    resources = default_cache().get(KernelSpec.from_json(canonical)).resources
    return resources.spills + resources.stack_frame


def precompile(specs: list[KernelSpec], jobs: int | None = None) -> dict[KernelSpec, str]:
    """Compile every spec into the disk cache in parallel processes (spawned: this one holds a CUDA
    context); the specs that failed or spill (never shipped: the CPU tier's rule), with why."""
    failed = {}
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile, spec.canonical()): spec for spec in specs}
        for future in as_completed(futures):
            if future.exception() is not None:
                failed[futures[future]] = str(future.exception()).splitlines()[0][:200]
            elif future.result():
                failed[futures[future]] = f"spills: {future.result()} bytes of local memory"
    return failed


SEQLENS = (2048, 8192, 16384)


def tune(found: list[Problem], seqlens=SEQLENS, jobs: int | None = None, progress=None, log=print) -> list[dict]:
    """Measure every candidate of every problem, then the tuning knobs on the best shapes; the table
    entries, one per problem that had a candidate pass its check."""
    from . import kernels

    def timed(problem, spec) -> list[float]:
        with tuning.override([entry_for(problem, [tiles_of(spec)])]):
            return [measure(problem, seqlen) for seqlen in seqlens]

    def compiled(specs: list[KernelSpec]) -> list[KernelSpec]:
        failed = precompile(specs, jobs) if specs else {}  # (no process pool for a family without knobs)
        for spec, why in failed.items():
            log(f"{spec.name}: ruled out ({why})")
        return [spec for spec in specs if spec not in failed]

    def ranked(problem, specs) -> list[tuple]:
        """(geometric mean, TFLOPS per length, spec) of each spec that passes its check."""
        results = []
        for spec in specs:
            try:
                kernels.get(spec)  # load first, so a failure to load is named as one
                with tuning.override([entry_for(problem, [tiles_of(spec)])]):
                    why = None if runs(problem, spec) else "the tables would not run it for this problem"
                    why = why or check(problem)
                tflops = None if why else timed(problem, spec)
            except Exception as error:  # a compile error or a launch failure rules the candidate out
                why, tflops = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}", None
            if why:
                log(f"{problem.label()}: {spec.name} rejected ({why})")
            else:
                results.append((statistics.geometric_mean(tflops), tflops, spec))
            if progress:
                progress.advance(task)
        return results

    entries = []
    picks = {problem.label(): current_pick(problem) for problem in found}  # before any override
    plans = [(problem, candidates(problem)) for problem in found]
    shapes = set(compiled(list(dict.fromkeys(s for _, specs in plans for s in specs))))
    plans = [(problem, [s for s in specs if s in shapes]) for problem, specs in plans]
    total = sum(len(c) for _, c in plans)
    task = progress.add_task("tuning", total=total) if progress else None
    for problem, specs in plans:
        results = sorted(ranked(problem, specs), key=lambda r: -r[0])
        knobs = compiled(knob_candidates([spec for _, _, spec in results[:TOP]]))
        total += len(knobs)
        if progress:
            progress.update(task, total=total)
        results = sorted(results + ranked(problem, knobs), key=lambda r: -r[0])
        if not results:
            log(f"{problem.label()}: no candidate passed; the table keeps its entry")
            continue
        best = settle(problem, results, picks[problem.label()], timed, log)[:TOP]
        log(f"{problem.label()}: " + ", ".join(f"{s.name} {mean:.0f}" for mean, _, s in best) + " TFLOPS (geometric mean)")
        entries.append(entry_for(
            problem, [tiles_of(s) for _, _, s in best],
            source=f"flashgen tune on {torch.cuda.get_device_name()}, {datetime.date.today()}",
            tflops={str(seqlen): [round(t[i], 1) for _, t, _ in best] for i, seqlen in enumerate(seqlens)},
        ))
    return entries


def settle(problem: Problem, results: list, pick: KernelSpec | None, timed, log) -> list:
    """The ranked (mean, tflops, spec) results, with the table's current pick put back first unless
    the winner beats it in CONFIRM_ROUNDS interleaved rounds of `timed(problem, spec)` (confirmed)."""
    current = next((r for r in results if r[2] == pick), None)
    if current is None or current is results[0]:
        return results
    winner = results[0][2]
    rounds = {winner: [], pick: []}
    for _ in range(CONFIRM_ROUNDS):
        for spec in rounds:
            rounds[spec].append(statistics.geometric_mean(timed(problem, spec)))
    if confirmed(rounds[winner], rounds[pick]):
        return results
    means = {spec: ", ".join(f"{mean:.0f}" for mean in rounds[spec]) for spec in rounds}
    log(f"{problem.label()}: {winner.name} is not ahead of the table's {pick.name} beyond the noise "
        f"({CONFIRM_ROUNDS} rounds each: {means[winner]} against {means[pick]} TFLOPS); the table's stays first")
    return [current] + [r for r in results if r is not current]


def merge(doc: dict, entries: list[dict]) -> dict:
    """The table with `entries` in place of entries of the same key (kind, arch, head dim, dtype,
    causal, bucket, varlen, V's own head dim), tuned entries first."""
    def key(entry):
        return tuple(entry.get(f, "*") for f in tuning.KEY_FIELDS + tuning.OPTIONAL_FIELDS + ("head_dim_v",))

    replaced = {key(e) for e in entries}
    kept = [e for e in doc["entries"] if key(e) not in replaced]
    return {**doc, "entries": entries + kept}
