"""Quick GPU probe: correctness + timing of a preset decode step vs torch (dev use)."""
import sys, time, torch
import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
ctx = 512
cfg = ModelConfig.preset(preset)
g, spec = build_decode_graph(cfg, max_len=1024)
W = random_weights(spec, seed=0, device="cuda")
t = time.time()
import os
from megaegg.rewrite.cost import CostModel
knobs = {"op_overhead": "OP_OVERHEAD_US", "instance_overhead": "INST_OVERHEAD_US"}
cm = CostModel(**{f: float(os.environ[e]) * 1e-6 for f, e in knobs.items() if e in os.environ})
k = me.compile(g, W, backend="cuda", max_dims={"pos": 1023}, dims_hint={"pos": ctx}, cost_model=cm)
print("kinds", sorted({e.op.kind for e in k.queue.entries}), "entries", len(k.queue.entries))
print("compile s", round(time.time() - t, 2), {a: round(b, 3) for a, b in k.artifact.timings.items()})
print("entries", len(k.queue.entries), k.queue.summary())
print("layer ops", [(e.op.kind, e.op.params.get("rows"), str(e.launch)) for e in k.queue.entries[13:25]])
caches = spec.new_caches("cuda")
for c in caches.values():
    c.normal_()
tok = torch.tensor([7], dtype=torch.int32, device="cuda")
out = k(token=tok, pos=ctx, **caches)
ref = me.run_reference(g, {"token": tok, **{n: c.clone() for n, c in caches.items()}}, W, {"pos": ctx})
err = ((out["logits"].float() - ref["logits"].float()).norm() / ref["logits"].float().norm()).item()
print("rel err", err, out["next_token"].item(), ref["next_token"].item())
# timing
for _ in range(5):
    k(token=tok, pos=ctx, check=False, **caches)
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
times = []
for _ in range(30):
    ev[0].record(); k._runner.launch([ctx], {**{b.id: caches[b.name] for b in k.program.buffers if b.name in caches}, **{b.id: tok for b in k.program.buffers if b.name == "token"}}); ev[1].record()
    torch.cuda.synchronize(); times.append(ev[0].elapsed_time(ev[1]))
k._runner.check()
times.sort()
kv = sum(c.numel() for c in caches.values()) * 2 * (ctx + 1) / 1024
# bandwidth: big copy
x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
e0.record(); [y.copy_(x) for _ in range(10)]; e1.record(); torch.cuda.synchronize()
bw = 2 * x.numel() * 2 * 10 / (e0.elapsed_time(e1) / 1e3)
floor = (spec.weight_bytes + kv) / (bw / 2 * 1.0) * 1e3  # read bandwidth ~ copy bw counting read+write /2? use copy rw total
print(f"median ms {times[len(times)//2]:.3f}  min {times[0]:.3f}  weights GB {spec.weight_bytes/1e9:.2f}  copy bw (r+w) {bw/1e12:.2f} TB/s  floor(ms, at copy bw) {(spec.weight_bytes + kv)/bw*1e3:.3f}")
tr = k.trace(token=tok, pos=ctx, **caches)
s = tr.summary()
print(f"trace: wall {s['wall_us']:.1f} us, busy {s['busy_pct']:.1f}%, waiting {s['waiting_pct']:.1f}%, pops {s['pop_pct']:.1f}%, instances {s['instances']}")
for kind, d in sorted(tr.by_kind().items(), key=lambda kv: -kv[1]['busy_us']):
    print(f"  {kind:<15} inst {d['instances']:>6}  busy {d['busy_us']:>10.1f} us  wait {d['wait_us']:>10.1f} us")
ops = s["ops"][:14]
for o in ops:
    print(f"  op{o.op:<4} {o.kind:<15} inst {o.instances:>4} span {o.span_us:7.2f} us  busy/inst {o.busy_us/o.instances:6.2f}  wait/inst {o.wait_us/o.instances:6.2f}")
import os
open(os.path.join(os.environ.get("OUT", "."), "trace.json"), "w").write(tr.chrome_json())
np_path = os.path.join(os.environ.get("OUT", "."), f"trace_{preset}.npz")
import numpy as np
np.savez(np_path, records=tr.records, kinds=np.array([e.op.kind for e in k.queue.entries]),
         launch=np.array([e.op.id for e in k.queue.entries]))
