"""Dev (CPU): the server's host side under load, with the GPU modeled: what the engine, the batcher and the
HTTP event loop cost beside a device that runs each launch for a set time (docs/perf-notes.md #103, #104).

    python3 scripts/dev/serve_host_probe.py [--step-ms 2.6] [--releases 6] [--run-ahead] [--http | --direct]
                                            [--requests 128] [--prompt-len 16,64] [--output-len 512]

The step function does no math: it lets go of the interpreter lock ``--releases`` times (as the torch calls
of a real launch's host work do), then queues the launch on a modeled device that runs launches one after
another, ``--step-ms`` each plus 8 us a prompt row, and returns it queued (``QueuedTokens``: its tokens
random). ``--http`` (default): the real engine and FastAPI app on a local port, 64 streaming clients in
``--client-procs`` processes (``examples/bench_serve.py``'s: warm, started together); ``--direct``: the batcher
alone. Prints output tokens/s against the modeled device's pace (GPU-bound: the launches' modeled seconds), the
batcher's seconds, and (HTTP) when the requests went out and the first and mixed launches one by one.
On a 2-core machine the client processes take a core: compare variants within one machine.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import random
import sys
import threading
import time
from pathlib import Path

import torch

from megaegg.models.batch import Batcher, QueuedTokens, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from bench_serve import (  # noqa: E402
    client_shares, free_port, launch_breakdown, launch_record, percentile, ready_client, run_clients,
)


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by name (Linux /proc)."""
    import os

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[names.get(int(tid), tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class ModeledDevice:
    """A step function over a device that runs its launches in order, each for a modeled time."""

    def __init__(self, step_ms: float, releases: int) -> None:
        self.step_s, self.releases = step_ms / 1e3, releases
        self.busy_until, self.seconds = 0.0, 0.0

    def __call__(self, rows) -> QueuedTokens:
        n, r = len(rows.host_pos), len(rows.host_sampling)
        for _ in range(self.releases):
            time.sleep(0)  # (lets go of the interpreter lock, as a torch call does)
        run = self.step_s + 8e-6 * max(0, n - r)
        self.seconds += run
        end = self.busy_until = max(time.perf_counter(), self.busy_until) + run
        tokens = torch.randint(5, 1000, (r,), dtype=torch.int32)

        def get() -> torch.Tensor:
            time.sleep(max(0.0, end - time.perf_counter()))
            return tokens

        return QueuedTokens(get, tokens)


def modeled_engine(step_ms: float, releases: int, slots: int, max_len: int, run_ahead: bool, max_queue: int):
    """The server's engine over a modeled device (a module function: it builds the engine process's)."""
    from megaegg.serve import Engine

    batcher = Batcher(ModeledDevice(step_ms, releases), slots=slots, max_len=max_len, max_tokens=2048,
                      run_ahead=run_ahead)
    return Engine(batcher, max_queue=max_queue, vocab=32000)


def engine_report(engine) -> dict:
    """(engine process) The modeled device's seconds, the launches, the engine thread's CPU seconds."""
    b = engine.batcher
    return {"modeled": b.step_fn.seconds, "launches": b.launches, "in_launches": sum(b.step_seconds),
            "engine_cpu": thread_cpu_s().get("megaegg-engine", 0.0),
            "part_full": sum(r < b.slots for r, p in zip(b.launch_rows, b.prefill_rows) if not p)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, default=2.6, help="a launch's modeled time (default 2.6: llama-3.2-1b, 64 rows)")
    p.add_argument("--releases", type=int, default=6, help="interpreter-lock releases in a launch's host work")
    p.add_argument("--run-ahead", action="store_true", help="Batcher(run_ahead=True), as the server's")
    p.add_argument("--direct", action="store_true", help="the batcher alone, no HTTP")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", default="16,64")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--loop", default="auto", help="uvicorn's event loop: auto (uvloop when installed) or asyncio")
    p.add_argument("--h11", action="store_true", help="uvicorn's pure-Python HTTP (else httptools when installed)")
    p.add_argument("--in-process", action="store_true", help="the engine thread in the server's process (else its own)")
    p.add_argument("--client-procs", type=int, default=1, help="processes the clients run in (bench_serve's default: 4)")
    a = p.parse_args()
    lo, hi = (int(v) for v in a.prompt_len.split(","))
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(lo, hi))] for _ in range(a.requests)]
    build = functools.partial(modeled_engine, a.step_ms, a.releases, a.concurrency, hi + a.output_len, a.run_ahead,
                              a.requests + 1)
    if a.direct:
        engine = build()
        t0 = time.perf_counter()
        engine.close()
        tokens = sum(len(g.tokens) for g in engine.batcher.run([Request(q, a.output_len) for q in prompts]))
        wall, itl, ok, cpu = time.perf_counter() - t0, [], a.requests, {}
        report = engine_report(engine)
    else:
        import uvicorn

        from megaegg.engine_process import EngineProcess
        from megaegg.serve import create_app

        engine = build() if a.in_process else EngineProcess(build, max_queue=a.requests + 1)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(engine, model="bench", max_len=hi + a.output_len),
                                               host="127.0.0.1", port=port, log_level="warning",
                                               loop=a.loop, http="h11" if a.h11 else "auto"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/completions"
        load = argparse.Namespace(concurrency=a.concurrency, rate=None, output_len=a.output_len, seed=0,
                                  client_procs=a.client_procs)
        shares = client_shares(load, prompts)
        spawn = multiprocessing.get_context("spawn")
        ready = spawn.Barrier(len(shares) + 1)
        clients = spawn.Pool(len(shares), initializer=ready_client, initargs=(url, ready))
        ready.wait(timeout=300)
        report0 = engine_report(engine) if a.in_process else engine.call(engine_report)
        t0, cpu0 = time.perf_counter() + 0.25, thread_cpu_s()
        try:
            results = [r for rs in clients.starmap(run_clients, [(sub, url, ps, t0) for sub, ps in shares]) for r in rs]
        finally:
            wall, cpu1 = time.perf_counter() - t0, thread_cpu_s()
            report = engine_report(engine) if a.in_process else engine.call(engine_report)
            n0 = report0["launches"]
            record = launch_record(engine, n0) if a.in_process else engine.call(launch_record, n0)
            clients.terminate()
            server.should_exit = True
            thread.join(timeout=10)
            engine.close()
        done = [r for r in results if r["error"] is None and len(r["stamps"]) == a.output_len]
        ok, tokens = len(done), sum(len(r["stamps"]) for r in done)
        itl = [y - x for r in done for x, y in zip(r["stamps"], r["stamps"][1:])]
        cpu = {"event loop": cpu1[thread.name] - cpu0.get(thread.name, 0.0),
               "engine": report["engine_cpu"] - report0["engine_cpu"]}
        print("CPU us a token: " + ", ".join(f"{k} {1e6 * v / tokens:.1f}" for k, v in cpu.items()))
        starts = sorted(r["start"] - t0 for r in results)
        print(f"requests sent {1e3 * starts[0]:.1f}-{1e3 * starts[min(len(starts), a.concurrency) - 1]:.1f} ms after "
              f"the start; launches: {launch_breakdown(record, results, a.concurrency, t0)['launch_log']}")
    modeled = report["modeled"]
    print(f"{'direct' if a.direct else 'http'}{' run ahead' if a.run_ahead else ''}"
          f"{' in process' if a.in_process else ''}: {ok}/{a.requests} complete, {tokens / wall:.0f} tok/s over "
          f"{wall:.2f} s (GPU-bound {tokens / modeled:.0f}: {report['launches']} launches, {report['part_full']} of them "
          f"part-full decode launches, {modeled:.2f} s modeled), "
          f"batcher {report['in_launches']:.2f} s in launches" + (f", ITL p50 {1e3 * percentile(itl, 50):.2f} ms" if itl else ""))


if __name__ == "__main__":
    main()
