"""The `flashgen` command: build | list | show | bench | plot | tune | cache (info | clear) | doctor.

Thin by design: it parses options, calls the library, prints. Nothing lives only here. Only
`bench`, `tune` and `doctor` import torch; the rest start fast. Errors go to stderr, one `error:`
line each, with exit status 1 (bad options: click's usage error, status 2).
"""

from __future__ import annotations

import json
import os
import sys
from itertools import product
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from .families import BY_KIND, KINDS
from .settings import SettingError
from .spec import ARCHS, ROTARY_STYLES, SpecError
from .variants import FIELDS as VARIANTS

console = Console()
errors = Console(stderr=True)


def _ints(ctx, param, value):
    """'64,128' -> [64, 128]; None stays None."""
    if value is None:
        return None
    parts = str(value).split(",")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected integers separated by commas, like 64,128") from None
    if any(n < 1 for n in numbers):
        raise click.BadParameter(f"{value!r}: every value must be a positive integer")
    return numbers


def _words(choices, both=None):
    """A comma list of `choices`; "both" stands for the two in `both` (by default the choices, when
    there are two)."""
    both = both or (choices if len(choices) == 2 else None)

    def parse(ctx, param, value):
        if value is None:
            return None
        words = [w.strip() for w in str(value).split(",")]
        expanded = []
        for word in words:
            if word == "both" and both:
                expanded += list(both)
            elif word in choices:
                expanded.append(word)
            else:
                allowed = ", ".join([*choices, "both"] if both else choices)
                raise click.BadParameter(f"{word!r}: must be one of {allowed}")
        return list(dict.fromkeys(expanded))

    return parse


def spec_options(multiple: bool):
    """The options that describe a KernelSpec; with multiple=True (build) each takes comma lists,
    and --variant may be given once per combination of variants the workload calls."""
    many = " (comma-separated list)" if multiple else ""

    def decorate(fn):
        options = [
            click.option("--d", "head_dims", required=not multiple, callback=_ints,
                         help=f"head dim{many}" + (" (not with --from / --spec)" if multiple else "")),
            click.option("--block", "blocks_m", callback=_ints, help=f"query rows per block (block_m){many}; default: tuned"),
            click.option("--block-n", "blocks_n", callback=_ints, help=f"key rows per stage{many}; default: tuned"),
            click.option("--warps", "warps", callback=_ints, help=f"warps per block{many}; default: tuned"),
            click.option("--stages", "stages", callback=_ints, help=f"key/value tiles in flight{many}; default: tuned"),
            click.option("--dtype", "dtypes", default="bf16", show_default=True,
                         callback=_words(("fp16", "bf16", "e4m3"), both=("fp16", "bf16")),
                         help="fp16, bf16, both, or e4m3 (FP8 inputs of attention: its forward, for each output type); "
                              "a comma list"),
            click.option("--causal", "causal", is_flag=False, flag_value="yes", default="no", show_default=True,
                         callback=_words(("yes", "no")), help="causal mask: yes (bare --causal), no or both"),
            click.option("--no-causal", "no_causal", is_flag=True, help="same as --causal no"),
            click.option("--arch", "archs", default="sm_90a", show_default=True,
                         callback=_words(ARCHS), help="compile target(s)"),
        ]
        if multiple:
            options.append(click.option(
                "--variant", "variant", multiple=True, callback=_variants,
                help=f"a combination of attention variants the calls use, comma-separated ({', '.join(VARIANTS)}), or "
                     f"none; repeat it for each combination (--variant none --variant window,softcap); default: none"))
        else:  # (show's --kind picks a decode kind; its --rotary turns q and the appended keys)
            options += [
                click.option("--variant", "variant", default=None, callback=_words(VARIANTS),
                             help=f"attention variants the kernel has, comma-separated: {', '.join(VARIANTS)}"),
                click.option("--rotary", default=None, type=click.Choice(ROTARY_STYLES),
                             help="rotary embedding of q and the appended keys (decode kinds: "
                                  "flash_attn_with_kvcache's tables)"),
            ]
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _variants(ctx, param, values):
    """--variant, once per combination: each a comma list of variant fields, or none (plain)."""
    combos = []
    for value in values or ("none",):
        fields = () if value.strip() == "none" else tuple(_words(VARIANTS)(ctx, param, value))
        combos.append(tuple(field for field in VARIANTS if field in fields))
    return list(dict.fromkeys(combos))


