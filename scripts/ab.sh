#!/usr/bin/env bash
# A/B of compile-time defines on the probe (dev use): bash scripts/ab.sh PRESET "A=1" "A=2" ...
preset=$1; shift
for d in "$@"; do
  echo "=== MEGAEGG_DEFINES=$d"
  MEGAEGG_DEFINES="$d" python3 scripts/gpu_probe.py "$preset" 2>&1 | grep -E "median|trace:|rel err"
done
