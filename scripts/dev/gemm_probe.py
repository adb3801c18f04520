"""Dev probe (GPU, Hopper): the TMA + wgmma GEMM tile body (interpreter/cuda/gemm_tile.cuh, issue 38)
in a persistent test kernel, checked against torch and timed next to torch.matmul.

    python3 scripts/dev/gemm_probe.py                  # compile, check, time (needs an sm_90 GPU)
    python3 scripts/dev/gemm_probe.py --compile-only   # everything but the launches (no GPU needed)
    python3 scripts/dev/gemm_probe.py --tile 64x128 --shapes 2048,2048,2048 200,300,136

The test kernel: a persistent grid (one block of 256 threads per SM, 132 on an H100 / H200) where
block b computes the output tiles t = b, b + gridDim.x, ... (BM x BN each; M fastest) by calling
``gemm_tile<BM, BN>``, one kernel per tile shape (``TILES``, ``--tile``) in one NVRTC program.
out = x @ w.T for x [M, K], w [N, K] (the Linear weight layout), bf16 in and out, f32 accumulation.

Headers: CUTLASS's (the ``nvidia-cutlass`` wheel, ``cutlass_library/source/include``; found through
importlib, or ``$CUTLASS_INCLUDE``), the CUDA runtime headers and libcu++ (``include/cccl``; found with
cuda-pathfinder, or ``$CCCL_INCLUDE``). A missing one stops the probe with one line saying which.
Nothing here imports the megaegg package (the device machine may lack egglog): interpreter/nvrtc.py is
loaded by its path for the NVRTC call and the include discovery.

Per shape and tile: max relative error ``|out - ref| / max|ref|`` and Frobenius ``||out - ref|| / ||ref||``
against ``x.float() @ w.float().T`` (pass: both < 1e-2), a check that nothing was written past row M
(the output buffer has sentinel rows below), and the median of 20 timed launches after 3 warm-ups
(CUDA events) as TFLOP/s, with torch.matmul's (cuBLAS) measured the same way in the same run.
``--compile-only``: NVRTC time (cold: no cache), the cubin size, ptxas' registers / spills / warnings,
and the SASS counts of HGMMA (wgmma) / UTMALDG (TMA loads) / SYNCS (mbarrier) through nvdisasm or
cuobjdump when one is found (``$NVDISASM``, PATH, the CUDA toolkit), else the counts of
``wgmma.mma_async`` etc. in the PTX that -lineinfo embeds in the cubin.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NVRTC_PY = ROOT / "interpreter" / "nvrtc.py"
# The megakernel's block shape (interpreter/render.py: THREADS, SMEM_BYTES), taken from it when megaegg
# imports, else these (its values when this probe was written).
THREADS, SMEM_BYTES = 256, 122880
TILES = ((128, 128), (128, 256), (64, 64), (64, 128))  # (BM, BN): gemm_tile<BM, BN>
DEVICE = "cuda"  # (where run_shape makes its tensors)
DEFAULT_SHAPES = [(128, 128, 64), (200, 300, 136), (1, 200, 72), (333, 520, 1000),
                  (2048, 2048, 2048), (2048, 8192, 2048), (2048, 2048, 8192), (4096, 4096, 4096)]

KERNEL = r"""{defines}
#define MEGA_THREADS {threads}
#define MEGA_SMEM {smem}
#include "common.cuh"
#include "gemm_tile.cuh"