def specs_from_options(head_dims, blocks_m, blocks_n, warps, stages, dtypes, causal, no_causal, archs, variant=None,
                       rotary=None, kind=None):
    """Every combination of the options, each field the tuning table's choice unless given; kind
    None is the forward kernel the tables pick for the target (and the variants)."""
    from . import tuning

    if no_causal and causal != ["no"]:
        raise click.UsageError("--no-causal contradicts --causal " + ",".join(causal))
    causals = [False] if no_causal else [c == "yes" for c in causal]
    specs = []
    for head_dim, dtype, is_causal, arch in product(head_dims, dtypes, causals, archs):
        tuned = tuning.tuned_spec(kind, head_dim, dtype, is_causal, arch, tuple(variant or ()))
        for block_m, block_n, num_warps, num_stages in product(blocks_m or [None], blocks_n or [None], warps or [None], stages or [None]):
            changes = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "rotary": rotary}
            changes = {field: value for field, value in changes.items() if value is not None}
            if "num_warps" not in changes and {"block_m", "block_n"} & set(changes) and hasattr(tuned.family, "owner"):
                changes["num_warps"] = _warps_for(tuned, changes)
            spec = tuned.replace(**changes)
            if spec not in specs:
                specs.append(spec)
    return specs


def _warps_for(tuned, changes) -> int:
    """The tuned warp count if it still gives each warp 16 or 32 rows of the new tile, else a warp
    count (1, 2, 4 or 8) that gives it 32, or 16; with none, the tuned one (and the spec's check
    names the tile that no warp count fits)."""
    owner = tuned.family.owner  # the tile dimension a warp owns rows of
    owned = changes.get(owner, getattr(tuned, owner))
    if owned == tuned.num_warps * 16 or owned == tuned.num_warps * 32:
        return tuned.num_warps
    fits = [warps for rows in (32, 16) for warps in (1, 2, 4, 8) if warps * rows == owned]
    return fits[0] if fits else tuned.num_warps


def _error(error) -> None:
    errors.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)  # (text in [] stays)


def _fail(error) -> None:
    _error(error)
    sys.exit(1)


def _progress() -> Progress:
    """A progress bar on a terminal; none in a pipe or a file, where it would only leave a blank
    line ahead of what follows (an error must be stderr's first line)."""
    return Progress(console=errors, transient=True, disable=not errors.is_terminal)


def _folder(ctx, param, value):
    if value is not None and not value.strip():
        raise click.BadParameter("must name a folder (empty would mean the current directory: say `.`)")
    return value


def _inside(path, folder) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


