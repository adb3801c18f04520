"""The traced decode step against the hand-built one (issue 41), in ONE run: a Hugging Face model through
``megaegg.from_transformers`` and the same preset through ``megaegg.models.build_decode_graph``.

    python examples/bench_hf.py --preset llama-3.2-1b,qwen3-8b --context 512 --json out.json
    python examples/bench_hf.py --dry-run          # CPU smoke test: the tiny preset, f32, sim backend

Per preset: the transformers model built from the preset's config.json (random weights, seed 0, bf16) and
compiled by ``from_transformers`` (its decode step); the hand-built decode graph of the same config with its
own random weights (the timing does not depend on the values). Both step at position ``--context`` (the
caches hold random rows), each a ``launcher`` (checked once, then bare launches), timed in alternating
rounds (CUDA events around each launch: bench_batch.timed's median a round; the median of the rounds). Printed: ms a step of each, their ratio, and the block ops
of each kernel by kind (where the programs differ: docs/frontend.md, "The traced and the hand-built paths").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter

import torch

import bench_batch
import megaegg as me
from megaegg.models import PRESETS, ModelConfig, build_decode_graph, random_weights
from megaegg.models.cli import OneLineParser, positive_int


def hf_model(preset: str, dtype: torch.dtype, device: str):
    """The transformers causal LM of a preset's config.json, random weights (seed 0)."""
    import transformers

    cfg = dict(PRESETS[preset])
    cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # (built in the dtype: no f32 copy of an 8B model first)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def kinds(kernel) -> dict[str, int]:
    return dict(Counter(e.op.kind for e in kernel.queue.entries))


def bench(preset: str, a) -> dict:
    cuda = a.backend == "cuda"
    device = "cuda" if cuda else "cpu"
    cfg = ModelConfig.preset(preset)
    dtype = torch.float32 if a.dry_run else cfg.dtype.torch
    max_len = a.context + 1
    t0 = time.perf_counter()
    model = hf_model(preset, dtype, device)
    lm = me.from_transformers(model, max_len=max_len, backend=a.backend)
    traced_s = time.perf_counter() - t0
    del model
    gen = torch.Generator(device=device).manual_seed(1)
    for c in lm.caches:
        c.copy_(torch.randn(c.shape, generator=gen, device=device).to(c.dtype) * 0.5)
    ids = torch.tensor([[1234 % cfg.vocab]], dtype=torch.int64, device=device)
    traced = lm.kernel.launcher(ids, lm.rows[:max_len], *lm.caches)

    t0 = time.perf_counter()
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=0, device=device)
    built_kernel = me.compile(graph, weights, backend=a.backend, dims_hint={"pos": a.context})
    built_s = time.perf_counter() - t0
    caches = {n: (torch.randn(s, generator=gen, device=device) * 0.5).to(spec.dtype.torch) for n, s in spec.caches.items()}
    token = torch.tensor([1234 % cfg.vocab], dtype=torch.int32, device=device)
    built = built_kernel.launcher(token=token, pos=a.context, **caches)

    ms = {"traced": [], "built": []}
    for r in range(a.rounds):  # alternating rounds: drifts (clocks, heat) hit both alike
        warmup = 3 if r == 0 else 0
        ms["traced"].append(bench_batch.timed(traced, a.iters, warmup, cuda))
        ms["built"].append(bench_batch.timed(built, a.iters, warmup, cuda))
    traced.check()
    built.check()
    out = {"preset": preset, "context": a.context, "backend": a.backend,
           "traced_ms": statistics.median(ms["traced"]), "built_ms": statistics.median(ms["built"]),
           "traced_compile_s": traced_s, "built_compile_s": built_s,
           "traced_ops": kinds(lm.kernel.kernel), "built_ops": kinds(built_kernel)}
    out["ratio"] = out["traced_ms"] / out["built_ms"]
    return out


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b", help="comma-separated presets (default llama-3.2-1b)")
    ap.add_argument("--context", type=positive_int, default=512, help="cached rows the step attends to (default 512)")
    ap.add_argument("--iters", type=positive_int, default=30, help="timed launches a round (default 30)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if available, else sim")
    ap.add_argument("--dry-run", action="store_true", help="the tiny preset in f32 on the simulator (a CPU smoke test)")
    ap.add_argument("--json", type=bench_batch.json_path, help="write the results here")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.preset, a.backend, a.context, a.iters, a.rounds = "tiny", "sim", min(a.context, 16), 1, 1
    a.backend = a.backend or ("cuda" if torch.cuda.is_available() else "sim")
    presets = a.preset.split(",")
    for p in presets:
        if p not in PRESETS:
            ap.error(f"--preset: unknown preset {p!r} (known: {', '.join(sorted(PRESETS))})")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_hf: needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    rows = [bench(p, a) for p in presets]
    print(f"{'preset':16s} {'hand-built ms':>14s} {'traced ms':>10s} {'traced / built':>15s}   ({a.backend}, context {a.context})")
    for r in rows:
        print(f"{r['preset']:16s} {r['built_ms']:14.3f} {r['traced_ms']:10.3f} {r['ratio']:15.3f}")
    for r in rows:
        diff = {k: (r["built_ops"].get(k, 0), r["traced_ops"].get(k, 0)) for k in sorted(set(r["built_ops"]) | set(r["traced_ops"]))
                if r["built_ops"].get(k, 0) != r["traced_ops"].get(k, 0)}
        print(f"{r['preset']}: block ops (built, traced) where they differ: {diff or 'none'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
