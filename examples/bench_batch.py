"""Batched decode and prompt prefill: the step graph's megakernel against torch.compile, in ONE run.

    python examples/bench_decode.py --preset llama-3.2-1b --batch 1,4,16,64 --prefill 512,2048
    python examples/bench_batch.py --preset llama-3.2-1b            (the same, these defaults)
    python examples/bench_batch.py --dry-run                          (CPU smoke test: tiny, sim)

A flag given is used as given (--dry-run changes only the defaults: tiny, --batch 1,3, --prefill 8,
--context 8, --iters 2, --warmup 0); a combination that cannot run is one ``error:`` line.

Decode at batch B: B sequences (cache slots 0..B-1, random caches) each add one token at position
``--context``, one launch for all: ms/step and tokens/s, the megakernel (``build_step_graph``,
compiled once for every B) against ``torch.compile(mode="reduce-overhead")`` of
:class:`~megaegg.models.torch_batch.PlainBatch`'s step at that B. The batch-1 row also times the
megakernel of the batch-1 decode graph (what a lone sequence decodes with). Prefill of T tokens:
one prompt into slot 0, time to its first token (the last row's logits and argmax), the megakernel
in one launch against ``torch.compile`` of the peer's prefill (default mode, a trace per T), with the
FLOP rate each reaches (``prefill_flops``) as a share of the dense bf16 rate measured in the same run
(an 8192-cube ``torch.matmul``). A mixed step: the largest batch decoding while a prompt of the first
prefill length joins (a chunked-prefill step, one launch), against the two as separate launches.
Logits are checked against the peer's in the same run. A table is printed last; ``--json PATH``
keeps it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import megaegg as me
from megaegg.models import PRESETS, ModelConfig, build_decode_graph, build_step_graph, random_weights
from megaegg.models.cli import OneLineParser, non_negative_int, positive_int
from megaegg.models.torch_batch import PlainBatch

TOKEN = 1234


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int_list, default=None,
                   help="decode batch sizes, e.g. 1,4,16,64 (the batch bench's default; 1,3 dry-run)")
    p.add_argument("--prefill", type=int_list, default=None,
                   help="prompt lengths to prefill, e.g. 512,2048 (the batch bench's default; 8 dry-run)")


# the batch bench's defaults: (normal, --dry-run); a flag given explicitly is never changed
DEFAULTS = {"preset": ("llama-3.2-1b", "tiny"), "batch": ([1, 4, 16, 64], [1, 3]), "prefill": ([512, 2048], [8]),
            "context": (512, 8), "iters": (50, 2), "warmup": (5, 0)}


def resolve(a: argparse.Namespace, error) -> argparse.Namespace:
    """Fill the flags not given (None) with the defaults of the mode (``--dry-run`` or not), then check that the
    combination can run (``error(message)``: one line, exits)."""
    for name, (normal, dry) in DEFAULTS.items():
        if getattr(a, name, None) is None:
            setattr(a, name, list(dry if a.dry_run else normal) if isinstance(normal, list) else
                    dry if a.dry_run else normal)
    positions = ModelConfig.preset(a.preset).max_positions
    if a.context >= positions:  # the decode step at pos = context reads context + 1 cache rows
        error(f"--context {a.context} must be below {a.preset}'s max_position_embeddings ({positions})")
    if max(a.prefill) > positions:
        error(f"--prefill {max(a.prefill)} is above {a.preset}'s max_position_embeddings ({positions})")
    return a


def prefill_iters(a: argparse.Namespace) -> tuple[int, int]:
    """Timed and warm-up calls of a prefill row: a fifth of --iters but at least 3 (never more than --iters),
    and at most one warm-up (never more than --warmup)."""
    return min(a.iters, max(3, a.iters // 5)), min(a.warmup, 1)


def json_path(text: str) -> str:
    """An argparse type: a file to write the report to, whose folder must exist (checked before the run, not after)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no directory {path.absolute().parent}")
    return text


