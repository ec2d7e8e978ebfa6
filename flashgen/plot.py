"""Bench reports as pictures: TFLOPS against sequence length, one row of panels per mode (fwd, bwd,
fwd+bwd) and one panel per head dim and mask, flashgen drawn next to each SDPA backend; a
`--variants` report as bars (TFLOPS per variant, full and causal, flashgen next to FlexAttention;
the sliding window's milliseconds next to its expected time and full causal). Needs matplotlib
(`pip install flashgen[plot]`); it reads the JSON `flashgen bench --json` writes."""

from __future__ import annotations

import json
from pathlib import Path

PEERS = {  # report column -> (label, style)
    "flashgen": ("flashgen", {"color": "tab:red", "linewidth": 2.4, "marker": "o"}),
    "cudnn": ("SDPA cuDNN", {"color": "tab:blue", "marker": "s"}),
    "flash": ("SDPA FLASH", {"color": "tab:green", "marker": "^"}),
    "efficient": ("SDPA EFFICIENT", {"color": "tab:gray", "marker": "v", "linestyle": "--"}),
}


def _panels(rows):
    """(d, causal) -> rows sorted by length, in the order the report lists them."""
    panels = {}
    for row in rows:
        panels.setdefault((row["d"], row["causal"]), []).append(row)
    return {key: sorted(value, key=lambda r: r["T"]) for key, value in panels.items()}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or flashgen[plot])") from error
    return plt


def plot(report: dict, path) -> Path:
    """Draw the report's TFLOPS tables into `path` (PNG, SVG or PDF by its suffix)."""
    if "tables" not in report and "variants" in report:
        return plot_variants(report, path)
    plt = _pyplot()
    tables = {mode: _panels(rows) for mode, rows in report["tables"].items() if rows}
    if not tables:
        raise ValueError("the report has no tables to draw")
    columns = sorted({key for panels in tables.values() for key in panels})
    fig, axes = plt.subplots(len(tables), len(columns), figsize=(3.6 * len(columns), 3.2 * len(tables)),
                             squeeze=False, sharex=True)
    for i, (mode, panels) in enumerate(tables.items()):
        for j, key in enumerate(columns):
            ax = axes[i][j]
            rows = panels.get(key, [])
            for column, (label, style) in PEERS.items():
                points = [(r["T"], r[column]) for r in rows if r.get(column)]
                if points:
                    ax.plot(*zip(*points), label=label, **style)
            head_dim, causal = key
            ax.set_title(f"{mode}, d={head_dim}, {'causal' if causal else 'full'}", fontsize=10)
            ax.set_xscale("log", base=2)
            lengths = [r["T"] for r in rows]
            ax.set_xticks(lengths, [f"{t // 1024}k" if t >= 1024 else str(t) for t in lengths])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("TFLOPS")
            if i == len(tables) - 1:
                ax.set_xlabel("sequence length")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{report.get('gpu', 'GPU')}, bf16, batch x length = 16k tokens, {report.get('date', '')}", y=0.995, fontsize=11)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, groups, series, styles):
    """Grouped bars: one group per label of `groups`, one bar per series (name -> values, None
    drawn as nothing)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        points = [(x, y) for x, y in zip(xs, values) if y is not None]
        if points:
            ax.bar(*zip(*points), width=width, label=name, **styles.get(name, {}))
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def plot_variants(report: dict, path) -> Path:
    """A `flashgen bench --variants` report: per mode, TFLOPS of each variant (full, causal) for
    flashgen and FlexAttention, and the sliding window's milliseconds."""
    plt = _pyplot()
    rows, window = report.get("variants", []), report.get("window", [])
    modes = list(dict.fromkeys([r["mode"] for r in rows] + [r["mode"] for r in window]))
    if not modes:
        raise ValueError("the report has no variant rows to draw")
    styles = {"flashgen": {"color": PEERS["flashgen"][1]["color"]}, "FlexAttention": {"color": "tab:purple"},
              "expected": {"color": "tab:red", "alpha": 0.35}}  # the window's tile fraction x causal on its kernel
    fig, axes = plt.subplots(len(modes), 3, figsize=(13, 3.4 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            cases = [r for r in rows if r["mode"] == mode and r["causal"] == causal]
            _bars(ax, [r["variant"] for r in cases], {"flashgen": [r["flashgen"] for r in cases],
                                                     "FlexAttention": [r["flex"] for r in cases]}, styles)
            ax.set_title(f"{mode}, {'causal' if causal else 'full'}" + (f", d={cases[0]['d']}, T={cases[0]['T']}" if cases else ""),
                         fontsize=10)
            ax.set_ylabel("TFLOPS")
        ax = axes[i][2]
        w = [r for r in window if r["mode"] == mode]
        if w:
            r = w[0]
            _bars(ax, [f"window {r['window']}", "causal,\nwindow kernel", "causal"], {
                "flashgen": [r["flashgen_ms"], r["causal_same_kernel_ms"], r["causal_ms"]],
                "expected": [r["expected_ms"], None, None], "FlexAttention": [r["flex_ms"], None, r["flex_causal_ms"]]}, styles)
            ax.set_title(f"{mode}, window {r['window']}, causal, T={r['T']} (ms)", fontsize=10)
            ax.set_ylabel("ms")
        else:
            ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.suptitle(f"{report.get('gpu', 'GPU')}, bf16, attention variants, {report.get('date', '')}", y=0.995, fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_file(report_path, path) -> Path:
    return plot(json.loads(Path(report_path).read_text()), path)
