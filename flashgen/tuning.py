"""Which KernelSpec to run for a problem, read from the tuning table (`tuning.json`, shipped in the
package; `flashgen tune` measures and rewrites it on a GPU; FLASHGEN_TUNING_TABLE names another).

An entry lists tile shapes best first for one kernel kind and a set of problems: arch (a glob),
dtype, causal, length bucket ('*' = any), a head-dim bound, and optionally varlen (true: only
attention_varlen's packed kernels; an entry without it serves both) and head_dim_v (only problems
whose V has that head dim of its own, e.g. 128 under a bound of 192: V's smaller tiles leave room
for more keys). A problem takes the entries of the
smallest bound at or above its head dim, the more exact ones first, and runs the first tile shape
that is a valid spec for its target (shared memory differs between sm_80, sm_86 and sm_90). On
sm_90a the forward is the Hopper family (TMA, wgmma, warp specialization); elsewhere, and for short
queries, the mma.sync family.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from itertools import product
from pathlib import Path

from . import variants
from .axes import TARGETS
from .settings import SettingError
from .spec import KernelSpec, SpecError, check_head_dim

TABLE_PATH = Path(__file__).with_name("tuning.json")
TABLE_ENV = "FLASHGEN_TUNING_TABLE"
KEY_FIELDS = ("kind", "arch", "head_dim", "dtype", "causal", "bucket")
# '*' where an entry leaves them out; a variant's key (variants.TUNING_KEYS) for kernels tuned apart with it
OPTIONAL_FIELDS = ("varlen", "variant", *variants.TUNING_KEYS)
TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "persistent", "exp2_fma")  # what an entry's tiles may set
SHORT_QUERY = 64  # at or below this many query rows, 64-row blocks waste less work

# Backward: which kernels run. Up to head_dim 128 one key-major kernel keeps dK and dV in registers
# together; above, dV and dK take separate passes so that each fits.
BACKWARD_KINDS = {
    (128, False): ["bwd_kvq"],
    (128, True): ["bwd_kv", "bwd_q"],
    (256, False): ["bwd_v", "bwd_kq"],
    (256, True): ["bwd_v", "bwd_k", "bwd_q"],
}  # (head-dim bound, deterministic) -> kinds, key-major first
# On sm_90a the Hopper family (TMA, wgmma, warp specialization) runs the key-major part at every
# head dim (above 128 in its split layout, block_n=64: one warpgroup computes dV, the other dK);
# deterministic mode still takes dQ from the query-major pass.
HOPPER_BACKWARD_KINDS = {False: ["bwd_sm90_kvq"], True: ["bwd_sm90_kv", "bwd_q"]}
HOPPER_BACKWARD_HEAD_DIM = 256


def query_bucket(seqlen_q: int) -> bool:
    """The forward's length bucket of a query length: whether it counts as short. Everything that
    keeps a choice per problem keys it by this."""
    return seqlen_q <= SHORT_QUERY


def bucket_name(seqlen_q: int) -> str:
    return "short" if query_bucket(seqlen_q) else "long"


# ---- the table ---------------------------------------------------------------------------------

_table: dict | None = None
_overrides: list[dict] = []


def table_path() -> Path:
    return Path(os.environ.get(TABLE_ENV) or TABLE_PATH)


def table() -> dict:
    """The tuning table as read from disk (once per process). A table that cannot be read or is not
    of the right shape is a SettingError naming FLASHGEN_TUNING_TABLE and the file."""
    global _table
    if _table is None:
        path = table_path()
        try:
            _table = read_table(path)
        except ValueError as why:
            named = f"{TABLE_ENV}={str(path)!r}" if os.environ.get(TABLE_ENV) else f"the shipped tuning table {path} ({TABLE_ENV} unset)"
            raise SettingError(f"{named}: {why}") from None
    return _table


def read_table(path: Path) -> dict:
    """A tuning table file, checked to be what candidates() reads; ValueError says what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror})") from None
    except ValueError as error:  # (JSONDecodeError, UnicodeDecodeError)
        raise ValueError(f"not valid JSON ({error})") from None
    why = table_problem(doc)
    if why:
        raise ValueError(why)
    return doc