def parse(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model preset, random weights (default llama-3.2-1b; tiny dry-run)")
    p.add_argument("--context", type=non_negative_int, default=None,
                   help="positions already cached for decode (default 512; 8 dry-run)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed decode steps per batch size (default 50; 2 dry-run); a prefill row times a fifth "
                        "of them, at least 3 and at most --iters")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed decode steps first (default 5; 0 dry-run); a prefill row at most 1")
    p.add_argument("--json", metavar="PATH", type=json_path)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke test: the preset (default tiny) in f32 on the simulator, no torch.compile")
    add_arguments(p)
    return resolve(p.parse_args(argv), p.error)


def timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median ms of single calls (CUDA events, or wall time on the CPU)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(iters):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append(1e3 * (time.perf_counter() - t0))
    return sorted(ms)[len(ms) // 2]


def prefill_flops(cfg: ModelConfig, t: int) -> float:
    """FLOPs of a t-token prefill that yields one token: every linear of every row (2 per weight
    element; a MoE layer: the router and the top_k experts a row chose), causal attention (QK^T and PV
    over t (t + 1) / 2 pairs a head), the LM head of one row."""
    h, d = cfg.hidden, cfg.head_dim
    attention_weights = h * d * (2 * cfg.heads + 2 * cfg.kv_heads)
    mlp = [h * cfg.moe.experts + 3 * h * cfg.moe.intermediate * cfg.moe.top_k if cfg.is_sparse(i)
           else 3 * h * cfg.intermediate for i in range(cfg.layers)]
    attention = 2 * 2 * cfg.heads * d * t * (t + 1) / 2
    return sum(2.0 * (attention_weights + m) * t + attention for m in mlp) + 2.0 * h * cfg.vocab


def dense_rate(cuda: bool) -> float | None:
    """TFLOP/s of an 8192-cube bf16 torch.matmul on this GPU (median of 5), None on the CPU."""
    if not cuda:
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, 5, 2, True)
    return 2 * 8192 ** 3 / ms / 1e9


def run(a: argparse.Namespace) -> dict:
    cuda = not a.dry_run
    device = "cuda" if cuda else "cpu"
    cfg = ModelConfig.preset(a.preset)
    if a.dry_run:
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    torch.set_grad_enabled(False)
    slots, longest = max(a.batch) + 1, max(a.prefill)  # (+1: the mixed step's prompt joins the largest batch)
    max_len = max(a.context + 1, longest)
    graph, spec = build_step_graph(cfg, max_len=max_len, slots=slots)
    weights = random_weights(spec, seed=0, device=device)
    backend = "cuda" if cuda else "sim"
    t0 = time.perf_counter()
    kernel = me.compile(graph, weights, backend=backend,
                        max_dims={"n": max(longest, min(a.prefill) + max(a.batch)), "r": slots, "ctx": max_len},
                        dims_hint={"n": 16, "r": 16, "ctx": a.context + 1})
    report = {"preset": f"{a.preset} (dry run)" if a.dry_run else a.preset, "context": a.context, "rows": [],
              "step_compile_s": time.perf_counter() - t0, "dense_tflops": dense_rate(cuda),
              "regime": str(kernel.program.regime) if kernel.program.regime else None}
    log(f"step graph compiled in {report['step_compile_s']:.1f} s ({len(kernel.queue.entries)} queue entries)")
    gen = torch.Generator(device=device).manual_seed(1)
    caches = {n: (torch.randn(s, generator=gen, device=device) * 0.5).to(cfg.dtype.torch) for n, s in spec.caches.items()}
    peer = PlainBatch(cfg, weights, max_len=max_len, slots=slots, device=device)
    for name, c in caches.items():  # the peer starts from the same caches
        layer, kind = int(name.split(".")[1]), name[0]
        peer.layers[layer][kind].copy_(c)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731

    def mega_step(ins: dict, dims: dict):
        """The launch alone (as bench_decode times it: ``kernel.launcher``), after one checked call for the logits."""
        logits = kernel(**ins, **caches, **dims)["logits"]
        return logits, kernel.launcher(**ins, **caches, **dims)

    def compiled(fn, mode):
        if not cuda:
            return fn
        for t in peer.caches():
            torch._dynamo.mark_static_address(t)
        return torch.compile(fn, mode=mode, fullgraph=True)

    decode_one = None
    if 1 in a.batch:  # a lone sequence decodes with the batch-1 decode graph
        dg, dspec = build_decode_graph(cfg, max_len=max_len, logits=False)
        decode_one = me.compile(dg, weights, backend=backend, max_dims={"pos": max_len - 1}, dims_hint={"pos": a.context})
    for b in a.batch:
        ins = {"token": i32([TOKEN % cfg.vocab] * b), "pos": i32([a.context] * b), "slot": i32(list(range(b))),
               "out": i32(list(range(b)))}
        row = {"kind": "decode", "batch": b}
        got, step = mega_step(ins, {"n": b, "r": b, "ctx": a.context + 1})
        row["megakernel_ms"] = timed(step, a.iters, a.warmup, cuda)
        step.check()  # raises if a timed launch hit a device-side error
        if b == 1 and decode_one is not None:
            views = {n: c[0] for n, c in caches.items()}
            one = decode_one.launcher(token=ins["token"], pos=a.context, **views)
            row["decode_graph_ms"] = timed(one, a.iters, a.warmup, cuda)
            one.check()
        fn = compiled(peer.decode, "reduce-overhead")
        pos = torch.full((b,), a.context, dtype=torch.int64, device=device)

        def call():
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            return fn(ins["token"], pos)

        want = call()[0].clone()
        row["torch_compile_ms"] = timed(call, a.iters, a.warmup, cuda)
        row["rel_err"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
        report["rows"].append(row)
        log(f"decode batch {b}: megakernel {row['megakernel_ms']:.3f} ms, torch.compile {row['torch_compile_ms']:.3f} ms")
    for t in a.prefill:
        toks = (torch.arange(t, device=device, dtype=torch.int32) * 7919) % cfg.vocab
        ins = {"token": toks, "pos": i32(list(range(t))), "slot": i32([0] * t), "out": i32([t - 1])}
        row = {"kind": "prefill", "tokens": t}
        got, step = mega_step(ins, {"n": t, "r": 1, "ctx": t})
        row["megakernel_ms"] = timed(step, *prefill_iters(a), cuda)
        step.check()  # raises if a timed launch hit a device-side error
        fn = compiled(peer.prefill, "default")
        want = fn(toks)[0].clone()
        row["torch_compile_ms"] = timed(lambda: fn(toks), *prefill_iters(a), cuda)
        row["rel_err"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
        row["flops"] = prefill_flops(cfg, t)
        report["rows"].append(row)
        log(f"prefill {t}: megakernel {row['megakernel_ms']:.3f} ms, torch.compile {row['torch_compile_ms']:.3f} ms")
    # a mixed step: the largest batch decodes one token each while a prompt joins in slot B, in one launch
    b, t = max(a.batch), min(a.prefill)
    toks = [TOKEN % cfg.vocab] * b + [int(x) for x in (torch.arange(t) * 7919) % cfg.vocab]
    ins = {"token": i32(toks), "pos": i32([a.context] * b + list(range(t))), "slot": i32(list(range(b)) + [b] * t),
           "out": i32(list(range(b)) + [b + t - 1])}
    _, step = mega_step(ins, {"n": b + t, "r": b + 1, "ctx": max(a.context + 1, t)})
    row = {"kind": "mixed", "batch": b, "tokens": t, "megakernel_ms": timed(step, *prefill_iters(a), cuda)}
    step.check()
    apart = [r["megakernel_ms"] for r in report["rows"] if (r["kind"], r.get("batch"), r.get("tokens")) in
             (("decode", b, None), ("prefill", None, t))]
    row["apart_ms"] = sum(apart) if len(apart) == 2 else None
    report["rows"].append(row)
    log(f"mixed step (batch {b} + a {t}-token prompt): megakernel {row['megakernel_ms']:.3f} ms")
    return report


def table(report: dict) -> str:
    peak = report.get("dense_tflops")
    lines = [f"{report['preset']}, decode at context {report['context']}; torch.compile = PlainBatch "
             "(reduce-overhead for decode, default for prefill); row regime: " + str(report.get("regime")),
             "| step | megakernel ms | tokens/s | torch.compile ms | tokens/s | vs torch.compile | rel err |",
             "|---|---|---|---|---|---|---|"]
    one = next((r for r in report["rows"] if r["kind"] == "decode" and r["batch"] == 1), None)
    for r in report["rows"]:
        if r["kind"] == "mixed":
            continue
        n = r["batch"] if r["kind"] == "decode" else r["tokens"]
        what = f"decode batch {n}" if r["kind"] == "decode" else f"prefill {n} tokens"
        lines.append(f"| {what} | {r['megakernel_ms']:.3f} | {1e3 * n / r['megakernel_ms']:.0f} | "
                     f"{r['torch_compile_ms']:.3f} | {1e3 * n / r['torch_compile_ms']:.0f} | "
                     f"{r['torch_compile_ms'] / r['megakernel_ms']:.2f}x | {r['rel_err']:.1e} |")
    prefills = [r for r in report["rows"] if r["kind"] == "prefill"]
    if prefills:
        rate = f"{peak:.0f} TFLOP/s (8192-cube torch.matmul, this run)" if peak else "not measured"
        lines.append(f"prefill FLOP rate (dense bf16 rate: {rate}):")
        for r in prefills:
            mega, torch_ = r["flops"] / r["megakernel_ms"] / 1e9, r["flops"] / r["torch_compile_ms"] / 1e9
            pct = (lambda x: f" ({100 * x / peak:.0f}%)") if peak else (lambda x: "")
            lines.append(f"  {r['tokens']} tokens: megakernel {mega:.0f} TFLOP/s{pct(mega)}, torch.compile "
                         f"{torch_:.0f} TFLOP/s{pct(torch_)}; time to first token {r['megakernel_ms']:.2f} ms")
    for r in report["rows"]:
        if r["kind"] == "mixed":
            apart = f"; as two launches {r['apart_ms']:.3f} ms" if r.get("apart_ms") else ""
            lines.append(f"mixed step, batch {r['batch']} decoding + a {r['tokens']}-token prompt: "
                         f"{r['megakernel_ms']:.3f} ms{apart}")
    if one and "decode_graph_ms" in one:
        lines.append(f"batch-1 decode graph (a lone sequence): {one['decode_graph_ms']:.3f} ms")
        for r in report["rows"]:
            if r["kind"] == "decode" and r["batch"] > 1:
                lines.append(f"decode batch {r['batch']} step / batch-1 decode graph: "
                             f"{r['megakernel_ms'] / one['decode_graph_ms']:.2f}x")
    return "\n".join(lines)


def main(argv=None, a: argparse.Namespace | None = None) -> dict:
    a = a or parse(argv)
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on the GPU machine, or use --dry-run for a CPU smoke test")
    report = run(a)
    print(table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
