#!/usr/bin/env bash
# Installs what megaegg needs. Keeps an installed torch; without one, a machine with
# no NVIDIA GPU gets the CPU build (torch==2.13.0) instead of several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    python3 -m pip install -q torch
  else
    python3 -m pip install -q torch==2.13.0
  fi
fi
python3 -m pip install -q -e ".[test,models]" 2>&1 | grep -v -e '^WARNING: Running pip as' -e 'notice' || true
python3 -c "import megaegg" || { echo "megaegg failed to import after setup" >&2; exit 1; }
