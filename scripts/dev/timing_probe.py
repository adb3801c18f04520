"""Dev: one preset's one-GPU megakernel timed three ways on the same launches (GPU), to see what the
timing method itself adds: CUDA events around each launch (examples/bench_decode.py's time_steps,
median), one event pair around N launches back to back, and wall clock around them.
With INSTANCES=k: k kernels of the same artifact and weights, each with its own arena, counters
and caches at other addresses (junk allocations between them), timed per launch in interleaved
rounds: how much the placement of a kernel's own buffers moves its time.

    python3 scripts/dev/timing_probe.py PRESET [PRESET ...]
"""
import os
import statistics
import sys
import time

import torch

import megaegg as me
from megaegg.compiler import cached_artifact
from megaegg.models import ModelConfig, build_decode_graph, random_weights

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/examples")
from bench_decode import time_steps  # noqa: E402

CTX, N, ROUNDS = 512, 50, 5


def probe(preset: str) -> dict:
    g, spec = build_decode_graph(ModelConfig.preset(preset), max_len=CTX + 1)
    k = me.Kernel(cached_artifact(g, max_dims={"pos": CTX}, dims_hint={"pos": CTX}), random_weights(spec, seed=0, device="cuda"),
                  backend="cuda")
    caches = {n: torch.randn_like(c) for n, c in spec.new_caches("cuda").items()}
    tok = torch.tensor([3], dtype=torch.int32, device="cuda")
    k(token=tok, pos=CTX, **caches)
    tensors = {bf.id: {"token": tok, **caches}[bf.name] for bf in k.program.buffers if bf.kind in ("input", "state")}
    dims = [{"pos": CTX}[s] for s in k.program.symbols]
    launch = lambda: k._runner.launch(dims, tensors)  # noqa: E731
    out = {"per_launch_events": [], "batch_events": [], "batch_wall": []}
    for _ in range(ROUNDS):
        out["per_launch_events"].append(time_steps(launch, iters=N, warmup=5, cuda=True)["ms"])
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        for _ in range(N):
            launch()
        e.record()
        torch.cuda.synchronize()
        out["batch_wall"].append((time.perf_counter() - t0) * 1e3 / N)
        out["batch_events"].append(s.elapsed_time(e) / N)
    k._runner.check()
    return {"preset": preset, **{m: statistics.median(v) for m, v in out.items()}}


def instances(preset: str, k: int) -> dict:
    g, spec = build_decode_graph(ModelConfig.preset(preset), max_len=CTX + 1)
    art = cached_artifact(g, max_dims={"pos": CTX}, dims_hint={"pos": CTX})
    W = random_weights(spec, seed=0, device="cuda")
    tok = torch.tensor([3], dtype=torch.int32, device="cuda")
    runs, junk = [], []
    for i in range(k):
        junk.append(torch.empty(int(1 + 37 * i) * (1 << 20) + 4096 * i, dtype=torch.uint8, device="cuda"))
        kern = me.Kernel(art, W, backend="cuda")
        caches = {n: torch.randn_like(c) for n, c in spec.new_caches("cuda").items()}
        kern(token=tok, pos=CTX, **caches)
        tensors = {bf.id: {"token": tok, **caches}[bf.name] for bf in kern.program.buffers if bf.kind in ("input", "state")}
        runs.append((kern, tensors))
    dims = [{"pos": CTX}[s] for s in runs[0][0].program.symbols]
    ms = [[] for _ in runs]
    for _ in range(ROUNDS):
        for i, (kern, tensors) in enumerate(runs):
            ms[i].append(time_steps(lambda: kern._runner.launch(dims, tensors), iters=N, warmup=5, cuda=True)["ms"])
    for kern, _ in runs:
        kern._runner.check()
    return {"preset": preset, **{f"kernel{i}": statistics.median(v) for i, v in enumerate(ms)}}


if __name__ == "__main__":
    if os.environ.get("INSTANCES"):
        for p in sys.argv[1:]:
            r = instances(p, int(os.environ["INSTANCES"]))
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        sys.exit()
    for p in sys.argv[1:]:
        print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in probe(p).items()), flush=True)
