"""``python -m megaegg inspect --model PRESET|DIR``: the block program, barriers, queue and compile times.

``--model`` is a preset name or a checkpoint folder (its ``config.json``, read as the examples read it;
a folder of that name wins over a preset).

``--timings`` prints a table of the compile stages instead of the program; ``--layers N``
changes the preset's layer count (compile time against depth:
``python -m megaegg inspect --model llama-3.2-1b --layers 64 --timings``).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from pathlib import Path

from .graph import GraphError
from .models import PRESETS, ModelConfig, build_decode_graph, read_config


def model_config(model: str) -> ModelConfig:
    """``--model``: a checkpoint folder's config (if a folder of that name exists), else a preset's."""
    path = Path(model)
    if path.is_dir():
        return read_config(path)
    if model in PRESETS:
        return ModelConfig.preset(model)
    if path.exists():
        raise GraphError(f"--model {model}: not a folder (give a checkpoint folder with a config.json, or a preset)")
    raise GraphError(f"--model {model}: no such preset or checkpoint folder (presets: {', '.join(sorted(PRESETS))})")


def inspect(preset: str, *, context: int, max_len: int, cuda: bool, layers: int | None = None, timings: bool = False,
            out=sys.stdout) -> dict:
    """``preset``: a preset name or a checkpoint folder (see :func:`model_config`)."""
    from .compiler import build_artifact

    cfg = model_config(preset)
    if layers is not None:
        cfg = dataclasses.replace(cfg, layers=layers)
    max_len = min(max_len, cfg.max_positions)
    if not 0 <= context < max_len:
        raise GraphError(f"--context {context} must be below the cache length {max_len}")
    t0 = time.perf_counter()
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    t_graph = time.perf_counter() - t0
    art = build_artifact(graph, max_dims={"pos": max_len - 1}, dims_hint={"pos": context}, compile_cuda=cuda)
    q = art.queue
    env = {"pos": context}
    names = {n.id: n.op for n in graph.nodes}
    p = lambda *a: print(*a, file=out)  # noqa: E731
    if timings:
        print_timings(p, f"{preset} ({cfg.layers} layers)", graph, {"graph": t_graph, **art.timings})
        return {"entries": len(q.entries), "timings": art.timings}
    p(f"{preset}: {len(graph.nodes)} graph nodes, {spec.weight_bytes / 1e9:.3f} GB of weights, context {context}")
    p(f"{'op':>5} {'kind':<15} {'fused source ops':<44} {'launch':>12} {'tile':<18} {'MB':>8} {'waits':>5}")
    total_bytes = total_inst = 0
    for e in q.entries:
        op = e.op
        srcs = "+".join(names[s] for s in op.sources)
        tile = ",".join(f"{k}={op.params[k]}" for k in ("rows", "rows_per", "chunk", "tile") if k in op.params)
        inst = e.launch.eval(env)
        mb = op.estimate.bytes / 1e6 if op.estimate else 0.0
        total_bytes += op.estimate.bytes if op.estimate else 0
        total_inst += inst
        p(f"{op.id:>5} {op.kind:<15} {srcs[:44]:<44} {inst:>5} {str(op.launch_count)[:6]:>6} {tile[:18]:<18} {mb:>8.3f} {len(e.waits):>5}")
    s = q.summary()
    waits_per_launch = sum(len(e.waits) * e.launch.eval(env) for e in q.entries)
    p(f"totals: {len(q.entries)} queue entries (block ops), {total_inst} instances, {total_bytes / 1e9:.3f} GB estimated traffic")
    p(f"barriers: {s['barrier_sets']} barrier sets, {s['counters']} counters per parity, {s['waits']} waits in the queue, "
      f"{waits_per_launch} waits per launch at context {context}")
    p(f"memory: arena {s['arena_bytes'] / 1e6:.2f} MB")
    p("compile time (s): graph {:.3f}; ".format(t_graph) + "; ".join(f"{k} {v:.3f}" for k, v in art.timings.items()))
    return {"entries": len(q.entries), "instances": total_inst, **s, "timings": art.timings}


def print_timings(p, what: str, graph, timings: dict) -> None:
    """One row per compile stage: seconds and share of the total (sub-stages indented)."""
    from .rewrite.layers import find_repeats

    rep = find_repeats(graph)
    shown = {k: v for k, v in timings.items() if k != "nvrtc_cached"}
    total = sum(v for k, v in shown.items() if "." not in k)
    p(f"{what}: {len(graph.nodes)} graph nodes; "
      + (f"{rep.count} identical blocks of {rep.period} nodes, rewritten once" if rep else "no repeated blocks"))
    p(f"{'stage':<26} {'s':>8} {'%':>6}")
    for k, v in shown.items():
        name = ("  " + k.split(".", 1)[1]) if "." in k else k
        if k == "nvrtc" and timings.get("nvrtc_cached"):
            name += " (cached)"
        p(f"{name:<26} {v:>8.3f} {100 * v / total if total else 0:>5.1f}%")
    p(f"{'total':<26} {total:>8.3f}")


def main(argv=None) -> None:
    from .models.cli import OneLineParser, non_negative_int, positive_int

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the OpenAI-compatible server: its own flags (megaegg/serve.py)
        from .serve import main as serve

        try:
            raise SystemExit(serve(argv[1:]))
        except GraphError as e:
            raise SystemExit(f"error: {'; '.join(x.strip() for x in str(e).splitlines() if x.strip())}") from None

    ap = OneLineParser(prog="python -m megaegg")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server (python -m megaegg serve --help)", add_help=False)
    ins = sub.add_parser("inspect", help="print the compiled block program of a preset model or a checkpoint's")
    ins.add_argument("--model", default="tiny", metavar="PRESET|DIR",
                     help=f"a preset ({', '.join(sorted(PRESETS))}) or a Hugging Face checkpoint folder "
                          "(its config.json; no weights are read) (default: %(default)s)")
    ins.add_argument("--context", type=non_negative_int, default=512, help="tokens in the KV cache (default: 512)")
    ins.add_argument("--max-len", type=positive_int, default=4096,
                     help="KV cache rows, capped by max_position_embeddings")
    ins.add_argument("--cuda", action="store_true", help="also compile the CUDA source with NVRTC (timed)")
    ins.add_argument("--layers", type=positive_int, default=None, help="change the preset's number of layers")
    ins.add_argument("--timings", action="store_true", help="print the compile stages' times instead of the program")
    a = ap.parse_args(argv)
    try:
        inspect(a.model, context=a.context, max_len=a.max_len, cuda=a.cuda, layers=a.layers, timings=a.timings)
    except GraphError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise SystemExit(f"error: {'; '.join(lines)}") from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
