"""Dev probe: one matvec op alone in the megakernel, TB/s and per-SM GB/s by instance count.

Separates per-SM limits from chip-wide ones: the same op with one instance per SM on all
SMs, on half of them, and many instances per SM.  python3 scripts/dev/wave_probe.py
"""
import torch
import megaegg as me
from megaegg.rewrite.cost import CostModel


def run(n, k, glu, sms):
    g = me.Graph()
    x = me.rms_norm(g.input("x", [1, k], me.bf16), g.weight("g", [k], me.bf16), 1e-5)
    y = me.linear(x, g.weight("w", [n, k], me.bf16))
    if glu:
        y = me.silu(y) * me.linear(x, g.weight("w2", [n, k], me.bf16))
    g.output("y", y)
    W = {nm: torch.randn([d.value for d in t.shape], device="cuda").to(torch.bfloat16) for nm, t in g.weights.items()}
    kern = me.compile(g, W, backend="cuda", cost_model=CostModel(sms=sms))
    xin = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ops = [(e.op.kind, e.op.params.get("rows"), e.launch.eval({})) for e in kern.queue.entries]
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # > L2: no weight stays resident
    walls = []
    for _ in range(7):
        flush.add_(1)
        walls.append(kern.trace(x=xin).summary()["wall_us"])
    walls.sort()
    wall = walls[len(walls) // 2]
    nbytes = n * k * 2 * (2 if glu else 1)
    inst = max(o[2] for o in ops)
    per_sm = nbytes / min(inst, 132) / (wall * 1e-6) / 1e9
    print(f"n={n:6d} k={k:5d} glu={glu:d} inst={inst:5d} rows={ops[-1][1]}: wall {wall:6.1f} us "
          f"{nbytes / wall / 1e6:5.2f} TB/s  {per_sm:5.1f} GB/s per busy SM")


for args in [(8192, 2048, True, 132), (32768, 2048, True, 132), (16384, 2048, False, 132), (65536, 2048, False, 132),
             (2048, 8192, False, 132), (8192, 8192, False, 132), (8192, 2048, True, 64)]:
    run(*args)
