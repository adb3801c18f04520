"""Dev: THE A/B harness: a same-run, interleaved A/B of variants of one preset's decode step (GPU);
one variant is a probe of the step (correctness, ms, where the time goes).

    python3 scripts/dev/ab_probe.py PRESET NAME=SETTINGS [NAME=SETTINGS ...]
    e.g. ab_probe.py llama-3.2-1b main= smem=MEGA_SMEM=98304 oh4=op_overhead_us=4

SETTINGS: comma-separated ``KEY=VALUE``: upper-case keys are compile-time defines (as
MEGAEGG_DEFINES takes them), lower-case ones fields of the cost model (``rewrite/cost.py``:
``op_overhead``, ``sms``, ...; with ``_us``, in microseconds); empty: the defaults.
A variant NAME=@FILE runs a saved artifact instead, e.g. one built by another checkout (A/B of code,
not settings): ``ab_probe.py --save PRESET FILE`` builds and saves this checkout's (no GPU needed;
from an old commit's worktree, with PYTHONPATH pointing at it). An A/B of NVRTC versions is the
same: ``--save`` under each NVRTC (perf-notes #57), then both files as variants.

Every variant is compiled and checked against the reference first (rel err, greedy token); then the
timing rounds interleave the variants (ROUNDS rounds, default 7, each 20 launches timed one by one
with CUDA events, then 20 back to back under one event pair), so clock or thermal drift during the
run hits all of them alike (the same code measured 1.043 and 1.116 ms on two H200 machines, and moved
within one run). Launches go through ``kernel.launcher`` (the call checked once). Prints the median
over rounds of each round's median, the spread and the back-to-back ms, and, from one traced launch
each, the trace summary (busy, barrier waiting, queue pops), busy / wait time by kind and the mean
per-layer step of every op (the time from the previous entry's last instance to this entry's last
instance, averaged over the layers). With $OUT set, the traces are saved there as
ab_<preset>_<name>.npz and ab_<preset>_<name>.json (Chrome trace: Perfetto).
$CTX: the position (default 512), $ROUNDS.
"""
import dataclasses
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights
from megaegg.rewrite import CostModel

CTX = int(os.environ.get("CTX", 512))
ROUNDS = int(os.environ.get("ROUNDS", 7))


def print_stages(tr) -> None:
    """The hand-off's anatomy per op signature (interpreter/trace.py: OpStages), medians over entries, us."""
    cols = [("claim gap", "claim_gap"), ("atomic", "claim_atomic"), ("dispatch", "dispatch"), ("poll", "poll"),
            ("sig->pass", "signal_to_pass"), ("hand-off", "handoff"), ("mark", "mark"), ("run", "run"),
            ("slowest", "run_max"), ("sig->end", "signal_to_done"), ("step", "step")]
    print("  stages (us, medians over entries): " + ", ".join(c for c, _ in cols))
    print(f"    {'op':<20} {'entries x inst':<14} " + " ".join(f"{c:>9}" for c, _ in cols))
    for st in tr.stages():
        print(f"    {st.kind:<20} {st.entries:>3} x {st.instances:<8} " + " ".join(f"{getattr(st, f):9.2f}" for _, f in cols))


def layer_steps(trace) -> list[tuple[str, float, int]]:
    """(op signature, mean step us, entries) in queue order of first appearance."""
    t = trace.times_us()
    done = {}
    for k in np.unique(trace.entry):
        done[int(k)] = t[trace.entry == k, 2].max()
    steps, prev = defaultdict(list), 0.0
    order = []
    for k, e in enumerate(trace.queue.entries):
        if k not in done:
            continue
        sig = f"{e.op.kind}/{e.op.params.get('rows', '')}/{e.launch}"
        if sig not in steps:
            order.append(sig)
        steps[sig].append(done[k] - prev)
        prev = done[k]
    return [(s, float(np.mean(steps[s])), len(steps[s])) for s in order]


def settings(spec: str) -> tuple[str, CostModel]:
    """(MEGAEGG_DEFINES, cost model) of a variant's SETTINGS."""
    defines, cost = [], {}
    fields = {f.name: f.type for f in dataclasses.fields(CostModel)}
    for kv in filter(None, spec.split(",")):
        key, value = kv.split("=", 1)
        if key.isupper():
            defines.append(kv)
        elif key.endswith("_us") and key[:-3] in fields:
            cost[key[:-3]] = float(value) * 1e-6
        elif key in fields:
            cost[key] = int(value) if fields[key] in (int, "int") else float(value)
        else:
            raise SystemExit(f"error: {key!r} is neither a define (upper case) nor a CostModel field: {sorted(fields)}")
    return ",".join(defines), CostModel(**cost)