_CHOICES = {"dtype": ("bf16", "fp16", "e4m3", "*"), "causal": (True, False, "*"), "bucket": ("short", "long", "*"),
            **dict.fromkeys(OPTIONAL_FIELDS, (True, False, "*"))}  # (True == 1: causal 1 is read as true)


def table_problem(doc) -> str | None:
    """What is wrong with a tuning table's shape (None: nothing): an object whose "entries" are
    objects with every key field, values the matching reads, and "tiles" a list of tile shapes."""
    from .families import KINDS

    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        return 'not a tuning table: it must be a JSON object with an "entries" list'
    for index, entry in enumerate(doc["entries"]):
        if not isinstance(entry, dict):
            return f"entry {index} is not a JSON object"
        missing = [field for field in (*KEY_FIELDS, "tiles") if field not in entry]
        if missing:
            return f"entry {index} lacks {', '.join(missing)} (an entry has {', '.join(KEY_FIELDS)} and tiles)"
        wrong = None
        if entry["kind"] not in KINDS:
            wrong = f"kind {entry['kind']!r}: must be one of {', '.join(KINDS)}"
        elif not isinstance(entry["arch"], str):
            wrong = f"arch {entry['arch']!r}: must be a target or a glob, like \"sm_90a\" or \"*\""
        elif type(entry["head_dim"]) is not int:
            wrong = f"head_dim {entry['head_dim']!r}: must be an integer"
        elif type(entry.get("head_dim_v", 0)) is not int:
            wrong = f"head_dim_v {entry['head_dim_v']!r}: must be an integer (V's own head dim) or left out"
        elif not isinstance(entry["tiles"], list) or not all(isinstance(tiles, dict) for tiles in entry["tiles"]):
            wrong = "tiles: must be a list of objects like {\"block_m\": 128, \"block_n\": 64}"
        for field, allowed in _CHOICES.items():
            if wrong is None and entry.get(field, "*") not in allowed:
                wrong = f"{field} {entry[field]!r}: must be one of {', '.join(map(json.dumps, allowed))}"
        for tiles in entry["tiles"] if wrong is None else ():
            unknown = sorted(set(tiles) - set(TILE_FIELDS))
            if unknown:
                wrong = f"tiles {json.dumps(tiles)}: {', '.join(unknown)} is not a tile field ({', '.join(TILE_FIELDS)})"
            elif not all(type(value) in (int, bool) for value in tiles.values()):
                wrong = f"tiles {json.dumps(tiles)}: every value must be an integer (persistent: true or false)"
            if wrong:
                break
        if wrong:
            return f"entry {index} ({entry['kind']!r}, head_dim {entry['head_dim']!r}): {wrong}"
    return None


def format_table(doc: dict) -> str:
    """The table as written: one entry per line, so a re-tune shows as a readable diff."""
    entries = ",\n".join("  " + json.dumps(entry) for entry in doc["entries"])
    return f'{{\n "about": {json.dumps(doc["about"])},\n "entries": [\n{entries}\n ]\n}}\n'


MATCHED = ("dtype", "causal", "bucket", *OPTIONAL_FIELDS)


def _matches(entry: dict, problem: dict) -> bool:
    for field in MATCHED:
        if entry.get(field, "*") != "*" and entry[field] != problem[field]:
            return False
    return entry["kind"] == problem["kind"] and fnmatch.fnmatchcase(problem["arch"], entry["arch"])


def _exactness(entry: dict) -> int:
    return sum(entry.get(field, "*") != "*" for field in MATCHED) + ("*" not in entry["arch"]) + ("head_dim_v" in entry)


