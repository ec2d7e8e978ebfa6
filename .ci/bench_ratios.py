"""One line per row of `flashgen bench --json FILE`: flashgen's TFLOPS, the best SDPA backend's and
the ratio to cuDNN, so that a device run's last lines hold the whole table.
Usage: python3 .ci/bench_ratios.py FILE"""

import json
import sys

data = json.load(open(sys.argv[1]))
print(data["gpu"], data["date"])
rows = [row for table in data["tables"].values() for row in table] + data.get("gqa", [])
for r in rows:
    cudnn = r.get("cudnn")
    ratio = f"{r['flashgen'] / cudnn:.2f}" if cudnn and r.get("flashgen") else "-"
    print(f"{r['mode']:7s} d={r['d']:<3d} {'causal' if r['causal'] else 'full  '} T={r['T']:<5d} {r['heads']:>5s} "
          f"flashgen {r['flashgen'] or 0:4.0f} cudnn {cudnn or 0:4.0f} flash {r.get('flash') or 0:4.0f} x{ratio}")
