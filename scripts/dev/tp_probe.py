"""Tensor-parallel probe: one GPU vs TP=N megakernels on random weights, greedy tokens and ms/token.

    python3 scripts/dev/tp_probe.py --build PRESET [PRESET ...]   # artifacts into $MEGAEGG_CACHE (no GPU)
    python3 scripts/dev/tp_probe.py PRESET [PRESET ...]           # on a machine of >= TP GPUs
    python3 scripts/dev/tp_probe.py --save PRESET FILE            # this checkout's TP artifact, saved

TP (default 2) from $TP. $TP_VARIANTS: TP kernels to compare in the same run, "NAME=DEFINES ..."
(DEFINES as MEGAEGG_DEFINES takes them; default "tp=", the defaults; "@FILE" a saved artifact,
e.g. another checkout's for an A/B of code, saved by --save run on that checkout's code; "{preset}"
in it is the preset's name); --build builds them all.
$MAX_LEN: the graphs' cache length (default 1024). Timing: context 512 (random caches), $ROUNDS (default 5) interleaved rounds of 50 launches after 10
of the one-GPU kernel and each variant, wall clock over all ranks, the median over rounds.
Correctness: 12 greedy steps from position 0 per variant, tokens and logits against the one-GPU run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import megaegg as me
from megaegg.compiler import cached_artifact
from megaegg.models import ModelConfig, build_decode_graph, random_weights
from megaegg.models.decoder import shard_caches, shard_weights
from megaegg.parallel import ParallelKernel

TP = int(os.environ.get("TP", "2"))
VARIANTS = dict(v.split("=", 1) for v in os.environ.get("TP_VARIANTS", "tp=").split())
ROUNDS = int(os.environ.get("ROUNDS", "5"))
CTX = 512
MAX_LEN = int(os.environ.get("MAX_LEN", "1024"))  # (the bench's graphs: CTX + 1)
MAX = {"pos": MAX_LEN - 1}


def artifact(graph, defines: str):
    if defines.startswith("@"):
        from ab_probe import load_any_artifact  # (scripts/dev)

        return load_any_artifact(defines[1:])
    os.environ["MEGAEGG_DEFINES"] = defines  # (read when the artifact is keyed and compiled)
    try:
        return cached_artifact(graph, max_dims=MAX, dims_hint={"pos": CTX})
    finally:
        del os.environ["MEGAEGG_DEFINES"]


def graphs(preset: str):
    cfg = ModelConfig.preset(preset)
    return cfg, build_decode_graph(cfg, max_len=MAX_LEN), build_decode_graph(cfg, max_len=MAX_LEN, tp=TP)


def build(preset: str) -> None:
    _, (g1, _), (g2, _) = graphs(preset)
    for g, defines in [(g1, "")] + [(g2, d) for d in VARIANTS.values() if not d.startswith("@")]:
        t = time.perf_counter()
        artifact(g, defines)
        print(f"{preset} {g.name} [{defines}]: built in {time.perf_counter() - t:.1f} s", flush=True)


def timed(run, sync, n=50, warm=10) -> float:
    for _ in range(warm):
        run()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        run()
    sync()
    return (time.perf_counter() - t) / n * 1e3


def probe(preset: str) -> list[dict]:
    cfg, (g1, s1), (g2, s2) = graphs(preset)
    W = random_weights(s1, seed=0, device="cuda:0")
    k1 = me.Kernel(artifact(g1, ""), W, backend="cuda")
    shards = [{n: t.to(f"cuda:{r}") for n, t in shard_weights(s2, W, r).items()} for r in range(TP)]
    kts = {name: ParallelKernel(artifact(g2, d.replace("{preset}", preset)), shards, backend="cuda")
           for name, d in VARIANTS.items()}

    def split(caches):
        return [{n: c.to(f"cuda:{r}") for n, c in shard_caches(s2, caches, r).items()} for r in range(TP)]

    def one_gpu(tok, pos, c1):
        return k1(token=torch.tensor([tok], dtype=torch.int32, device="cuda:0"), pos=pos, **c1)

    def greedy(kt) -> dict:
        """12 greedy steps from position 0: the one-GPU run (its sequence followed) against ``kt``."""
        c1 = s1.new_caches("cuda:0")
        ct = split(c1)
        tok1 = tokt = 7
        worst, same, ties, bad, gaps = 0.0, 0, 0, 0, []
        for pos in range(12):
            o1 = one_gpu(tok1, pos, c1)
            ot = kt([{"token": torch.tensor([tokt], dtype=torch.int32, device=f"cuda:{r}"), **ct[r]} for r in range(TP)], pos=pos)
            a, b = o1["logits"].float()[0], ot[0]["logits"].float()[0].to("cuda:0")
            worst = max(worst, ((a - b).norm() / a.norm()).item())
            top2 = a.topk(2).values
            tie = (top2[0] - top2[1]).item() <= 2e-2 * top2[0].abs().item()
            ties += tie
            tok1, tokt = int(o1["next_token"][0]), int(ot[0]["next_token"][0])
            same += tok1 == tokt
            bad += tok1 != tokt and not tie  # (the target: equal tokens wherever the top 2 are not a near-tie)
            if tok1 != tokt:  # how far apart the one-GPU top 2 were, against how far the two runs' logits are
                gaps.append(f"gap {(top2[0] - top2[1]).item():.3f} of top {top2[0].item():.2f}, max|diff| {(a - b).abs().max().item():.3f}")
                tokt = tok1  # (follow the one-GPU sequence)
        return {"tokens_equal": f"{same}/12", "near_ties": ties, "differ_not_near_tie": bad, "logits_rel_err": worst,
                "mismatches": "; ".join(gaps) or "-"}

    # the one-GPU kernel against itself: its f32 atomics make runs differ in the last bits
    ca, cb = s1.new_caches("cuda:0"), s1.new_caches("cuda:0")
    tok, repeat = 7, 0
    for pos in range(12):
        oa, ob = one_gpu(tok, pos, ca), one_gpu(tok, pos, cb)
        repeat += int(oa["next_token"][0]) == int(ob["next_token"][0])
        tok = int(oa["next_token"][0])
    rows = {name: {"preset": preset, "variant": name, "one_gpu_repeat_equal": f"{repeat}/12", **greedy(kt)}
            for name, kt in kts.items()}
    # ms/token at context CTX, the kernels interleaved round by round
    c1 = {n: torch.randn_like(c) for n, c in s1.new_caches("cuda:0").items()}
    ct = split(c1)
    x1 = torch.tensor([3], dtype=torch.int32, device="cuda:0")
    xt = [{"token": torch.tensor([3], dtype=torch.int32, device=f"cuda:{r}"), **ct[r]} for r in range(TP)]

    def sync():
        for r in range(TP):
            torch.cuda.synchronize(r)

    runs = {"tp1": lambda: k1(token=x1, pos=CTX, check=False, **c1),
            **{name: (lambda kt=kt: kt(xt, pos=CTX, check=False)) for name, kt in kts.items()}}
    ms = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            ms[name].append(timed(run, sync))
    k1.check()
    for kt in kts.values():
        kt.check()
    med = {name: statistics.median(v) for name, v in ms.items()}
    for name, row in rows.items():
        row.update({"tp1_ms": med["tp1"], f"tp{TP}_ms": med[name], "speedup": med["tp1"] / med[name],
                    "spread_ms": max(ms[name]) - min(ms[name])})
    return list(rows.values())


if __name__ == "__main__":
    if sys.argv[1] == "--save":
        _, _, (g2, _) = graphs(sys.argv[2])
        cached_artifact(g2, max_dims=MAX, dims_hint={"pos": CTX}).save(sys.argv[3])
    elif sys.argv[1] == "--build":
        for p in sys.argv[2:]:
            build(p)
    else:
        rows = [r for p in sys.argv[1:] for r in probe(p)]
        for r in rows:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
