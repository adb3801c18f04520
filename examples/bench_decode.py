"""Batch-1 decode, one token per step: the megakernel against PyTorch and the memory floor, in ONE run.

    python examples/bench_decode.py --preset llama-3.2-1b --context 512 --json out.json
    python examples/bench_decode.py --preset qwen3-8b --max-autotune
    python examples/bench_decode.py --dry-run          # CPU smoke test: tiny preset, f32, sim backend
    python examples/bench_decode.py --preset llama-3.2-1b --batch 1,4,16,64 --prefill 512,2048
                                                       # batches and prefill instead (examples/bench_batch.py)

What it does (docs/design.md, "Performance facts"):
1. read bandwidth: a >= 4 GiB tensor summed (f32 and bf16 views, read only), CUDA-event
   timed, median of several; a device-to-device copy for reference;
2. the floor: (weight bytes read + KV bytes read at ``--context``) / read bandwidth;
3. random weights (``random_weights``, seed 0, the model dtype) shared by every variant,
   KV caches filled with random data (``max_len = context + 1``, the step runs at
   ``pos = context`` and reads ``context + 1`` rows);
4. median ms/step (CUDA events around each single step, steps back to back, after
   warm-up) of the megakernel (``kernel.launcher(...)``: the call checked once, then bare launches) and
   two families of PyTorch peers:

   - "ref-rounding ...": :class:`~megaegg.models.torch_decode.TorchDecoder`, which rounds
     like the reference (norms / RoPE in fp32 with a rounding after each, fused q/k/v and
     gate/up, SDPA): "ref-rounding eager", "ref-rounding CUDA graph" (the step captured
     once), "ref-rounding torch.compile reduce-overhead" (and "... max-autotune" with
     ``--max-autotune``); ``--skip-ref-rounding`` skips them;
   - "plain ...": :class:`~megaegg.models.torch_plain.PlainDecoder`, the step as a
     performance-minded user writes it (gpt-fast style: ``F.rms_norm``, concatenated
     q/k/v and gate/up weights, SDPA with ``enable_gqa`` over the static cache, bf16 but
     for fp32 RoPE; ``--plain-attention grouped`` views q per KV head instead):
     "plain eager", "plain CUDA graph", "plain torch.compile" (default mode, fullgraph),
     "plain torch.compile reduce-overhead" (and "plain torch.compile max-autotune" with
     ``--max-autotune``).

   ``--skip-compile-baseline`` skips every torch.compile variant; ``--dry-run`` reports
   them (and the CUDA graphs) as skipped. One family's decoder is dropped before the
   next is built (each holds a copy of the q/k/v and gate/up weights), and both before
   the megakernel: at most one extra copy of those weights is alive at a time;
5. correctness in the same run: every peer's and the megakernel's logits vs the exact
   step (TorchDecoder with the reference's fp32 attention arithmetic) at that position:
   rel err and whether the greedy next token is equal (and vs ``megaegg.run_reference``);
6. compile times: megakernel cold (fresh ``MEGAEGG_CACHE``) and warm (artifact cache hit),
   and torch.compile's;
7. a table, printed last, and everything as JSON (``--json``). "vs best peer" is the
   fastest PyTorch variant's ms (the best peer: any timed row but the megakernel and
   the floor) over the row's ms; the header names it, and the JSON has ``best_peer``
   and each variant's ``vs_best_peer``. "vs eager" / "vs CUDA graphs" /
   "vs torch.compile" are against the fastest variant of that kind.

A variant that fails (OOM, a compile error, ...) is reported in the table, not fatal.

A flag given is used as given: ``--dry-run`` changes only defaults (the tiny preset, context 16, 2 timed
steps and no warm-up, a 0.25 GiB bandwidth test), and ``--batch`` / ``--prefill`` run the batch bench with
its defaults for the flags not given (examples/bench_batch.py). A flag that the chosen bench does not use
(``--tp`` with ``--batch``, ``--tp-only`` without ``--tp``, ...) is one ``error:`` line naming both.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

import bench_batch
import megaegg as me
from megaegg.models import PRESETS, ModelConfig, build_decode_graph, random_weights
from megaegg.models.cli import OneLineParser, non_negative_int, positive_float, positive_int
from megaegg.models.torch_decode import TorchDecoder
from megaegg.models.torch_plain import ATTENTION as PLAIN_ATTENTION
from megaegg.models.torch_plain import PlainDecoder

WARN_REL_ERR = 3e-2
CHECKS = ("torch exact logits", "reference check")  # untimed steps: not rows of the table
REF, PLAIN = "ref-rounding", "plain"  # the two families of PyTorch peers (row-name prefixes)
TOKEN = 1234  # the token fed at every timed step (mod vocab)


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def parse(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="\n".join(__doc__.split("\n")[1:]))
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model preset (random weights); required unless --dry-run (then default tiny)")
    p.add_argument("--context", type=non_negative_int, default=None,
                   help="tokens already in the KV cache (default 512; 16 dry-run; with --batch: 512, 8 dry-run)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed steps per variant (default 100; 2 dry-run; with --batch: 50, 2 dry-run)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed steps first (default 20; 0 dry-run; with --batch: 5, 0 dry-run)")
    p.add_argument("--max-autotune", action="store_true", help="also time torch.compile(mode='max-autotune')")
    p.add_argument("--skip-compile-baseline", action="store_true", help="skip every torch.compile variant")
    p.add_argument("--skip-ref-rounding", action="store_true",
                   help="skip the reference-rounding peers (TorchDecoder eager / CUDA graph / torch.compile)")
    p.add_argument("--plain-attention", choices=PLAIN_ATTENTION, default=None,
                   help="the plain peer's attention: SDPA with enable_gqa (default), or q grouped per KV head")
    p.add_argument("--no-reference-check", action="store_true", help="skip the check against megaegg.run_reference")
    p.add_argument("--bw-gib", type=positive_float, default=None,
                   help="size of the bandwidth test tensor (GiB, default 4; 0.25 dry-run)")
    p.add_argument("--bw-reps", type=positive_int, default=None,
                   help="timed repetitions of each bandwidth test (default 10)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="also time the model tensor parallel over this many GPUs (megaegg.parallel), one megakernel "
                        "each; its %% of floor is of the ONE-GPU floor; PyTorch TP peers over NCCL in N processes")
    p.add_argument("--tp-only", action="store_true",
                   help="with --tp: skip the one-GPU PyTorch peers (the TP rows, the one-GPU megakernel and the "
                        "exact check still run)")
    p.add_argument("--json", metavar="PATH", type=bench_batch.json_path, help="write all results as JSON to PATH")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke test: tiny preset in f32, megakernel on the sim backend, CUDA-only parts skipped")
    bench_batch.add_arguments(p)
    a = p.parse_args(argv)
    if a.preset is None and not a.dry_run:
        p.error("--preset is required (or --dry-run)")
    if a.batch is not None or a.prefill is not None:  # the batch bench: its own defaults, and only its flags
        mode = "--batch" if a.batch is not None else "--prefill"
        for flag in BATCH_1_ONLY:
            dest = flag[2:].replace("-", "_")
            if getattr(a, dest) not in (None, False):
                p.error(f"{flag} is a flag of the batch-1 bench; {mode} runs the batch bench "
                        f"(examples/bench_batch.py), which does not use it")
        return bench_batch.resolve(a, p.error)
    if a.tp_only and (a.tp or 1) < 2:
        p.error("--tp-only needs --tp N with N >= 2 (it skips the one-GPU PyTorch peers of a tensor-parallel run)")
    for name, normal, dry in (("preset", None, "tiny"), ("context", 512, 16), ("iters", 100, 2), ("warmup", 20, 0),
                              ("bw_gib", 4.0, 0.25), ("bw_reps", 10, 10), ("tp", 1, 1), ("plain_attention", "gqa", "gqa")):
        if getattr(a, name) is None:
            setattr(a, name, dry if a.dry_run else normal)
    positions = ModelConfig.preset(a.preset).max_positions
    if a.context >= positions:  # the step at pos = context reads context + 1 cache rows
        p.error(f"--context {a.context} must be below {a.preset}'s max_position_embeddings ({positions})")
    return a


# flags the batch bench (--batch / --prefill) does not use: given with it, an error rather than ignored
BATCH_1_ONLY = ("--max-autotune", "--skip-compile-baseline", "--skip-ref-rounding", "--plain-attention",
                "--no-reference-check", "--bw-gib", "--bw-reps", "--tp", "--tp-only")


# --- timing --------------------------------------------------------------------------
def summarize(ms: list[float]) -> dict:
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"ms": statistics.median(s), "mean_ms": statistics.fmean(s), "min_ms": s[0], "p10_ms": q(0.1),
            "p90_ms": q(0.9), "n": len(s)}


def time_steps(fn: Callable[[], object], *, iters: int, warmup: int, cuda: bool) -> dict:
    """Median ms per call: CUDA events around each single call (back to back), or wall time on the CPU."""
    for _ in range(warmup):
        fn()
    if not cuda:
        ms = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ms.append(1e3 * (time.perf_counter() - t0))
        return summarize(ms)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# --- bandwidth and floor ---------------------------------------------------------------
def measure_bandwidth(*, gib: float, reps: int, cuda: bool) -> dict:
    """Read bandwidth (a read-only sum of a large tensor) and device-to-device copy bandwidth, in TB/s."""
    device = "cuda" if cuda else "cpu"
    nbytes = int(gib * 2**30) // 64 * 64
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf.view(torch.float32).normal_()
    out = {"bytes": nbytes, "gib": nbytes / 2**30, "reps": reps}
    for name, view in (("sum_f32", buf.view(torch.float32)), ("sum_bf16", buf.view(torch.bfloat16))):
        t = time_steps(lambda v=view: v.sum(), iters=reps, warmup=2, cuda=cuda)
        out[f"{name}_ms"] = t["ms"]
        out[f"{name}_tbps"] = nbytes / (t["ms"] * 1e-3) / 1e12
    half = nbytes // 2
    src, dst = buf[:half], buf[half : 2 * half]
    t = time_steps(lambda: dst.copy_(src), iters=reps, warmup=2, cuda=cuda)
    out["copy_ms"] = t["ms"]
    out["copy_tbps"] = 2 * half / (t["ms"] * 1e-3) / 1e12  # bytes read + written
    out["read_tbps"] = max(out["sum_f32_tbps"], out["sum_bf16_tbps"])  # the faster read: the stricter floor
    del buf, src, dst
    free_memory(cuda)
    return out


def floor(cfg: ModelConfig, spec, context: int, read_tbps: float) -> dict:
    """The memory floor of one step at ``pos = context``: every weight once (of routed experts, the
    ``top_k`` chosen ones: ``spec.step_bytes``), plus ``context + 1`` KV rows."""
    item = cfg.dtype.itemsize
    weights_all = spec.weight_bytes
    # an untied embedding table is gathered, not streamed: one row of it is read
    unread = 0 if cfg.tie_embeddings else (cfg.vocab - 1) * cfg.hidden * item
    weights_read = spec.step_bytes - unread
    kv = 2 * cfg.layers * cfg.kv_heads * (context + 1) * cfg.head_dim * item
    bw = read_tbps * 1e12
    return {"weight_bytes": weights_all, "weight_bytes_read": weights_read, "kv_bytes": kv,
            "bytes": weights_read + kv, "ms": (weights_read + kv) / bw * 1e3,
            "ms_all_weights": (weights_all + kv) / bw * 1e3}


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# --- the shared setup --------------------------------------------------------------------
@dataclass
class Bench:
    args: argparse.Namespace
    cfg: ModelConfig
    graph: me.Graph
    spec: object
    weights: dict
    caches: dict  # the initial random KV caches (every variant starts from a copy)
    cuda: bool
    device: str
    context: int
    token: torch.Tensor  # int32[1]
    pos: torch.Tensor  # int64[1] == context
    decoders: dict = field(default_factory=dict)  # family -> the eager variant's decoder (shared with graph/compile)
    eager_logits: dict = field(default_factory=dict)  # family -> its eager step's logits at pos (CPU, f32)
    exact_logits: torch.Tensor | None = None  # TorchDecoder(attention="exact") logits: the correctness baseline
    exact_next: int | None = None
    broken: str | None = None  # set when the CUDA context is unusable
    results: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def timed(self, fn) -> dict:
        return time_steps(fn, iters=self.args.iters, warmup=self.args.warmup, cuda=self.cuda)


def setup(a: argparse.Namespace) -> Bench:
    cuda = not a.dry_run
    device = "cuda" if cuda else "cpu"
    cfg = ModelConfig.preset(a.preset)
    if a.dry_run:
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    max_len = a.context + 1  # the torch step reads all max_len rows: exactly the megakernel's context + 1
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=0, device=device)
    caches = random_caches(spec, device)
    token = torch.tensor([TOKEN % cfg.vocab], dtype=torch.int32, device=device)
    pos = torch.tensor([a.context], dtype=torch.int64, device=device)
    return Bench(a, cfg, graph, spec, weights, caches, cuda, device, a.context, token, pos)


def random_caches(spec, device) -> dict:
    """The bench's KV caches (every run draws the same ones: the tensor-parallel workers too)."""
    gen = torch.Generator(device=device).manual_seed(1)
    return {n: torch.randn(s, generator=gen, device=device).to(spec.dtype.torch) for n, s in spec.caches.items()}


