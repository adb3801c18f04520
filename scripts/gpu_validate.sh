#!/usr/bin/env bash
# The GPU validation run (dev use, on the device machine): tests, then compute-sanitizer on the tiny model.
set -u
export PYTHONUNBUFFERED=1
python3 -m pytest -q -n 4 -p no:warnings tests/gpu -rA 2>&1 | grep -E "passed|failed|PASSED|FAILED|worst logits|^E  " | tail -40
python3 scripts/sanitize_tiny.py  # warm the cubin cache outside the sanitizer
for tool in memcheck racecheck initcheck; do
  echo "=== compute-sanitizer $tool"
  timeout 150 compute-sanitizer --tool $tool --report-api-errors no python3 scripts/sanitize_tiny.py 2>&1 | tail -4  # API errors: cuda-python probing cuGetProcAddress
done