// Persistent: block b takes tiles b, b + gridDim.x, ... (M fastest: neighbouring blocks share w's tile).
template <int BM, int BN>
__device__ __forceinline__ void gemm_probe(const CUtensorMap* tmap_x, const CUtensorMap* tmap_w,
                                           __nv_bfloat16* out, long long ldo, int M, int N, int K) {{
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {{
        const int m0 = (t % tiles_m) * BM, n0 = (t / tiles_m) * BN;
        const GemmTileOut o{{out + (long long)m0 * ldo + n0, ldo, nullptr, 0, M - m0, N - n0, nullptr}};
        gemm_tile<BM, BN>(GEMM_PLAIN, tmap_x, tmap_w, nullptr, o, K, 0, m0, n0, mega_dyn_smem, [] {{ return true; }});
    }}
}}
{kernels}
"""
KERNEL_ONE = r"""
extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1)
gemm_probe_{bm}x{bn}(const CUtensorMap* tmap_x, const CUtensorMap* tmap_w, __nv_bfloat16* out, long long ldo,
                  int M, int N, int K) {{
    gemm_probe<{bm}, {bn}>(tmap_x, tmap_w, out, ldo, M, N, K);
}}
"""


class MissingHeaders(RuntimeError):
    """A header directory the tile needs is not there: the message is the one line to print."""


# --- toolchain --------------------------------------------------------------------------------------
def load_nvrtc_module():
    """interpreter/nvrtc.py as a module of its own (its top level imports only the standard library)."""
    if "_megaegg_nvrtc" in sys.modules:
        return sys.modules["_megaegg_nvrtc"]
    spec = importlib.util.spec_from_file_location("_megaegg_nvrtc", NVRTC_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def block_shape() -> tuple[int, int]:
    try:
        from megaegg.interpreter.render import SMEM_BYTES as smem, THREADS as threads

        return threads, smem
    except Exception:  # megaegg not importable here (no egglog on the device machine): its values
        return THREADS, SMEM_BYTES


def cutlass_include() -> str:
    return _wrap(load_nvrtc_module().cutlass_include)


def cccl_include() -> str:
    return _wrap(load_nvrtc_module().cccl_include)


def _wrap(fn):
    nv = load_nvrtc_module()
    try:
        return fn()
    except nv.MissingHeaders as e:
        raise MissingHeaders(str(e)) from None


def kernel_source(tiles=TILES, smem: int | None = None, defines: tuple[str, ...] = ()) -> tuple[str, int, int]:
    threads, default_smem = block_shape()
    smem = smem or default_smem
    src = KERNEL.format(threads=threads, smem=smem,
                        defines="".join(f"\n#define {d.replace('=', ' ', 1)}" for d in defines),
                        kernels="".join(KERNEL_ONE.format(bm=bm, bn=bn) for bm, bn in tiles))
    return src, threads, smem


def compile_options(nv, arch: str = "sm_90a") -> list[str]:
    """interpreter/nvrtc.py's compile_cubin options and include path, plus CUTLASS and libcu++."""
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo", "--ptxas-options=-v"]
    opts += [f"-I{d}" for d in nv.include_dirs()]
    return opts + _wrap(nv.cute_options)


def compile_probe(tiles=TILES, arch: str = "sm_90a", smem: int | None = None, defines: tuple[str, ...] = ()) -> dict:
    """NVRTC-compile the probe kernels: {cubin, log, seconds, source, threads, smem} (CompileError: NVRTC's log)."""
    nv = load_nvrtc_module()
    opts = compile_options(nv, arch)
    src, threads, smem = kernel_source(tiles, smem, defines)
    t0 = time.perf_counter()
    if arch.startswith("compute_"):
        out, text = _nvrtc_ptx(src, opts), ""
    else:
        out, text = nv._nvrtc_compile(src, opts)
    return {"cubin": out, "log": text, "seconds": time.perf_counter() - t0, "source": src,
            "threads": threads, "smem": smem, "nvrtc": nv.nvrtc_version()}


def _nvrtc_ptx(source: str, opts: list[str]) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"gemm_probe.cu", 0, [], [])
    try:
        opts = [o.encode() for o in opts if "ptxas" not in o]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC (PTX) failed: {err}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def find_disassembler() -> list[str] | None:
    """nvdisasm (``-c``) or cuobjdump (``-sass``), as a command prefix; None when neither is found."""
    env = os.environ.get("NVDISASM")
    if env and os.path.isfile(env):
        return [env, "-c"]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for name, flag in (("nvdisasm", "-c"), ("cuobjdump", "-sass")):
        for p in (shutil.which(name), os.path.join(cuda_home, "bin", name)):
            if p and os.path.isfile(p):
                return [p, flag]
    return None


