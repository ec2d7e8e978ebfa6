#!/usr/bin/env bash
# The paged forward's loads of small pages, side by side on one GPU (issue 42's paged prefill
# target): the trees of two commits, each timed by .ci/bench_paged_prefill.py (cp.async gathers and
# TMA boxes at 16- and 32-row pages, and TMA at 64 and 256). Run from the repository root with
# build/gx made here first (`.ci/gx_experiment.sh make`) and passed in the run's carry.
set -uo pipefail
cd "$(dirname "$0")/.."
trees="cdc059d d204134"  # the gathers at one multiply-add a row; TMA from four producer warps
if [ "${1:-}" = make ]; then
  for tree in $trees; do rm -rf build/gx/$tree; mkdir -p build/gx/$tree; git archive $tree flashgen templates | tar -x -C build/gx/$tree; done
  exit 0
fi
for tree in $trees; do
  for d in 128 64; do
    pages=16,32; [ $d = 128 ] && pages=16,32,64,256
    echo "== $tree d$d"; PYTHONPATH=build/gx/$tree timeout 80 python3 .ci/bench_paged_prefill.py --pages $pages --head-dim $d 2>&1 | grep "^| [0-9]" | sort -u
  done
done
