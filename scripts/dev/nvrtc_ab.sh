#!/usr/bin/env bash
# dev (device machine): the one-GPU megakernel built by the image's NVRTC against one unpacked into
# /tmp/site/nvidia (a newer nvidia-cuda-nvrtc wheel), same run: scripts/dev/timing_probe.py per preset.
#   bash scripts/dev/nvrtc_ab.sh PRESET [PRESET ...]      (PYTHONPATH=/tmp/site:$PWD set)
set -u
for v in image site; do
  [ $v = image ] && mv /tmp/site/nvidia /tmp/site_nvidia_off
  [ $v = site ] && mv /tmp/site_nvidia_off /tmp/site/nvidia
  python3 -c "
from cuda.pathfinder import load_nvidia_dynamic_lib
from megaegg.interpreter.nvrtc import include_dirs, nvrtc_version
print('$v: nvrtc', nvrtc_version(), load_nvidia_dynamic_lib('nvrtc').abs_path, include_dirs()[1:])"
  MEGAEGG_CACHE=/tmp/mc_$v python3 scripts/dev/timing_probe.py "$@" 2>&1 | grep preset | sed "s/^/$v: /"
done