class _Main(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SettingError as error:  # a FLASHGEN_* variable set wrong, met by any command: one line
            _fail(error)


@click.group(cls=_Main)
@click.version_option(package_name="flashgen")
def main():
    """flashgen: exact FlashAttention kernels generated for each head size, dtype, tile and mask."""


def _entries(ctx, param, value):
    from .workload import ENTRIES

    words = [word.strip() for word in str(value).split(",")]
    return list(ENTRIES) if "all" in words else _words(ENTRIES)(ctx, param, value)


@main.command()
@spec_options(multiple=True)
@click.option("--entry", "entries", default="attention", show_default=True, callback=_entries,
              help="the functions the deployment calls, comma-separated: attention (flashgen.attention), varlen "
                   "(attention_varlen), kvcache (attention_with_kvcache), merge (merge_attention_states), or all")
@click.option("--kvcache", "layouts", default="contiguous,paged", show_default=True,
              callback=_words(("contiguous", "paged")),
              help="KV cache layouts of kvcache calls (one kernel serves every page size and split count); paged "
                   "also makes varlen's kernels over a block table")
@click.option("--dv", "head_dim_v", type=int, default=0,
              help="V's head dim where it differs from q's (DeepSeek's --d 192 --dv 128); attention and varlen calls")
@click.option("--rotary", default="none", show_default=True, callback=_words(("none", *ROTARY_STYLES)),
              help="rotary styles of kvcache calls, comma-separated: none, interleaved (GPT-J), halves (GPT-NeoX)")
@click.option("--kv-dtype", "kv_dtypes", default="same", show_default=True, callback=_words(("same", "e4m3")),
              help="KV cache element types of kvcache and paged varlen calls, comma-separated: same (the calls' "
                   "dtype), e4m3 (an FP8 cache with k_descale and v_descale)")
@click.option("--from", "recorded", type=click.Path(dir_okay=False),
              help="build exactly the kernels a run recorded with FLASHGEN_RECORD=FILE (not with --d)")
@click.option("--spec", "spec_texts", multiple=True,
              help="build this spec, its canonical JSON (as a NoJitError prints it); repeatable (not with --d)")
@click.option("--dry-run", is_flag=True, help="list the kernels the build would make, compile nothing")
@click.option("--out", default="generated", show_default=True, type=click.Path(file_okay=False), callback=_folder,
              help="folder for the .cu, .cubin, .json and .py of each kernel")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="parallel compile processes (default: one per core)")
@click.option("--with-backward/--no-backward", default=True, show_default=True,
              help="also build the backward kernels (fast and deterministic) of attention and varlen")
def build(out, jobs, with_backward, entries, layouts, head_dim_v, rotary, kv_dtypes, recorded, spec_texts, dry_run, **options):
    """Compile kernels ahead of time into a folder a deployment loads with flashgen.load(FOLDER).

    By default it makes every kernel flashgen.attention can pick for the head dims, dtypes and masks
    given (short and long queries), forward and backward; --entry, --variant, --kvcache and --rotary
    describe the rest of a workload. A user's score or mask rule is built from a recorded run
    (--from). Under FLASHGEN_NO_JIT=1 a kernel the folder lacks raises NoJitError with the command
    that builds it.
    """
    from . import aot

    try:
        specs = _build_specs(entries, layouts, head_dim_v, rotary, recorded, spec_texts, with_backward, options, kv_dtypes)
        backward = with_backward and not (recorded or spec_texts)
        plan = aot.with_backward(specs) if backward else specs
    except SpecError as error:
        _fail(error)
    if dry_run:
        click.echo(f"{len(plan)} kernel(s) for {out}/")
        for spec in sorted(plan, key=lambda spec: spec.name):
            click.echo(f"  {spec.name}")
        return
    try:
        with _progress() as progress:
            task = progress.add_task(f"compiling {len(plan)} kernel(s)", total=len(plan))
            metas = aot.build(specs, Path(out), jobs=jobs, backward=backward,
                              progress=lambda meta: progress.advance(task))
    except OSError as error:  # (the cache's own are CacheErrors, which name it)
        if error.filename and _inside(error.filename, out):
            error = f"cannot write the build's output folder --out {out}: {error.strerror} ({error.filename})"
        _fail(error)
    except Exception as error:  # CompileError, CacheError: say what and where, no traceback
        _fail(error)
    _print_kernels(metas, f"built into {out}/")


