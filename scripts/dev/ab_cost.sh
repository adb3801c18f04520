#!/usr/bin/env bash
# A/B of the cost model's op overhead on the probe (dev use): bash scripts/dev/ab_cost.sh PRESET 1.5 4 10
preset=$1; shift
for v in "$@"; do
  echo "=== op_overhead ${v} us"
  OP_OVERHEAD_US=$v python3 scripts/dev/gpu_probe.py "$preset" 2>&1 | grep -E "median|trace:|rel err|kinds"
done
