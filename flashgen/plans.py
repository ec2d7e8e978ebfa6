"""Launch plans: what one call of attention runs, as data.

A plan is the scratch buffers a call needs and the steps that use them: kernel launches (each
kernel takes its family's named arguments from the call's values: inputs, outputs and scratch,
by name) and conversions. Plans are picked by the tuning tables and kept per problem bucket, so a
warm call is one dictionary lookup and then its launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from . import kernels, tuning, workspace
from .families import padded
from .families.backward import padded_varlen
from .axes import ELEMENT_TYPES
from .families.decode import MAX_SPLITS
from .kernels import Kernel
from .spec import KernelSpec, SpecError, arch_for_capability

# torch dtype -> the spec's: the 16-bit types every entry point takes, and the FP8 inputs of the forward
DTYPES = {getattr(torch, element.torch): name for name, element in ELEMENT_TYPES.items() if element.output}
FP8_DTYPES = {getattr(torch, element.torch): name for name, element in ELEMENT_TYPES.items() if not element.output}


@dataclass(frozen=True)
class Scratch:
    """A buffer the plan allocates per call, uninitialized: its shape from the call's values. Or,
    from flashgen/workspace.py instead, per stream: `counts`, int32 counts that the kernel leaves at
    zero; `reused`, flat scratch the kernel fills before it reads it."""

    name: str
    shape: Callable[[dict], tuple]
    dtype: torch.dtype = torch.float32
    counts: bool = False
    reused: bool = False


@dataclass(frozen=True)
class Launch:
    kernel: Kernel

    def run(self, device: int, values: dict) -> None:
        self.kernel.launch(device, values)


@dataclass(frozen=True)
class Convert:
    """values["dq"] = the fp32 sum in values["dq_accum"], read back through the layout of the
    kernel that wrote it (its family's dq_from_accum) and converted to dq's dtype."""

    spec: KernelSpec

    @cached_property
    def read_back(self) -> Callable:  # the family's, looked up once (spec.family imports on each call)
        return self.spec.family.dq_from_accum

    def run(self, device: int, values: dict) -> None:
        self.read_back(self.spec, values["dq_accum"], values["dq"])


@dataclass(frozen=True)
class Plan:
    steps: tuple
    scratch: tuple[Scratch, ...] = ()
    whole: bool = False  # one piece, never sliced: its callers keep the grids in bounds (varlen and serving plans)

    @property
    def kernels(self) -> list[Kernel]:
        return [step.kernel for step in self.steps if isinstance(step, Launch)]

    def run(self, device: int, values: dict) -> None:
        """Run every step on `device`'s current stream; `values` holds the call's named tensors and
        scalars, and gains the scratch buffers."""
        stream = None
        for buffer in self.scratch:
            place = values["q"].device
            if buffer.counts or buffer.reused:
                stream = stream or workspace.where(device)
                (size,) = buffer.shape(values)
                values[buffer.name] = (workspace.counts(device, *stream, size, place) if buffer.counts
                                       else workspace.scratch(device, *stream, buffer.name, size, buffer.dtype, place))
                continue
            values[buffer.name] = torch.empty(buffer.shape(values), dtype=buffer.dtype, device=place)
        batch, heads = (0, 0) if self.whole else values["q"].shape[:2]
        parts = (values,) if batch <= MAX_GRID_YZ and heads <= MAX_GRID_YZ else self.slices(values)
        for part in parts:
            for step in self.steps:
                step.run(device, part)


    def slices(self, values: dict):
        """The call in pieces whose grids fit (slices); a rule sees each piece's batch and head from
        0 (and a mask rule's lists are the whole call's), so a plan with one is refused."""
        rule = next((field for kernel in self.kernels for field in ("score_mod", "mask_mod") if getattr(kernel.spec, field)), "")
        if rule:
            batch, heads = values["q"].shape[:2]
            raise ValueError(
                f"{rule} with batch={batch}, heads={heads}: a call of more than {MAX_GRID_YZ} batches or heads runs "
                f"in pieces, whose batch and head indices the rule would see from 0; split the call"
            )
        return slices(values)


MAX_GRID_YZ = 65535  # a grid's largest y (heads) and z (batches)


def slices(values: dict):
    """The call cut into independent pieces whose grids fit: batches at most MAX_GRID_YZ at a
    time, or, when there are more heads than that, one batch and a whole number of key/value
    groups at a time. Every (batch, heads, ...) tensor is sliced alike (by its query or key/value
    heads), so flat-indexed buffers stay contiguous slices."""
    batch, heads = values["q"].shape[:2]
    kv_heads = values["k"].shape[1]
    group = heads // kv_heads
    if group > MAX_GRID_YZ:
        raise ValueError(f"{heads} query heads on {kv_heads} key/value heads: at most {MAX_GRID_YZ} query heads share "
                         f"one key/value head (a grid's limit)")
    if heads <= MAX_GRID_YZ:
        pieces = [(slice(b, b + MAX_GRID_YZ), slice(None), slice(None)) for b in range(0, batch, MAX_GRID_YZ)]
    else:
        step = MAX_GRID_YZ // group * group
        pieces = [
            (slice(b, b + 1), slice(h, h + step), slice(h // group, (h + step) // group))
            for b in range(batch) for h in range(0, heads, step)
        ]
    for b, h, h_kv in pieces:
        part = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch:
                value = value[b, h] if value.shape[1] == heads else value[b, h_kv] if value.shape[1] == kv_heads else value[b]
            part[name] = value
        yield part


# ---- the plans of flashgen.attention -----------------------------------------------------------

_arch: dict[int, str] = {}
_plans: dict[tuple, Plan] = {}


def device_arch(device: int) -> str:
    """The target flashgen compiles for on `device`."""
    arch = _arch.get(device)
    if arch is None:
        arch = _arch[device] = arch_for_capability(*torch.cuda.get_device_capability(device))
    return arch


def forward(device: int, head_dim: int, dtype: torch.dtype, causal: bool, seqlen_q: int, spec: str,
            variant: tuple[str, ...] = (), head_dim_v: int = 0) -> Plan:
    """The forward's plan: the kernel `spec` names (its canonical text), or the tables' choice;
    `variant` names the variant fields the kernel has (flashgen.variants); head_dim_v: V's head dim
    where it differs from q's (0: the same)."""
    key = ("fwd", device, head_dim, head_dim_v, dtype, causal, tuning.query_bucket(seqlen_q), spec, variant)
    plan = _plans.get(key)
    if plan is None:
        chosen = KernelSpec.from_json(spec) if spec else tuning.forward_spec(
            head_dim, DTYPES[dtype], causal, device_arch(device), seqlen_q, variant=variant, head_dim_v=head_dim_v
        )
        plan = _plans[key] = Plan((Launch(kernels.get(chosen)),))
    return plan


def fp8_values_shape(values: dict) -> tuple:
    """The FP8 forward's V as its kernel reads it, from the call's `v_keys` (flashgen.reference.
    fp8_values says the layout): (B, H_kv, d_v, keys in whole 16s), or packed (1, H_kv, d_v, 16
    (ceil(total_k / 16) + sequences + 1)), room for every sequence to start on a whole 16."""
    v = values["v_keys"]
    if values.get("cu_seqlens_k") is not None:
        total, kv_heads, head_dim_v = v.shape
        return 1, kv_heads, head_dim_v, 16 * (-(-total // 16) + values["cu_seqlens_k"].shape[0])
    batch, kv_heads, keys, head_dim_v = v.shape
    return batch, kv_heads, head_dim_v, -(-keys // 16) * 16


def forward_fp8(device: int, head_dim: int, out_dtype: torch.dtype, causal: bool, variant: tuple[str, ...] = (),
                head_dim_v: int = 0, spec: str = "", varlen: bool = False) -> Plan:
    """The FP8 forward's plan (e4m3 q, k, v_keys; the output in out_dtype; varlen: packed sequences):
    V laid out for the P V product (fp8_v, into the scratch `v`), then the kernel `spec` names (its
    canonical text), or the tables' choice."""
    key = ("fwd_fp8", device, head_dim, head_dim_v, out_dtype, causal, variant, spec, varlen)
    plan = _plans.get(key)
    if plan is None:
        chosen = KernelSpec.from_json(spec) if spec else tuning.fp8_forward_spec(
            head_dim, DTYPES[out_dtype], causal, device_arch(device), variant, head_dim_v, varlen)
        v_layout = tuning.fp8_values_spec(head_dim_v or head_dim, chosen.arch, varlen)
        plan = _plans[key] = Plan((Launch(kernels.get(v_layout)), Launch(kernels.get(chosen))),
                                  (Scratch("v", fp8_values_shape, torch.float8_e4m3fn),), whole=varlen)
    return plan


def _dq_adder(specs: list[KernelSpec]) -> KernelSpec | None:
    """The backward kernel that adds dQ into an fp32 sum (a dq_accum parameter), if one does."""
    return next((spec for spec in specs if "dq_accum" in spec.family.params(spec).used(spec.family.grid(spec))), None)


def _sum_dq(specs: list[KernelSpec], scratch: list, steps: list) -> None:
    """Where a backward kernel adds dQ into an fp32 sum: the buffer in its family's layout (the
    prep, the plan's first kernel, writes its zeros), and the last step, which reads the sum back
    into dq (on the host, or by its family's reader kernel)."""
    spec = _dq_adder(specs)
    if spec is not None:
        family = spec.family
        scratch.append(Scratch("dq_accum", lambda values: family.dq_accum_shape(spec, values)))
        reader = family.dq_reader(spec)
        steps.append(Launch(kernels.get(reader)) if reader else Convert(spec))


def _backward_kernels(device: int, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool,
                      forward_spec: str, variant: tuple, varlen: bool = False,
                      head_dim_v: int = 0) -> tuple[KernelSpec, list[KernelSpec]]:
    """The backward's prep (over rows of O and dO: V's head dim) and its kernels (the tables' choice)
    for the forward's target."""
    arch = KernelSpec.from_json(forward_spec).arch if forward_spec else device_arch(device)
    specs = tuning.backward_specs(head_dim, DTYPES[dtype], causal, arch, deterministic, varlen, variant=variant,
                                  head_dim_v=head_dim_v)
    prep = tuning.backward_prep(head_dim_v or head_dim, DTYPES[dtype], arch, varlen, variant)
    return prep, specs


_warmed: set = set()


def warm_backward(device: int, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool, forward_spec: str,
                  variant: tuple[str, ...] = (), varlen: bool = False, head_dim_v: int = 0) -> None:
    """A forward that will be differentiated starts loading (compiling, the first time) the kernels
    of its backward plan in the background (kernels.prefetch), once per plan, so that a training
    step's first backward does not wait for compiles that could run beside the forward's."""
    key = ("bwd_varlen" if varlen else "bwd", device, head_dim, head_dim_v, dtype, causal, deterministic, forward_spec, variant)
    if key in _plans or key in _warmed:
        return
    _warmed.add(key)
    try:
        prep, specs = _backward_kernels(device, head_dim, dtype, causal, deterministic, forward_spec, variant, varlen,
                                        head_dim_v)
    except SpecError:  # no backward for this shape: the forward still runs, and a backward names the reason
        return
    adder = _dq_adder(specs)
    reader = adder and adder.family.dq_reader(adder)
    kernels.prefetch([prep, *specs, *([reader] if reader else [])])


def _learned_grad(prep: KernelSpec) -> list[Scratch]:
    """The partial sums of a learned variant's gradient (a sink's), where the prep computes them."""
    if not prep.variants:
        return []
    return [Scratch("learned_grad", lambda values, family=prep.family: family.learned_grad_shape(prep, values))]


def _stats(values: dict) -> tuple:
    batch, heads, seqlen_q, _ = values["q"].shape
    return batch, heads, padded(seqlen_q)


def backward(device: int, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool, forward_spec: str,
             variant: tuple[str, ...] = (), head_dim_v: int = 0) -> Plan:
    """The backward's plan: the prep (delta and the base-2 lse, padded), then the tables' backward
    kernels for the target of the forward's kernel (`forward_spec`, its canonical text; "" = the
    device's); without `deterministic` the key-major kernel adds dQ into an fp32 buffer with
    atomics, converted to dq at the end."""
    key = ("bwd", device, head_dim, head_dim_v, dtype, causal, deterministic, forward_spec, variant)
    plan = _plans.get(key)
    if plan is None:
        prep, specs = _backward_kernels(device, head_dim, dtype, causal, deterministic, forward_spec, variant,
                                        head_dim_v=head_dim_v)
        scratch = [Scratch("delta", _stats), Scratch("lse_log2", _stats), *_learned_grad(prep)]
        steps = [Launch(kernels.get(spec)) for spec in [prep, *specs]]
        _sum_dq(specs, scratch, steps)
        plan = _plans[key] = Plan(tuple(steps), tuple(scratch))
    return plan


# ---- the plans of flashgen.attention_varlen ----------------------------------------------------


def forward_varlen(device: int, head_dim: int, dtype: torch.dtype, causal: bool, max_seqlen_q: int, spec: str,
                   variant: tuple[str, ...] = (), head_dim_v: int = 0) -> Plan:
    """attention_varlen's forward: the kernel `spec` names, or the tables' varlen choice for the
    longest sequence's length."""
    key = ("fwd_varlen", device, head_dim, head_dim_v, dtype, causal, tuning.query_bucket(max_seqlen_q), spec, variant)
    plan = _plans.get(key)
    if plan is None:
        chosen = KernelSpec.from_json(spec) if spec else tuning.forward_spec(
            head_dim, DTYPES[dtype], causal, device_arch(device), max_seqlen_q, varlen=True, variant=variant,
            head_dim_v=head_dim_v,
        )
        plan = _plans[key] = Plan((Launch(kernels.get(chosen)),), whole=True)
    return plan


def paged_prefill(device: int, head_dim: int, dtype: torch.dtype, causal: bool, max_seqlen_q: int,
                  variant: tuple[str, ...] = ()) -> Plan | None:
    """attention_varlen over a paged cache with long query chunks: the Hopper forward reading pages
    (tuning.paged_forward_spec), or None where the decode plan's varlen kernel runs instead."""
    key = ("paged_prefill", device, head_dim, dtype, causal, tuning.query_bucket(max_seqlen_q), variant)
    if key not in _plans:
        spec = tuning.paged_forward_spec(head_dim, DTYPES[dtype], causal, device_arch(device), max_seqlen_q, variant)
        _plans[key] = Plan((Launch(kernels.get(spec)),), whole=True) if spec else None
    return _plans[key]


def kv_append(device: int, head_dim: int, dtype: torch.dtype) -> Plan:
    """attention_with_kvcache's append into a paged cache on its own (ahead of paged_prefill's
    forward, which then reads the new keys from the pages)."""
    key = ("append", device, head_dim, dtype)
    if key not in _plans:
        _plans[key] = Plan((Launch(kernels.get(tuning.append_spec(head_dim, DTYPES[dtype], device_arch(device)))),), whole=True)
    return _plans[key]


def _varlen_stats(values: dict) -> tuple:
    """[heads, padded_q]: each sequence's rows on whole tiles (block_info's stats_rows)."""
    total_q, heads, _ = values["q"].shape
    return heads, padded_varlen(total_q, values["cu_seqlens_q"].shape[0] - 1)


def backward_varlen(device: int, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool, forward_spec: str,
                    variant: tuple[str, ...] = (), head_dim_v: int = 0) -> Plan:
    """attention_varlen's backward: backward()'s steps over packed sequences; the statistics are
    [heads, padded_q] and the fp32 dQ sum is [total_q, heads, head_dim], like q."""
    key = ("bwd_varlen", device, head_dim, head_dim_v, dtype, causal, deterministic, forward_spec, variant)
    plan = _plans.get(key)
    if plan is None:
        prep, specs = _backward_kernels(device, head_dim, dtype, causal, deterministic, forward_spec, variant, varlen=True,
                                        head_dim_v=head_dim_v)
        scratch = [Scratch("delta", _varlen_stats), Scratch("lse_log2", _varlen_stats), *_learned_grad(prep)]
        steps = [Launch(kernels.get(spec)) for spec in [prep, *specs]]
        _sum_dq(specs, scratch, steps)
        plan = _plans[key] = Plan(tuple(steps), tuple(scratch), whole=True)
    return plan


# ---- the plans of flashgen.attention_with_kvcache and merge_attention_states -------------------

_sm_counts: dict[int, int] = {}


def sm_count(device: int) -> int:
    """Streaming multiprocessors of `device`."""
    count = _sm_counts.get(device)
    if count is None:
        count = _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


MIN_SPLIT_TILES = 2  # key tiles a split gets at least: every block pays the pipeline's start and the merge
FULL = 0.8  # blocks that fill this share of the GPU's slots already run unsplit
GOOD_ENOUGH = 0.95  # the fewest splits whose waves are this close to the best split count's


def num_splits(blocks: int, key_tiles: int, slots: int, max_splits: int = MAX_SPLITS) -> int:
    """How many blocks the keys of each (sequence, KV head, row tile) are split across (split-KV,
    flash-decoding), from shapes only: `blocks` = batch x KV heads x row tiles, `key_tiles` = the
    cache's capacity (plus the new keys) in key tiles, `slots` = blocks the GPU runs at once (SMs x
    blocks per SM). Never the lengths in cache_seqlens: a captured graph stays right as they grow
    (a split past a sequence's end is an empty partial). Unsplit when the blocks fill the GPU
    already; else the fewest splits, at least MIN_SPLIT_TILES tiles each, whose last wave of blocks
    is nearly as full as the best count's (blocks x splits / (waves x slots))."""
    limit = max(1, min(max_splits, key_tiles // MIN_SPLIT_TILES))
    if blocks >= FULL * slots or limit == 1:
        return 1

    def fill(splits: int) -> float:
        launched = blocks * splits
        return launched / (-(-launched // slots) * slots)

    best = max(fill(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if fill(s) >= GOOD_ENOUGH * best)


def _partials(values: dict) -> tuple:
    """The split-KV scratch, flat fp32: [splits, batch, heads, seqlen_q, head_dim] partial outputs,
    then [splits, batch, heads, seqlen_q] their log-sum-exps."""
    rows = values["splits"] * values["batch"] * values["heads"] * values["seqlen_q"]
    return (rows * (values["q"].shape[3] + 1),)


def decode(device: int, head_dim: int, dtype: torch.dtype, paged: bool, rows: int, batch: int, kv_heads: int,
           max_keys: int, splits: int = 0, variant: tuple[str, ...] = (), rotary: str = "",
           varlen: bool = False, *, kv_dtype: str = "") -> tuple[Plan, int]:
    """attention_with_kvcache's plan and its split count for a shape (and attention_varlen's over a
    paged cache, `varlen`): the decode kernel the tables pick for `rows` packed query rows per KV
    head (at most, with varlen) (with the variant fields `variant` names, and the rotary
    embedding's style `rotary`, "" for none); with
    more than one split (`splits`, or 0 for num_splits' choice over `max_keys`, the keys a block
    may see: the cache's capacity plus the new keys, or fewer through a window), fp32 partials in
    scratch and the counts by which each row tile's last block knows to merge them. kv_dtype: an FP8
    cache's element type ("" = dtype's)."""
    key = ("decode", device, head_dim, dtype, paged, rows, batch, kv_heads, max_keys, splits, variant, rotary, varlen, kv_dtype)
    found = _plans.get(key)
    if found is None:
        arch = device_arch(device)
        spec = tuning.decode_spec(head_dim, DTYPES[dtype], arch, paged, rows, variant, rotary, varlen, kv_dtype=kv_dtype)
        chosen = splits or num_splits(
            batch * kv_heads * -(-rows // spec.block_m), -(-max_keys // spec.block_n),
            sm_count(device) * spec.family.blocks_per_sm(spec),
        )
        scratch = []
        if chosen > 1:
            # The counts: one per (sequence, KV head, row tile of the packed rows).
            tiles = -(-rows // spec.block_m)
            scratch = [Scratch("partials", _partials, reused=True),
                       Scratch("counters", lambda values: (values["batch"] * values["kv_heads"] * tiles,), torch.int32, counts=True)]
        found = _plans[key] = (Plan((Launch(kernels.get(spec)),), tuple(scratch), whole=True), chosen)
    return found


def merge(device: int, head_dim: int, dtype: torch.dtype) -> Plan:
    """merge_attention_states' plan: one launch of the merge kernel for states of `dtype`."""
    key = ("merge", device, head_dim, dtype)
    plan = _plans.get(key)
    if plan is None:
        kind, name = ("merge_fp32", "bf16") if dtype == torch.float32 else ("merge", DTYPES[dtype])
        plan = _plans[key] = Plan((Launch(kernels.get(tuning.merge_spec(kind, head_dim, name, device_arch(device)))),), whole=True)
    return plan


def clear() -> None:
    """Forget every plan (and the devices' targets): the next call picks again."""
    _plans.clear()
    _warmed.clear()
    _arch.clear()

