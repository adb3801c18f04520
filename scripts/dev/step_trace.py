"""Dev: where a step graph's time goes (GPU): one traced launch per case of PRESET's step graph (as
``step_ab.py`` compiles it), the trace summary, busy / wait by kind, and one middle layer's ops in queue
order: instances, when the first was claimed, when the last passed its wait and when the last finished
(us from the end of the entry before the layer's attention), and the median instance's wait and run.

    python3 scripts/dev/step_trace.py PRESET CASES
    e.g. step_trace.py llama-3.2-1b b16,b64,p2048

A case is ``b<N>`` (a batch of N decoding at position 512), ``p<T>`` (a T-token prompt) or ``m<N>+<T>`` (the
two in one launch: a mixed step). A deferred
kind (the gemm tile) does its wait inside its body, after the trace's wait stamp: its wait column is 0.
With $OUT set, each trace is saved there as Chrome JSON (Perfetto).
"""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_ab import compile_step, step_inputs  # noqa: E402

ATTENTION = ("ragged_partial_merge", "ragged_flash", "attn_partial_merge")


def op_name(op) -> str:
    keys = ("rows", "bm", "bn", "splits", "mrows", "tile")
    extra = ",".join(f"{k}={op.params[k]}" for k in keys if k in op.params and not hasattr(op.params[k], "eval"))
    return f"{op.kind}({extra})" if extra else op.kind


def middle_layer(trace) -> None:
    t = trace.times_us()
    entries = trace.entry
    active = [k for k in range(len(trace.queue.entries)) if (entries == k).any()]
    att = [k for k in active if trace.queue.entries[k].op.kind.startswith(ATTENTION)]
    if len(att) < 3:
        return
    m = len(att) // 2
    layer = [k for k in active if att[m] <= k < att[m + 1]]
    before = active[active.index(att[m]) - 1]
    t0 = t[entries == before, 2].max()
    print(f"  layer {m} (us from the end of the entry before its attention):")
    print(f"    {'op':<44} {'inst':>6} {'claim0':>8} {'waited':>8} {'done':>8} {'wait~':>7} {'run~':>7}")
    for k in layer:
        r = t[entries == k]
        print(f"    {op_name(trace.queue.entries[k].op)[:44]:<44} {len(r):>6} {r[:, 0].min() - t0:8.1f} "
              f"{r[:, 1].max() - t0:8.1f} {r[:, 2].max() - t0:8.1f} {np.median(r[:, 1] - r[:, 0]):7.1f} "
              f"{np.median(r[:, 2] - r[:, 1]):7.1f}")
    print(f"    a layer: {t[entries == layer[-1], 2].max() - t0:.1f} us")


def main(preset: str, cases: list[str]) -> None:
    kernel, cfg, caches, compile_s = compile_step(preset)
    print(f"{preset}: compiled in {compile_s:.0f} s")
    for case in cases:
        tr = kernel.trace(**step_inputs(cfg, case), **caches)
        s = tr.summary()
        print(f"\n{preset} {case}: wall {s['wall_us']:.1f} us, busy {s['busy_pct']:.1f}%, waiting {s['waiting_pct']:.1f}%, "
              f"pops {s['pop_pct']:.1f}%, {s['instances']} instances")
        for kind, d in sorted(tr.by_kind().items(), key=lambda kv: -kv[1]["busy_us"]):
            print(f"  {kind:<22} inst {d['instances']:>7}  busy {d['busy_us'] / s['sms']:>9.1f} us an SM  "
                  f"wait {d['wait_us'] / s['sms']:>8.1f}")
        middle_layer(tr)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"trace_{preset}_{case}.json"), "w") as f:
                f.write(tr.chrome_json())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2].split(","))
