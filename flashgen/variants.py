"""Attention variants: sliding windows, logit soft-capping and ALiBi (FlashAttention's names and
semantics), and the user rules (flashgen.modifiers), each declared once in REGISTRY.

A declaration says what the rest of the package asks of a variant: its name (the KernelSpec's
`variants` entry, the kernel name's part, the templates' flag), the public keyword that turns it on,
the device hook it acts at (the mask piece, templates/mask.cuh.j2: which keys a query sees; the
score piece, templates/score.cuh.j2: the value the softmax takes for a score, with or without a
derivative the backward multiplies into dS), the kernel parameters it adds and their host values,
the registers it costs beside a kernel's accumulators, and whether the tuning table keys on it.
Families and tables ask these traits (`on`, `has`), not the names. A spec without a variant renders
no trace of it. The values (a window's bounds, a cap, slopes) are kernel arguments, so one compiled
kernel serves every window, cap and slope. `Variant` is one call's values, checked (`make`), and
what the plans and launches read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .params import Param, pointer, scalar

UNBOUNDED = 1 << 30  # a window side without bound, as the kernel takes it (no sequence is this long)


@dataclass(frozen=True)
class Declaration:
    """One variant, as every layer sees it.

    name:        the KernelSpec `variants` entry (a rule: its own spec field, holding its source),
                 the kernel name's part, the templates' flag.
    keyword:     the public functions' keyword that turns it on.
    header:      what the rendered kernel's first line says of it.
    mask:        it hides keys: the mask piece's key-tile range and per-element test.
    score:       it changes a score before the softmax (the score piece): "pointwise" (a function of
                 the score alone), "positional" (of the score and its row and key) or "rule".
    grad:        the backward multiplies dS by the score's derivative.
    tuning_key:  the tuning table's key for kernels that have it, where entries are tuned apart (it
                 moves a kernel's bound, as a tanh per score does); "" where they are not.
    registers:   what it takes per thread beside a kernel's accumulators, in the per-element loops.
    arguments:   the launch's named arguments its parameters read.
    params:      its kernel parameters (after a spec's others), from the spec.
    mask_args:   the kernel parameters the Mask piece's constructor takes.
    holds_causal: its mask holds causal's too (a window's right side is 0 under causal), so a
                 kernel that has it asks it alone.
    default:     the keyword's value when not given (the variant is off).
    check:       (the keyword's value, the Call) -> its op arguments by name, checked and normalized,
                 or None where the value turns it off (named errors for bad values).
    op_args:     (name, torch schema type, value when off) of the op arguments it travels as.
    neutral:     (Call) -> op arguments with which a kernel that has it computes as if it were off
                 (a prebuilt kernel called without it), or None where none do.
    keys_seen:   (op arguments, query rows) -> the most keys a block of those rows sees, or None.
    keyword_schema: the keyword as a torch.library argument (for ops that take it as given and
                 check it when they run), or "" where it cannot travel so (a rule's object).
    state:       it changes the softmax's state (the softmax piece's finish): a sink joins each
                 row's denominator.
    kinds:       the kernel kinds whose templates build it, where not every family that takes
                 variants does (their `fields`); the others refuse it by name.
    backward:    the backward's kernels have it (False: they see it only through the forward's lse;
                 the prep, kind "bwd_prep", may still have it where `kinds` names it).
    plain_tiles: it takes the plain kernel's tiles: the tuning table's variant entries (smaller tiles,
                 for the registers a variant takes in the per-element loops) are not for it.
    gradient:    (its tensor, delta, lse, cu_seqlens_q or None) -> the gradient its tensor receives,
                 from the forward's lse and the backward's delta = rowsum(dO * O) - dlse per row
                 (in lse's layout), or None: the rule, which the oracle and the context-parallel
                 merge apply; the ops take it from the backward's prep, which computes the same sum
                 per (sequence, head) in its blocks (a learned variant's kinds name "bwd_prep"; at
                 most one variant learns: the op returns one gradient).
    no_key_lse:  (its op argument, packed) -> the log-sum-exp of a row that sees no key, broadcast
                 over lse's layout, where it is not -inf (a sink: its logit), or None.
    sample:      (spec, q) -> a keyword value that exercises it (`python -m flashgen.check` runs a
                 prebuilt kernel and the oracle with it), or None (a rule: only its author has one).
    """

    name: str
    keyword: str
    header: str
    mask: bool = False
    score: str = ""
    grad: bool = False
    tuning_key: str = ""
    registers: int = 8
    arguments: tuple[str, ...] = ()
    params: Callable = field(default=lambda spec: [], repr=False)
    mask_args: tuple[str, ...] = ()
    holds_causal: bool = False
    rule: bool = False  # a user rule (flashgen.modifiers): its spec field holds its source
    default: object = None
    check: Callable = field(default=lambda value, call: None, repr=False)
    op_args: tuple[tuple[str, str, object], ...] = ()
    neutral: Callable | None = field(default=None, repr=False)
    keys_seen: Callable = field(default=lambda args, rows: None, repr=False)
    keyword_schema: str = ""
    state: bool = False
    kinds: tuple[str, ...] | None = None
    backward: bool = True
    plain_tiles: bool = False
    gradient: Callable | None = field(default=None, repr=False)
    no_key_lse: Callable | None = field(default=None, repr=False)
    sample: Callable | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Call:
    """What a variant's check needs of a call: its mask, its batch (or sequences) and query heads,
    its device, and FlashAttention's seqlen_k (attention: the keys; varlen: max_seqlen_k; kvcache:
    the cache's capacity), past which a window side is unbounded (None: as given)."""

    causal: bool
    batch: int
    heads: int
    device: object
    keys: int | None = None


def window_bound(side: int) -> int:
    """A window side as the kernel takes it: no bound is a bound no key reaches."""
    return UNBOUNDED if side < 0 else side


def _window_params(spec) -> list[Param]:
    return [scalar("window_left", "int", "window_bound(window_left)"), scalar("window_right", "int", "window_bound(window_right)")]


def _softcap_params(spec) -> list[Param]:
    return [scalar("softcap_scale", "float", "scale / softcap")]  # raw score -> tanh's argument


def _alibi_params(spec) -> list[Param]:
    return [pointer("alibi_slopes", "const float*"),
            scalar("alibi_batch_stride", "int", "alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0"),
            # slopes in the units of the value the softmax takes (score.cuh.j2)
            scalar("alibi_scale", "float", "1.0 / softcap" if has(spec, "softcap") else "1.0 / scale")]


def _check_window(window_size, call: Call) -> dict | None:
    """Causal caps the right side at 0, a side of at least call.keys is unbounded (FlashAttention's
    rule), and a window that bounds nothing is no window (causal alone, or nothing)."""
    try:
        left, right = (int(x) for x in window_size)
        ok = len(tuple(window_size)) == 2 and all(int(x) == x for x in window_size)
    except (TypeError, ValueError):
        ok = False
    if not ok or left < -1 or right < -1 or max(left, right) >= UNBOUNDED:
        raise ValueError(
            f"window_size={window_size!r}: must be (left, right), two ints >= -1 (-1 = unbounded) below {UNBOUNDED}"
        )
    if call.keys is not None:
        left, right = clip_window((left, right), call.keys)
    if call.causal:
        right = 0 if left != -1 else -1  # (causal alone: the causal mask, no window)
    return None if (left, right) == (-1, -1) else {"window_left": left, "window_right": right}


def _window_keys(args: dict, rows: int) -> int | None:
    left, right = args["window_left"], args["window_right"]
    return rows + left + right if min(left, right) >= 0 else None


def _check_softcap(softcap, call: Call) -> dict | None:
    softcap = float(softcap or 0.0)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: must be a finite number >= 0 (0 = no soft-capping)")
    return {"softcap": softcap} if softcap else None


def _check_alibi(slopes, call: Call) -> dict | None:
    """Slopes per query head, or per batch (sequence) and query head, read as (batch, heads): the
    plans slice them like q."""
    if slopes is None:
        return None
    check_slopes(slopes, call.batch, call.heads, call.device)
    return {"alibi_slopes": slopes.expand(call.batch, call.heads)}


def _check_rule(kind: str):
    def check(rule, call: Call) -> dict | None:
        from . import modifiers

        if rule is None:
            return None
        wanted = modifiers.ScoreMod if kind == "score_mod" else modifiers.MaskMod
        if not isinstance(rule, wanted):
            raise TypeError(f"{kind} must be a flashgen.{wanted.__name__}, got {type(rule).__name__}")
        tensors = rule.arguments()
        for name, tensor in zip(rule.tensors, tensors):
            if tensor.device != call.device:
                raise ValueError(f"{kind}'s tensor {name!r} is on {tensor.device}, the inputs on {call.device}")
        return {kind: rule.source, f"{kind}_tensors": tensors}

    return check


def _check_sink(sink, call: Call) -> dict | None:
    """One logit per query head, fp32 (gpt-oss' sinks), read as (batch, heads): the plans slice it
    like q, and its gradient comes back per batch and head (autograd sums it over the batch)."""
    import torch  # here: the CLI imports this module and must not pay for torch

    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dtype != torch.float32:
        raise TypeError(f"learnable_sink has dtype {sink.dtype}; it must be torch.float32 (one logit per query head)")
    if tuple(sink.shape) != (call.heads,):
        raise ValueError(f"learnable_sink has shape {tuple(sink.shape)}; it must be ({call.heads},): one logit per query head")
    if sink.device != call.device:
        raise ValueError(f"learnable_sink is on {sink.device}, the inputs on {call.device}: they must be on one device")
    return {"learnable_sink": sink.expand(call.batch, call.heads)}


def _sink_gradient(sink, delta, lse, cu_seqlens_q):
    """d sink[b, h] = -sum over the rows i of (b, h) of P_sink,i * delta_i, P_sink,i = exp(sink -
    lse_i): the sink's share of row i's softmax, which the row's output loses as the sink grows
    (lse holds the sink; the kernels' gradients of q, k, v need nothing more); delta_i = dO_i . O_i
    - dlse_i, from the backward's prep. `sink` is (batch, heads) (sequences, packed); delta and lse
    are (batch, heads, seq) fixed, (heads, total_q) packed."""
    import torch

    if cu_seqlens_q is None:
        return torch.linalg.vecdot(torch.exp(sink[..., None] - lse), delta).neg_()
    batch, total_q = sink.shape[0], lse.shape[1]
    sequence = torch.searchsorted(cu_seqlens_q[1:], torch.arange(total_q, device=lse.device, dtype=cu_seqlens_q.dtype),
                                  right=True)
    inside = sequence < batch  # (rows past the last sequence's end belong to none: no kernel wrote their lse)
    sequence.clamp_(max=batch - 1)
    rows = torch.where(inside, -(torch.exp(sink[sequence].t() - lse) * delta), 0.0)  # (heads, total_q)
    return torch.zeros_like(sink, memory_format=torch.contiguous_format).index_add_(0, sequence, rows.t())


def _sink_params(spec) -> list[Param]:
    return [pointer("learnable_sink", "const float*"),
            scalar("sink_batch_stride", "int", "learnable_sink.stride(0)")]  # (0: one logit per head for every batch)


def _rule_params(kind: str):
    def params(spec) -> list[Param]:
        from .modifiers import kernel_tensors

        return [Param(name, f"const {ctype}* __restrict__", "ptr", f"{kind}_tensors[{i}].data_ptr()")
                for i, (name, ctype) in enumerate(kernel_tensors(kind, getattr(spec, kind)))]

    return params


def _geometric_slopes(q):
    """ALiBi's slopes for q's heads (the paper's geometric sequence), fp32 on q's device."""
    import torch

    heads = q.shape[1]
    return torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=q.device)


