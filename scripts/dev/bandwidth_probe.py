"""Dev probe (GPU): achieved bandwidth of the matvec and attention bodies, alone or as one op in the
megakernel. Prints numbers; checks nothing.

    python3 scripts/dev/bandwidth_probe.py                        # the bodies alone
    python3 scripts/dev/bandwidth_probe.py op [N,K,GLU,NORM[,SMS] ...]   # one op in the megakernel

The bodies alone: the matvec body in a persistent one-block-per-SM loop over 1 GiB of bf16 weights,
with cuBLAS gemv and a device copy as the references measured in the same run; split-KV attention
(one block per instance, and persistent) over 32768 cached rows of 8 KV heads. The bodies are
wrapped and compiled as in tests/test_cuda_bodies_compile.py, whose helpers this imports.

``op``: one bf16 matvec ``[N, K]`` (GLU=1: a gated MLP's two, NORM=1: with the RMSNorm prologue)
alone in the megakernel, compiled for a cost model of SMS SMs (default: the GPU's; fewer SMs,
fewer and larger instances): TB/s of the launch (``kernel.launcher``, CUDA events), and, from
traced launches with L2 flushed before each, the wall time, TB/s and GB/s per busy SM (per-SM
against chip-wide limits), busy and waiting %. NO_TRACE=1 skips the traced launches (a second
NVRTC compile). (It replaces matvec_probe.py and wave_probe.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_cuda_bodies_compile import PRELUDE, Arg, Module, kernel_source  # noqa: E402

from megaegg import dtypes as dt  # noqa: E402
from megaegg.dims import as_dim, sym  # noqa: E402

POS = sym("pos")
GIB = 1 << 30


def median_ms(fn, reps: int = 20) -> float:
    fn()  # warm-up: module load, caches
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def device_copy() -> None:
    src = torch.empty(GIB // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    print(f"device copy: {2 * src.numel() * 2 / ms / 1e9:.2f} TB/s (read + write)")


def matvec_specs(T) -> list[tuple]:
    specs = []
    for k, rows in ((2048, 16), (2048, 32), (2048, 64), (8192, 32)):
        n = GIB // (2 * k)
        specs.append((f"mv_k{k}_r{rows}", [Arg((1, k), T), Arg((n, k), T)], Arg((1, n), T),
                      {"rows": rows, "mrows": 1, "roles": ("x", "w"), "eps": 0.0}))
    n = GIB // (4 * 2048)
    specs.append(("mv_norm_glu_k2048_r32", [Arg((1, 2048), T), Arg((n, 2048), T), Arg((n, 2048), T),
                                             Arg((2048,), T)], Arg((1, n), T),
                  {"rows": 32, "mrows": 1, "roles": ("x", "w", "w2", "g"), "eps": 1e-5}))
    return specs


def attention_specs(T, rows: int) -> list[tuple]:
    return [(f"attn_d{d}_c{chunk}", [Arg((32, d), T), Arg((8, rows, d), T), Arg((8, rows, d), T)],
             Arg((32, rows // chunk, d + 2), dt.f32), {"length": POS + 1, "scale": 0.088, "chunk": chunk, "group": 4})
            for d, chunk in ((128, 256), (128, 1024), (64, 256), (64, 1024))]


def shape_of(a: Arg) -> list[int]:
    return [as_dim(s).value for s in a.shape]


OP_CONFIGS = [(65536, 2048, 0, 0, 0), (8192, 2048, 1, 1, 0), (2048, 8192, 0, 0, 0), (131072, 2048, 1, 1, 0),
              (8192, 2048, 1, 1, 64)]


def op_probe(n: int, k: int, glu: bool, norm: bool, sms: int) -> None:
    import os

    import megaegg as me
    from megaegg.rewrite import CostModel

    g = me.Graph()
    x = g.input("x", [1, k], me.bf16)
    if norm:
        x = me.rms_norm(x, g.weight("g", [k], me.bf16), 1e-5)
    y = me.linear(x, g.weight("w", [n, k], me.bf16))
    if glu:
        y = me.silu(y) * me.linear(x, g.weight("w2", [n, k], me.bf16))
    g.output("y", y)
    weights = {name: torch.randn(shape_of(t), device="cuda").to(torch.bfloat16) for name, t in g.weights.items()}
    chip = torch.cuda.get_device_properties(0).multi_processor_count
    kern = me.compile(g, weights, backend="cuda", cost_model=CostModel(sms=sms or chip))
    xin = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ops = [(e.op.kind, e.op.params.get("rows"), e.launch.eval({})) for e in kern.queue.entries]
    launch = kern.launcher(x=xin)
    ms = median_ms(launch, reps=30)
    launch.check()
    nbytes = n * k * 2 * (2 if glu else 1)
    line = f"n={n} k={k} glu={glu:d} norm={norm:d} sms={sms or chip} ops={ops}: {ms * 1e3:.1f} us, {nbytes / ms / 1e9:.2f} TB/s"
    if not os.environ.get("NO_TRACE"):
        flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # > L2: no weight stays resident
        runs = []
        for _ in range(7):
            flush.add_(1)
            runs.append(kern.trace(x=xin).summary())
        tr = sorted(runs, key=lambda r: r["wall_us"])[len(runs) // 2]
        wall, inst = tr["wall_us"], max(o[2] for o in ops)
        line += (f"; traced wall {wall:.1f} us, {nbytes / wall / 1e6:.2f} TB/s, "
                 f"{nbytes / min(inst, chip) / (wall * 1e-6) / 1e9:.1f} GB/s per busy SM, busy {tr['busy_pct']:.0f}% "
                 f"wait {tr['waiting_pct']:.0f}%")
    print(line, flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: this probe needs a CUDA GPU")
    if sys.argv[1:2] == ["op"]:
        for cfg in [tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]] or OP_CONFIGS:
            n, k, glu, norm, sms = (*cfg, 0) if len(cfg) == 4 else cfg
            op_probe(n, k, bool(glu), bool(norm), sms)
        return
    torch.empty(1, device="cuda")  # the primary context exists before cuModuleLoadData
    T, L = dt.bf16, 32768
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device_copy()
    mv, attn = matvec_specs(T), attention_specs(T, L)
    mod = Module("\n".join([PRELUDE, '#include "matvec.cuh"', '#include "attention.cuh"']
                           + [kernel_source(name, "matvec", i, o, p, persistent=True) for name, i, o, p in mv]
                           + [kernel_source(name, "attn_partial", i, o, p) for name, i, o, p in attn]
                           + [kernel_source(name + "_p", "attn_partial", i, o, p, persistent=True)
                              for name, i, o, p in attn]))
    for name, ins, out, params in mv:
        tensors = [torch.randn(shape_of(a), device="cuda").to(torch.bfloat16) for a in ins]
        y = torch.empty(shape_of(out), device="cuda", dtype=torch.bfloat16)
        n_inst = -(-y.shape[1] // params["rows"])
        w_bytes = sum(t.numel() * 2 for t in tensors[1:3] if t.dim() == 2 and t.shape[0] > 2)
        ms = median_ms(lambda: mod.launch(name, (sms, 1), [*tensors, y, 0, n_inst, n_inst]))
        print(f"{name:26s} {w_bytes / ms / 1e9:5.2f} TB/s  ({ms * 1e3:7.1f} us, {mod.resources[name].registers} regs)")
        if name == "mv_k2048_r16":
            x, w = tensors
            ms = median_ms(lambda: torch.mv(w, x[0]))
            print(f"{'cuBLAS torch.mv k2048':26s} {w_bytes / ms / 1e9:5.2f} TB/s  ({ms * 1e3:7.1f} us)")
        del tensors, y
    for name, ins, out, params in attn:
        q, kc, vc = (torch.randn(shape_of(a), device="cuda").to(torch.bfloat16) for a in ins)
        part = torch.empty(shape_of(out), device="cuda")
        n_split = L // params["chunk"]
        kv_bytes = (kc.numel() + vc.numel()) * 2
        ms = median_ms(lambda: mod.launch(name, (8, n_split), [q, kc, vc, part, L - 1]))
        ms_p = median_ms(lambda: mod.launch(name + "_p", (sms, 1), [q, kc, vc, part, L - 1, 8 * n_split, n_split]))
        print(f"{name + f' L={L}':26s} {kv_bytes / ms / 1e9:5.2f} TB/s  ({ms * 1e3:7.1f} us, "
              f"{mod.resources[name].registers} regs); persistent {kv_bytes / ms_p / 1e9:5.2f} TB/s")


if __name__ == "__main__":
    try:
        main()
    except pytest.skip.Exception as e:  # the shared helpers skip when NVRTC or its headers are missing
        raise SystemExit(f"error: {e.msg}") from None