def main() -> None:
    preset, variants = sys.argv[1], dict(v.split("=", 1) for v in sys.argv[2:])
    cfg = ModelConfig.preset(preset)
    g, spec = build_decode_graph(cfg, max_len=1024)
    W = random_weights(spec, seed=0, device="cuda")
    caches = spec.new_caches("cuda")
    for c in caches.values():
        c.normal_()
    tok = torch.tensor([7], dtype=torch.int32, device="cuda")
    ref = me.run_reference(g, {"token": tok, **{n: c.clone() for n, c in caches.items()}}, W, {"pos": CTX})
    kernels = {}
    for name, spec in variants.items():
        defines, cost = ("", None) if spec.startswith("@") else settings(spec)
        os.environ["MEGAEGG_DEFINES"] = defines
        try:
            t0 = time.perf_counter()
            if spec.startswith("@"):
                k = me.Kernel(load_any_artifact(spec[1:]), W, backend="cuda")
            else:
                k = me.compile(g, W, backend="cuda", max_dims={"pos": 1023}, dims_hint={"pos": CTX}, cost_model=cost)
            compile_s = time.perf_counter() - t0
            out = k(token=tok, pos=CTX, **{n: c.clone() for n, c in caches.items()})
        except Exception as e:  # (a variant that does not fit this GPU: the others still run)
            print(f"{name}: skipped: {str(e).splitlines()[0]}", flush=True)
            continue
        err = ((out["logits"].float() - ref["logits"].float()).norm() / ref["logits"].float().norm()).item()
        print(f"{name}: rel err {err:.4f}, next token {out['next_token'].item()} (ref {ref['next_token'].item()}); "
              f"{len(k.queue.entries)} queue entries, compiled in {compile_s:.1f} s", flush=True)
        kernels[name] = k
    launchers = {name: k.launcher(token=tok, pos=CTX, **caches) for name, k in kernels.items()}
    rounds, back_to_back = defaultdict(list), defaultdict(list)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(ROUNDS):
        for name, launch in launchers.items():
            for _ in range(3):
                launch()
            times = []
            for _ in range(20):
                ev[0].record()
                launch()
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]))
            rounds[name].append(float(np.median(times)))
            ev[0].record()
            for _ in range(20):
                launch()
            ev[1].record()
            torch.cuda.synchronize()
            back_to_back[name].append(ev[0].elapsed_time(ev[1]) / 20)
        for launch in launchers.values():
            launch.check()
    base = None
    print(f"\n{preset} ctx {CTX}, {ROUNDS} interleaved rounds (median of round medians, ms; back to back: 20 "
          "launches under one event pair):")
    for name in kernels:
        r = np.array(rounds[name])
        med = float(np.median(r))
        base = base or med
        print(f"  {name:<24} {med:.4f}  (rounds {r.min():.4f}-{r.max():.4f})  {100 * (med / base - 1):+.1f}%  "
              f"back to back {np.median(back_to_back[name]):.4f}")
    steps = {}
    for name, k in kernels.items():
        if variants[name].startswith("@"):  # (a saved artifact: its source needs its own headers to trace)
            continue
        tr = k.trace(token=tok, pos=CTX, **caches)
        steps[name] = layer_steps(tr)
        s = tr.summary()
        print(f"\n{name} trace: wall {s['wall_us']:.1f} us, busy {s['busy_pct']:.1f}%, waiting {s['waiting_pct']:.1f}%, "
              f"pops {s['pop_pct']:.1f}%, {s['instances']} instances")
        for kind, d in sorted(tr.by_kind().items(), key=lambda kv: -kv[1]["busy_us"]):
            print(f"  {kind:<20} inst {d['instances']:>6}  busy {d['busy_us']:>10.1f} us  wait {d['wait_us']:>10.1f} us")
        print_stages(tr)
        if os.environ.get("OUT"):
            np.savez(os.path.join(os.environ["OUT"], f"ab_{preset}_{name}.npz"), records=tr.records)
            with open(os.path.join(os.environ["OUT"], f"ab_{preset}_{name}.json"), "w") as f:
                f.write(tr.chrome_json())
    names = list(steps)
    if not names:
        return
    print("\nmean step per op (us): " + " | ".join(names))
    sigs = [s for s, _, n in steps[names[0]] if n > 1]
    for s in sigs:
        row = [dict((a, b) for a, b, _ in steps[n]).get(s, float("nan")) for n in names]
        print(f"  {s[:44]:<44} " + " ".join(f"{v:7.2f}" for v in row))
    for n in names:
        total = sum(v for s, v, c in steps[n] if c > 1)
        print(f"  {n}: a layer {total:.1f} us")


def save(preset: str, path: str) -> None:
    """Build and save PRESET's decode artifact (what main() compiles) with this checkout's code."""
    from megaegg.compiler import build_artifact

    g, _ = build_decode_graph(ModelConfig.preset(preset), max_len=1024)
    build_artifact(g, max_dims={"pos": 1023}, dims_hint={"pos": CTX}, compile_cuda=True).save(path)


def load_any_artifact(path: str):
    """An artifact saved by any code version (Artifact.load refuses other versions: the queue
    format is what must match, and the A/B's reference check catches a mismatch)."""
    import json
    import zipfile

    from safetensors.torch import load as load_tensors

    from megaegg.artifact import Artifact, decode, image_part

    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("artifact.json"))
        body = json.loads(meta["body"]) if "body" in meta else meta  # (format 2 nests them in a JSON string)
        blob = z.read("constants.safetensors")
        constants = {int(k): t for k, t in load_tensors(blob).items()} if blob else {}
        names = set(z.namelist())
        cubins = []  # every band's kernel image, in band order
        while image_part(len(cubins)) in names:
            cubins.append(z.read(image_part(len(cubins))))
        return Artifact(queue=decode(body["queue"]), source=z.read("kernel.cu").decode(), table=body["table"],
                        cubins=cubins, constants=constants, defines=body["defines"])


if __name__ == "__main__":
    if sys.argv[1] == "--save":
        save(*sys.argv[2:4])
    else:
        main()