def _build_specs(entries, layouts, head_dim_v, rotary, recorded, spec_texts, with_backward, options, kv_dtypes=("same",)) -> list:
    """What `build` makes: the recorded or named specs, else the workload its options describe,
    else (tile options given) the attention forward kernels of those tiles."""
    from . import workload
    from .spec import KernelSpec

    if recorded or spec_texts:
        if options["head_dims"]:
            raise click.UsageError("--from and --spec build exactly the kernels they name: leave out --d")
        specs = workload.read_recorded(recorded) if recorded else []
        for text in spec_texts:
            try:
                specs.append(KernelSpec.from_json(text))
            except (ValueError, TypeError) as error:  # (SpecError is a ValueError)
                raise SpecError(f"--spec {text[:80]!r}: not a kernel spec's JSON ({error})") from None
        return list(dict.fromkeys(specs))
    if not options["head_dims"]:
        raise click.UsageError("Missing option '--d' (or --from FILE / --spec JSON)")
    variants = options.pop("variant")
    if any(options[tiles] for tiles in ("blocks_m", "blocks_n", "warps", "stages")):
        if head_dim_v:
            raise click.UsageError("--dv goes with a workload's description, not with --block, --block-n, --warps, --stages")
        if entries != ["attention"]:
            raise click.UsageError("--block, --block-n, --warps and --stages pick attention's forward tiles: "
                                   "not with --entry " + ",".join(entries))
        return [spec for variant in variants for spec in specs_from_options(**options, variant=variant)]
    if options["no_causal"] and options["causal"] != ["no"]:
        raise click.UsageError("--no-causal contradicts --causal " + ",".join(options["causal"]))
    if rotary != ["none"] and "kvcache" not in entries:
        raise click.UsageError("--rotary turns attention_with_kvcache's queries and keys: add --entry kvcache")
    if list(kv_dtypes) != ["same"] and not ({"kvcache", "varlen"} & set(entries) and "paged" in layouts or "kvcache" in entries):
        raise click.UsageError("--kv-dtype names the caches of attention_with_kvcache and paged attention_varlen: add "
                               "--entry kvcache (or varlen with --kvcache paged)")
    if head_dim_v and "varlen" in entries and "paged" in layouts:
        layouts = [layout for layout in layouts if layout != "paged"]  # (no paged cache with V of its own head dim)
    if len(layouts) < len(workload.LAYOUTS) and not {"kvcache", "varlen"} & set(entries) and not head_dim_v:
        raise click.UsageError("--kvcache names the caches of attention_with_kvcache and attention_varlen: add "
                               "--entry kvcache or varlen")
    return workload.Workload(
        head_dims=tuple(options["head_dims"]), dtypes=tuple(options["dtypes"]),
        causal=(False,) if options["no_causal"] else tuple(c == "yes" for c in options["causal"]),
        archs=tuple(options["archs"]), entries=tuple(entries), variants=tuple(variants), layouts=tuple(layouts),
        rotary=tuple("" if style == "none" else style for style in rotary), backward=with_backward, head_dim_v=head_dim_v,
        kv_dtypes=tuple("" if kv == "same" else kv for kv in kv_dtypes),
    ).specs()


@main.command(name="list")
@click.option("--out", default="generated", show_default=True, type=click.Path(file_okay=False), callback=_folder,
              help="the build folder to list")
def list_kernels(out):
    """Show the kernels built into a folder, and any damaged one (status 1)."""
    from . import aot

    metas, damaged = aot.scan(Path(out))
    if metas:
        _print_kernels(metas, f"{out}/")
    elif not damaged:
        console.print(f"no kernels in {out}/ (run `flashgen build --d 64`)", highlight=False)
    for problem in damaged:
        _error(problem)
    if damaged:
        sys.exit(1)