def _spread_sinks(q):
    """A sink per query head, from below the scores to above them."""
    import torch

    return torch.linspace(-2.0, 4.0, q.shape[1], device=q.device)


REGISTRY: tuple[Declaration, ...] = (
    Declaration("window", "window_size", ", sliding window", mask=True, arguments=("window_left", "window_right"),
                params=_window_params, mask_args=("window_left", "window_right"), holds_causal=True, default=(-1, -1),
                check=_check_window, op_args=(("window_left", "SymInt", -1), ("window_right", "SymInt", -1)),
                neutral=lambda call: {"window_left": -1, "window_right": 0 if call.causal else -1}, keys_seen=_window_keys,
                keyword_schema="SymInt[] window_size", sample=lambda spec, q: (256, 0 if spec.causal else 64)),
    Declaration("softcap", "softcap", ", soft-capped scores", score="pointwise", grad=True, tuning_key="softcap",
                arguments=("softcap",), params=_softcap_params, default=0.0, check=_check_softcap,
                op_args=(("softcap", "float", 0.0),), keyword_schema="float softcap", sample=lambda spec, q: 30.0),
    Declaration("alibi", "alibi_slopes", ", ALiBi", score="positional", arguments=("alibi_slopes",), params=_alibi_params,
                check=_check_alibi, op_args=(("alibi_slopes", "Tensor?", None),), keyword_schema="Tensor? alibi_slopes",
                sample=lambda spec, q: _geometric_slopes(q)),
    Declaration("sink", "learnable_sink", ", attention sinks", state=True, registers=2, arguments=("learnable_sink",),
                params=_sink_params, check=_check_sink, op_args=(("learnable_sink", "Tensor?", None),),
                keyword_schema="Tensor? learnable_sink", kinds=("fwd", "fwd_sm90", "decode", "decode_paged", "bwd_prep"), backward=False,
                plain_tiles=True, gradient=_sink_gradient, sample=lambda spec, q: _spread_sinks(q),
                no_key_lse=lambda sink, packed: sink[0, :, None] if packed else sink[..., None]),  # ((heads, 1), (b, h, 1))
    Declaration("score_mod", "score_mod", ", a user score rule", score="rule", grad=True, registers=48,
                arguments=("score_mod_tensors",), params=_rule_params("score_mod"), rule=True, check=_check_rule("score_mod"),
                op_args=(("score_mod", "str", ""), ("score_mod_tensors", "Tensor[]", []))),
    Declaration("mask_mod", "mask_mod", ", a user mask rule", mask=True, registers=48, tuning_key="mask_rule",
                arguments=("mask_mod_tensors", "block_masks"), params=_rule_params("mask_mod"), rule=True,
                check=_check_rule("mask_mod"), op_args=(("mask_mod", "str", ""), ("mask_mod_tensors", "Tensor[]", []))),
)
BY_NAME = {declaration.name: declaration for declaration in REGISTRY}
FIELDS = tuple(declaration.name for declaration in REGISTRY if not declaration.rule)  # what KernelSpec.variants holds
# what every family that takes variants builds (its `fields`' default); the others name their kinds
EVERYWHERE = tuple(declaration.name for declaration in REGISTRY if not declaration.rule and declaration.kinds is None)
RULES = tuple(declaration.name for declaration in REGISTRY if declaration.rule)  # spec fields of their own (sources)
# the kernels' named arguments: the variants' values, the rules' tensors and block masks
# (flashgen.blockmask.BlockMasks: the tiles a mask rule leaves, per tile shape, made on first use)
ARGUMENTS = tuple(name for declaration in REGISTRY for name in declaration.arguments)
TUNING_KEYS = {declaration.tuning_key: declaration.name for declaration in REGISTRY if declaration.tuning_key}
OP_ARGS = tuple(arg for declaration in REGISTRY for arg in declaration.op_args)  # the ops' variant arguments, in order
OP_SCHEMA = ", ".join(f"{kind} {name}" for name, kind, _ in OP_ARGS)  # their torch.library schema
PLAIN_ARGS = tuple(plain for _, _, plain in OP_ARGS)
# a learned variant's op argument -> the gradient its tensor receives
GRADIENTS = {d.op_args[0][0]: d.gradient for d in REGISTRY if d.gradient}
assert len(GRADIENTS) <= 1 and all("bwd_prep" in BY_NAME[d.name].kinds for d in REGISTRY if d.gradient), \
    "a learned variant's gradient is the prep's, and the backward op returns one"
