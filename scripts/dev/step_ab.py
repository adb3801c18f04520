"""Dev: one variant's round of a step-graph A/B (GPU): batched decode steps and prompt prefills of a preset,
the step graph as ``examples/bench_batch.py`` compiles it (context 512, 65 slots, hint 16 rows), median ms
of 30 timed launches a batch and 10 a prompt; one line of output.

    python3 scripts/dev/step_ab.py PRESET BATCHES TAG [PREFILLS]
    e.g. step_ab.py llama-3.2-1b 1,4,16,32,64 new 512,2048

An A/B of code is this script run from each checkout in turn, rounds interleaved (the same code moves by a
few % between runs and machines, so compare only within one run), e.g. with ``base`` a ``git archive`` of
main and the working tree as ``new``:

    for r in 1 2; do for v in base new; do PYTHONPATH=$v python3 scripts/dev/step_ab.py PRESET 1,16,64 $v; done; done

(docs/perf-notes.md #84-#87 were measured this way.)
"""
import sys
import time
from pathlib import Path

import torch

import megaegg as me
from megaegg.models import ModelConfig, build_step_graph, random_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from bench_batch import timed  # noqa: E402  (the benches' timer: median ms of single launches)

CTX, SLOTS, MAX_LEN = 512, 65, 2049


def median_ms(launch, runs: int, warm: int) -> float:
    """bench_batch.timed's median of single launches, then the launches' errors checked once."""
    ms = timed(launch, runs, warm, cuda=True)
    launch.check()
    return ms


def compile_step(preset: str):
    """(kernel, cfg, caches, compile seconds): PRESET's step graph as bench_batch.py compiles it, random
    weights and caches (also step_trace.py's)."""
    cfg = ModelConfig.preset(preset)
    graph, spec = build_step_graph(cfg, max_len=MAX_LEN, slots=SLOTS)
    weights = random_weights(spec, seed=0, device="cuda")
    t0 = time.time()
    kernel = me.compile(graph, weights, backend="cuda", max_dims={"n": MAX_LEN - 1 + 64, "r": SLOTS, "ctx": MAX_LEN},
                        dims_hint={"n": 16, "r": 16, "ctx": CTX + 1})
    compile_s = time.time() - t0
    gen = torch.Generator(device="cuda").manual_seed(1)
    caches = {n: (torch.randn(s, generator=gen, device="cuda") * 0.5).to(cfg.dtype.torch) for n, s in spec.caches.items()}
    return kernel, cfg, caches, compile_s


def step_inputs(cfg, case: str) -> dict:
    """The kernel's inputs and dims for ``b<N>`` (a batch of N decoding at position CTX, slots 0..N-1),
    ``p<T>`` (a T-token prompt in slot 0) or ``m<N>+<T>`` (a mixed step: N decoding as ``b<N>``, then a
    T-token prompt in slot N)."""
    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device="cuda")

    if case[0] == "m":
        b, t = (int(v) for v in case[1:].split("+"))
        dec, pre = step_inputs(cfg, f"b{b}"), step_inputs(cfg, f"p{t}")
        return {"token": torch.cat([dec["token"], pre["token"]]), "pos": torch.cat([dec["pos"], pre["pos"]]),
                "slot": i32(list(range(b)) + [b] * t), "out": i32(list(range(b)) + [b + t - 1]),
                "n": b + t, "r": b + 1, "ctx": CTX + 1}
    n = int(case[1:])
    if case[0] == "b":
        return {"token": i32([(1234 + 17 * i) % cfg.vocab for i in range(n)]), "pos": i32([CTX] * n),
                "slot": i32(list(range(n))), "out": i32(list(range(n))), "n": n, "r": n, "ctx": CTX + 1}
    toks = (torch.arange(n, device="cuda", dtype=torch.int32) * 7919) % cfg.vocab
    return {"token": toks, "pos": i32(list(range(n))), "slot": i32([0] * n), "out": i32([n - 1]), "n": n, "r": 1, "ctx": n}


def main(preset: str, batches: list[int], tag: str, prefills: list[int]) -> None:
    kernel, cfg, caches, compile_s = compile_step(preset)
    out = []
    for b in batches:
        out.append(f"b{b} {median_ms(kernel.launcher(**step_inputs(cfg, f'b{b}'), **caches), 30, 5):.3f}")
    for t in prefills:
        out.append(f"p{t} {median_ms(kernel.launcher(**step_inputs(cfg, f'p{t}'), **caches), 10, 3):.3f}")
    print(f"{tag:5s} {preset} compile {compile_s:.0f} s: " + "  ".join(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(sys.argv[1], [int(b) for b in sys.argv[2].split(",")], sys.argv[3],
         [int(t) for t in sys.argv[4].split(",")] if len(sys.argv) == 5 else [])