def _print_kernels(metas, title):
    """One line per kernel, names whole (they are what `import <folder>.<name>` takes)."""
    rows = [("kernel", "regs", "spills", "smem", "nvrtc")]
    for meta in sorted(metas, key=lambda m: m["name"]):
        res = meta["resources"]
        rows.append((
            meta["name"], str(res["registers"]), str(res["spill_stores"] + res["spill_loads"]),
            f"{(meta['smem_dynamic'] + res['static_smem']) // 1024} KiB", meta["nvrtc"],
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    click.echo(f"{title} ({len(metas)} kernel{'s' if len(metas) != 1 else ''})")
    for row in rows:
        click.echo("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


SHOWN_KINDS = tuple(kind for kind in KINDS if not BY_KIND[kind].needs_rule)  # (a rule's source comes from Python)
RULE_KINDS = tuple(kind for kind in KINDS if kind not in SHOWN_KINDS)


@main.command()
@spec_options(multiple=False)
@click.option("--kind", default=None, type=click.Choice(SHOWN_KINDS), metavar="KIND",
              help=f"the kernel kind: {', '.join(SHOWN_KINDS)} (default: the forward the tables pick for --arch)"
                   + (f"; {', '.join(RULE_KINDS)} kernels are made from a user rule, in Python" if RULE_KINDS else ""))
@click.option("--resources", is_flag=True,
              help="also compile it and print ptxas' report (an explicit build: it compiles under FLASHGEN_NO_JIT too)")
def show(resources, **options):
    """Print the CUDA source flashgen renders for one spec."""
    from .render import render

    try:
        specs = specs_from_options(**options)
    except SpecError as error:
        _fail(error)
    for spec in specs:
        source = render(spec)
        click.echo(source)
        if resources:
            from .compile import compile_source

            try:
                report = compile_source(spec, source, ahead_of_time=True).resources  # asked for, like `build`
            except Exception as error:  # CompileError, no NVRTC
                _fail(error)
            click.echo(f"// {spec.name}: {json.dumps(report.to_dict())}, {spec.smem_bytes} bytes dynamic smem")


@main.command()
@click.option("--d", "head_dims", default="64,128", show_default=True, callback=_ints,
              help="head dims to time (comma-separated list)")
@click.option("--seqlens", default="512,1024,2048,4096,8192,16384", show_default=True, callback=_ints,
              help="sequence lengths to time (comma-separated list; batch x length = 16k tokens)")
@click.option("--modes", default="fwd,bwd,fwd+bwd", show_default=True, callback=_words(("fwd", "bwd", "fwd+bwd")),
              help="what to time: fwd, bwd, fwd+bwd (comma-separated list)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the numbers here")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), help="also write the tables here, as Markdown")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="also draw the tables here (.png, .svg, .pdf)")
@click.option("--varlen", is_flag=True, help="instead: attention_varlen on 16 mixed-length sequences against a uniform batch")
@click.option("--decode", is_flag=True, help="instead: decode steps over a KV cache (attention_with_kvcache), GPU time "
                                             "through CUDA-graph replay next to SDPA and the memory floor, and the host cost")
@click.option("--variants", is_flag=True, help="instead: plain vs softcap vs ALiBi (d=128, T=8k) and a sliding window of "
                                               "4096 at T=16k against its tile fraction of causal, next to FlexAttention, "
                                               "and the first-use (compile) costs")
@click.option("--no-flex", is_flag=True, help="with --variants: leave FlexAttention out")
@click.option("--dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="fp8: the FP8 (e4m3) forward beside flashgen's bf16 one and SDPA's cuDNN bf16, and the GPU's "
                   "FP8 matrix-product rate (--d defaults to 64,128,256 then)")
