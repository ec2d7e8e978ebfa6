"""Compare `flashgen bench --json` reports: two runs of one tree (A1, A2) and one of another (B).

Prints, per row, flashgen's TFLOPS in each run, the noise |A1 - A2| / mean(A), and B against
mean(A); then the summary: the largest noise, and the range of B / A."""

import json
import sys


def rows(path):
    report = json.load(open(path))
    return {(mode, r["d"], r["causal"], r["T"]): r["flashgen"] for mode, table in report["tables"].items() for r in table}, report


def main(a1_path, b_path, a2_path):
    a1, report = rows(a1_path)
    b, _ = rows(b_path)
    a2, _ = rows(a2_path)
    print(f"flashgen TFLOPS, this tree (A, twice) against the other (B); {report['gpu']}, {report['date']}")
    print()
    print("| mode | d | causal | T | A1 | A2 | B | noise A | B / A |")
    print("|---|---|---|---|---|---|---|---|---|")
    noises, ratios = [], []
    for key in a1:
        mean = (a1[key] + a2[key]) / 2
        noise, ratio = abs(a1[key] - a2[key]) / mean, b[key] / mean
        noises.append(noise)
        ratios.append(ratio)
        mode, d, causal, t = key
        print(f"| {mode} | {d} | {'yes' if causal else 'no'} | {t} | {a1[key]:.0f} | {a2[key]:.0f} | {b[key]:.0f} | {noise:.3f} | {ratio:.3f} |")
    print()
    print(f"largest noise between the two runs of A: {max(noises):.3f}; median {sorted(noises)[len(noises) // 2]:.3f}")
    print(f"B / A: {min(ratios):.3f} to {max(ratios):.3f}, median {sorted(ratios)[len(ratios) // 2]:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