_NO_KEY_LSE = {d.op_args[0][0]: d.no_key_lse for d in REGISTRY if d.no_key_lse}


def no_key_lse(lse, packed: bool, variant: tuple):
    """lse filled for rows that see no key: -inf, or what a given variant argument puts there
    (a sink's logit); `variant` is the ops' variant arguments (OP_ARGS' order)."""
    lse.fill_(-math.inf)
    for (name, _, _), value in zip(OP_ARGS, variant):
        if value is not None and name in _NO_KEY_LSE:
            lse.copy_(_NO_KEY_LSE[name](value, packed).expand(lse.shape))
    return lse
# The variants an op may take as given (a keyword each, checked when the op runs), and their schema
KEYWORDS = tuple(declaration.keyword for declaration in REGISTRY if declaration.keyword_schema)
KEYWORD_SCHEMA = ", ".join(declaration.keyword_schema for declaration in REGISTRY if declaration.keyword_schema)


def builds(fields, kind: str, name: str) -> bool:
    """Whether a family of these `fields` builds variant `name` in kernels of `kind`."""
    declaration = BY_NAME[name]
    return name in fields if declaration.kinds is None else kind in declaration.kinds


def tiled_apart(variant: tuple) -> bool:
    """Whether a problem's variant (tuning.variant_fields' form) takes the tuning table's variant
    tiles: any of its variants but those that take the plain kernel's."""
    return any(not BY_NAME[item[0] if isinstance(item, tuple) else item].plain_tiles for item in variant)