def bench(head_dims, seqlens, modes, json_path, markdown_path, plot_path, varlen, decode, variants, no_flex, dtype):
    """flashgen next to SDPA's FLASH, CUDNN and EFFICIENT backends, in TFLOPS."""
    from . import bench as benchmark

    if varlen + decode + variants + (dtype == "fp8") > 1:
        _fail(click.UsageError("--varlen, --decode, --variants and --dtype fp8 are separate benchmarks: ask for one"))
    if dtype == "fp8":
        if plot_path or markdown_path:
            _fail(click.UsageError("--dtype fp8 prints its table (and --json): no --plot or --markdown"))
        given = click.get_current_context().get_parameter_source("head_dims") != click.core.ParameterSource.DEFAULT
        try:
            benchmark.run_fp8(head_dims=head_dims if given else benchmark.FP8_HEAD_DIMS, seqlens=seqlens, json_path=json_path,
                              console=console)
        except RuntimeError as error:
            _fail(error)
        return
    if no_flex and not variants:
        _fail(click.UsageError("--no-flex goes with --variants"))
    if variants:
        if plot_path:
            _need_matplotlib()
        try:
            report = benchmark.run_variants(json_path=json_path, console=console, flex=not no_flex)
        except RuntimeError as error:
            _fail(error)
        if markdown_path:
            Path(markdown_path).write_text(benchmark.variants_markdown(report))
        if plot_path:
            from .plot import plot as draw

            click.echo(f"wrote {draw(report, plot_path)}")
        return
    if varlen:
        try:
            benchmark.run_varlen(json_path=json_path, console=console)
        except RuntimeError as error:
            _fail(error)
        return
    if decode:
        if plot_path:
            _fail(click.UsageError("--plot draws the TFLOPS tables; --decode has none"))
        try:
            report = benchmark.run_decode(json_path=json_path, console=console)
        except RuntimeError as error:
            _fail(error)
        if markdown_path:
            Path(markdown_path).write_text(benchmark.decode_markdown(report))
        return
    if plot_path:
        _need_matplotlib()  # before minutes of timing, not after
    try:
        report = benchmark.run(head_dims=head_dims, seqlens=seqlens, modes=modes, json_path=json_path, console=console)
    except RuntimeError as error:
        _fail(error)
    if markdown_path:
        Path(markdown_path).write_text(benchmark.markdown(report))
    if plot_path:
        from .plot import plot as draw

        click.echo(f"wrote {draw(report, plot_path)}")


@main.command()
@click.argument("report", type=click.Path(exists=True, dir_okay=False))
@click.argument("picture", type=click.Path(dir_okay=False))
def plot(report, picture):
    """Draw a saved `flashgen bench --json` REPORT as charts into PICTURE (.png, .svg, .pdf)."""
    _need_matplotlib()
    from .plot import plot_file

    try:
        click.echo(f"wrote {plot_file(report, picture)}")
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        _fail(ValueError(f"{report}: not a flashgen bench report ({type(error).__name__}: {error})"))


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail(RuntimeError("drawing needs matplotlib: pip install matplotlib (or flashgen[plot])"))


@main.command()
@click.option("--d", "head_dims", default="64,128", show_default=True, callback=_ints,
              help="head dims to tune (comma-separated list)")
@click.option("--dtype", "dtypes", default="bf16", show_default=True, callback=_words(("bf16", "fp16", "e4m3"), both=("bf16", "fp16")),
              help="bf16, fp16, both, or e4m3 (the FP8 forward's tiles); a comma list")
@click.option("--mask", "masks", default="full,causal", show_default=True, callback=_words(("full", "causal")),
              help="full, causal or both (comma-separated list)")
@click.option("--kinds", default=None, callback=_words(KINDS),
              help="only these kernel kinds (default: every kind the tables run on this GPU)")
@click.option("--seqlens", default="2048,8192,16384", show_default=True, callback=_ints,
              help="sequence lengths the candidates are timed at (16k tokens, model dim 2048); they rank by the geometric mean")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="the table to write [default: the one the package reads]")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="parallel compiles [default: CPUs]")