def candidates(kind: str, head_dim: int, dtype: str, causal: bool, arch: str, bucket: str, varlen: bool = False,
               variant: bool = False, head_dim_v: int = 0, exact_dtype: bool = False, **tuned_apart: bool) -> list[dict]:
    """Tile shapes for a problem, best first: the entries of the smallest bound, more exact first
    (overrides from `override` before all), then those of larger bounds as a fallback. `head_dim_v`:
    V's head dim where it has one of its own (0: none; entries naming one serve only it). `variant`:
    the kernel has an attention variant (entries with "variant": true are for those alone);
    `tuned_apart`: by their tuning keys (variants.TUNING_KEYS), the variants on that the table
    tunes apart (a user mask rule; softcap, whose tanh shares the exponentials' unit, which moves
    the forward's exp2_fma). exact_dtype: only entries that name `dtype` (not "*")."""
    unknown = set(tuned_apart) - set(variants.TUNING_KEYS)
    if unknown:
        raise TypeError(f"candidates: {', '.join(sorted(unknown))} is not a tuning key ({', '.join(variants.TUNING_KEYS)})")
    problem = {"kind": kind, "dtype": dtype, "causal": causal, "arch": arch, "bucket": bucket, "varlen": varlen,
               "variant": variant, **dict.fromkeys(variants.TUNING_KEYS, False), **tuned_apart}
    entries = [e for e in _overrides + table()["entries"]
               if _matches(e, problem) and e["head_dim"] >= head_dim and e.get("head_dim_v", head_dim_v) == head_dim_v
               and (not exact_dtype or e.get("dtype") == dtype)]
    entries.sort(key=lambda e: (e["head_dim"], e not in _overrides, -_exactness(e)))
    return [tiles for entry in entries for tiles in entry["tiles"]]


@contextlib.contextmanager
def override(entries: list[dict]):
    """Run the block with these entries ahead of the table (what `flashgen tune` times); plans made
    inside are forgotten on both sides, so calls pick again."""
    from . import plans

    plans.clear()
    _overrides[:0] = entries
    try:
        yield
    finally:
        del _overrides[: len(entries)]
        plans.clear()


def reload() -> None:
    """Read the table again (after `flashgen tune` wrote it); plans made from the old one go."""
    global _table
    from . import plans

    _table = None
    plans.clear()


# ---- the choices -------------------------------------------------------------------------------


def variant_fields(variant: tuple) -> dict:
    """A problem's variant as spec fields: `variant` holds the names of the variants that are on
    (variants.FIELDS) and (field, value) pairs (a user rule's source: ("mask_mod", source))."""
    names = tuple(item for item in variant if not isinstance(item, tuple))
    return {**({"variants": names} if names else {}), **dict(item for item in variant if isinstance(item, tuple))}


def _names(variant: tuple) -> list[str]:
    return [item[0] if isinstance(item, tuple) else item for item in variant]


def builds_for(kind: str, arch: str) -> bool:
    """Whether kernels of `kind` build for target `arch` (its family's needs, flashgen.axes)."""
    from .families import family

    return arch in family(kind).archs


def takes(kind: str, variant: tuple) -> bool:
    """Whether kernels of `kind` build the variant (flashgen.families: the fields they use)."""
    from .families import family

    fields = family(kind).fields
    return all(name in fields if name in variants.RULES else variants.builds(fields, kind, name) for name in _names(variant))


def _first_valid(kind, head_dim, dtype, causal, arch, bucket="long", varlen=False, variant=(), head_dim_v=0) -> KernelSpec:
    """The first of the table's tile shapes that makes a valid spec; `variant` names the variant
    fields to set (the tiles are those of the plain kernel: a variant adds a few registers). With
    a V head dim of its own the tiles are those of the wider head dim, which hold both."""
    from .families import family

    check_head_dim(head_dim)  # a bad head dim is the problem, not the tiles
    if head_dim_v:
        check_head_dim(head_dim_v, "head_dim_v")
    family(kind).check_arch(kind, arch)  # nor the tiles of a kind that never builds for the target
    error = None
    fields = variant_fields(variant) | ({"head_dim_v": head_dim_v} if head_dim_v and head_dim_v != head_dim else {})
    apart = {key: name in _names(variant) for key, name in variants.TUNING_KEYS.items()}
    wider = max(head_dim, head_dim_v)
    own_v = head_dim_v if head_dim_v and head_dim_v != head_dim else 0
    for tiles in candidates(kind, wider, dtype, causal, arch, bucket, varlen, variants.tiled_apart(variant), own_v, **apart):
        if varlen and tiles.get("persistent"):
            tiles = {**tiles, "persistent": False}  # the varlen Hopper forward runs one tile per CTA
        try:
            return KernelSpec(head_dim=head_dim, dtype=dtype, causal=causal, arch=arch, kind=kind, **tiles,
                              **({"varlen": True} if varlen else {}), **fields)
        except SpecError as rejected:
            error = rejected
    dims = f"head_dim={head_dim}" + (f", head_dim_v={head_dim_v}" if "head_dim_v" in fields else "")
    raise SpecError(f"no {kind} tile shape fits {dims} on {arch}: {error or 'the tuning table has no entry'}")


def forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int, varlen: bool = False,
                 variant: tuple[str, ...] = (), head_dim_v: int = 0) -> KernelSpec:
    """The forward kernel for a problem: the Hopper family on sm_90a, unless the query is short
    (varlen: the longest sequence's query) or the family does not build the variant. head_dim_v:
    V's head dim where it differs from q's (0: the same). FP8 inputs (e4m3): the FP8 forward, with
    its default bf16 output."""
    if dtype == "e4m3":
        return fp8_forward_spec(head_dim, "bf16", causal, arch, variant, head_dim_v, varlen)
    if builds_for("fwd_sm90", arch) and not query_bucket(seqlen_q) and takes("fwd_sm90", variant):
        try:
            return _first_valid("fwd_sm90", head_dim, dtype, causal, arch, "long", varlen, variant, head_dim_v)
        except SpecError:
            if not variant:
                raise
            # no Hopper tile shape has registers for this variant (every rule and variant at once,
            # at the largest head dims): the mma.sync family runs it
    return mma_forward_spec(head_dim, dtype, causal, arch, seqlen_q, varlen, variant, head_dim_v)


FP8_TILES = {"block_m": 128, "block_n": 128, "num_stages": 2}  # where the table has no e4m3 entry


def fp8_values_spec(head_dim_v: int, arch: str, varlen: bool = False) -> KernelSpec:
    """The kernel that lays V out as the FP8 forward reads it (fp8_v: no tiles to tune)."""
    return KernelSpec(kind="fp8_v", head_dim=head_dim_v, arch=arch, varlen=varlen)


def fp8_forward_spec(head_dim: int, out_dtype: str, causal: bool, arch: str, variant: tuple[str, ...] = (),
                     head_dim_v: int = 0, varlen: bool = False) -> KernelSpec:
    """The FP8 forward (e4m3 q, k, v; the output in out_dtype; varlen: packed sequences) on the
    Hopper family (sm_90a only): the first valid tiles of the table's e4m3 entries (`flashgen tune
    --dtype e4m3` writes them; entries for any dtype are the 16-bit kernels' and do not count),
    else FP8_TILES (block_n is always 128: one 128-byte row of transposed V's keys)."""
    from .families import family

    family("fwd_sm90").check_arch("fwd_sm90", arch)
    check_head_dim(head_dim)
    own_v = head_dim_v if head_dim_v and head_dim_v != head_dim else 0
    tuned = candidates("fwd_sm90", max(head_dim, own_v), "e4m3", causal, arch, "long", varlen, bool(variant), own_v,
                       exact_dtype=True)
    error = None
    for tiles in [*tuned, FP8_TILES]:
        try:
            return KernelSpec(kind="fwd_sm90", head_dim=head_dim, head_dim_v=head_dim_v, dtype="e4m3", out_dtype=out_dtype,
                              causal=causal, arch=arch, varlen=varlen, **({**tiles, "persistent": False} if varlen else tiles),
                              **variant_fields(variant))
        except SpecError as rejected:
            error = rejected
    raise error


def paged_forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int, variant: tuple[str, ...] = (),
                       head_dim_v: int = 0) -> KernelSpec | None:
    """The Hopper forward over a paged cache (chunked prefill: packed queries whose longest sequence
    has more than SHORT_QUERY rows) on targets that build it, or None where the decode kernels'
    varlen form runs instead (short queries, other targets, a variant without Hopper tiles)."""
    if not builds_for("fwd_sm90", arch) or query_bucket(seqlen_q) or not takes("fwd_sm90", variant):
        return None
    try:
        spec = _first_valid("fwd_sm90", head_dim, dtype, causal, arch, "long", True, variant, head_dim_v)
        return spec.replace(paged=True, block_m=128)  # two consumers: the producer's page gathers take a third's registers
    except SpecError:
        return None


def mma_forward_spec(head_dim: int, dtype: str, causal: bool, arch: str, seqlen_q: int, varlen: bool = False,
                     variant: tuple[str, ...] = (), head_dim_v: int = 0) -> KernelSpec:
    return _first_valid("fwd", head_dim, dtype, causal, arch, bucket_name(seqlen_q), varlen, variant, head_dim_v)


