"""Dev probe (GPU): the prompt attention body `ragged_flash` (interpreter/cuda/flash.cuh, issue 38) alone,
in a persistent test kernel, checked against torch's scaled_dot_product_attention and timed next to it.

    python3 scripts/dev/flash_probe.py                          # D 64 and 128, G 4, 512 and 2048 tokens
    python3 scripts/dev/flash_probe.py --cases 64,4,2048 --define FLASH_BLOCK=128 --smem 204800
    python3 scripts/dev/flash_probe.py --compile-only           # NVRTC only (no GPU)

The kernel: one block of 256 threads per SM; each block claims instances (c0, c1) from a counter, the
last token tiles first (as the megakernel's `BlockKind.longest_last`), and runs ragged_flash on one
prompt of T tokens (positions 0..T-1, slot 0, causal) with Hkv = 8 KV heads of G query heads each.
Per case: the max relative error against SDPA in f32 (pass < 2e-2), the median of 20 launches
(CUDA events; the counter's reset included, ~2 us) as causal TFLOP/s (4 * T(T+1)/2 * D * Hq), the
time per instance-block (instances x their 64-row blocks / SMs), and SDPA's time in the same run.
`--rope`: the body with q's RoPE folded in (ROPE=true), against SDPA on q rotated by torch.
Nothing here imports megaegg: interpreter/nvrtc.py is loaded by path (gemm_probe.py's loader).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_probe as gp  # noqa: E402  (its NVRTC loader, driver helpers and timing)

HKV = 8
KERNEL = r"""{defines}
#define MEGA_THREADS 256
#define MEGA_SMEM {smem}
#define MEGA_ERR_INDEX 2
__device__ int probe_error;
__device__ void mega_body_error(int code, long long detail) {{ atomicCAS(&probe_error, 0, code); (void)detail; }}
#include "common.cuh"
#include "flash.cuh"
{kernels}
"""
KERNEL_ONE = r"""
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1)
flash_probe_d{d}_g{g}_r{rope}(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const int* pos,
                     const int* slot, __nv_bfloat16* out, long long N, float scale, const float* inv_freq,
                     unsigned* counter) {{
    constexpr int D = {d}, G = {g}, BT = 128 / G;
    const long long Hq = {hkv} * G, tiles = (N + BT - 1) / BT, total = tiles * {hkv};
    __shared__ long long claimed;
    for (;;) {{
        if (threadIdx.x == 0) claimed = atomicAdd(counter, 1u);
        mega_sync();
        const long long i = claimed;
        mega_sync();
        if (i >= total) break;
        const long long c0 = tiles - 1 - i / {hkv}, c1 = i % {hkv};
        ragged_flash<D, G, {rope_b}, false>(
            mega_dyn_smem, Ten3<const __nv_bfloat16>{{q, Hq * D, D, 1}},
            Ten4<const __nv_bfloat16>{{k, {hkv} * N * D, N * D, D, 1}}, Ten4<const __nv_bfloat16>{{v, {hkv} * N * D, N * D, D, 1}},
            Vec<const int>{{pos, 1}}, Vec<const int>{{slot, 1}}, N, KvPages{{Mat<const int>{{}}, 1, N, N, 1}}, scale, Ten3<__nv_bfloat16>{{out, Hq * D, D, 1}}, c0, c1,
            1, 0, FlashQRope{{inv_freq, Vec<const int>{{pos, 1}}, Vec<const __nv_bfloat16>{{nullptr, 0}}, 0.0f}});
    }}
}}
"""


def parse_case(s: str) -> tuple[int, int, int]:
    d, g, t = (int(x) for x in s.split(","))
    return d, g, t


def source(cases, smem: int, defines, rope: bool) -> str:
    kinds = sorted({(d, g) for d, g, _ in cases})
    return KERNEL.format(
        defines="".join(f"\n#define {x.replace('=', ' ', 1)}" for x in defines), smem=smem,
        kernels="".join(KERNEL_ONE.format(d=d, g=g, hkv=HKV, rope=int(rope), rope_b="true" if rope else "false")
                        for d, g in kinds))


def rope_ref(q, inv_freq):
    """q [T, H, D] rotated at positions 0..T-1 (half-split pairs, f32 math, bf16 out), as rope.cuh stores it."""
    import torch

    t = torch.arange(q.shape[0], device=q.device, dtype=torch.float32)
    ang = t[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = q.float()
    h = q.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(q.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=parse_case, nargs="+", default=[(64, 4, 512), (64, 4, 2048), (128, 4, 512), (128, 4, 2048)],
                    help="D,G,T ...")
    ap.add_argument("--smem", type=int, default=120 * 1024, help="dynamic shared memory bytes (the decode image's)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel source (a variant)")
    ap.add_argument("--rope", action="store_true", help="the body with q's RoPE folded in")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args(argv)
    nv = gp.load_nvrtc_module()
    src = source(a.cases, a.smem, a.define, a.rope)
    opts = ["--gpu-architecture=sm_90a", "-std=c++17", "-lineinfo", "--ptxas-options=-v"] + [f"-I{d}" for d in nv.include_dirs()]
    t0 = time.perf_counter()
    cubin, log = nv._nvrtc_compile(src, opts)
    regs = sorted(set(l.strip() for l in log.splitlines() if "registers" in l or "spill" in l))
    print(f"NVRTC {time.perf_counter() - t0:.1f} s; defines {a.define or '-'}; smem {a.smem}; rope {a.rope}")
    for l in regs[:6]:
        print("  ptxas:", l)
    if a.compile_only:
        return 0
    import torch
    import torch.nn.functional as F
    from cuda.bindings import driver

    torch.empty(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    module = gp._drv(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    ok = True
    print(f"{props.name}: {sms} SMs")
    for d, g, t in a.cases:
        f = gp._drv(driver.cuModuleGetFunction(module, f"flash_probe_d{d}_g{g}_r{int(a.rope)}".encode()), "getfunc")
        gp._drv(driver.cuFuncSetAttribute(f, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          a.smem), "setattr")
        torch.manual_seed(d * 1000 + g * 100 + t)
        hq = HKV * g
        q = torch.randn(t, hq, d, device="cuda").to(torch.bfloat16)
        k = torch.randn(HKV, t, d, device="cuda").to(torch.bfloat16)
        v = torch.randn(HKV, t, d, device="cuda").to(torch.bfloat16)
        pos = torch.arange(t, device="cuda", dtype=torch.int32)
        slot = torch.zeros(t, device="cuda", dtype=torch.int32)
        out = torch.full((t, hq, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        inv_freq = (1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))).contiguous()
        counter = torch.zeros(1, device="cuda", dtype=torch.int32)
        scale = d ** -0.5
        args = [ctypes.c_void_p(x.data_ptr()) for x in (q, k, v, pos, slot, out)]
        args += [ctypes.c_longlong(t), ctypes.c_float(scale), ctypes.c_void_p(inv_freq.data_ptr()),
                 ctypes.c_void_p(counter.data_ptr())]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])

        def launch():
            counter.zero_()
            stream = torch.cuda.current_stream().cuda_stream
            gp._drv(driver.cuLaunchKernel(f, sms, 1, 1, 256, 1, 1, a.smem, stream, ctypes.addressof(params), 0), "launch")

        launch()
        torch.cuda.synchronize()
        qr = rope_ref(q, inv_freq) if a.rope else q
        qh = qr.permute(1, 0, 2)[None]  # [1, Hq, T, D]
        kh, vh = k[None], v[None]
        ref = F.scaled_dot_product_attention(qh.float(), kh.float().repeat_interleave(g, 1),
                                             vh.float().repeat_interleave(g, 1), is_causal=True)[0].permute(1, 0, 2)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        good = err < 2e-2 and not torch.isnan(out).any().item()
        ok &= good
        ms = gp.median_ms(launch)
        ms_sdpa = gp.median_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True))
        flops = 4.0 * t * (t + 1) / 2 * d * hq
        bt = 128 // g
        blocks = sum(-(-min(t, (c + 1) * bt) // 64) for c in range(-(-t // bt))) * HKV
        print(f"D {d} G {g} T {t}: {'ok' if good else 'WRONG'} err {err:.1e} | {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s"
              f" {ms * 1e3 * sms / blocks:5.2f} us per 64-row block on an SM | SDPA {ms_sdpa * 1e3:8.1f} us "
              f"{flops / ms_sdpa / 1e9:6.1f} TFLOP/s", flush=True)
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
