"""dev: run a preset's decode step a few times, for `ncu` to profile one launch.

  ncu -k regex:megakernel --launch-skip 3 --launch-count 1 \\
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \\
      python3 scripts/dev/ncu_step.py llama-3.2-1b

(the stall breakdown in docs/perf-notes.md, "What would close the gap"). A second argument @FILE
runs an artifact saved by `ab_probe.py --save` (another checkout's code) instead of compiling.
"""
import sys

import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
ctx = 512
g, spec = build_decode_graph(ModelConfig.preset(preset), max_len=1024)
w = random_weights(spec, seed=0, device="cuda")
if len(sys.argv) > 2 and sys.argv[2].startswith("@"):
    from ab_probe import load_any_artifact

    k = me.Kernel(load_any_artifact(sys.argv[2][1:]), w, backend="cuda")
else:
    k = me.compile(g, w, backend="cuda", max_dims={"pos": 1023}, dims_hint={"pos": ctx})
caches = spec.new_caches("cuda")
for c in caches.values():
    c.normal_()
tok = torch.tensor([7], dtype=torch.int32, device="cuda")
for _ in range(5):
    k(token=tok, pos=ctx, check=False, **caches)
torch.cuda.synchronize()
print("done")
