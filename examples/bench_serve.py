"""The server under load: many requests through `python -m megaegg serve`'s app, measured from the client side.

    python examples/bench_serve.py --preset llama-3.2-1b --requests 256 --concurrency 64
    python examples/bench_serve.py --preset qwen3-8b --requests 256 --rate 8          (open loop: 8 requests/s)
    python examples/bench_serve.py --dry-run                                          (CPU smoke test: tiny, sim)

The server (random weights, `--slots` = the concurrency) runs in this process on a free local port, its
engine in a process of its own, as `python -m megaegg serve` runs them;
the clients (in ``--client-procs`` processes) stream completions over HTTP: closed loop (``--concurrency`` requests in flight, a new one
as one ends) or open loop (``--rate`` arrivals a second, Poisson, seeded). Prompts are random token
ids of lengths drawn from ``--prompt-len LO,HI``; every request asks for ``--output-len`` tokens
(random weights have no EOS, so each must get exactly that many: anything else counts as lost or
corrupted). Reported: output tokens/s, time to first token and inter-token latency percentiles, and,
on a GPU, the plain torch.compile batched decode step's tokens/s at the same batch in the same run
(``PlainBatch``, reduce-overhead), as examples/bench_batch.py measures it (``--skip-peer``: not), and with
one client the step of the batch-1 decode graph a lone sequence runs (its launch alone, CUDA events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import sys
import threading
import time
from types import SimpleNamespace

import torch


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def parse(argv=None) -> argparse.Namespace:
    from megaegg.models import PRESETS
    from megaegg.models.cli import OneLineParser, positive_int

    def span(text: str) -> tuple[int, int]:
        try:
            lo, hi = (int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
        if not 1 <= lo <= hi:
            raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
        return lo, hi

    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model preset (default llama-3.2-1b; tiny dry-run)")
    p.add_argument("--requests", type=positive_int, default=None, help="requests in all (default 256; 6 dry-run)")
    p.add_argument("--prompt-len", type=span, default=None, help="prompt lengths LO,HI (default 128,2048; 2,6 dry-run)")
    p.add_argument("--output-len", type=positive_int, default=None, help="tokens each request asks for (default 128; 3 dry-run)")
    p.add_argument("--concurrency", type=positive_int, default=None, help="closed loop: requests in flight (default 64; 3 dry-run)")
    p.add_argument("--rate", type=float, default=None, help="open loop instead: arrivals a second (Poisson)")
    p.add_argument("--max-step-tokens", type=positive_int, default=2048, help="rows of one launch (default 2048)")
    p.add_argument("--page-len", type=positive_int, default=None,
                   help="a paged KV cache of pages of this many rows (default: a cache of max-len rows a sequence)")
    p.add_argument("--pages", type=positive_int, default=None, help="pages in the pool, with --page-len (default: as "
                   "many rows as the caches of slots)")
    p.add_argument("--slots", type=positive_int, default=None,
                   help="sequences the engine holds (default: the concurrency; with the same --slots and --max-len, runs "
                   "share their compiled kernels through the cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-procs", type=positive_int, default=None,
                   help="processes the clients run in, the load split evenly (default 4; 1 dry-run)")
    p.add_argument("--skip-peer", action="store_true", help="do not time the torch.compile batched step")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="rows a sequence's cache holds (default: the longest prompt and output)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test: tiny in f32 on the simulator")
    a = p.parse_args(argv)
    dry = a.dry_run
    defaults = {"preset": ("llama-3.2-1b", "tiny"), "requests": (256, 6), "prompt_len": ((128, 2048), (2, 6)),
                "output_len": (128, 3), "concurrency": (64, 3), "client_procs": (4, 1)}
    for name, (normal, small) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, small if dry else normal)
    if a.rate is not None and not a.rate > 0:
        p.error(f"--rate must be > 0, got {a.rate}")
    if a.pages and not a.page_len:
        p.error("--pages goes with --page-len (a paged KV cache)")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client, url: str, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    stamps, ids, error = [], [], None
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                        break
                    now = time.perf_counter()
                    stamps += [now] * len(chunk["choices"][0].get("token_ids", ()))
    except Exception as e:  # (a lost response: counted, the run goes on)
        error = f"{type(e).__name__}: {e}"
    return {"start": t0, "end": time.perf_counter(), "stamps": stamps, "error": error, "prompt": len(prompt)}


async def drive(a, url: str, prompts: list[list[int]], start_at: float | None = None) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=max(a.concurrency, 64) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        if start_at is not None:  # (every client process starts its load at the same moment)
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        if a.rate is None:  # closed loop
            sem = asyncio.Semaphore(a.concurrency)

            async def gated(p):
                async with sem:
                    return await one_request(client, url, p, a.output_len)

            return await asyncio.gather(*(gated(p) for p in prompts))
        rng = random.Random(a.seed + 1)
        tasks = []
        for p in prompts:  # open loop: Poisson arrivals
            tasks.append(asyncio.create_task(one_request(client, url, p, a.output_len)))
            await asyncio.sleep(rng.expovariate(a.rate))
        return await asyncio.gather(*tasks)


def run_clients(a, url: str, prompts: list[list[int]], start_at: float | None = None) -> list[dict]:
    """The workload's requests from a process of their own (``drive``), sent from ``start_at`` on (a
    ``time.perf_counter`` time: its clock is system-wide); their records."""
    return asyncio.run(drive(a, url, prompts, start_at))


def ready_client(url: str, ready) -> None:
    """(a client process's start, before the clock) One streamed request of its own, so that what a process's
    first request costs (imports, the app's first route call) is not the workload's; then wait at ``ready``
    (a barrier) until every client process and the bench are there."""
    import httpx

    async def one() -> None:  # (the clients' own path: an async client, its first connection and imports)
        async with httpx.AsyncClient(timeout=600.0) as client:
            await one_request(client, url, [1, 2], 2)

    asyncio.run(one())
    ready.wait()


def client_shares(a, prompts: list[list[int]]) -> list[tuple[argparse.Namespace, list[list[int]]]]:
    """The workload split over ``--client-procs`` processes: every k-th prompt, a k-th of the concurrency (or
    of the arrival rate: Poisson arrivals at rate / k in k processes are Poisson at the rate)."""
    k = max(1, min(a.client_procs, len(prompts), a.concurrency if a.rate is None else a.client_procs))
    shares = []
    for i in range(k):
        sub = argparse.Namespace(**vars(a))
        sub.concurrency = a.concurrency // k + (i < a.concurrency % k)
        sub.rate, sub.seed = (a.rate / k if a.rate else None), a.seed + i
        shares.append((sub, prompts[i::k]))
    return shares


def torch_compile_tokens_per_s(cfg, weights, batch: int, max_len: int) -> float | None:
    """The plain torch.compile batched decode step (reduce-overhead) at ``batch``: tokens/s."""
    if not torch.cuda.is_available():
        return None
    from megaegg.models.torch_batch import PlainBatch

    peer = PlainBatch(cfg, weights, max_len=max_len, slots=batch, device="cuda")
    for t in peer.caches():
        torch._dynamo.mark_static_address(t)
    fn = torch.compile(peer.decode, mode="reduce-overhead", fullgraph=True)
    token = torch.full((batch,), 1234 % cfg.vocab, dtype=torch.int32, device="cuda")
    pos = torch.full((batch,), min(512, max_len - 1), dtype=torch.int64, device="cuda")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return fn(token, pos)

    from bench_batch import timed  # (this folder's batch bench: the same timing)

    return batch / (timed(call, 20, 5, True) / 1e3)


def launch_record(engine, since: int = 0) -> SimpleNamespace:
    """(engine process) The batcher's record of its launches from the ``since``-th on."""
    b = engine.batcher
    return SimpleNamespace(launches=b.launches - since, step_started=b.step_started[since:],
                           step_seconds=b.step_seconds[since:], prefill_rows=b.prefill_rows[since:],
                           launch_rows=b.launch_rows[since:])


def launch_count(engine) -> int:
    """(engine process) Launches so far."""
    return engine.batcher.launches


def launch_breakdown(record, results: list[dict], slots: int, start_at: float) -> dict:
    """Where the engine's time went: its launches (each one's wall time: host work, launch, the wait for its
    tokens; run ahead, from the previous launch's tokens on: the pace of launches), the time between them
    (the batcher's and the server's host work, or idle waiting for requests), how full the pure decode
    launches were (``slots`` rows: full), and how long the clients took past the last launch (their parsing;
    the clocks agree: perf_counter is system-wide); the first launches and the mixed ones one by one (ms from
    ``start_at``, ms, rows, prompt rows)."""
    b = record  # (launch_record's)
    if not b.step_started:
        return {"launches": 0}
    span = b.step_started[-1] + b.step_seconds[-1] - b.step_started[0]
    inside = sum(b.step_seconds)
    mixed = [s for s, p in zip(b.step_seconds, b.prefill_rows) if p]
    decode_rows = [r for r, p in zip(b.launch_rows, b.prefill_rows) if not p]
    stamps = [t for r in results for t in r["stamps"]]
    return {"launches": b.launches, "mixed_launches": len(mixed), "prefill_rows": sum(b.prefill_rows),
            "part_full_decode_launches": sum(r < slots for r in decode_rows),
            "decode_rows_mean": sum(decode_rows) / len(decode_rows) if decode_rows else None,
            "span_s": span, "in_launches_s": inside, "in_mixed_launches_s": sum(mixed), "between_launches_s": span - inside,
            "first_launch_after_s": b.step_started[0] - min(r["start"] for r in results),
            "clients_after_last_launch_s": (max(stamps) if stamps else 0.0) - (b.step_started[-1] + b.step_seconds[-1]),
            "launch_log": [(round(1e3 * (t - start_at), 2), round(1e3 * d, 3), r, p) for i, (t, d, r, p) in
                           enumerate(zip(b.step_started, b.step_seconds, b.launch_rows, b.prefill_rows)) if i < 12 or p][:60]}


def decode_step_ms(engine, max_len: int, temperature: float = 0.0, top_p: float = 1.0) -> float | None:
    """The engine's batch-1 decode graph (what a lone sequence runs) at position 512: ms a launch (CUDA events)."""
    kernel = engine.decode_kernel
    if kernel is None or kernel.backend != "cuda":
        return None
    one = lambda dt, v: torch.tensor([v], dtype=dt, device="cuda")  # noqa: E731
    caches = {n: c[0] for n, c in engine.caches.items()}
    launch = kernel.launcher(token=one(torch.int32, 1234), pos=min(512, max_len - 1),
                             temperature=one(torch.float32, temperature), top_k=one(torch.int32, 0),
                             top_p=one(torch.float32, top_p), seed=one(torch.int32, 0), counter=one(torch.int32, 0), **caches)
    from bench_batch import timed

    ms = timed(launch, 20, 5, True)
    launch.check()
    return ms


def main(argv=None) -> dict:
    import dataclasses

    import uvicorn

    import megaegg as me
    from megaegg.engine_process import EngineProcess, EngineSpec
    from megaegg.models import ModelConfig
    from megaegg.serve import create_app

    a = parse(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    device, backend = ("cuda", "cuda") if cuda else ("cpu", "sim")
    cfg = ModelConfig.preset(a.preset)
    if a.dry_run:
        cfg = dataclasses.replace(cfg, dtype=me.f32)
    need = a.prompt_len[1] + a.output_len - 1  # (the last token is not fed back)
    max_len = a.max_len or min(cfg.max_positions, need)
    if not need <= max_len <= cfg.max_positions:
        raise SystemExit(f"error: --max-len {max_len} must hold a prompt of {a.prompt_len[1]} tokens and {a.output_len} "
                         f"more ({need} rows) and be at most the model's {cfg.max_positions} positions")
    slots = a.slots or a.concurrency
    t0 = time.perf_counter()
    # the engine in a process of its own, as `python -m megaegg serve` runs it
    engine = EngineProcess(EngineSpec(cfg, backend, device, max_len, slots, max(slots, a.max_step_tokens), seed=0,
                                      page_len=a.page_len, pages=a.pages), max_queue=a.requests + 1)
    print(f"  engine ready in {time.perf_counter() - t0:.1f} s ({backend})", file=sys.stderr, flush=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model="bench", max_len=max_len), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(cfg.vocab) for _ in range(rng.randint(*a.prompt_len))] for _ in range(a.requests)]
    # the clients in processes of their own, as real ones are: in this one they would take the interpreter
    # lock from the server's event loop, and in one process 64 streams' parsing (pure-Python HTTP and JSON,
    # tens of us a chunk) falls behind the server's pace
    shares = client_shares(a, prompts)
    url = f"http://127.0.0.1:{port}/v1/completions"
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Barrier(len(shares) + 1)
    clients = spawn.Pool(len(shares), initializer=ready_client, initargs=(url, ready))
    ready.wait(timeout=300)  # (every client process started and warm before the clock)
    before = engine.call(launch_count)
    start_at = time.perf_counter() + 0.25  # (the workers' start: after every one has its share)
    try:
        results = [r for rs in clients.starmap(run_clients, [(sub, url, ps, start_at) for sub, ps in shares]) for r in rs]
    finally:
        clients.terminate()
        wall = time.perf_counter() - start_at
        server.should_exit = True
        thread.join(timeout=30)
    if results:  # (the clock stops with the last response, not with the worker processes' hand-back)
        wall = max(r["end"] for r in results) - start_at
    try:
        record = engine.call(launch_record, before)
        lone_ms = engine.call(decode_step_ms, max_len) if a.concurrency == 1 else None
        sampled_ms = engine.call(decode_step_ms, max_len, 0.8, 0.95) if a.concurrency == 1 else None
    finally:
        engine.close()
    engine_report = launch_breakdown(record, results, slots, start_at)
    ok = [r for r in results if r["error"] is None and len(r["stamps"]) == a.output_len]
    ttft = [r["stamps"][0] - r["start"] for r in ok]
    itl = [b - c for r in ok for c, b in zip(r["stamps"], r["stamps"][1:])]
    out_tokens = sum(len(r["stamps"]) for r in ok)
    peer = None
    # (the same random weights, in this process: the engine's has exited)
    if cuda and not a.skip_peer:
        from megaegg.models import build_step_graph, random_weights

        spec = build_step_graph(cfg, max_len=max_len, slots=slots, sampling=True)[1]
        peer = torch_compile_tokens_per_s(cfg, random_weights(spec, seed=0, device=device), a.concurrency, max_len)
    report = {"preset": a.preset + (" (dry run)" if a.dry_run else ""), "backend": backend, "requests": a.requests,
              "completed": len(ok), "lost_or_corrupted": a.requests - len(ok),
              "errors": sorted({r["error"] for r in results if r["error"]})[:5], "wall_s": wall,
              "output_tokens_per_s": out_tokens / wall, "torch_compile_tokens_per_s": peer,
              "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
              "itl_s": {f"p{q}": percentile(itl, q) for q in (50, 90, 99)}, "decode_graph_step_ms": lone_ms,
              "decode_graph_sampled_step_ms": sampled_ms,
              "mode": (f"open loop, {a.rate}/s" if a.rate else f"closed loop, concurrency {a.concurrency}")
              + f", clients in {len(shares)} processes",
              "prompt_len": list(a.prompt_len), "output_len": a.output_len, "engine": engine_report}
    fmt = lambda d: " / ".join("-" if v is None else f"{1e3 * v:.1f}" for v in d.values())  # noqa: E731
    print(f"{report['preset']} ({backend}), {report['mode']}, {a.requests} requests, prompts {a.prompt_len[0]}-"
          f"{a.prompt_len[1]} tokens, {a.output_len} out")
    print(f"| output tokens/s | torch.compile step tokens/s (batch {a.concurrency}) | TTFT p50/p90/p99 ms | "
          f"ITL p50/p90/p99 ms | completed | lost or corrupted |")
    print("|---|---|---|---|---|---|")
    print(f"| {report['output_tokens_per_s']:.0f} | {'-' if peer is None else f'{peer:.0f}'} | {fmt(report['ttft_s'])} | "
          f"{fmt(report['itl_s'])} | {len(ok)} | {report['lost_or_corrupted']} |")
    if lone_ms is not None and itl:
        print(f"one client: ITL p50 {1e3 * report['itl_s']['p50']:.3f} ms against the batch-1 decode graph's step "
              f"{lone_ms:.3f} ms ({1e3 * report['itl_s']['p50'] / lone_ms:.3f}x; sampling at temperature 0.8, top_p "
              f"0.95: {sampled_ms:.3f} ms a step)")
    e = engine_report
    if e["launches"]:
        mean_rows = "-" if e["decode_rows_mean"] is None else f"{e['decode_rows_mean']:.1f}"
        print(f"engine: {e['launches']} launches ({e['mixed_launches']} with prompt rows, {e['prefill_rows']} prompt rows; "
              f"{e['part_full_decode_launches']} decode launches of fewer than {slots} rows, "
              f"{mean_rows} rows on average) "
              f"over {e['span_s']:.2f} s: {e['in_launches_s']:.2f} s in launches ({e['in_mixed_launches_s']:.2f} s of it "
              f"mixed), {e['between_launches_s']:.2f} s between them; first launch {e['first_launch_after_s']:.2f} s "
              f"after the first request, last client stamp {e['clients_after_last_launch_s']:.3f} s after the last launch")
        starts = sorted(r["start"] - start_at for r in results)
        first = min(len(starts), a.concurrency)
        print(f"the first {first} requests sent {1e3 * starts[0]:.1f}-{1e3 * starts[first - 1]:.1f} ms after the start; launches (ms from the start, ms, rows, prompt rows), the "
              f"first 12 and those with prompt rows: {e['launch_log']}")
    if report["errors"]:
        print("errors:", "; ".join(report["errors"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
