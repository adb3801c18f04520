"""Dev probe (issue 39): what one hand-off between dependent ops costs, built from the compiler's own
protocol (queue entries, counters, waits), with HBM idle and under an independent weight stream.

    python3 scripts/dev/hop_probe.py                         # GPU: the table below
    python3 scripts/dev/hop_probe.py --backend sim --lengths 1,2 --iters 1   # a CPU smoke run

A graph per (chain length L, instances a hop, stream): L elementwise adds in a chain, y_{k+1} = y_k + b
(each a block op whose instances wait for the previous op's instances of the same elements: the shape
is `instances` tiles of 1024 elements, one tile an instance), beside an independent linear reading
`--stream-mb` of weights (0: none; it is built first, so its instances are claimed first and stream while
the chain hops). Each launch is timed with CUDA events (median of `--iters`); the per-hop cost is the
least-squares slope of time over L, so the launch's fixed costs (start, the stream's own time where it
is longer than the chain) fall into the intercept. From one traced launch of the longest chain
(`kernel.trace`: global-clock and SM-cycle stamps), the hand-off's stages, medians over hops (interpreter/trace.py:
OpStages): hand-off (the previous hop's last instance done -> this hop's first past its wait), sig->pass
(the previous hop's last signal issued -> that pass: the signal's trip to L2, the poll noticing it, the
block barrier), atomic (the claim's round trip and entry search), dispatch (claimed -> first poll: table
read, wait list), poll (first poll -> passed), run (passed -> done), sig->end (the signal issued -> the
instance's end). Printed: instances (as the rewrite chose them), stream MB, us a hop (slope), intercept,
and those stages in us.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import megaegg as me

TILE = 1024  # elements a chain instance (ELEMENTWISE_TILES' smaller tile)


def chain_graph(length: int, instances: int, stream_mb: int, hidden: int = 2048):
    g = me.Graph(f"hops_{length}_{instances}_{stream_mb}")
    if stream_mb:  # the independent weight stream, first in the queue
        rows = max(1, stream_mb * 2**20 // (hidden * 2))
        g.output("z", me.linear(g.input("x2", [1, hidden], me.bf16), g.weight("w", [rows, hidden], me.bf16)))
    y = g.input("y0", [instances * TILE], me.bf16)
    b = g.input("b", [instances * TILE], me.bf16)
    for _ in range(length):
        y = y + b
    g.output("y", y)
    return g


def inputs(g, device):
    gen = torch.Generator(device=device).manual_seed(0)
    return {name: (torch.randn([d.value for d in t.shape], generator=gen, device=device) * 0.1).to(t.dtype.torch)
            for name, t in g.inputs.items()}


def weights(g, device):
    return {name: torch.randn([d.value for d in t.shape], device=device).to(t.dtype.torch) * 0.01
            for name, t in g.weights.items()}


def timed(kernel, ins, iters: int, cuda: bool) -> float:
    """Median ms of one launch."""
    if cuda:
        run = kernel.launcher(**ins)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            e.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(e))
        run.check()
        return statistics.median(ts)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        kernel(**ins)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def traced_stages(kernel, ins):
    """The chain's hand-off stages from a traced launch (interpreter/trace.py: OpStages, medians over hops)."""
    return next(st for st in kernel.trace(**ins).stages() if st.kind == "elementwise")


STAGES = (("hand-off", "handoff"), ("sig->pass", "signal_to_pass"), ("atomic", "claim_atomic"),
          ("dispatch", "dispatch"), ("poll", "poll"), ("run", "run"), ("sig->end", "signal_to_done"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "sim")
    ap.add_argument("--lengths", default="1,2,4,8,16,32,64")
    ap.add_argument("--instances", default="1,132")
    ap.add_argument("--stream-mb", default="0,256")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    cuda = a.backend == "cuda"
    device = "cuda" if cuda else "cpu"
    lengths = [int(v) for v in a.lengths.split(",")]
    print(f"backend {a.backend}" + (f", {torch.cuda.get_device_name()}" if cuda else ""))
    print(f"{'instances':>9} {'stream MB':>9} {'us/hop':>8} {'intercept ms':>12}  traced, us: "
          + " ".join(f"{c:>9}" for c, _ in STAGES))
    for inst in (int(v) for v in a.instances.split(",")):
        for mb in (int(v) for v in a.stream_mb.split(",")):
            ms, chosen = [], None
            for length in lengths:
                g = chain_graph(length, inst, mb)
                kernel = me.compile(g, weights(g, device), backend=a.backend)
                chosen = [e.op.launch_count.eval({}) for e in kernel.queue.entries if e.op.kind == "elementwise"][0]
                ms.append(timed(kernel, inputs(g, device), a.iters, cuda))
            slope, intercept = np.polyfit(lengths, ms, 1) if len(lengths) > 1 else (float("nan"), ms[0])
            st = traced_stages(kernel, inputs(g, device)) if cuda else None
            traced = " ".join(f"{getattr(st, f) if st else float('nan'):9.2f}" for _, f in STAGES)
            print(f"{chosen:>9} {mb:>9} {slope * 1e3:>8.2f} {intercept:>12.3f}              {traced}")


if __name__ == "__main__":
    main()