def tuned_spec(kind: str | None, head_dim: int, dtype: str, causal: bool, arch: str, variant: tuple[str, ...] = ()) -> KernelSpec:
    """The table's spec of a kind for long sequences; kind None is the forward the tables pick.
    (A decode kind: its spec for one query row; causal does not change a decode or merge kernel.)
    `variant` names the variant fields to set."""
    if kind in DECODE_KINDS:
        return decode_spec(head_dim, dtype, arch, kind == "decode_paged", rows=1, variant=variant)
    if kind in MERGE_KINDS:
        return merge_spec(kind, head_dim, dtype, arch)
    if kind == "append_paged":
        return append_spec(head_dim, dtype, arch)
    if kind is None:
        return forward_spec(head_dim, dtype, causal, arch, seqlen_q=4096, variant=variant)
    if kind == "bwd_prep":
        return backward_prep(head_dim, dtype, arch, variant=variant)
    if kind == "bwd_dq_sm90":  # no tiles to tune: it reads the varlen backward's dQ sum back
        return KernelSpec(kind=kind, head_dim=head_dim, dtype=dtype, arch=arch, varlen=True)
    return _first_valid(kind, head_dim, dtype, causal, arch, variant=variant)


def backward_kinds(head_dim: int, arch: str, deterministic: bool, variant: tuple[str, ...] = ()) -> list[str]:
    """The kinds of the backward kernels that run after the prep, in order (head_dim: the wider of
    q's and v's)."""
    hopper = HOPPER_BACKWARD_KINDS[deterministic]
    if all(builds_for(k, arch) for k in hopper) and head_dim <= HOPPER_BACKWARD_HEAD_DIM and all(takes(k, variant) for k in hopper):
        return hopper
    return BACKWARD_KINDS[(128 if head_dim <= 128 else 256, deterministic)]


def backward_specs(head_dim: int, dtype: str, causal: bool, arch: str, deterministic: bool, varlen: bool = False,
                   variant: tuple[str, ...] = (), head_dim_v: int = 0) -> list[KernelSpec]:
    """The backward kernels to run after the prep, in order."""
    variant = variants.for_backward(variant)
    kinds = backward_kinds(max(head_dim, head_dim_v), arch, deterministic, variant)
    return [_first_valid(kind, head_dim, dtype, causal, arch, varlen=varlen, variant=variant, head_dim_v=head_dim_v)
            for kind in kinds]


def backward_prep(head_dim: int, dtype: str, arch: str, varlen: bool = False, variant: tuple = ()) -> KernelSpec:
    """The prep reads rows of O and dO: head_dim is theirs (V's head dim). With a variant that
    learns (a sink) it also sums that variant's gradient (variants.for_prep)."""
    return KernelSpec(head_dim=head_dim, dtype=dtype, arch=arch, kind="bwd_prep", **({"varlen": True} if varlen else {}),
                      **variant_fields(variants.for_prep(variant)))


TEST_HEAD_DIMS = (32, 40, 64, 80, 96, 128, 192, 256)


def shipped_specs(arch: str, head_dims=TEST_HEAD_DIMS) -> list[KernelSpec]:
    """Every spec the tables pick on `arch` for these head dims, both dtypes and masks: forward,
    and backward (with its prep) in both modes."""
    specs = []
    for head_dim in head_dims:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                picked = [forward_spec(head_dim, dtype, causal, arch, t) for t in (SHORT_QUERY, SHORT_QUERY + 1)]
                picked.append(backward_prep(head_dim, dtype, arch))
                for deterministic in (False, True):
                    picked += backward_specs(head_dim, dtype, causal, arch, deterministic)
                specs += [spec for spec in dict.fromkeys(picked) if spec not in specs]
    return specs


def shipped_varlen_specs(arch: str, head_dims=TEST_HEAD_DIMS) -> list[KernelSpec]:
    """Every spec the tables pick for attention_varlen on `arch` for these head dims (shipped_specs'
    set, over packed sequences)."""
    specs = []
    for head_dim in head_dims:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                specs += [forward_spec(head_dim, dtype, causal, arch, t, varlen=True) for t in (SHORT_QUERY, SHORT_QUERY + 1)]
                specs.append(backward_prep(head_dim, dtype, arch, varlen=True))
                for deterministic in (False, True):
                    picked = backward_specs(head_dim, dtype, causal, arch, deterministic, varlen=True)
                    specs += picked + [reader for reader in (s.family.dq_reader(s) for s in picked) if reader]
    return list(dict.fromkeys(specs))