@click.option("--dry-run", is_flag=True, help="list the problems and candidates, run nothing")
def tune(head_dims, dtypes, masks, kinds, seqlens, out, jobs, dry_run):
    """Time every candidate tile shape on this GPU (each checked against the reference first) and
    write the fastest into the tuning table."""
    import torch

    from . import tune as tuner
    from . import tuning

    if not torch.cuda.is_available() and not dry_run:
        _fail(RuntimeError("flashgen tune needs a CUDA GPU (--dry-run lists what it would run)"))
    from .plans import device_arch

    arch = device_arch(0) if torch.cuda.is_available() else "sm_90a"
    causals = [m == "causal" for m in masks]
    try:
        found = tuner.problems(head_dims, dtypes, causals, arch, kinds)
    except SpecError as error:
        _fail(error)
    if not found:  # (a table written from nothing would only lose entries)
        tunable = sorted({problem.kind for problem in tuner.problems(head_dims, dtypes, causals, arch, None)})
        _fail(SpecError(f"--kinds {','.join(kinds)}: none of them is tuned on {arch}; its tables run {', '.join(tunable)}"))
    if dry_run:
        if not torch.cuda.is_available():
            click.echo(f"(no GPU here: the problems of {arch})")
        for problem in found:
            specs = tuner.candidates(problem)
            knobs = ", ".join(f"{field} {values}" for field, values in specs[0].family.tune_knobs.items()) if specs else ""
            click.echo(f"{problem.label()}: {len(specs)} candidates" + (f", then {knobs} on the best {tuner.TOP}" if knobs else ""))
        return
    path = Path(out) if out else tuning.table_path()
    current = tuning.table()  # the table the new entries merge into: checked before minutes of timing
    if out and path.exists():
        try:
            current = tuning.read_table(path)
        except ValueError as why:
            _fail(f"--out {path}: {why} (an existing file there is the table the new entries merge into)")
    with _progress() as progress:
        entries = tuner.tune(found, seqlens, jobs, progress=progress, log=lambda line: console.print(line, highlight=False))
    doc = tuner.merge(current, entries)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tuning.format_table(doc))
    os.replace(tmp, path)  # a crash mid-write leaves the old table whole
    click.echo(f"wrote {len(entries)} tuned entr{'y' if len(entries) == 1 else 'ies'} to {path}")


@main.group()
def cache():
    """Inspect or clear the on-disk kernel cache ($FLASHGEN_CACHE_DIR)."""


def _existing_cache():
    """The cache, or None (said) when it does not exist yet; one error for a path it cannot use."""
    from .cache import CacheError, default_cache

    store = default_cache()
    try:
        if store.exists():
            return store
    except CacheError as error:  # a file, not one's own, writable by others (refused for use too)
        _fail(error)
    click.echo(f"no cache yet: {store.root} does not exist (the first compile creates it; FLASHGEN_CACHE_DIR chooses where)")
    return None


@cache.command()
def info():
    """Where the cache is and what it holds."""
    store = _existing_cache()
    if store is None:
        return
    entries = store.entries()
    total = sum(e["bytes"] for e in entries)
    click.echo(f"cache: {store.root} — {len(entries)} kernel(s), {total / 1024:.0f} KiB")
    for entry in entries:
        click.echo(f"  {entry['flashgen']}/{entry['spec']['arch']}/{entry['name']}  {entry['bytes'] / 1024:.0f} KiB")


@cache.command()
def clear():
    """Delete every cached kernel."""
    store = _existing_cache()
    if store is not None:
        click.echo(f"removed {store.clear()} kernel(s) from {store.root}")


@main.command()
def doctor():
    """Versions, GPU, NVRTC and the FLASHGEN_* variables: what flashgen sees on this machine (status 1
    if a variable is set wrong)."""
    import torch

    from . import __version__
    from .settings import environment

    click.echo(f"flashgen {__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    try:
        from .compile import nvrtc_version

        click.echo(f"NVRTC {nvrtc_version()}")
    except Exception as error:  # a deployment may run prebuilt kernels with no NVRTC at all
        click.echo(f"NVRTC unavailable ({error}); prebuilt kernels still load")
    if torch.cuda.is_available():
        from .plans import device_arch

        for index in range(torch.cuda.device_count()):
            click.echo(f"GPU {index}: {torch.cuda.get_device_name(index)} -> {device_arch(index)}")
    else:
        click.echo("no CUDA GPU visible: build, show and the cache work; attention() needs a GPU")
    wrong = []
    for shown, meaning in environment():
        if isinstance(meaning, Exception):
            wrong.append(meaning)
            meaning = "set wrong (the error below)"
        click.echo(f"{shown}: {meaning}")
    for error in wrong:
        _error(error)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
