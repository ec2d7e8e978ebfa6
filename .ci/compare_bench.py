"""Compare `flashgen bench --json` reports: two runs of one tree (A1, A2) and one of another (B).

Any of the bench's reports: dense (`tables`: TFLOPS), `--varlen` (TFLOPS of attention_varlen),
`--decode` (GPU microseconds a step) and `--variants` (TFLOPS of the variants, the window and the
rules). Prints, per row, flashgen's number in each run, the noise |A1 - A2| / mean(A), and B's speed
against A's (B / A for TFLOPS, A / B for microseconds: above 1, B is faster); then the summary:
the largest noise, and the range of B against A."""

import json
import sys


def rows(path) -> tuple[dict, dict, bool]:
    """{row key: flashgen's number} of a report, the report, and whether higher is faster."""
    report = json.load(open(path))
    if "tables" in report:  # dense
        return {(mode, r["d"], r["causal"], r["T"]): r["flashgen"] for mode, table in report["tables"].items() for r in table}, \
            report, True
    if "varlen" in report and isinstance(report["varlen"], dict):
        return {("varlen", mode): value for mode, value in report["varlen"].items()}, report, True
    if "decode" in report:
        return {("decode", r["B"], r["T"], r["layout"], r.get("cache", "bf16")): r["flashgen_us"] for r in report["decode"]}, report, False
    if "variants" in report:
        found = {}
        for part in ("variants", "window", "rules"):
            for r in report.get(part, []):
                if r.get("flashgen") is not None:
                    found[(part, r.get("variant", r.get("window", "")), r.get("causal"), r.get("mode"), r.get("d"), r.get("T"))] = r["flashgen"]
        return found, report, True
    raise SystemExit(f"{path}: not a report compare_bench knows (dense, varlen, decode or variants)")


def main(a1_path, b_path, a2_path):
    a1, report, higher_faster = rows(a1_path)
    b, _, _ = rows(b_path)
    a2, _, _ = rows(a2_path)
    unit = "TFLOPS" if higher_faster else "us a step"
    print(f"flashgen {unit}, this tree (A, twice) against the other (B); {report['gpu']}, {report['date']}")
    print()
    print("| row | A1 | A2 | B | noise A | B's speed / A's |")
    print("|---|---|---|---|---|---|")
    noises, ratios = [], []
    for key in a1:
        if key not in b or key not in a2:
            continue
        mean = (a1[key] + a2[key]) / 2
        noise = abs(a1[key] - a2[key]) / mean
        ratio = b[key] / mean if higher_faster else mean / b[key]
        noises.append(noise)
        ratios.append(ratio)
        label = " ".join(str(part) for part in key)
        print(f"| {label} | {a1[key]:.1f} | {a2[key]:.1f} | {b[key]:.1f} | {noise:.3f} | {ratio:.3f} |")
    print()
    print(f"largest noise between the two runs of A: {max(noises):.3f}; median {sorted(noises)[len(noises) // 2]:.3f}")
    print(f"B's speed / A's: {min(ratios):.3f} to {max(ratios):.3f}, median {sorted(ratios)[len(ratios) // 2]:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
