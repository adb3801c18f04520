#!/usr/bin/env bash
# dev: one GPU round: unpack the egglog site, install, GPU body/op tests, then probes.
#   bash scripts/dev/gpu_round.sh PRESET "ENV=VALUE ..." "ENV=VALUE ..." ...   (logs under $OUT)
# Each variant is a set of environment assignments for scripts/dev/gpu_probe.py (MEGAEGG_DEFINES,
# cost-model knobs TILE_OVERHEAD_US, OP_OVERHEAD_US, ...); "-" runs the defaults.
# The variant "OLD [ENV=VALUE ...]" probes the code unpacked in $OLD instead (another commit,
# for a same-run A/B), with those assignments.
set -u
mkdir -p /tmp/site && tar xzf .device/site.tgz -C /tmp/site
export PYTHONPATH=/tmp/site MEGAEGG_CACHE=/tmp/mcache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -x -n 4 $TESTS > "$OUT/tests.log" 2>&1; echo "tests rc $?: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5
fi
preset=$1; shift
probe() {  # name, env assignments, script
  local log="$OUT/probe_${preset}_$1.log"
  env $2 python3 "$3" "$preset" > "$log" 2>&1
  [ -f "$OUT/trace_${preset}.npz" ] && mv "$OUT/trace_${preset}.npz" "$OUT/trace_${preset}_$1.npz"
  echo "=== $preset [$2] $(grep -E "median" "$log" | cut -c1-40) $(grep -E "rel err" "$log")"
  grep -E "trace:|Error|error:" "$log" | head -3
}
i=0
for d in "$@"; do
  i=$((i + 1)); [ "$d" = "-" ] && d=""
  if [ "${d%% *}" = "OLD" ]; then  # the code unpacked in $OLD (another commit), for a same-run A/B
    (cd "$OLD" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
    probe "v$i-old" "OP_OVERHEAD_US=1.5 ${d#OLD}" "$OLD/scripts/dev/gpu_probe.py"
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
  else
    probe "v$i" "OP_OVERHEAD_US=1.5 $d" scripts/dev/gpu_probe.py
  fi
done