def for_backward(variant: tuple) -> tuple:
    """A forward's variant (tuning.variant_fields' form) as its backward kernels have it: without
    those they see only through the forward's lse (a sink)."""
    return tuple(item for item in variant if BY_NAME[item[0] if isinstance(item, tuple) else item].backward)


def for_prep(variant: tuple) -> tuple:
    """A forward's variant (tuning.variant_fields' form) as the backward's prep has it: the variant
    that learns (a sink), whose gradient the prep sums."""
    return tuple(item for item in variant if not isinstance(item, tuple) and BY_NAME[item].gradient)


def on(spec) -> tuple[Declaration, ...]:
    """The declarations of the variants a spec has, in registry order."""
    return tuple(d for d in REGISTRY if (getattr(spec, d.name) if d.rule else d.name in spec.variants))


def has(spec, name: str) -> bool:
    declaration = BY_NAME[name]
    return bool(getattr(spec, name)) if declaration.rule else name in spec.variants


def normalized(names) -> tuple[str, ...]:
    """A spec's `variants`: known names, each once, in registry order (so equal specs compare equal)."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"variants={names!r}: must be a tuple of variant names ({', '.join(FIELDS)})")
    unknown = [name for name in names if name not in FIELDS]
    if unknown:
        raise ValueError(f"variants={tuple(names)!r}: {', '.join(map(repr, unknown))} is not one of {', '.join(FIELDS)}")
    return tuple(name for name in FIELDS if name in names)


def _off(value, plain) -> bool:
    return value is None if plain is None else (not value) if isinstance(plain, list) else value == plain


class Variant:
    """One call's variants, checked: the op arguments of those that are on, by name (the others
    travel at their values when off)."""

    __slots__ = ("args", "fields")

    def __init__(self, args: dict | None = None):
        self.args = args or {}
        # tuning.variant_fields' form: the names of those on, and a rule's (name, source); a decode
        # step reads it on every call
        self.fields = tuple((d.name, self.args[d.name]) if d.rule else d.name for d in REGISTRY
                            if any(name in self.args for name, _, _ in d.op_args))

    @classmethod
    def from_op_args(cls, values) -> Variant:
        """From the ops' positional variant arguments (OP_ARGS' order): a declaration is on where
        any of its arguments is not at its value when off (a window of (-1, 30) is on)."""
        given = dict(zip((name for name, _, _ in OP_ARGS), values))
        return cls({name: given[name] for d in REGISTRY if any(not _off(given[name], plain) for name, _, plain in d.op_args)
                    for name, _, _ in d.op_args})

    def op_args(self) -> tuple:
        """The ops' positional variant arguments (OP_ARGS' order), those off at their plain values;
        () for a plain call (the eager path passes none at all)."""
        return tuple(self.args.get(name, plain) for name, _, plain in OP_ARGS) if self.args else ()

    def values(self) -> dict:
        """The kernels' named arguments: every op argument (those off at their values when off: a
        parameter may read one, as a rule's unit reads the cap), less the rules' sources (spec
        fields)."""
        return {name: self.args.get(name, plain) for name, _, plain in OP_ARGS if name not in RULES}

    def keys_seen(self, rows: int) -> int | None:
        """The most keys a block of `rows` query rows can see under the variants' bounds (a window),
        or None where none bounds them."""
        bounds = [d.keys_seen(self.args, rows) for d in REGISTRY if d.name in self.fields]
        bounds = [keys for keys in bounds if keys is not None]
        return min(bounds) if bounds else None

    def __eq__(self, other) -> bool:  # (tensors compare by identity)
        return isinstance(other, Variant) and self.args.keys() == other.args.keys() and all(
            value is other.args[name] or (not hasattr(value, "shape") and value == other.args[name])
            for name, value in self.args.items())

    __hash__ = None

    def __repr__(self) -> str:
        return f"Variant({self.args!r})"


PLAIN = Variant()


def make_if_given(call: Callable[[], Call], **given) -> Variant:
    """make() for a public function's keywords, where a plain call (each keyword at its default:
    one cheap test, no Call built) is PLAIN; `call` builds the Call otherwise."""
    if all(value is declaration.default or (type(value) is type(declaration.default) and value == declaration.default)
           for declaration in REGISTRY for value in (given.get(declaration.keyword, declaration.default),)):
        return PLAIN
    return make(call(), **given)


def make(call: Call, **given) -> Variant:
    """Check a call's variant keywords (each declaration's `keyword`; named in every error) and
    normalize them into the op arguments of those that are on."""
    args = {}
    for declaration in REGISTRY:
        if declaration.keyword in given:
            found = declaration.check(given[declaration.keyword], call)
            if found:
                args.update(found)
    return Variant(args)


def clip_window(window_size, keys: int) -> tuple[int, int]:
    """FlashAttention's rule for its seqlen_k (flash_attn_func: the keys' length; varlen:
    max_seqlen_k; kvcache: the cache's capacity): a window side of at least that many keys is
    unbounded (-1). It changes rows only where a sequence has more queries than keys plus one."""
    return tuple(-1 if side >= keys else side for side in window_size)


def check_slopes(slopes, batch: int, heads: int, device) -> None:
    import torch  # here: the CLI imports this module and must not pay for torch

    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes has dtype {slopes.dtype}; it must be torch.float32 (FlashAttention's rule)")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; it must be ({heads},) or ({batch}, {heads})")
    if slopes.stride(-1) != 1:
        raise ValueError("alibi_slopes' last dimension must be contiguous (stride 1)")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, the inputs on {device}: they must be on one device")


def params(spec, tiles: tuple[int, int, bool] | None = None) -> list[Param]:
    """The kernel parameters of the spec's variants and rules, after its others (an empty list for
    a plain spec). The softmax's own scale_log2 changes with softcap: see scale_log2(). `tiles`:
    (rows, columns, key-major) of the block mask lists a mask_mod kernel walks (its tile shape)."""
    out = [param for declaration in on(spec) for param in declaration.params(spec)]
    if spec.score_mod:
        out.append(scalar("score_unit", "float", "softcap if softcap else scale"))  # the score piece's value -> natural logit
    if spec.mask_mod and tiles is not None:
        lists = f"block_masks.get({tiles[0]}, {tiles[1]}, {tiles[2]})"
        out += [Param("bm_count", "const int* __restrict__", "ptr", f"{lists}.count.data_ptr()"),
                Param("bm_index", "const int* __restrict__", "ptr", f"{lists}.index.data_ptr()"),
                Param("bm_state", "const unsigned char* __restrict__", "ptr", f"{lists}.state.data_ptr()"),
                scalar("bm_batch", "int", f"{lists}.batch_stride"), scalar("bm_head", "int", f"{lists}.head_stride")]
    return out


def scale_log2(spec) -> str:
    """The host expression of the softmax's scale_log2, which turns the value the score piece
    leaves (the raw score; with softcap, tanh of the scaled one; with a score_mod, the logit
    itself) into a base-2 logit."""
    return "LOG2E" if spec.score_mod else "softcap * LOG2E" if has(spec, "softcap") else "scale * LOG2E"


HELPERS = {"window_bound": window_bound}
