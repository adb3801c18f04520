"""Dev: where a lone sequence's inter-token time goes in the serving engine (GPU), in ONE run.

    python3 scripts/dev/serve_probe.py PRESET [SLOTS]

Builds the serving engine's kernels as ``megaegg.serve.build_engine`` does (the step graph with sampling, the
batch-1 decode graph with sampling), then decodes one request (a 256-token prompt, 128 tokens, greedy and
sampled) through the batcher alone (no HTTP), three ways interleaved: the step graph for every launch, the
decode graph through ``single_sequence_decode`` (without and with its run ahead), and the decode graph's bare launch (CUDA events, the floor).
Prints the median decode-launch seconds of each (the batcher's ``step_seconds``: host work, launch, sync),
so host overhead = batcher - bare.
"""
import statistics
import sys
import time

import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, build_step_graph, random_weights
from megaegg.models.batch import Batcher, Request, Sampling, kernel_batch_step, single_sequence_decode

preset = sys.argv[1]
slots = int(sys.argv[2]) if len(sys.argv) > 2 else 8
cuda = torch.cuda.is_available()  # (without a GPU: a smoke test of this script, f32 on the simulator)
dev, backend = ("cuda", "cuda") if cuda else ("cpu", "sim")
max_len, prompt, new = (1024, 256, 128) if cuda else (64, 8, 4)
cfg = ModelConfig.preset(preset)
if not cuda:
    import dataclasses
    cfg = dataclasses.replace(cfg, dtype=me.f32)
t0 = time.perf_counter()
graph, spec = build_step_graph(cfg, max_len=max_len, slots=slots, sampling=True)
weights = random_weights(spec, seed=0, device=dev)
step_k = me.compile(graph, weights, backend=backend, max_dims={"n": 2048, "r": slots, "ctx": max_len},
                    dims_hint={"n": slots, "r": slots, "ctx": 512})
dg, _ = build_decode_graph(cfg, max_len=max_len, logits=False, sampling=True)
dec_k = me.compile(dg, weights, backend=backend, max_dims={"pos": max_len - 1}, dims_hint={"pos": 512})
print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
caches = spec.new_caches(device=dev)
step = kernel_batch_step(step_k, caches)
ways = {"step graph": step, "decode graph": single_sequence_decode(step, dec_k, caches, run_ahead=False),
        "decode ahead": single_sequence_decode(step, dec_k, caches)}
rng = torch.Generator().manual_seed(0)
ids = torch.randint(0, cfg.vocab, (prompt,), generator=rng).tolist()
results = {(w, s): [] for w in ways for s in ("greedy", "sampled")}
tokens = {}
for rnd in range(3):
    for w, fn in ways.items():
        for s, sampling in (("greedy", Sampling()), ("sampled", Sampling(temperature=0.8, top_p=0.95, seed=7))):
            b = Batcher(fn, slots=slots, max_len=max_len, max_tokens=2048, device=dev)
            out = b.run([Request(ids, new, sampling=sampling)])[0].tokens
            tokens.setdefault((w, s), out)
            dec = [sec for sec, pre in zip(b.step_seconds, b.prefill_rows) if pre == 0]
            results[(w, s)].append(statistics.median(dec))
view = {n: c[0] for n, c in caches.items()}
one = lambda dt, v: torch.tensor([v], dtype=dt, device=dev)  # noqa: E731
launch = dec_k.launcher(token=one(torch.int32, 5), pos=min(512, max_len - 1), temperature=one(torch.float32, 0.0), top_k=one(torch.int32, 0),
                        top_p=one(torch.float32, 1.0), seed=one(torch.int32, 0), counter=one(torch.int32, 0), **view)
ms = []
for _ in range(50 if cuda else 2):
    if cuda:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); launch(); e.record(); torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    else:
        t = time.perf_counter(); launch(); ms.append(1e3 * (time.perf_counter() - t))
launch.check()
bare = statistics.median(ms[10:] if cuda else ms)
print(f"{preset}, slots {slots}: lone decode launch, median of rounds' medians (ms)")
for (w, s), v in results.items():
    print(f"  {w:14s} {s:8s} {1e3 * statistics.median(v):.3f}  (rounds {', '.join(f'{1e3 * x:.3f}' for x in v)})")
print(f"  decode graph bare launch (events, pos 512) {bare:.3f}")
print("  greedy tokens equal (decode graph vs run ahead):", tokens[("decode graph", "greedy")] == tokens[("decode ahead", "greedy")],
      "sampled:", tokens[("decode graph", "sampled")] == tokens[("decode ahead", "sampled")])
