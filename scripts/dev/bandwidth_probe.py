"""Dev probe (GPU): achieved bandwidth of the matvec and attention bodies. Prints numbers; checks nothing.

    python3 scripts/dev/bandwidth_probe.py

The matvec body in a persistent one-block-per-SM loop over 1 GiB of bf16 weights, with
cuBLAS gemv and a device copy as the references measured in the same run; split-KV
attention (one block per instance, and persistent) over 32768 cached rows of 8 KV heads.
The bodies are wrapped and compiled as in tests/test_cuda_bodies_compile.py, whose
helpers this imports.
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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: this probe needs a CUDA GPU")
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
