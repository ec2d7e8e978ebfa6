"""Bench reports as pictures: TFLOPS against sequence length, one row of panels per mode (fwd, bwd,
fwd+bwd) and one panel per head dim and mask, flashgen drawn next to each SDPA backend. Needs
matplotlib (`pip install flashgen[plot]`); it reads the JSON `flashgen bench --json` writes."""

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


def plot(report: dict, path) -> Path:
    """Draw the report's TFLOPS tables into `path` (PNG, SVG or PDF by its suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or flashgen[plot])") from error
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


def plot_file(report_path, path) -> Path:
    return plot(json.loads(Path(report_path).read_text()), path)