# ---- serving: attention_with_kvcache and merge_attention_states ----------------------------------

DECODE_KINDS = ("decode", "decode_paged")
MERGE_KINDS = ("merge", "merge_fp32")
DECODE_BLOCK_M = (16, 64)  # packed query rows of a decode block: one warp's 16, or 16 for each of 4 warps


def decode_block_m(rows: int) -> int:
    """The decode kernel's block_m for `rows` packed query rows of a KV head (query heads per KV
    head x query tokens): 16 covers a decode step of up to 16 heads per KV head; more rows take
    64-row blocks (as many as they need)."""
    return DECODE_BLOCK_M[0] if rows <= DECODE_BLOCK_M[0] else DECODE_BLOCK_M[1]


def decode_spec(head_dim: int, dtype: str, arch: str, paged: bool, rows: int, variant: tuple[str, ...] = (),
                rotary: str = "", varlen: bool = False, *, kv_dtype: str = "") -> KernelSpec:
    """The decode kernel for a problem: the table's first tile shape (block_n, num_warps,
    num_stages) that is a valid spec with the block_m the rows need; `variant` names the variant
    fields to set, `rotary` the rotary embedding's style ("" = none), `varlen` packed sequences
    (flash_attn_varlen_func over a paged cache), kv_dtype an FP8 cache's element type."""
    kind = "decode_paged" if paged else "decode"
    check_head_dim(head_dim)
    error = None
    # An FP8 cache's tiles are the table's entries for its type (its stages are half the bytes); the
    # bucket says the block: "short" one 16-row block (a decode step), "long" 64-row blocks.
    bucket = "short" if decode_block_m(rows) == DECODE_BLOCK_M[0] else "long"
    for tiles in candidates(kind, head_dim, kv_dtype or dtype, False, arch, bucket, variant=variants.tiled_apart(variant)):
        try:
            return KernelSpec(head_dim=head_dim, dtype=dtype, arch=arch, kind=kind, **{**tiles, "block_m": decode_block_m(rows)},
                              **variant_fields(variant), rotary=rotary, varlen=varlen, kv_dtype=kv_dtype)
        except SpecError as rejected:
            error = rejected
    raise SpecError(f"no {kind} tile shape fits head_dim={head_dim} on {arch}: {error or 'the tuning table has no entry'}")


def append_spec(head_dim: int, dtype: str, arch: str) -> KernelSpec:
    """attention_with_kvcache's append into a paged cache on its own (the paged Hopper forward's)."""
    check_head_dim(head_dim)
    return KernelSpec(kind="append_paged", head_dim=head_dim, dtype=dtype, arch=arch)


def merge_spec(kind: str, head_dim: int, dtype: str, arch: str) -> KernelSpec:
    """The merge of two states of `dtype` ("merge") or of fp32 ("merge_fp32", dtype unused)."""
    if kind == "merge_fp32":
        return KernelSpec(head_dim=head_dim, arch=arch, kind=kind)
    return KernelSpec(head_dim=head_dim, dtype=dtype, arch=arch, kind=kind)


def serving_specs(arch: str, head_dims=TEST_HEAD_DIMS, kv_dtypes=("",)) -> list[KernelSpec]:
    """Every decode, merge and append spec the serving functions pick on `arch` for these head dims,
    both dtypes, contiguous and paged caches, both row counts; and the decode specs over the caches
    of kv_dtypes ("e4m3": FP8) where the target and head dim take them."""
    specs = []
    for head_dim in head_dims:
        for dtype in ("bf16", "fp16"):
            for paged, kv_dtype in product((False, True), kv_dtypes):
                if kv_dtype and (not TARGETS[arch].fp8 or head_dim % 16):
                    continue
                specs += [decode_spec(head_dim, dtype, arch, paged, rows, kv_dtype=kv_dtype) for rows in DECODE_BLOCK_M]
            specs += [merge_spec(kind, head_dim, dtype, arch) for kind in MERGE_KINDS]
            if builds_for("fwd_sm90", arch):  # (the append runs ahead of the paged Hopper forward only)
                specs.append(append_spec(head_dim, dtype, arch))
    return list(dict.fromkeys(specs))