def sass_facts(cubin: bytes) -> str | None:
    dis = find_disassembler()
    if dis is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([*dis, f.name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"{Path(dis[0]).name} failed: {r.stderr.strip()[:200]}"
    sass = r.stdout
    counts = {name: len(re.findall(rx, sass)) for name, rx in SASS_OPS.items()}
    shapes = sorted(set(re.findall(r"HGMMA\.(\w+)", sass)))
    return f"SASS ({Path(dis[0]).name}): " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"; HGMMA shapes {shapes}"


# SASS: wgmma, TMA loads, mbarrier operations, wgmma fences / waits
SASS_OPS = {"HGMMA": r"\bHGMMA\.", "UTMALDG": r"\bUTMALDG\b", "SYNCS": r"\bSYNCS\.", "WARPGROUP": r"\bWARPGROUP\."}
# PTX: the same, as instructions
PTX_OPS = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "wgmma.wait_group")


def ptx_facts(cubin: bytes) -> str:
    """Counts of PTX_OPS in the PTX that -lineinfo embeds in the cubin (.nv_debug_ptx_txt), else in a
    second, compute_90a compile."""
    if b".nv_debug_ptx_txt" in cubin:
        text, where = cubin, "the cubin's embedded PTX"
    else:
        text, where = compile_probe(arch="compute_90a")["cubin"], "a compute_90a compile's PTX"
    return f"no nvdisasm / cuobjdump: {where} has " + ", ".join(f"{text.count(op.encode())} {op}" for op in PTX_OPS)


def text_bytes(cubin: bytes) -> dict[str, int]:
    """The size of each kernel's machine code: the cubin's .text.<kernel> sections (64-bit ELF)."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    def sec(i):  # (name offset, offset, size)
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, off, size
    _, stroff, _ = sec(shstrndx)
    out = {}
    for i in range(shnum):
        name, _, size = sec(i)
        name = cubin[stroff + name: cubin.index(b"\0", stroff + name)].decode()
        if name.startswith(".text."):
            out[name[6:]] = size
    return out


def wgmma_count(cubin: bytes) -> tuple[int, str] | None:
    """(wgmma instructions, where counted): SASS HGMMA through a disassembler, else the PTX that -lineinfo
    embeds in the cubin; None when neither is there."""
    dis = find_disassembler()
    if dis is not None:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            r = subprocess.run([*dis, f.name], capture_output=True, text=True)
        if r.returncode == 0:
            return len(re.findall(SASS_OPS["HGMMA"], r.stdout)), "SASS HGMMA"
    if b".nv_debug_ptx_txt" in cubin:
        return cubin.count(b"wgmma.mma_async"), "embedded PTX wgmma.mma_async"
    return None


def print_compile_facts(res: dict) -> None:
    v = res["nvrtc"]
    print(f"NVRTC {v[0]}.{v[1]}: compiled in {res['seconds']:.1f} s (no cache); cubin {len(res['cubin'])} bytes "
          f"(machine code: {', '.join(f'{k} {n}' for k, n in text_bytes(res['cubin']).items())}; the rest is mostly "
          f"the PTX that -lineinfo embeds); MEGA_THREADS {res['threads']}, MEGA_SMEM {res['smem']}")
    for line in res["log"].splitlines():  # ptxas -v: registers, spills; and any wgmma serialisation warning
        if re.search(r"registers|spill|wgmma|Warning|warning|serializ", line):
            print("  " + line.strip())
            if "C7517" in line:  # (seen: the barrier wait's timeout path, which traps with wgmmas in flight)
                print("    (C7517: check where; on the __trap path of a barrier timeout it costs nothing)")
    print(sass_facts(res["cubin"]) or ptx_facts(res["cubin"]))


# --- the GPU run ------------------------------------------------------------------------------------
def _drv(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else (rest or None)


def encode_tmap(t, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap of a row-major bf16 [rows, K] tensor: 2-D {K, rows}, box {64, box_rows},
    128-byte swizzle (gemm_tile.cuh's Layout_K_SW128_Atom), zero fill out of bounds."""
    from cuda.bindings import driver as d

    rows, k = t.shape
    assert t.stride() == (k, 1) and t.data_ptr() % 16 == 0 and (k * 2) % 16 == 0, "TMA: 16-byte rows and base"
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tmap = _drv(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(),
        [u64(k), u64(rows)], [u64(k * 2)], [u32(64), u32(box_rows)], [u32(1), u32(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    raw = ctypes.string_at(tmap.getPtr(), 128)
    assert len(raw) == 128
    return raw


class Probe:
    def __init__(self, cubin: bytes, smem: int, threads: int, tiles) -> None:
        import torch
        from cuda.bindings import driver

        torch.empty(1, device="cuda")  # torch creates the primary context lazily
        props = torch.cuda.get_device_properties(0)
        self.sms, self.smem, self.threads = props.multi_processor_count, smem, threads
        self.device_name = props.name
        self.module = _drv(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.funcs = {}
        # Every tensor-map buffer stays allocated until the end: a freed one's address could come back for
        # the next shape while the TMA unit still caches the old descriptor at that address.
        self.maps = []
        for bm, bn in tiles:
            f = _drv(driver.cuModuleGetFunction(self.module, f"gemm_probe_{bm}x{bn}".encode()), "cuModuleGetFunction")
            _drv(driver.cuFuncSetAttribute(
                f, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "cuFuncSetAttribute")
            self.funcs[(bm, bn)] = f

    def prepare(self, tile: tuple[int, int], x, w, out):
        """The launch of gemm_probe_{BM}x{BN} on x, w -> out: a closure (its tensor maps and arguments kept alive)."""
        import torch
        from cuda.bindings import driver

        maps = torch.frombuffer(bytearray(encode_tmap(x, tile[0]) + encode_tmap(w, min(tile[1], 128))), dtype=torch.uint8).to("cuda")
        assert maps.data_ptr() % 64 == 0, "a CUtensorMap in global memory must be 64-byte aligned"
        self.maps.append(maps)
        m, k = x.shape
        n = w.shape[0]
        args = [ctypes.c_void_p(maps.data_ptr()), ctypes.c_void_p(maps.data_ptr() + 128), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_longlong(out.stride(0)), ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        func = self.funcs[tile]

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            _drv(driver.cuLaunchKernel(func, self.sms, 1, 1, self.threads, 1, 1, self.smem, stream,
                                       ctypes.addressof(params), 0), "cuLaunchKernel")

        launch.keep = (maps, args, params)
        return launch


def median_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def run_shape(probe: Probe, tiles, m: int, n: int, k: int, time_it: bool) -> bool:
    import torch

    torch.manual_seed(m * 1000003 + n * 1009 + k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    flops = 2.0 * m * n * k
    ok = True
    cells = []
    for bm, bn in tiles:
        name = f"{bm}x{bn}"
        pad = 128  # sentinel rows below out: a store past row M lands there
        buf = torch.full((m + pad, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        out = buf[:m]
        sentinel = torch.tensor(-7.0, dtype=torch.bfloat16, device=DEVICE)
        buf[m:] = sentinel
        try:
            launch = probe.prepare((bm, bn), x, w, out)
        except Exception as e:  # (a tensor map the driver refused: the next shapes can still run)
            print(f"({m}, {n}, {k}) {name}: FAILED to prepare: {e}", flush=True)
            ok = False
            continue
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as e:  # a trap (barrier timeout) or a fault: the context is gone
            raise SystemExit(f"({m}, {n}, {k}) {name}: the kernel FAILED ({e}); the CUDA context is lost, stopping")
        diff = (out.float() - ref)
        max_rel = (diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        fro_rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
        nan = torch.isnan(out).sum().item()
        below_ok = bool((buf[m:] == sentinel).all().item())
        good = max_rel < 1e-2 and fro_rel < 1e-2 and nan == 0 and below_ok
        ok &= good
        cell = (f"{name}: {'ok' if good else 'WRONG'} max_rel {max_rel:.1e} fro_rel {fro_rel:.1e}"
                + (f" nan {nan}" if nan else "") + ("" if below_ok else " WROTE PAST ROW M"))
        if not good:  # where it goes wrong: a swizzle / descriptor mismatch shows as a pattern of rows and k-chunks
            bad = ~((out.float() - ref).abs() <= 1e-2 * ref.abs().max())
            rows, cols = bad.nonzero(as_tuple=True)
            if rows.numel():
                r, c = rows[0].item(), cols[0].item()
                cell += (f" [{bad.float().mean().item():.1%} bad; first at ({r}, {c}): {out[r, c].item():.4g} vs "
                         f"{ref[r, c].item():.4g}; bad rows mod {bm}: {sorted(set((rows % bm).tolist()))[:12]}...; "
                         f"bad cols mod {bn}: {sorted(set((cols % bn).tolist()))[:12]}...]")
        if time_it:
            ms = median_ms(launch)
            cell += f" {flops / ms / 1e9:7.1f} TFLOP/s ({ms * 1e3:.1f} us)"
        cells.append(cell)
    line = f"({m}, {n}, {k}): " + " | ".join(cells)
    if time_it:
        ms = median_ms(lambda: torch.matmul(x, w.T))
        line += f" | torch.matmul {flops / ms / 1e9:7.1f} TFLOP/s ({ms * 1e3:.1f} us)"
    print(line, flush=True)
    return ok


def parse_shape(s: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in s.split(","))
    if k % 8:
        raise argparse.ArgumentTypeError(f"{s}: K must be a multiple of 8 (TMA row strides are multiples of 16 bytes)")
    return m, n, k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile and report; no GPU needed")
    ap.add_argument("--tile", choices=[f"{m}x{n}" for m, n in TILES], action="append",
                    help="BMxBN tile to build (default: all)")
    ap.add_argument("--shapes", type=parse_shape, nargs="+", help="M,N,K ... (default: a ragged and a large set)")
    ap.add_argument("--smem", type=int, help="dynamic shared memory bytes (default: the megakernel's decode image; "
                    "its tile image has interpreter/render.py's TILE_SMEM)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel source (a variant)")
    a = ap.parse_args(argv)
    tiles = tuple(tuple(int(v) for v in t.split("x")) for t in a.tile) if a.tile else TILES
    try:
        res = compile_probe(tiles, smem=a.smem, defines=tuple(a.define))
    except MissingHeaders as e:
        print(f"gemm_probe: {e}", file=sys.stderr)
        return 2
    print_compile_facts(res)
    if a.compile_only:
        return 0
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        print("gemm_probe: needs an sm_90 GPU (H100 / H200); use --compile-only here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 reference in f32
    probe = Probe(res["cubin"], res["smem"], res["threads"], tiles)
    print(f"{probe.device_name}: {probe.sms} SMs, grid {probe.sms} x {probe.threads}, {probe.smem} B dynamic smem; "
          f"torch {torch.__version__}")
    ok = True
    for m, n, k in a.shapes or DEFAULT_SHAPES:
        ok &= run_shape(probe, tiles, m, n, k, time_it=True)
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
