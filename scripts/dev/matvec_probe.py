"""Dev probe: one big matvec / one gated MLP inside the megakernel, as TB/s (is the body or the chain slow?).

    python3 scripts/dev/matvec_probe.py [N,K,GLU,NORM ...]   (e.g. 65536,2048,0,0; GLU/NORM 0 or 1)
NO_TRACE=1 skips the traced launch (a second NVRTC compile)."""
import os
import sys

import torch
import megaegg as me

def run(n, k, glu, norm):
    g = me.Graph()
    x = g.input("x", [1, k], me.bf16)
    if norm:
        x = me.rms_norm(x, g.weight("g", [k], me.bf16), 1e-5)
    w = g.weight("w", [n, k], me.bf16)
    y = me.linear(x, w)
    if glu:
        y = me.silu(y) * me.linear(x, g.weight("w2", [n, k], me.bf16))
    g.output("y", y)
    W = {name: torch.randn([d.value for d in t.shape], device="cuda").to(torch.bfloat16) for name, t in g.weights.items()}
    kern = me.compile(g, W, backend="cuda")
    xin = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ops = [(e.op.kind, e.op.params.get("rows"), e.launch.eval({})) for e in kern.queue.entries]
    b = {bb.id: xin for bb in kern.program.buffers if bb.name == "x"}
    for _ in range(5): kern._runner.launch([], b)
    torch.cuda.synchronize()
    t = []
    for _ in range(30):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); kern._runner.launch([], b); e1.record(); torch.cuda.synchronize(); t.append(e0.elapsed_time(e1))
    kern._runner.check()
    t.sort(); ms = t[len(t)//2]
    nbytes = n * k * 2 * (2 if glu else 1)
    line = f"n={n} k={k} glu={glu} norm={norm} ops={ops}: {ms*1000:.1f} us, {nbytes/ms/1e9:.2f} TB/s"
    if not os.environ.get("NO_TRACE"):
        tr = kern.trace(x=xin).summary()
        line += f"; trace wall {tr['wall_us']:.1f} us busy {tr['busy_pct']:.0f}% wait {tr['waiting_pct']:.0f}%"
    print(line, flush=True)

configs = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [
    (65536, 2048, 0, 0), (8192, 2048, 1, 1), (2048, 8192, 0, 0), (131072, 2048, 1, 1)]
for n, k, glu, norm in configs:
    run(n, k, bool(glu), bool(norm))
