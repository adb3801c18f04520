#!/usr/bin/env bash
# dev: one GPU round: unpack the egglog site, install, GPU body/op tests, then A/B probes.
#   bash scripts/gpu_round.sh PRESET "DEFINES_A" "DEFINES_B" ...   (logs under $OUT)
set -u
mkdir -p /tmp/site && tar xzf .device/site.tgz -C /tmp/site
export PYTHONPATH=/tmp/site MEGAEGG_CACHE=/tmp/mcache OP_OVERHEAD_US=${OP_OVERHEAD_US:-1.5}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -x -n 4 $TESTS > "$OUT/tests.log" 2>&1; echo "tests rc $?: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5
fi
preset=$1; shift
for d in "$@"; do
  MEGAEGG_DEFINES="$d" python3 scripts/gpu_probe.py "$preset" > "$OUT/probe_${preset}_${d//[=,]/_}.log" 2>&1
  cp "$OUT/trace_${preset}.npz" "$OUT/trace_${preset}_${INST_OVERHEAD_US:-d}_${d//[=,]/_}.npz"
  grep "layer ops" "$OUT/probe_${preset}_${d//[=,]/_}.log" | cut -c1-400
  echo "=== $preset [$d] [${INST_OVERHEAD_US:-}] $(grep -E "median" "$OUT/probe_${preset}_${d//[=,]/_}.log" | cut -c1-40) $(grep -E "rel err" "$OUT/probe_${preset}_${d//[=,]/_}.log")"
  grep -E "trace:" "$OUT/probe_${preset}_${d//[=,]/_}.log"
done