def run_variant(b: Bench, name: str, fn: Callable[[Bench], dict]) -> None:
    """Run one variant; a failure is recorded (and shown in the table), never raised."""
    if b.broken:
        b.results[name] = {"status": "skipped", "error": f"CUDA context unusable after: {b.broken}"}
        return
    log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        res = fn(b)
        res.setdefault("status", "ok")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - egglog panics derive from BaseException
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        res = {"status": "oom" if oom else "failed", "error": f"{type(e).__name__}: {e}".strip(),
               "traceback": traceback.format_exc(limit=8)}
        log(f"{name} FAILED: {res['error'].splitlines()[0][:300]}")
        if b.cuda:
            try:
                torch.cuda.synchronize()
            except BaseException as e2:  # noqa: BLE001
                b.broken = f"{name}: {type(e2).__name__}: {str(e2).splitlines()[0] if str(e2) else ''}"
    res["wall_s"] = time.perf_counter() - t0
    b.results[name] = res
    if "ms" in res:
        log(f"{name}: {res['ms']:.4f} ms/step")
    free_memory(b.cuda)


def rel_errs(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float().cpu().reshape(-1), want.float().cpu().reshape(-1)
    return {"rel_err_max": ((got - want).abs().max() / want.abs().max()).item(),
            "rel_err_norm": ((got - want).norm() / want.norm()).item()}


def next_token_check(got_next: int, want_next: int, got: torch.Tensor, want: torch.Tensor) -> dict:
    """Greedy next tokens compared; where they differ, how far apart the two tokens' exact
    logits are against the largest logit error (random weights give near-ties)."""
    got, want = got.float().cpu().reshape(-1), want.float().cpu().reshape(-1)
    return {"next_token_equal": got_next == want_next, "next_token_gap": (want[want_next] - want[got_next]).item(),
            "logit_err_max": (got - want).abs().max().item()}


# --- the variants --------------------------------------------------------------------------
def vs_exact(b: Bench, logits: torch.Tensor, nxt: torch.Tensor) -> dict:
    """A variant's logits and greedy token at pos against the exact step's."""
    if b.exact_logits is None:
        return {}
    got = logits.float().cpu()
    return {"vs_exact": {**rel_errs(got, b.exact_logits),
                         **next_token_check(int(nxt.reshape(-1)[0]), b.exact_next, got, b.exact_logits)}}


def build_decoder(b: Bench, family: str):
    if family == REF:
        return TorchDecoder(b.cfg, b.weights, max_len=b.context + 1, device=b.device)
    return PlainDecoder(b.cfg, b.weights, max_len=b.context + 1, device=b.device, attention=b.args.plain_attention)


def drop_decoder(b: Bench, family: str) -> None:
    """Free a family's decoder (and its copy of the q/k/v and gate/up weights) before the next is built."""
    b.decoders.pop(family, None)
    free_memory(b.cuda)


def eager_decoder(b: Bench, family: str):
    dec = b.decoders.get(family)
    if dec is None:
        raise RuntimeError(f"needs the {family} eager decoder, which failed")
    return dec


def torch_eager(family: str) -> Callable[[Bench], dict]:
    def run(b: Bench) -> dict:
        drop_decoder(b, family)
        dec = build_decoder(b, family)
        dec.load_caches(b.caches)
        logits, nxt = dec.step(b.token, b.pos)
        b.eager_logits[family] = logits.float().cpu()
        check = vs_exact(b, logits, nxt)
        del logits, nxt
        res = b.timed(lambda: dec.step(b.token, b.pos))
        b.decoders[family] = dec  # only once it works: the CUDA graph and torch.compile variants reuse it
        return {**res, **check}

    return run


def torch_exact(b: Bench) -> dict:
    """The correctness baseline: the step with the reference's fp32 attention arithmetic.

    SDPA (the timed baselines) may round softmax probabilities to bf16 before P @ V; this
    one does not. Unfused, so it shares the weights' storage (no extra weight memory).
    """
    dec = TorchDecoder(b.cfg, b.weights, max_len=b.context + 1, device=b.device, fuse=False, attention="exact")
    dec.load_caches(b.caches)
    logits, nxt = dec.step(b.token, b.pos)
    b.exact_logits, b.exact_next = logits.float().cpu(), int(nxt.item())
    return {}


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` warmed up on a side stream (lazy inits, cuBLAS handles: off the capture), then captured
    once in a CUDA graph: the graph and the outputs its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def cuda_graph(family: str) -> Callable[[Bench], dict]:
    def run(b: Bench) -> dict:
        if not b.cuda:
            return {"status": "skipped", "error": "needs CUDA"}
        dec = eager_decoder(b, family)
        dec.load_caches(b.caches)
        graph, (logits, nxt) = capture(lambda: dec.step(b.token, b.pos))
        graph.replay()
        torch.cuda.synchronize()
        check = {"vs_eager": rel_errs(logits, b.eager_logits[family]), **vs_exact(b, logits, nxt)}
        res = b.timed(graph.replay)
        del graph, logits, nxt
        return {**res, **check}

    return run


def torch_compile(family: str, mode: str) -> Callable[[Bench], dict]:
    def run(b: Bench) -> dict:
        if b.args.dry_run:
            return {"status": "skipped", "error": "--dry-run: no torch.compile on the CPU"}
        dec = eager_decoder(b, family)
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        dec.load_caches(b.caches)
        for t in dec.caches.values():  # mutated in place: static addresses, so CUDA graphs stay on
            torch._dynamo.mark_static_address(t)
        step = torch.compile(dec, mode=mode, fullgraph=True)

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            return step(b.token, b.pos)

        t0 = time.perf_counter()
        logits, nxt = call()
        sync(b.cuda)
        first = time.perf_counter() - t0
        check = {"vs_eager": rel_errs(logits, b.eager_logits[family]), **vs_exact(b, logits, nxt)}
        for _ in range(2):  # reduce-overhead records its CUDA graph on a later call
            call()
        sync(b.cuda)
        steady = time.perf_counter() - t0
        del logits, nxt
        res = b.timed(call)
        skips = int(counters["inductor"].get("cudagraph_skips", 0))
        if skips and b.cuda and mode != "default":
            log(f"WARNING: torch.compile {mode} skipped CUDA graphs {skips} time(s) (see TORCH_LOGS=perf_hints)")
        del step
        torch._dynamo.reset()
        return {**res, "compile_first_call_s": first, "compile_s": steady, **check, "cudagraph_skips": skips}

    return run


# "torch.compile CUDA graph": the default-mode compiled step captured once by hand, as the eager one is;
# what reduce-overhead does, without a second inductor compile of the whole model.
TP_MODES = ("eager", "CUDA graph", "torch.compile", "torch.compile CUDA graph")


def torch_tp_peers(b: Bench, tp: int) -> None:
    """The plain step tensor parallel over ``tp`` processes, one GPU each, all-reducing over NCCL
    (gloo on the CPU), as eager, CUDA-graph replay and torch.compile rows ``plain tp=N ...``: the peers
    of the ``megakernel tp=N`` row. Each rank draws the bench's weights and caches and keeps its shard."""
    import torch.multiprocessing as mp

    names = [f"{PLAIN} tp={tp} {mode}" for mode in TP_MODES]
    if b.broken:
        b.results.update({n: {"status": "skipped", "error": f"CUDA context unusable after: {b.broken}"} for n in names})
        return
    if b.cuda and torch.cuda.device_count() < tp:
        b.results.update({n: {"status": "skipped", "error": f"needs {tp} GPUs"} for n in names})
        return
    log(f"{PLAIN} tp={tp}: {tp} worker processes ...")
    out = tempfile.mktemp(prefix="megaegg-tp-", suffix=".pt")
    a = b.args
    try:
        try:
            mp.spawn(torch_tp_worker, args=(tp, a.preset, b.context, a.iters, a.warmup, b.cuda,
                                            a.skip_compile_baseline, 29500 + os.getpid() % 1000, out), nprocs=tp)
        except Exception as e:  # noqa: BLE001
            if not os.path.exists(out):  # a worker failed before rank 0 saved the rows: every row says so
                b.results.update({n: {"status": "failed", "error": f"{type(e).__name__}: {e}".strip()[:2000]} for n in names})
                log(f"{PLAIN} tp={tp} FAILED: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
                return
            log(f"{PLAIN} tp={tp}: a worker failed; the modes finished before stay: {type(e).__name__}: {e}")
        rows = torch.load(out)
    finally:
        if os.path.exists(out):
            os.remove(out)
    for name, mode in zip(names, TP_MODES):
        row = rows.get(mode, {"status": "failed", "error": "a worker failed before this mode finished"})
        if "logits" in row:
            row.update(vs_exact(b, row.pop("logits"), row.pop("next")))
        b.results[name] = row


def torch_tp_worker(rank: int, tp: int, preset: str, context: int, iters: int, warmup: int, cuda: bool,
                    skip_compile: bool, port: int, out: str) -> None:
    """One rank of ``torch_tp_peers`` (a spawned process); rank 0 saves every mode's row to ``out``."""
    import torch.distributed as dist

    from megaegg.models import shard_caches, shard_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp)
    try:
        cfg = ModelConfig.preset(preset)
        if not cuda:
            cfg = dataclasses.replace(cfg, dtype=me.f32)
        _, full = build_decode_graph(cfg, max_len=context + 1)
        _, spec = build_decode_graph(cfg, max_len=context + 1, tp=tp)
        shards = shard_weights(spec, random_weights(full, seed=0, device=device), rank)
        caches = shard_caches(spec, random_caches(full, device), rank)
        dec = PlainDecoder.tensor_parallel(cfg, shards, tp=tp, max_len=context + 1, device=device)
        token = torch.tensor([TOKEN % cfg.vocab], dtype=torch.int32, device=device)
        pos = torch.tensor([context], dtype=torch.int64, device=device)
        rows = {}

        def measure(mode: str, step: Callable) -> None:
            if rank == 0:
                log(f"{PLAIN} tp={tp} {mode} ...")
            dec.load_caches(caches)
            logits, nxt = step()
            row = {"logits": logits.float().cpu(), "next": nxt.reshape(-1)[:1].cpu()}
            row.update(time_steps(step, iters=iters, warmup=warmup, cuda=cuda))
            rows[mode] = {**row, "status": "ok"}
            if rank == 0:  # saved as it goes: a run cut short keeps the modes it finished
                log(f"{PLAIN} tp={tp} {mode}: {row['ms']:.4f} ms/step")
                torch.save(rows, out)

        def captured(fn: Callable) -> Callable:  # a replay returning the captured outputs, as the step does
            graph, out = capture(fn)
            return lambda: (graph.replay(), out)[1]

        measure("eager", lambda: dec.step(token, pos))
        if cuda:
            measure("CUDA graph", captured(lambda: dec.step(token, pos)))
        else:
            rows["CUDA graph"] = {"status": "skipped", "error": "needs CUDA"}
        if skip_compile or not cuda:
            for mode in ("torch.compile", "torch.compile CUDA graph"):
                rows[mode] = {"status": "skipped", "error": "--skip-compile-baseline" if cuda else "needs CUDA"}
        else:
            torch._dynamo.reset()
            for t in dec.caches.values():
                torch._dynamo.mark_static_address(t)
            step = torch.compile(dec, fullgraph=True)
            t0 = time.perf_counter()
            for _ in range(3):
                step(token, pos)
            sync(cuda)
            compile_s = time.perf_counter() - t0
            measure("torch.compile", lambda: step(token, pos))
            rows["torch.compile"]["compile_s"] = compile_s
            measure("torch.compile CUDA graph", captured(lambda: step(token, pos)))
        if rank == 0:
            torch.save(rows, out)
        # both ranks done before either tears its group down: a rank leaving while gloo still serves the other
        # aborted in CI ("terminate called without an active exception", the dry run's worker exit code 1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def megakernel_tp(tp: int) -> Callable[[Bench], dict]:
    """The decode step tensor parallel over ``tp`` GPUs (or simulated ones): every rank's shard of the
    weights and caches, one megakernel a GPU; timed from the first GPU's stream (the all-reduces keep
    the ranks in step, so rank 0's step spans the group's)."""
    from megaegg.compiler import cached_artifact
    from megaegg.models.decoder import shard_caches, shard_weights
    from megaegg.parallel import ParallelKernel

    def run(b: Bench) -> dict:
        if b.cuda and torch.cuda.device_count() < tp:
            raise RuntimeError(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
        graph, spec = build_decode_graph(b.cfg, max_len=b.context + 1, tp=tp)
        devices = [f"cuda:{r}" if b.cuda else "cpu" for r in range(tp)]
        shards = [{n: w.to(d) for n, w in shard_weights(spec, b.weights, r).items()} for r, d in enumerate(devices)]
        art = cached_artifact(graph, max_dims={"pos": b.context}, dims_hint={"pos": b.context}, compile_cuda=b.cuda)
        kernel = ParallelKernel(art, shards, backend="cuda" if b.cuda else "sim")
        inputs = [{"token": b.token.to(d), **{n: c.to(d) for n, c in shard_caches(spec, b.caches, r).items()}}
                  for r, d in enumerate(devices)]
        out = kernel(inputs, pos=b.context)[0]  # one checked step: correctness
        info = {"queue_entries": len(art.queue.entries), "tp": tp}
        if b.exact_logits is not None:
            info["correctness"] = {**rel_errs(out["logits"], b.exact_logits),
                                   **next_token_check(int(out["next_token"].reshape(-1)[0]), b.exact_next,
                                                      out["logits"].float().cpu(), b.exact_logits)}
        res = b.timed(lambda: kernel(inputs, pos=b.context, check=False)) if b.cuda else \
            time_steps(lambda: kernel(inputs, pos=b.context), iters=b.args.iters, warmup=b.args.warmup, cuda=False)
        kernel.check()
        return {**res, **info}

    return run


def megakernel(b: Bench) -> dict:
    backend = "cuda" if b.cuda else "sim"
    kw = dict(backend=backend, max_dims={"pos": b.context}, dims_hint={"pos": b.context})
    comp = b.extra.setdefault("megakernel_compile", {})
    old_cache = os.environ.get("MEGAEGG_CACHE")
    tmp = tempfile.mkdtemp(prefix="megaegg-cache-")
    os.environ["MEGAEGG_CACHE"] = tmp  # a fresh artifact and cubin cache: the first compile is cold
    try:
        t0 = time.perf_counter()
        kernel = me.compile(b.graph, b.weights, **kw)
        sync(b.cuda)
        comp["cold_s"], comp["cold_timings"] = time.perf_counter() - t0, dict(kernel.artifact.timings)
        del kernel
        free_memory(b.cuda)
        t0 = time.perf_counter()
        kernel = me.compile(b.graph, b.weights, **kw)  # same graph: the artifact cache hits (no rewrite, no NVRTC)
        sync(b.cuda)
        comp["warm_s"], comp["warm_timings"] = time.perf_counter() - t0, dict(kernel.artifact.timings)
    finally:
        if old_cache is None:
            os.environ.pop("MEGAEGG_CACHE", None)
        else:
            os.environ["MEGAEGG_CACHE"] = old_cache
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"megakernel compiled: cold {comp['cold_s']:.2f} s, warm {comp['warm_s']:.2f} s, "
        f"{len(kernel.queue.entries)} queue entries")
    info = {"queue_entries": len(kernel.queue.entries), "backend": backend}

    caches = {n: t.clone() for n, t in b.caches.items()}
    out = kernel(token=b.token, pos=b.context, check=True, **caches)  # one checked step: correctness
    b.extra["megakernel_logits"] = out["logits"].float().cpu()
    b.extra["megakernel_next"] = int(out["next_token"].reshape(-1)[0])
    if b.exact_logits is not None:  # against the torch step that rounds like the reference
        b.extra["correctness"] = {**rel_errs(out["logits"], b.exact_logits),
                                  **next_token_check(b.extra["megakernel_next"], b.exact_next,
                                                     b.extra["megakernel_logits"], b.exact_logits)}
        for family, key in ((REF, "vs_torch_sdpa"), (PLAIN, "vs_torch_plain")):
            if family in b.eager_logits:
                b.extra["correctness"][key] = rel_errs(out["logits"], b.eager_logits[family])
    del out

    # the step's arguments checked once; each timed launch is the launch alone (on the CPU simulator a
    # whole simulated step, seconds each: a smoke test, not a timing)
    launch = kernel.launcher(token=b.token, pos=b.context, **caches)
    res = b.timed(launch)
    launch.check()  # syncs; raises if any timed launch hit a device-side error
    return {**res, **info}


def reference_check(b: Bench) -> dict:
    """Both implementations against megaegg.run_reference (the oracle) at the same position."""
    caches = {n: t.clone() for n, t in b.caches.items()}
    ref = me.run_reference(b.graph, {"token": b.token, **caches}, b.weights, {"pos": b.context})
    out = {"reference_next": int(ref["next_token"].reshape(-1)[0])}
    if REF in b.eager_logits:
        out["torch_vs_reference"] = rel_errs(b.eager_logits[REF], ref["logits"])
    if PLAIN in b.eager_logits:
        out["torch_plain_vs_reference"] = rel_errs(b.eager_logits[PLAIN], ref["logits"])
    if b.exact_logits is not None:
        out["torch_exact_vs_reference"] = rel_errs(b.exact_logits, ref["logits"])
    if "megakernel_logits" in b.extra:
        out["megakernel_vs_reference"] = rel_errs(b.extra["megakernel_logits"], ref["logits"])
    return out


def next_token_words(corr: dict) -> str:
    if corr["next_token_equal"]:
        return "equal"
    tie = " (a near-tie)" if corr["next_token_gap"] <= 2 * corr["logit_err_max"] else ""
    return (f"DIFFERENT: its exact logit is {corr['next_token_gap']:.3g} below the top, "
            f"max logit error {corr['logit_err_max']:.3g}{tie}")


# --- report ----------------------------------------------------------------------------------
PEER_KINDS = (("eager", "vs eager"), ("graphs", "vs CUDA graphs"), ("compile", "vs torch.compile"))


def peer_kind(name: str) -> str | None:
    """Which "vs ..." column a PyTorch peer's row counts for."""
    if "torch.compile" in name:
        return "compile"
    if "CUDA graph" in name:
        return "graphs"
    return "eager" if name.endswith("eager") else None


def peers(results: dict) -> dict[str, float]:
    """ms of every timed PyTorch variant (all rows but the megakernel and the checks) that ran."""
    return {k: v["ms"] for k, v in results.items()
            if v.get("status") == "ok" and "ms" in v and k not in CHECKS and not k.startswith("megakernel") and " tp=" not in k}


def best_peer(results: dict) -> tuple[str, float] | None:
    """The fastest PyTorch peer (name, ms), or None if none ran."""
    ms = peers(results)
    return min(ms.items(), key=lambda kv: kv[1]) if ms else None


def tp_summary(results: dict, tp: int) -> str | None:
    """The tensor-parallel rows against their own peers (the PyTorch rows at the same tp) and against
    the one-GPU megakernel; their '% of floor' and 'vs' columns are of the ONE-GPU floor and peers."""
    ok = {k: v["ms"] for k, v in results.items() if v.get("status") == "ok" and "ms" in v}
    mine = ok.get(f"megakernel tp={tp}")
    if tp < 2 or mine is None:
        return None
    peers_tp = {k: v for k, v in ok.items() if k.startswith(f"{PLAIN} tp={tp} ")}
    parts = [f"tensor parallel over {tp} GPUs: megakernel tp={tp} {mine:.4f} ms"]
    if "megakernel" in ok:
        parts.append(f"{ok['megakernel'] / mine:.2f}x the one-GPU megakernel")
    if peers_tp:
        name, ms = min(peers_tp.items(), key=lambda kv: kv[1])
        parts.append(f"{ms / mine:.2f}x the best PyTorch tp={tp} peer ({name}, {ms:.4f} ms)")
    return "; ".join(parts)


def table(b: Bench, bw: dict, fl: dict | None) -> str:
    R = b.results
    ms = {k: v["ms"] for k, v in R.items() if v.get("status") == "ok" and "ms" in v}
    peer_ms = peers(R)
    best = {kind: min((k for k in peer_ms if peer_kind(k) == kind), key=peer_ms.get, default=None)
            for kind, _ in PEER_KINDS}
    refs = [peer_ms.get(best[kind]) if best[kind] else None for kind, _ in PEER_KINDS]
    top = best_peer(R)
    refs.append(top[1] if top else None)

    def ratio(ref, x):
        return f"{ref / x:.2f}x" if ref and x else "-"

    rows = [("variant", "ms/token", "% of floor", *(col for _, col in PEER_KINDS), "vs best peer")]
    if fl:
        rows.append(("memory floor", f"{fl['ms']:.4f}", "100.0%", *(ratio(ref, fl["ms"]) for ref in refs)))
    for name, r in R.items():
        if name in CHECKS:
            continue
        if name in ms:
            x = ms[name]
            pct = f"{fl['ms'] / x * 100:.1f}%" if fl else "-"
            rows.append((name, f"{x:.4f}", pct, *(ratio(ref, x) for ref in refs)))
        else:
            err = (r.get("error") or "").splitlines()[0][:70] if r.get("error") else ""
            rows.append((name, r.get("status", "?").upper(), err, "", "", "", ""))
    widths = [max(len(r[i]) for r in rows if not (r[1] in ("FAILED", "OOM", "SKIPPED") and i == 2))
              for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        if r[1] in ("FAILED", "OOM", "SKIPPED"):
            lines.append(f"{r[0]:<{widths[0]}} | {r[1]:>{widths[1]}} | {r[2]}")
        else:
            lines.append(" | ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("-+-".join("-" * w for w in widths))
    head = [f"device: {b.extra['device']}",
            f"model: {b.args.preset} ({b.cfg.layers} layers, hidden {b.cfg.hidden}, {b.cfg.dtype}), "
            f"batch 1, context {b.context} (pos {b.context}, {b.context + 1} KV rows)"]
    if bw:
        head.append(f"bandwidth: read {bw['read_tbps']:.3f} TB/s (sum f32 {bw['sum_f32_tbps']:.3f}, bf16 "
                    f"{bw['sum_bf16_tbps']:.3f}; {bw['gib']:.1f} GiB), d2d copy {bw['copy_tbps']:.3f} TB/s")
    if fl:
        head.append(f"floor: {fl['ms']:.4f} ms = ({fl['weight_bytes_read'] / 1e9:.3f} GB weights + "
                    f"{fl['kv_bytes'] / 1e6:.2f} MB KV) / read bandwidth")
        if fl["weight_bytes_read"] != fl["weight_bytes"]:
            head.append(f"  (the untied embedding table is gathered, one row read; counting all of it: "
                        f"{fl['ms_all_weights']:.4f} ms)")
    if top:
        head.append(f"best peer: {top[0]} ({top[1]:.4f} ms), the fastest PyTorch variant; "
                    f"'vs best peer' is its ms over the row's")
    tp = tp_summary(R, b.args.tp)
    if tp:
        head.append(tp)
    named = [f"{col} against {best[kind]}" for kind, col in PEER_KINDS if best[kind]]
    if named:
        head.append("fastest of each kind: " + "; ".join(named))
    if b.args.dry_run:
        head.append("DRY RUN on the CPU: wall-clock timings, megakernel on the simulator; not a benchmark")
    return "\n".join(head + [""] + lines)


def main(argv=None) -> dict:
    a = parse(argv)
    if a.batch or a.prefill:  # the batch bench instead: decode at several batch sizes, prompt prefill
        return bench_batch.main(a=a)
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run on the GPU machine, or use --dry-run for a CPU smoke test")
    torch.set_grad_enabled(False)
    report: dict = {"args": vars(a), "torch": torch.__version__}
    device_name = torch.cuda.get_device_name() if not a.dry_run else "CPU (dry run)"
    log(f"device: {device_name}")

    bw, bw_err = None, None
    try:
        log(f"bandwidth ({a.bw_gib} GiB) ...")
        bw = measure_bandwidth(gib=a.bw_gib, reps=a.bw_reps, cuda=not a.dry_run)
        log(f"read {bw['read_tbps']:.3f} TB/s, copy {bw['copy_tbps']:.3f} TB/s")
    except Exception as e:  # noqa: BLE001 - e.g. no room for the test tensor: report, go on
        bw_err = f"{type(e).__name__}: {e}"
        log(f"bandwidth test FAILED: {bw_err}")
        free_memory(not a.dry_run)

    log(f"setup: {a.preset}, context {a.context}")
    b = setup(a)
    b.extra["device"] = device_name
    fl = floor(b.cfg, b.spec, b.context, bw["read_tbps"]) if bw else None
    if fl:
        log(f"floor {fl['ms']:.4f} ms ({fl['bytes'] / 1e9:.3f} GB)")

    # torch first: a device fault in the megakernel would poison the CUDA context for what follows
    run_variant(b, CHECKS[0], torch_exact)  # the exact step first: every variant is checked against it
    compile_modes = {REF: ["reduce-overhead"], PLAIN: ["default", "reduce-overhead"]}
    for family in [] if a.tp_only else ([] if a.skip_ref_rounding else [REF]) + [PLAIN]:
        run_variant(b, f"{family} eager", torch_eager(family))
        run_variant(b, f"{family} CUDA graph", cuda_graph(family))
        if not a.skip_compile_baseline:
            for mode in compile_modes[family] + (["max-autotune"] if a.max_autotune else []):
                name = f"{family} torch.compile" + ("" if mode == "default" else f" {mode}")
                run_variant(b, name, torch_compile(family, mode))
        drop_decoder(b, family)  # its fused weights go before the next decoder's (or the megakernel's) arrive
    if a.tp > 1:  # (torch first, as above)
        torch_tp_peers(b, a.tp)
    run_variant(b, "megakernel", megakernel)
    if a.tp > 1:
        run_variant(b, f"megakernel tp={a.tp}", megakernel_tp(a.tp))
    if not a.no_reference_check:
        run_variant(b, CHECKS[1], reference_check)

    corr = b.extra.get("correctness")
    report.update({
        "device": device_name, "preset": a.preset, "config": {k: str(v) if k == "dtype" else v
                                                                for k, v in dataclasses.asdict(b.cfg).items()},
        "context": b.context, "max_len": b.context + 1, "bandwidth": bw, "bandwidth_error": bw_err, "floor": fl,
        "variants": {k: {kk: vv for kk, vv in v.items()} for k, v in b.results.items()},
        "megakernel_compile": b.extra.get("megakernel_compile"), "correctness": corr,
        "torch_compile_s": {k: v.get("compile_s") for k, v in b.results.items() if "torch.compile" in k},
    })
    top = best_peer(b.results)
    report["best_peer"] = {"name": top[0], "ms": top[1]} if top else None
    report["tensor_parallel"] = tp_summary(b.results, a.tp)
    for v in report["variants"].values():
        if fl and "ms" in v and v.get("status") == "ok":
            v["pct_of_floor"] = fl["ms"] / v["ms"] * 100
        if top and "ms" in v and v.get("status") == "ok":
            v["vs_best_peer"] = top[1] / v["ms"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {a.json}")

    # the summary: correctness and compile times, then the table last
    print()
    if corr:
        warn = "  WARNING: above 3e-2" if corr["rel_err_max"] > WARN_REL_ERR else ""
        print(f"correctness: megakernel vs torch (exact attention) logits at pos {b.context}: rel err max "
              f"{corr['rel_err_max']:.2e}, norm {corr['rel_err_norm']:.2e}, "
              f"next token {next_token_words(corr)}{warn}")
        if "vs_torch_sdpa" in corr:
            print(f"  megakernel vs torch (ref-rounding eager): rel err max {corr['vs_torch_sdpa']['rel_err_max']:.2e}")
        if "vs_torch_plain" in corr:
            print(f"  megakernel vs torch (plain eager): rel err max {corr['vs_torch_plain']['rel_err_max']:.2e}")
    else:
        print("correctness: not checked (a variant failed)")
    for k, r in b.results.items():
        if "vs_exact" in r:
            c = r["vs_exact"]
            warn = "  WARNING: above 3e-2" if c["rel_err_max"] > WARN_REL_ERR else ""
            print(f"  {k} vs exact: rel err max {c['rel_err_max']:.2e}, next token {next_token_words(c)}{warn}")
    ref = b.results.get(CHECKS[1], {})
    for k, what in (("torch_vs_reference", "ref-rounding eager"), ("torch_plain_vs_reference", "plain eager"),
                    ("torch_exact_vs_reference", "torch exact"), ("megakernel_vs_reference", "megakernel")):
        if k in ref:
            print(f"  {what} vs reference: rel err max {ref[k]['rel_err_max']:.2e}, norm {ref[k]['rel_err_norm']:.2e}")
    comp = b.extra.get("megakernel_compile") or {}
    if "cold_s" in comp:
        t = comp.get("cold_timings", {})
        nv = f", nvrtc {t['nvrtc']:.2f} s" if "nvrtc" in t else ""
        print(f"megakernel compile: cold {comp['cold_s']:.2f} s (rewrite {t.get('rewrite', math.nan):.2f} s{nv}), "
              f"warm {comp['warm_s']:.2f} s" + (" (artifact cache hit)" if "cache_load" in comp.get("warm_timings", {})
                                                  else ""))
    for k, s in report["torch_compile_s"].items():
        if s is not None:
            first = b.results[k].get("compile_first_call_s")  # (the TP workers time their first calls as one)
            print(f"{k}: compile {s:.1f} s" + (f" (first call {first:.1f} s)" if first is not None else ""))
    print()
    print(table(b, bw, fl))
    return report


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
