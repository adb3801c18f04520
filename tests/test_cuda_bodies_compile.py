"""Every block-op kind's CUDA body compiles for sm_90a with NVRTC (no GPU needed), and,
on a GPU, computes what the kind's ``cpu()`` does.

For each kind, realistic BlockOps are rendered through the kind's ``cuda_call`` with
dummy operands (typed pointer parameters of a small ``__global__`` wrapper that also
declares what the interpreter provides: ``smem``, ``c0``, ``c1``, the runtime dim
``D_pos``, ``mega_body_error`` and ``MEGA_ERR_INDEX``), in bf16 and f32 (f16 for a few),
and compiled with ``--ptxas-options=-v``. The register / spill figures are printed
(``pytest -s``); the matvec fast path must not spill.

GPU tests (marked ``gpu``, skipped without one): each body against its kind's ``cpu()``
on random data with poisoned outputs (bf16 / f32 / f16); out-of-range ids and positions
reported, not written; ``BODY_CASES=REGEX`` runs only the cases whose labels match. (The bandwidth printout of matvec and attention, which checks
nothing, is ``scripts/dev/bandwidth_probe.py``; it imports this file's helpers.)
"""

from __future__ import annotations

import collections
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from megaegg import dtypes as dt
from megaegg.blockops import REGISTRY, CudaOperand
from megaegg.dims import Dim, as_dim, sym
from megaegg.blockops.matvec import runtime_mrows
from megaegg.blockops.moe_rows import expert_block
from megaegg.blockops.ragged_attention import SPLIT_WAVE, split_count
from megaegg.interpreter.nvrtc import function_sizes
from megaegg.interpreter.render import SMEM_BYTES, THREADS
from megaegg.ir.program import BlockOp, Operand, View

CUDA_DIR = Path(__file__).resolve().parents[1] / "interpreter" / "cuda"
POS = sym("pos")

# The bodies compile and run with the megakernel's own block size and shared memory, so a
# case that fits here fits in the kernel (attention's ring depth and matvec's x staging follow it).
PRELUDE = f"""\
#define MEGA_THREADS {THREADS}
#define MEGA_SMEM {SMEM_BYTES}
#define MEGA_ERR_INDEX 2
__device__ int mega_test_error;
__device__ void mega_body_error(int code, long long detail) {{ atomicCAS(&mega_test_error, 0, code); (void)detail; }}
#include "common.cuh"
__device__ bool mega_wait_all(const MegaWaits& w) {{ return w.n == 0; }}  // the wrappers wait for nothing
__device__ bool mega_waits_met(const MegaWaits& w) {{ return w.n == 0; }}
"""


# --- toolchain ------------------------------------------------------------------------
def _nvrtc():
    try:
        from cuda.bindings import nvrtc

        err, *_ = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(err)
        return nvrtc
    except Exception as e:  # the library or its bindings are missing
        pytest.skip(f"NVRTC cannot be loaded: {e}")


def _cuda_include_dir() -> str:
    """A directory holding cuda_bf16.h: cuda-pathfinder, else the CUDA wheels, else the toolkit."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d and os.path.isfile(os.path.join(d, "cuda_bf16.h")):
            return d
    except Exception:
        pass
    import site

    roots = [*site.getsitepackages(), site.getusersitepackages()]
    candidates = [c for r in roots for c in glob.glob(os.path.join(r, "nvidia", "*", "include"))]
    candidates += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda_bf16.h")):
            return c
    pytest.skip("no CUDA headers (cuda_bf16.h) found for NVRTC")


def compile_cuda(source: str, *, cubin: bool = False):
    """Compile for sm_90a; return the log (ptxas -v included), and the cubin if asked. Fails the test on errors."""
    nvrtc = _nvrtc()
    opts = [
        b"--gpu-architecture=sm_90a",
        b"-std=c++17",
        b"--ptxas-options=-v",
        f"-I{_cuda_include_dir()}".encode(),
        f"-I{CUDA_DIR}".encode(),
    ]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"bodies.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))
            pytest.fail(f"NVRTC failed ({res}):\n{log}\n--- source ---\n{numbered}")
        _, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
        assert cubin_size > 0
        if not cubin:
            return log
        image = b" " * cubin_size
        nvrtc.nvrtcGetCUBIN(prog, image)
        return log, image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass
class Resources:
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


def ptxas_resources(log: str) -> dict[str, Resources]:
    """Per-kernel registers / spills from ptxas -v output."""
    out: dict[str, Resources] = {}
    for block in re.split(r"ptxas info\s*: Compiling entry function ", log)[1:]:
        name = re.match(r"'(\w+)'", block).group(1)
        regs = re.search(r"Used (\d+) registers", block)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        out[name] = Resources(
            int(regs.group(1)) if regs else -1,
            int(frame.group(2)) if frame else 0,
            int(frame.group(3)) if frame else 0,
            int(frame.group(1)) if frame else 0,
        )
    return out


# --- dummy block ops ------------------------------------------------------------------
def contiguous(shape) -> tuple[Dim, ...]:
    strides, acc = [], as_dim(1)
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * d
    return tuple(reversed(strides))


@dataclass
class Arg:
    """One operand of a test op: shape, dtype, and optionally non-contiguous strides."""

    shape: tuple
    dtype: dt.DType
    strides: tuple | None = None
    views: tuple = ()

    def operand(self, buffer: int) -> Operand:
        return Operand(buffer, tuple(as_dim(s) for s in self.shape), self.dtype, self.views)


def dimc(name: str) -> str:
    return f"D_{name}"


def make_op(kind: str, inputs: list[Arg], output: Arg, params: dict) -> BlockOp:
    ins = [a.operand(i) for i, a in enumerate(inputs)]
    out = output.operand(len(inputs))
    part = REGISTRY[kind].build(ins, out, params)
    return BlockOp(0, kind, (), tuple(ins), out, part.grid, part.reads, part.writes, params)


def kernel_source(name: str, kind: str, inputs: list[Arg], output: Arg, params: dict, *, persistent: bool = False):
    """A ``__global__`` wrapper calling the kind's body: block (c0, c1) = grid coordinates,
    or (``persistent``) one block per SM looping over the ``n_inst`` instances of a grid
    of ``n_inst / g1`` x ``g1``, as the megakernel does (without its queue and barriers)."""
    op = make_op(kind, inputs, output, params)

    def cuda_operand(a: Arg, ptr: str) -> CudaOperand:
        strides = a.strides if a.strides is not None else contiguous(a.shape)
        return CudaOperand(ptr, tuple(as_dim(s).to_c(dimc) for s in strides),
                           tuple(as_dim(s).to_c(dimc) for s in a.shape), a.dtype.c_type)

    ins = [cuda_operand(a, f"in{i}") for i, a in enumerate(inputs)]
    out = cuda_operand(output, "out0")
    call = REGISTRY[kind].cuda_call(op, ins, out)
    waits = "MegaWaits wl{}; wl.n = 0;"  # the interpreter's wait list (none here), for waits_in_body kinds
    params_c = [f"const {a.dtype.c_type}* in{i}" for i, a in enumerate(inputs)] + [f"{output.dtype.c_type}* out0"]
    assert set(re.findall(r"\bD_\w+", call)) <= {"D_pos"}, call  # the wrappers declare D_pos only
    params_c += ["long long D_pos"]
    head = f'extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) {name}({", ".join(params_c)}'
    if persistent:
        return (
            f"{head}, long long n_inst, long long g1) {{\n"
            f"    extern __shared__ __align__(16) char smem[];\n"
            f"    for (long long inst = blockIdx.x; inst < n_inst; inst += gridDim.x) {{\n"
            f"        const long long c0 = inst / g1, c1 = inst % g1;\n"
            f"        (void)c1;\n"
            f"        {waits}\n"
            f"        {call};\n"
            f"        __syncthreads();\n"
            f"    }}\n"
            f"}}\n"
        )
    return (
        f"{head}) {{\n"
        f"    extern __shared__ __align__(16) char smem[];\n"
        f"    const long long c0 = blockIdx.x, c1 = blockIdx.y, c2 = blockIdx.z;\n"
        f"    (void)smem; (void)c0; (void)c1; (void)c2;\n"
        f"    {waits}\n"
        f"    {call};\n"
        f"}}\n"
    )


def permuted(shape_kn, dtype) -> Arg:
    """``matmul``'s weight: a contiguous B[K, N] read as w[N, K] through a permute view."""
    k, n = shape_kn
    return Arg((n, k), dtype, strides=(1, n), views=(View("permute", (1, 0)),))


def cases(dtype: dt.DType) -> dict[str, list[tuple]]:
    """kind -> [(label, kind, inputs, output, params)] for element type ``dtype``."""
    T, f32, i32 = dtype, dt.f32, dt.i32
    L = POS + 1
    c = {}
    c["matvec"] = [
        ("plain", "matvec", [Arg((1, 2048), T), Arg((8192, 2048), T)], Arg((1, 8192), T),
         {"rows": 16, "mrows": 1, "roles": ("x", "w"), "eps": 0.0}),
        ("norm_glu", "matvec", [Arg((1, 2048), T), Arg((8192, 2048), T), Arg((8192, 2048), T), Arg((2048,), T)],
         Arg((1, 8192), T), {"rows": 32, "mrows": 1, "roles": ("x", "w", "w2", "g"), "eps": 1e-5}),
        ("res", "matvec", [Arg((1, 8192), T), Arg((2048, 8192), T), Arg((1, 2048), T)], Arg((1, 2048), T),
         {"rows": 16, "mrows": 1, "roles": ("x", "w", "r"), "eps": 0.0}),
        ("norm_lmhead", "matvec", [Arg((1, 2048), T), Arg((128256, 2048), T), Arg((2048,), T)],
         Arg((1, 128256), T), {"rows": 64, "mrows": 1, "roles": ("x", "w", "g"), "eps": 1e-5}),
        ("m2_norm_res", "matvec", [Arg((2, 1024), T), Arg((3072, 1024), T), Arg((1024,), T), Arg((2, 3072), T)],
         Arg((2, 3072), T), {"rows": 8, "mrows": 2, "roles": ("x", "w", "g", "r"), "eps": 1e-6}),
        ("matmul_permuted", "matvec", [Arg((1, 64), T), permuted((64, 96), T)], Arg((1, 96), T),
         {"rows": 8, "mrows": 1, "roles": ("x", "w"), "eps": 0.0}),
        ("ragged_k", "matvec", [Arg((1, 100), T), Arg((37, 100), T), Arg((100,), T)], Arg((1, 37), T),
         {"rows": 8, "mrows": 1, "roles": ("x", "w", "g"), "eps": 1e-5}),
        ("lm_head_argmax", "matvec_argmax", [Arg((1, 2048), T), Arg((128256, 2048), T), Arg((2048,), T)],
         Arg((1, 1002, 2), f32), {"rows": 128, "roles": ("x", "w", "g"), "eps": 1e-5}),
        ("heads_norm_rope", "matvec_heads", [Arg((1, 2048), T), Arg((2048, 2048), T), Arg((2048,), T), Arg((32,), f32)],
         Arg((32, 64), T), {"rows": 64, "head_dim": 64, "roles": ("x", "w", "g", "inv_freq"), "eps": 1e-5, "pos": POS}),
        ("heads_norm_rope_hf", "matvec_heads", [Arg((1, 2048), T), Arg((2048, 2048), T), Arg((2048,), T),
                                                Arg((32,), f32)], Arg((32, 64), T),
         {"rows": 64, "head_dim": 64, "roles": ("x", "w", "g", "inv_freq"), "eps": 1e-5, "pos": POS, "hf": True}),
        ("heads_to_cache_row", "matvec_heads", [Arg((1, 2048), T), Arg((1024, 2048), T)],  # v: [Hkv, D] row of a cache
         Arg((8, 128), T, strides=(512 * 128, 1)), {"rows": 128, "head_dim": 128, "roles": ("x", "w"), "eps": 0.0,
                                                   "pos": POS}),
        ("glu_down_llama", "glu_down", [Arg((1, 2048), T), Arg((2048,), T), Arg((8192, 2048), T), Arg((8192, 2048), T),
                                        Arg((8192, 2048), T)], Arg((1, 2048), f32),
         {"rows": 64, "roles": ("x", "g", "w", "w2", "wd"), "eps": 1e-5}),
        ("glu_down_qwen3_8b", "glu_down", [Arg((1, 4096), T), Arg((4096,), T), Arg((12288, 4096), T),
                                           Arg((12288, 4096), T), Arg((12288, 4096), T)], Arg((1, 4096), f32),
         {"rows": 96, "roles": ("x", "g", "w", "w2", "wd"), "eps": 1e-6}),
        ("moe_qwen3_30b", "moe_glu_down", [Arg((1, 2048), T), Arg((2048,), T), Arg((1, 128), T),
                                           Arg((128, 768, 2048), T), Arg((128, 768, 2048), T),
                                           Arg((128, 768, 2048), T)], Arg((1, 2048), f32),
         {"rows": 32, "roles": ("x", "g", "logits", "w", "w2", "wd"), "eps": 1e-6, "top_k": 8, "normalize": True}),
        ("acc_residual", "acc_residual", [Arg((1, 2048), T), Arg((1, 2048), f32)], Arg((1, 2048), T), {"tile": 1024}),
        ("acc_residual_rows", "acc_residual", [Arg((40, 2048), T), Arg((40, 2048), f32)], Arg((40, 2048), T),
         {"tile": 1024}),
        # a batch's or a prompt's rows through qwen3-30b-a3b's experts (blockops/moe_rows.py), and qwen3-235b's width
        ("moe_route_qwen3_30b", "moe_route", [Arg((40, 128), T)], Arg((40, 2064), f32),
         {"rows_per": 8, "top_k": 8, "sum": 2048, "normalize": True, "dtype": T.name}),
        ("moe_experts_qwen3_30b", "moe_experts", [Arg((40, 2048), T), Arg((2048,), T), Arg((40, 2, 8), f32),
                                                  Arg((128, 768, 2048), T), Arg((128, 768, 2048), T),
                                                  Arg((128, 768, 2048), T)], Arg((40, 2048), f32),
         {"rows": 32, "roles": ("x", "g", "route", "w", "w2", "wd"), "eps": 1e-6, "top_k": 8, **_moe_block(2048, T, True)}),
        ("moe_experts_k4096", "moe_experts", [Arg((40, 4096), T), Arg((40, 2, 8), f32), Arg((128, 1536, 4096), T),
                                              Arg((128, 1536, 4096), T), Arg((128, 1536, 4096), T)],
         Arg((40, 4096), f32), {"rows": 64, "roles": ("x", "route", "w", "w2", "wd"), "eps": 0.0, "top_k": 8,
                                **_moe_block(4096, T, False)}),
        ("sum_norm_q", "matvec", [Arg((1, 2048), T), Arg((2048, 2048), T), Arg((2048,), T), Arg((1, 2048), f32)],
         Arg((1, 2048), T), {"rows": 24, "mrows": 1, "roles": ("x", "w", "g", "xa"), "eps": 1e-5}),
        ("sum_res_o", "matvec", [Arg((1, 2048), T), Arg((2048, 2048), T), Arg((1, 2048), T), Arg((1, 2048), f32)],
         Arg((1, 2048), T), {"rows": 16, "mrows": 1, "roles": ("x", "w", "r", "ra"), "eps": 0.0}),
    ]
    attn = {"length": L, "scale": 0.125}
    c["attention"] = [
        ("partial_d64", "attn_partial", [Arg((32, 64), T), Arg((8, 1024, 64), T), Arg((8, 1024, 64), T)],
         Arg((32, 4, 66), f32), {**attn, "chunk": 256, "group": 4}),
        ("partial_d128", "attn_partial", [Arg((32, 128), T), Arg((8, 2048, 128), T), Arg((8, 2048, 128), T)],
         Arg((32, 32, 130), f32), {**attn, "chunk": 64, "group": 4, "scale": 0.08838834764831845}),
        ("partial_g8", "attn_partial", [Arg((64, 128), T), Arg((8, 1024, 128), T), Arg((8, 1024, 128), T)],
         Arg((64, 4, 130), f32), {**attn, "chunk": 256, "group": 8}),
        ("merge_d64", "attn_merge", [Arg((32, 4, 66), f32)], Arg((32, 64), T), {**attn, "chunk": 256, "rows_per": 4}),
        ("merge_d128", "attn_merge", [Arg((32, 32, 130), f32)], Arg((32, 128), T),
         {**attn, "chunk": 64, "rows_per": 4}),
        ("partial_merge_d64", "attn_partial_merge", [Arg((32, 64), T), Arg((8, 1024, 64), T), Arg((8, 1024, 64), T),
                                                     Arg((32, 4, 66), f32), Arg((8,), i32)],
         Arg((32, 64), T), {**attn, "chunk": 256, "group": 4}),
        ("partial_merge_d128", "attn_partial_merge", [Arg((64, 128), T), Arg((8, 2048, 128), T), Arg((8, 2048, 128), T),
                                                      Arg((64, 32, 130), f32), Arg((8,), i32)],
         Arg((64, 128), T), {**attn, "chunk": 64, "group": 8, "scale": 0.08838834764831845}),
    ]
    c["rms_norm"] = [
        ("hidden", "rms_norm", [Arg((1, 2048), T), Arg((2048,), T)], Arg((1, 2048), T), {"rows_per": 1, "eps": 1e-5}),
        ("qk_norm", "rms_norm", [Arg((32, 128), T), Arg((128,), T)], Arg((32, 128), T), {"rows_per": 4, "eps": 1e-6}),
        ("wide", "rms_norm", [Arg((1, 8192), T), Arg((8192,), T)], Arg((1, 8192), T), {"rows_per": 1, "eps": 1e-5}),
    ]
    c["rope"] = [
        ("pos_dim", "rope", [Arg((32, 128), T), Arg((64,), f32)], Arg((32, 128), T),
         {"rows_per": 4, "pos": POS, "group": 1, "roles": ("x", "inv_freq"), "eps": 0.0}),
        ("pos_tensor", "rope", [Arg((4, 64), T), Arg((32,), f32), Arg((2,), i32)], Arg((4, 64), T),
         {"rows_per": 4, "pos": None, "group": 2, "roles": ("x", "inv_freq", "pos_ids"), "eps": 0.0}),
        ("norm_to_cache_row", "rope", [Arg((8, 128), T), Arg((64,), f32), Arg((128,), T)],  # qwen3's k: norm, rope, append
         Arg((8, 128), T, strides=(1024 * 128, 1)), {"rows_per": 1, "pos": POS, "group": 1,
                                                    "roles": ("x", "inv_freq", "g"), "eps": 1e-6}),
        # rounded as Hugging Face does (a traced model's RoPE): at a position from a tensor, k's into its cache row
        ("hf_pos_tensor", "rope", [Arg((4, 64), T), Arg((32,), f32), Arg((1,), i32)], Arg((4, 64), T),
         {"rows_per": 1, "pos": None, "group": 4, "roles": ("x", "inv_freq", "pos_ids"), "eps": 0.0, "hf": True}),
        ("hf_norm_to_cache_row", "rope", [Arg((8, 128), T), Arg((64,), f32), Arg((1,), i32), Arg((128,), T)],
         Arg((8, 128), T, strides=(1024 * 128, 1)), {"rows_per": 1, "pos": None, "group": 8,
                                                    "roles": ("x", "inv_freq", "pos_ids", "g"), "eps": 1e-6, "hf": True}),
    ]
    c["softmax"] = [
        ("rows", "softmax", [Arg((4, 1000), T)], Arg((4, 1000), T), {"rows_per": 4}),
        ("runtime_len", "softmax", [Arg((32, L), T, strides=(4096, 1))], Arg((32, L), T, strides=(4096, 1)),
         {"rows_per": 1}),
    ]
    c["argmax"] = [
        ("partial", "argmax_partial", [Arg((1, 128256), T)], Arg((1, 32, 2), f32), {"chunk": 4096}),
        ("reduce", "argmax_reduce", [Arg((1, 32, 2), f32)], Arg((1,), i32), {}),
    ]
    c["embedding"] = [
        ("row", "embedding", [Arg((128256, 2048), T), Arg((1,), i32)], Arg((1, 2048), T), {}),
    ]
    c["kv_append"] = [
        ("d64", "kv_append", [Arg((8, 64), T)], Arg((8, 1024, 64), T), {"pos": POS}),
    ]
    # batches and prompts: several x rows per matvec instance (tensor cores for bf16 / f16), the KV rows
    # of many sequences, attention over each row's own slot, sampling
    def mr(k, norm, rows=None, gated=False):  # as the lowering picks it
        return runtime_mrows(k, T, norm=norm, rows=rows, gated=gated)
    length = as_dim(1024)
    c["batch"] = [
        ("rows_norm_glu", "matvec", [Arg((16, 2048), T), Arg((8192, 2048), T), Arg((8192, 2048), T), Arg((2048,), T)],
         Arg((16, 8192), T), {"rows": 64, "mrows": mr(2048, True), "m_last": True, "roles": ("x", "w", "w2", "g"),
                              "eps": 1e-5}),
        ("rows_res_k8192", "matvec", [Arg((16, 8192), T), Arg((2048, 8192), T), Arg((16, 2048), T)], Arg((16, 2048), T),
         {"rows": 16, "mrows": mr(8192, False), "m_last": True, "roles": ("x", "w", "r"), "eps": 0.0}),
        ("rows_norm_qkv", "matvec", [Arg((16, 4096), T), Arg((1024, 4096), T), Arg((4096,), T)], Arg((16, 1024), T),
         {"rows": 24, "mrows": mr(4096, True), "m_last": True, "roles": ("x", "w", "g"), "eps": 1e-6}),
        # wide tiles of 64 x rows (their few-rows case runs the staged body above): llama's gated MLP and
        # down projection, qwen3-8b's k projection (norm at K = 4096) and gated MLP (96 rows a tile)
        *([] if T == f32 else [
            ("rows_wide_norm_glu", "matvec", [Arg((64, 2048), T), Arg((8192, 2048), T), Arg((8192, 2048), T),
                                              Arg((2048,), T)], Arg((64, 8192), T),
             {"rows": 64, "mrows": mr(2048, True, 64, True), "m_last": True, "roles": ("x", "w", "w2", "g"), "eps": 1e-5}),
            ("rows_wide_res_k8192", "matvec", [Arg((64, 8192), T), Arg((2048, 8192), T), Arg((64, 2048), T)],
             Arg((64, 2048), T), {"rows": 16, "mrows": mr(8192, False, 16), "m_last": True, "roles": ("x", "w", "r"),
                                  "eps": 0.0}),
            ("rows_wide_norm_k4096", "matvec", [Arg((64, 4096), T), Arg((1024, 4096), T), Arg((4096,), T)],
             Arg((64, 1024), T), {"rows": 32, "mrows": mr(4096, True, 32), "m_last": True, "roles": ("x", "w", "g"),
                                  "eps": 1e-6}),
            ("rows_wide_glu96", "matvec", [Arg((64, 4096), T), Arg((12288, 4096), T), Arg((12288, 4096), T)],
             Arg((64, 12288), T), {"rows": 96, "mrows": mr(4096, False, 96, True), "m_last": True,
                                   "roles": ("x", "w", "w2"), "eps": 0.0}),
            # split over K (matvec_split.cuh): llama's down projection (128 rows, 8 splits) and O (64, 4)
            ("split_down", "matvec_split", [Arg((64, 8192), T), Arg((2048, 8192), T), Arg((64, 2048), T),
                                            Arg((128, 64 * 128), f32), Arg((16,), i32)], Arg((64, 2048), T),
             {"rows": 128, "splits": 8, "roles": ("x", "w", "r")}),
            ("split_o", "matvec_split", [Arg((64, 2048), T), Arg((2048, 2048), T), Arg((128, 64 * 64), f32),
                                         Arg((32,), i32)], Arg((64, 2048), T),
             {"rows": 64, "splits": 4, "roles": ("x", "w")}),
        ]),
        ("kv_store", "kv_store", [Arg((6, 8, 64), T), Arg((6,), i32), Arg((6,), i32)], Arg((4, 8, 1024, 64), T), {}),
        ("kv_store_rope", "kv_store", [Arg((6, 8, 128), T), Arg((6,), i32), Arg((6,), i32), Arg((64,), f32),
                                       Arg((6,), i32), Arg((128,), T)], Arg((4, 8, 1024, 128), T),
         {"roles": ("new", "pos", "slot", "inv_freq", "pos_ids", "g"), "eps": 1e-6}),
        ("kv_store_rope_hf", "kv_store", [Arg((6, 8, 128), T), Arg((6,), i32), Arg((6,), i32), Arg((64,), f32),
                                          Arg((6,), i32), Arg((128,), T)], Arg((4, 8, 1024, 128), T),
         {"roles": ("new", "pos", "slot", "inv_freq", "pos_ids", "g"), "eps": 1e-6, "hf": True}),
        ("ragged_partial_merge", "ragged_partial_merge", [Arg((6, 32, 64), T), Arg((4, 8, 1024, 64), T),
                                                          Arg((4, 8, 1024, 64), T), Arg((6,), i32), Arg((6,), i32),
                                                          Arg((132, 4, 66), f32), Arg((48,), i32)], Arg((6, 32, 64), T),
         {"splits": split_count(length, 64, 48), "group": 4, "scale": 0.125, "length": length}),
        ("sample", "sample", [Arg((4, 128256), T), Arg((4,), f32), Arg((4,), i32), Arg((4,), f32), Arg((4,), i32),
                              Arg((4,), i32)], Arg((4,), i32), {}),
    ]
    if T == dt.bf16:  # (tensor cores: bf16 only)
        c["batch"] += [
            ("flash_d64", "ragged_flash", [Arg((2048, 32, 64), T), Arg((4, 8, 4096, 64), T), Arg((4, 8, 4096, 64), T),
                                           Arg((2048,), i32), Arg((2048,), i32)], Arg((2048, 32, 64), T),
             {"group": 4, "scale": 0.125, "length": length}),
            ("flash_d128", "ragged_flash", [Arg((2048, 32, 128), T), Arg((4, 8, 4096, 128), T), Arg((4, 8, 4096, 128), T),
                                            Arg((2048,), i32), Arg((2048,), i32)], Arg((2048, 32, 128), T),
             {"group": 4, "scale": 0.08838834764831845, "length": length}),
            ("flash_rope_hf", "ragged_flash", [Arg((2048, 32, 64), T), Arg((4, 8, 4096, 64), T), Arg((4, 8, 4096, 64), T),
                                               Arg((2048,), i32), Arg((2048,), i32), Arg((32,), f32), Arg((2048,), i32)],
             Arg((2048, 32, 64), T), {"group": 4, "scale": 0.125, "length": length, "rope": ("inv_freq", "pos_ids"),
                                      "eps": 0.0, "hf": True}),
        ]
    ew = lambda fn, shape, tile=8192, axis=0: {"fn": fn, "axis": axis, "tile": tile}  # noqa: E731
    c["elementwise"] = [
        ("add", "elementwise", [Arg((1, 2048), T), Arg((1, 2048), T)], Arg((1, 2048), T), ew("add", (1, 2048), 1, 1)),
        ("mul_bcast", "elementwise", [Arg((4, 2048), T), Arg((4, 2048), T, strides=(0, 1))], Arg((4, 2048), T),
         ew("mul", (4, 2048), 2048, 1)),
        ("silu", "elementwise", [Arg((1, 8192), T)], Arg((1, 8192), T), ew("silu", (1, 8192), 8192, 1)),
        ("copy_3d", "elementwise", [Arg((8, 4, 64), T, strides=(64, 512, 1))], Arg((8, 4, 64), T),
         ew("copy", (8, 4, 64), 8, 0)),
        ("cast", "elementwise", [Arg((2, 3, 4, 5), T)], Arg((2, 3, 4, 5), f32 if T != f32 else dt.bf16),
         ew("cast", (2, 3, 4, 5), 1, 1)),
        ("int_add", "elementwise", [Arg((16,), i32), Arg((16,), i32)], Arg((16,), i32), ew("add", (16,), 16)),
        ("sub_bcast", "elementwise", [Arg((4, 2048), T), Arg((4, 2048), T, strides=(0, 1))], Arg((4, 2048), T),
         ew("sub", (4, 2048), 2048, 1)),
        ("div", "elementwise", [Arg((2, 1000), T), Arg((2, 1000), T)], Arg((2, 1000), T), ew("div", (2, 1000), 1000, 1)),
        ("neg_3d", "elementwise", [Arg((8, 4, 64), T, strides=(64, 512, 1))], Arg((8, 4, 64), T),
         ew("neg", (8, 4, 64), 8, 0)),
        ("int_neg_sub", "elementwise", [Arg((16,), i32)], Arg((16,), i32), ew("neg", (16,), 16)),
        *((fn, "elementwise", [Arg((2, 1000), T)], Arg((2, 1000), T), ew(fn, (2, 1000), 1000, 1))
          for fn in ("sigmoid", "gelu", "gelu_tanh", "tanh", "exp", "cos", "sin")),
        ("scalar", "elementwise", [Arg((), T)], Arg((), T), {"fn": "copy", "axis": 0, "tile": 1}),
    ]
    return c


GROUPS = ["matvec", "attention", "rms_norm", "rope", "softmax", "argmax", "embedding", "kv_append", "batch",
          "elementwise"]
DTYPES = {"bf16": dt.bf16, "f32": dt.f32, "f16": dt.f16}
F16_GROUPS = {"matvec", "attention", "batch"}


def group_source(group: str) -> tuple[str, list[str]]:
    files = sorted({k.cuda_file for k in REGISTRY.values() if k.name not in WHOLE_KERNEL_KINDS})
    src = [PRELUDE] + [f'#include "{f}"' for f in files] + [""]
    names = []
    for tname, T in DTYPES.items():
        if tname == "f16" and group not in F16_GROUPS:
            continue
        for label, kind, inputs, output, params in cases(T)[group]:
            name = f"k_{group}_{label}_{tname}"
            src.append(kernel_source(name, kind, inputs, output, params))
            names.append(name)
    return "\n".join(src), names


def test_every_kind_has_a_body_file():
    for kind in REGISTRY.values():
        assert kind.cuda_file and (CUDA_DIR / kind.cuda_file).is_file(), kind.name
    covered = {kind for g in GROUPS for (_, kind, *_rest) in cases(dt.bf16)[g]}
    assert covered | PEER_KINDS | WHOLE_KERNEL_KINDS == set(REGISTRY), set(REGISTRY) ^ (covered | PEER_KINDS | WHOLE_KERNEL_KINDS)


# Bodies that address the other GPUs' peer regions through the kernel's arguments: compiled in a whole
# tensor-parallel kernel (tests/test_parallel.py) and run on 2 GPUs (tests/gpu/test_parallel_gpu.py).
PEER_KINDS = {"allreduce_send", "allreduce_sum", "allgather_copy"}
# A deferred body (BlockKind.deferred: its case fills a job the interpreter runs after its switch) that
# needs CuTe: compiled in whole kernels (tests/test_gemm.py) and run in them (tests/gpu/test_batch_gpu.py).
WHOLE_KERNEL_KINDS = {"gemm"}


@pytest.mark.parametrize("group", GROUPS)
def test_cuda_bodies_compile(group):
    source, names = group_source(group)
    log, image = compile_cuda(source, cubin=True)
    res = ptxas_resources(log)
    for name in names:
        r = res.get(name)
        assert r is not None, f"no ptxas report for {name}"
        print(f"{name:40s} {r.registers:4d} regs  stack {r.stack:5d}  spill st/ld {r.spill_stores}/{r.spill_loads}")
    for name in names:
        # the bandwidth-bound hot paths keep everything in registers: one x row, and rows on tensor cores
        if group == "matvec" or (group == "batch" and "_rows_" in name and not name.endswith("_f32")):
            assert res[name].spill_stores == 0 and res[name].spill_loads == 0, (name, res[name])
    # every instance fetches its body's code cold from L2: a body past the instruction cache's reach runs
    # at fetch speed (the tensor-core matvec's unrolled norm staging was ~200 KB: perf-notes #72)
    for fname, size in function_sizes(image).items():
        bound = MAX_MATVEC_SASS if "matvec_impl" in fname else MAX_BODY_SASS
        assert size < bound, f"{fname[:120]}: {size // 1024} KB of SASS (at most {bound // 1024} KB)"


MAX_MATVEC_SASS = 48 * 1024  # a matvec body (the largest, on tensor cores with its norm: ~31 KB)
MAX_BODY_SASS = 128 * 1024  # any test kernel with its bodies inlined (the largest: ~62 KB)


# --- GPU: each body against its kind's cpu() (the living definition) ---------------------
SMEM = SMEM_BYTES  # PRELUDE's MEGA_SMEM


def _torch_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.empty(1, device="cuda")  # the primary context exists before cuModuleLoadData
    return torch


class Module:
    """A compiled wrapper program loaded with the driver API."""

    def __init__(self, source: str):
        from cuda.bindings import driver

        self.driver = driver
        log, image = compile_cuda(source, cubin=True)
        # (a second compile in one process has been seen to come back without a ptxas report)
        self.resources = collections.defaultdict(lambda: Resources(-1, 0, 0, 0), ptxas_resources(log))
        err, self.mod = driver.cuModuleLoadData(image)
        assert err == driver.CUresult.CUDA_SUCCESS, err

    def launch(self, name: str, grid: tuple[int, ...], args: list) -> None:
        import numpy as np

        d = self.driver
        err, fn = d.cuModuleGetFunction(self.mod, name.encode())
        assert err == d.CUresult.CUDA_SUCCESS, (name, err)
        (err,) = d.cuFuncSetAttribute(fn, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM)
        assert err == d.CUresult.CUDA_SUCCESS, err
        vals = [np.array([a.data_ptr() if hasattr(a, "data_ptr") else a], dtype=np.uint64 if hasattr(a, "data_ptr")
                         else np.int64) for a in args]
        ptrs = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
        (err,) = d.cuLaunchKernel(fn, *(tuple(grid) + (1, 1))[:3], THREADS, 1, 1, SMEM, 0, ptrs.ctypes.data, 0)
        assert err == d.CUresult.CUDA_SUCCESS, (name, err)

    def error_code(self) -> int:
        import numpy as np

        d = self.driver
        err, ptr, size = d.cuModuleGetGlobal(self.mod, b"mega_test_error")
        assert err == d.CUresult.CUDA_SUCCESS, err
        host = np.zeros(1, dtype=np.int32)
        (err,) = d.cuMemcpyDtoH(host.ctypes.data, ptr, 4)
        assert err == d.CUresult.CUDA_SUCCESS, err
        return int(host[0])


def _strided(a: Arg, env: dict, gen, fill=None):
    """Random storage for ``a`` and its strided view (CPU)."""
    import torch

    shape = [as_dim(s).eval(env) for s in a.shape]
    strides = [as_dim(s).eval(env) for s in (a.strides if a.strides is not None else contiguous(a.shape))]
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if a.dtype.is_float:
        storage = torch.randn(size, generator=gen).to(a.dtype.torch)
    else:
        storage = torch.randint(0, 100, (size,), generator=gen, dtype=torch.int32)
    view = storage.as_strided(shape, strides)
    if fill is not None:
        fill(view, gen)
    return storage, view


def _poisoned(a: Arg, env: dict):
    import torch

    shape = [as_dim(s).eval(env) for s in a.shape]
    strides = [as_dim(s).eval(env) for s in (a.strides if a.strides is not None else contiguous(a.shape))]
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    storage = torch.full((size,), float("nan") if a.dtype.is_float else -7, dtype=a.dtype.torch)
    return storage, storage.as_strided(shape, strides)


def _randint(lo, hi):
    import torch

    return lambda v, gen: v.copy_(torch.randint(lo, hi, v.shape, generator=gen, dtype=v.dtype))


def _moe_block(k_dim: int, dtype, norm: bool) -> dict:
    """moe_experts' block fields as the emit chooses them (moe_rows.expert_block)."""
    block, mma = expert_block(k_dim, dtype, norm=norm)
    return {"block": block, "mma": mma}


def _routes(used: int):
    """The route [n, 2, top_k] of moe_rows.py's state: random weights, each row's experts distinct among the first
    ``used``."""
    import torch

    def fill(v, gen):
        for r in range(v.shape[0]):
            v[r, 0] = torch.rand(v.shape[2], generator=gen)
            v[r, 1] = torch.randperm(used, generator=gen)[: v.shape[2]].float()
    return fill


def _attn_part(d):
    import torch

    def fill(v, gen):  # plausible partials: max logits spread out, positive sums
        v[..., d] = torch.randn(v.shape[:-1], generator=gen) * 3
        v[..., d + 1] = torch.rand(v.shape[:-1], generator=gen) * 10 + 0.5
    return fill


def _argmax_ties(v, gen):  # equal maxima inside a chunk and across chunks: the lowest index wins
    top = v.float().max() + 1
    for k in (70000, 5003, 5000, 90000):
        v[0, k] = top


def _argmax_part(v, gen):
    import torch

    v[..., 0] = torch.randn(v.shape[:-1], generator=gen).round()  # ties between chunks
    v[..., 1] = torch.randint(0, 1 << 20, v.shape[:-1], generator=gen).float()


def _small_ints(v, gen):  # exact f32 sums in any order: the GPU's logits equal the CPU's, ties included
    import torch

    v.copy_(torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype))


def _plus_minus_2(v, gen):  # RMS exactly 2: the RMSNorm prologue scales by 0.5, exactly
    import torch

    v.copy_((torch.randint(0, 2, v.shape, generator=gen) * 4 - 2).to(v.dtype))


def _distinct(hi):  # distinct indices below hi (cache positions no two rows share)
    import torch

    return lambda v, gen: v.copy_(torch.randperm(hi, generator=gen)[: v.numel()].reshape(v.shape).to(v.dtype))


def _arange(start):  # consecutive positions from start (a prompt's rows)
    import torch

    return lambda v, gen: v.copy_(torch.arange(start, start + v.numel(), dtype=v.dtype).reshape(v.shape))


def _values(*xs):
    import torch

    return lambda v, gen: v.copy_(torch.tensor(xs, dtype=v.dtype))


def gpu_cases(dtype: dt.DType) -> list[tuple]:
    """(label, kind, inputs, output, params, fills) at sizes a CPU reference runs quickly."""
    T, f32, i32 = dtype, dt.f32, dt.i32
    L = POS + 1
    ew = lambda fn, tile, axis: {"fn": fn, "axis": axis, "tile": tile}  # noqa: E731
    attn = {"length": L, "scale": 0.125}
    return [
        ("mv_plain", "matvec", [Arg((1, 2048), T), Arg((1000, 2048), T)], Arg((1, 1000), T),
         {"rows": 16, "mrows": 1, "roles": ("x", "w"), "eps": 0.0}, {}),
        ("mv_norm_glu", "matvec", [Arg((1, 2048), T), Arg((600, 2048), T), Arg((600, 2048), T), Arg((2048,), T)],
         Arg((1, 600), T), {"rows": 32, "mrows": 1, "roles": ("x", "w", "w2", "g"), "eps": 1e-5}, {}),
        ("mv_res_k8192", "matvec", [Arg((1, 8192), T), Arg((200, 8192), T), Arg((1, 200), T)], Arg((1, 200), T),
         {"rows": 16, "mrows": 1, "roles": ("x", "w", "r"), "eps": 0.0}, {}),
        ("mv_norm_rows64", "matvec", [Arg((1, 1024), T), Arg((700, 1024), T), Arg((1024,), T)], Arg((1, 700), T),
         {"rows": 64, "mrows": 1, "roles": ("x", "w", "g"), "eps": 1e-6}, {}),
        ("mv_m2_all", "matvec", [Arg((2, 512), T, strides=(520, 1)), Arg((300, 512), T), Arg((300, 512), T),
                                 Arg((512,), T), Arg((2, 300), T)], Arg((2, 300), T),
         {"rows": 8, "mrows": 2, "roles": ("x", "w", "w2", "g", "r"), "eps": 1e-5}, {}),
        ("mv_m3_tiles", "matvec", [Arg((3, 512), T), Arg((300, 512), T), Arg((512,), T), Arg((3, 300), T)],
         Arg((3, 300), T), {"rows": 16, "mrows": 1, "roles": ("x", "w", "g", "r"), "eps": 1e-5}, {}),
        ("mv_matmul", "matvec", [Arg((1, 64), T), permuted((64, 96), T)], Arg((1, 96), T),
         {"rows": 8, "mrows": 1, "roles": ("x", "w"), "eps": 0.0}, {}),
        ("mv_ragged_k", "matvec", [Arg((1, 100), T), Arg((37, 100), T), Arg((100,), T), Arg((1, 37), T)],
         Arg((1, 37), T), {"rows": 8, "mrows": 1, "roles": ("x", "w", "g", "r"), "eps": 1e-5}, {}),
        ("glu_down_norm", "glu_down", [Arg((1, 512), T), Arg((512,), T), Arg((300, 512), T), Arg((300, 512), T),
                                       Arg((300, 256), T)], Arg((1, 256), f32),
         {"rows": 32, "roles": ("x", "g", "w", "w2", "wd"), "eps": 1e-5}, {}),
        ("glu_down_strided_x", "glu_down", [Arg((1, 256), T, strides=(512, 2)), Arg((256,), T), Arg((72, 256), T),
                                            Arg((72, 256), T), Arg((72, 128), T)], Arg((1, 128), f32),
         {"rows": 16, "roles": ("x", "g", "w", "w2", "wd"), "eps": 1e-5}, {}),  # (the generic gated body)
        ("glu_down_wide_n", "glu_down", [Arg((1, 256), T), Arg((100, 256), T), Arg((100, 256), T),
                                         Arg((100, 4096), T)], Arg((1, 4096), f32),
         {"rows": 16, "roles": ("x", "w", "w2", "wd"), "eps": 0.0}, {}),
        ("moe_norm", "moe_glu_down", [Arg((1, 256), T), Arg((256,), T), Arg((1, 5), T), Arg((5, 72, 256), T),
                                      Arg((5, 72, 256), T), Arg((5, 72, 256), T)], Arg((1, 256), f32),
         {"rows": 32, "roles": ("x", "g", "logits", "w", "w2", "wd"), "eps": 1e-5, "top_k": 3, "normalize": True}, {}),
        ("moe_f32_logits", "moe_glu_down", [Arg((1, 128), T), Arg((1, 7), f32), Arg((7, 40, 128), T),
                                            Arg((7, 40, 128), T), Arg((7, 40, 128), T)], Arg((1, 128), f32),
         {"rows": 16, "roles": ("x", "logits", "w", "w2", "wd"), "eps": 0.0, "top_k": 2, "normalize": False}, {}),
        ("acc_residual", "acc_residual", [Arg((1, 3000), T), Arg((1, 3000), f32)], Arg((1, 3000), T), {"tile": 1024}, {}),
        ("acc_residual_rows", "acc_residual", [Arg((5, 3000), T), Arg((5, 3000), f32)], Arg((5, 3000), T), {"tile": 1024},
         {}),
        # 21 rows (a ragged last routing instance); the experts of rows that chose among 6 of 9, ~10 rows each
        # (one block each; f32: 3 passes of 4), so the instances past 6 find none; 72 = 2 tiles of 32 + 8;
        # N = 1024: 2 vectors a thread
        ("moe_route", "moe_route", [Arg((21, 9), T)], Arg((21, 24), f32),
         {"rows_per": 8, "top_k": 3, "sum": 16, "normalize": True, "dtype": T.name}, {}),
        ("moe_route_f32_logits", "moe_route", [Arg((5, 7), f32, strides=(9, 1))], Arg((5, 16), f32),
         {"rows_per": 8, "top_k": 2, "sum": 12, "normalize": False, "dtype": T.name}, {}),
        ("moe_experts_norm", "moe_experts", [Arg((21, 256), T), Arg((256,), T), Arg((21, 2, 3), f32), Arg((9, 72, 256), T),
                                             Arg((9, 72, 256), T), Arg((9, 72, 256), T)], Arg((21, 256), f32),
         {"rows": 32, "roles": ("x", "g", "route", "w", "w2", "wd"), "eps": 1e-5, "top_k": 3, **_moe_block(256, T, True)},
         {2: _routes(6)}),
        ("moe_experts_wide_n", "moe_experts", [Arg((21, 128), T), Arg((21, 2, 3), f32), Arg((9, 40, 128), T),
                                               Arg((9, 40, 128), T), Arg((9, 40, 1024), T)], Arg((21, 1024), f32),
         {"rows": 16, "roles": ("x", "route", "w", "w2", "wd"), "eps": 0.0, "top_k": 3, **_moe_block(128, T, False)},
         {1: _routes(6)}),
        # 40 rows among 4 experts, ~30 rows each: two blocks an expert; and K = 4096 normalised: blocks of 8 rows
        ("moe_experts_blocks", "moe_experts", [Arg((40, 256), T), Arg((256,), T), Arg((40, 2, 3), f32),
                                               Arg((4, 72, 256), T), Arg((4, 72, 256), T), Arg((4, 72, 256), T)],
         Arg((40, 256), f32), {"rows": 32, "roles": ("x", "g", "route", "w", "w2", "wd"), "eps": 1e-5, "top_k": 3,
                               **_moe_block(256, T, True)}, {2: _routes(4)}),
        ("moe_experts_k4096_norm", "moe_experts", [Arg((12, 4096), T), Arg((4096,), T), Arg((12, 2, 2), f32),
                                                   Arg((3, 40, 4096), T), Arg((3, 40, 4096), T), Arg((3, 40, 128), T)],
         Arg((12, 128), f32), {"rows": 32, "roles": ("x", "g", "route", "w", "w2", "wd"), "eps": 1e-5, "top_k": 2,
                               **_moe_block(4096, T, True)}, {2: _routes(3)}),
        # a runtime M's tiles of 64 x rows (matvec_wide.cuh), ragged in x rows and weight rows: two tiles
        # (64 + 36 rows) gated with the norm, one of 40 rows with the residual (24-row tiles: half a
        # group padded), K = 4096's norm (its staged body takes 8 rows), and 10 rows (the staged body)
        *([] if T == f32 else [
            ("mv_wide_norm_glu", "matvec", [Arg((100, 512), T), Arg((300, 512), T), Arg((300, 512), T), Arg((512,), T)],
             Arg((100, 300), T), {"rows": 64, "mrows": 64, "m_last": True, "roles": ("x", "w", "w2", "g"), "eps": 1e-5},
             {}),
            ("mv_wide_res", "matvec", [Arg((40, 1024), T, strides=(1032, 1)), Arg((200, 1024), T), Arg((40, 200), T)],
             Arg((40, 200), T), {"rows": 24, "mrows": 64, "m_last": True, "roles": ("x", "w", "r"), "eps": 0.0}, {}),
            ("mv_wide_half", "matvec", [Arg((20, 1024), T), Arg((200, 1024), T), Arg((20, 200), T)],  # 32-row stages
             Arg((20, 200), T), {"rows": 16, "mrows": 64, "m_last": True, "roles": ("x", "w", "r"), "eps": 0.0}, {}),
            ("mv_wide_norm_k4096", "matvec", [Arg((30, 4096), T), Arg((96, 4096), T), Arg((4096,), T)],
             Arg((30, 96), T), {"rows": 32, "mrows": 64, "m_last": True, "roles": ("x", "w", "g"), "eps": 1e-6}, {}),
            ("mv_wide_few_rows", "matvec", [Arg((10, 512), T), Arg((300, 512), T), Arg((512,), T), Arg((10, 300), T)],
             Arg((10, 300), T), {"rows": 96, "mrows": 64, "m_last": True, "roles": ("x", "w", "g", "r"), "eps": 1e-5},
             {}),
            # split over K (matvec_split.cuh), ragged in weight rows (200 = 3 tiles of 64 + 8): the wide tile's
            # 64-row and 32-row stages, the staged body (10 rows) and, past one row tile, the unsplit matvec
            *(("split" + label, "matvec_split",
               [Arg((m, 1024), T), Arg((rows_n, 1024), T), *([Arg((m, rows_n), T)] if res else []),
                Arg((-(-rows_n // tile) * splits, 64 * tile), f32), Arg((-(-rows_n // tile),), i32)], Arg((m, rows_n), T),
               {"rows": tile, "splits": splits, "roles": ("x", "w", "r") if res else ("x", "w")},
               {3 if res else 2: lambda v, gen: v.fill_(float("nan")), 4 if res else 3: lambda v, gen: v.zero_()})
              for label, m, rows_n, tile, splits, res in (
                  ("_res40", 40, 200, 64, 4, True), ("_20", 20, 200, 64, 2, False), ("_res10", 10, 200, 64, 4, True),
                  ("_10_rows48", 10, 200, 48, 2, False), ("_unsplit70", 70, 200, 64, 4, True),
                  ("_res64_rows48", 64, 100, 48, 2, True))),
        ]),
        ("mv_sum_norm", "matvec", [Arg((1, 1024), T), Arg((300, 1024), T), Arg((1024,), T), Arg((1, 1024), f32)],
         Arg((1, 300), T), {"rows": 24, "mrows": 1, "roles": ("x", "w", "g", "xa"), "eps": 1e-5}, {}),
        ("mv_sum_res", "matvec", [Arg((1, 512), T), Arg((200, 512), T), Arg((1, 200), T), Arg((1, 200), f32)],
         Arg((1, 200), T), {"rows": 16, "mrows": 1, "roles": ("x", "w", "r", "ra"), "eps": 0.0}, {}),
        ("mv_sum_scalar", "matvec", [Arg((1, 100), T), Arg((37, 100), T), Arg((100,), T), Arg((1, 37), T),
                                     Arg((1, 100), f32), Arg((1, 37), f32)], Arg((1, 37), T),
         {"rows": 8, "mrows": 1, "roles": ("x", "w", "g", "r", "xa", "ra"), "eps": 1e-5}, {}),
        ("attn_d64", "attn_partial", [Arg((32, 64), T), Arg((8, 1024, 64), T), Arg((8, 1024, 64), T)],
         Arg((32, 4, 66), f32), {**attn, "chunk": 256, "group": 4}, {}),
        ("attn_d128", "attn_partial", [Arg((16, 128), T), Arg((8, 1024, 128), T), Arg((8, 1024, 128), T)],
         Arg((16, 16, 130), f32), {**attn, "chunk": 64, "group": 2, "scale": 0.08838834764831845}, {}),
        ("attn_g8_strided_q", "attn_partial", [Arg((64, 128), T, strides=(1, 64)), Arg((8, 1024, 128), T),
                                               Arg((8, 1024, 128), T)], Arg((64, 4, 130), f32),
         {**attn, "chunk": 256, "group": 8}, {}),
        ("attn_d64_strided_cache", "attn_partial", [Arg((32, 64), T), Arg((8, 300, 64), T, strides=(300 * 64, 1, 300)),
                                                    Arg((8, 300, 64), T, strides=(300 * 64, 1, 300))],
         Arg((32, 2, 66), f32), {**attn, "length": as_dim(300), "chunk": 256, "group": 4}, {}),  # (the generic body)
        ("merge_d64", "attn_merge", [Arg((32, 4, 66), f32)], Arg((32, 64), T), {**attn, "chunk": 256, "rows_per": 4},
         {0: _attn_part(64)}),
        ("merge_d128_many", "attn_merge", [Arg((16, 64, 130), f32)], Arg((16, 128), T),
         {**attn, "chunk": 16, "rows_per": 2}, {0: _attn_part(128)}),
        # the last split of each KV head merges: 3 splits, then 44 (more than a warp's 32)
        ("partial_merge_d64", "attn_partial_merge", [Arg((32, 64), T), Arg((8, 1024, 64), T), Arg((8, 1024, 64), T),
                                                     Arg((32, 4, 66), f32), Arg((8,), i32)], Arg((32, 64), T),
         {**attn, "chunk": 256, "group": 4}, {4: lambda v, gen: v.zero_()}),
        ("partial_merge_d128_many", "attn_partial_merge", [Arg((16, 128), T), Arg((8, 1024, 128), T),
                                                           Arg((8, 1024, 128), T), Arg((16, 64, 130), f32),
                                                           Arg((8,), i32)], Arg((16, 128), T),
         {**attn, "chunk": 16, "group": 2, "scale": 0.08838834764831845}, {4: lambda v, gen: v.zero_()}),
        ("rms_hidden", "rms_norm", [Arg((1, 2048), T), Arg((2048,), T)], Arg((1, 2048), T),
         {"rows_per": 1, "eps": 1e-5}, {}),
        ("rms_qk", "rms_norm", [Arg((40, 128), T), Arg((128,), T)], Arg((40, 128), T), {"rows_per": 4, "eps": 1e-6}, {}),
        ("rms_wide_strided", "rms_norm", [Arg((3, 4000), T, strides=(1, 3)), Arg((4000,), T)], Arg((3, 4000), T),
         {"rows_per": 4, "eps": 1e-5}, {}),
        # a warp a row up to D = 4096 (g read again for the write past 32 elements a lane), a block a row past it
        ("rms_rows_d4096", "rms_norm", [Arg((20, 4096), T), Arg((4096,), T)], Arg((20, 4096), T),
         {"rows_per": 16, "eps": 1e-6}, {}),
        ("rms_rows_few_d4096", "rms_norm", [Arg((3, 4096), T), Arg((4096,), T)], Arg((3, 4096), T),
         {"rows_per": 2, "eps": 1e-6}, {}),
        ("rms_rows_d8192", "rms_norm", [Arg((3, 8192), T), Arg((8192,), T)], Arg((3, 8192), T),
         {"rows_per": 2, "eps": 1e-5}, {}),
        ("rope_pos", "rope", [Arg((32, 128), T), Arg((64,), f32)], Arg((32, 128), T),
         {"rows_per": 4, "pos": POS, "group": 1, "roles": ("x", "inv_freq"), "eps": 0.0}, {1: lambda v, g: v.copy_(v.abs() * 0.3)}),
        ("rope_ids", "rope", [Arg((8, 64), T), Arg((32,), f32), Arg((4,), i32)], Arg((8, 64), T),
         {"rows_per": 4, "pos": None, "group": 2, "roles": ("x", "inv_freq", "pos_ids"), "eps": 0.0}, {1: lambda v, g: v.copy_(v.abs() * 0.3), 2: _randint(0, 4096)}),
        ("rope_norm_d256", "rope", [Arg((5, 256), T, strides=(300, 1)), Arg((128,), f32), Arg((256,), T)],
         Arg((5, 256), T, strides=(1000 * 256, 1)), {"rows_per": 4, "pos": POS, "group": 1,
                                                     "roles": ("x", "inv_freq", "g"), "eps": 1e-6},
         {1: lambda v, g: v.copy_(v.abs() * 0.3)}),
        # ... rounded as Hugging Face does (cos / sin, each product and sum in T), normalised first (qwen3)
        ("rope_ids_hf", "rope", [Arg((8, 64), T), Arg((32,), f32), Arg((4,), i32)], Arg((8, 64), T),
         {"rows_per": 4, "pos": None, "group": 2, "roles": ("x", "inv_freq", "pos_ids"), "eps": 0.0, "hf": True},
         {1: lambda v, g: v.copy_(v.abs() * 0.3), 2: _randint(0, 4096)}),
        ("rope_norm_hf", "rope", [Arg((6, 128), T), Arg((64,), f32), Arg((128,), T)], Arg((6, 128), T),
         {"rows_per": 4, "pos": POS, "group": 1, "roles": ("x", "inv_freq", "g"), "eps": 1e-6, "hf": True},
         {1: lambda v, g: v.copy_(v.abs() * 0.3)}),
        ("softmax", "softmax", [Arg((5, 1000), T)], Arg((5, 1000), T), {"rows_per": 4}, {}),
        ("softmax_long", "softmax", [Arg((2, 3000), T)], Arg((2, 3000), T), {"rows_per": 1}, {}),
        ("softmax_len", "softmax", [Arg((32, L), T, strides=(1024, 1))], Arg((32, L), T, strides=(1024, 1)),
         {"rows_per": 1}, {}),
        ("argmax_partial", "argmax_partial", [Arg((1, 128256), T)], Arg((1, 32, 2), f32), {"chunk": 4096},
         {0: _argmax_ties}),
        ("argmax_partial_m3", "argmax_partial", [Arg((3, 1003), T, strides=(2000, 1))], Arg((3, 8, 2), f32),
         {"chunk": 128}, {}),
        ("argmax_reduce", "argmax_reduce", [Arg((3, 32, 2), f32)], Arg((3,), i32), {}, {0: _argmax_part}),
        ("embedding", "embedding", [Arg((5000, 2048), T), Arg((3,), i32)], Arg((3, 2048), T), {},
         {1: _randint(0, 5000)}),
        ("kv_append", "kv_append", [Arg((8, 128), T)], Arg((8, 1024, 128), T), {"pos": POS}, {}),
        ("ew_add", "elementwise", [Arg((1, 2048), T), Arg((1, 2048), T)], Arg((1, 2048), T), ew("add", 1024, 1), {}),
        ("ew_mul_bcast", "elementwise", [Arg((4, 2000), T), Arg((4, 2000), T, strides=(0, 1))], Arg((4, 2000), T),
         ew("mul", 512, 1), {}),
        ("ew_silu", "elementwise", [Arg((1, 8192), T)], Arg((1, 8192), T), ew("silu", 8192, 1), {}),
        ("ew_copy_3d", "elementwise", [Arg((8, 4, 64), T, strides=(64, 512, 1))], Arg((8, 4, 64), T),
         ew("copy", 3, 0), {}),
        ("ew_cast", "elementwise", [Arg((2, 3, 4, 5), T)], Arg((2, 3, 4, 5), f32 if T != f32 else dt.bf16),
         ew("cast", 2, 1), {}),
        ("ew_int_add", "elementwise", [Arg((16,), i32), Arg((16,), i32)], Arg((16,), i32), ew("add", 16, 0), {}),
        ("ew_scalar", "elementwise", [Arg((), T)], Arg((), T), {"fn": "copy", "axis": 0, "tile": 1}, {}),
        # the LM head's argmax partials (compared in f32: the logits must be exact, so the data are small
        # integers: many ties, the lowest index wins), a ragged last tile; then with the RMSNorm prologue
        ("mv_argmax_ties", "matvec_argmax", [Arg((1, 512), T), Arg((1000, 512), T)], Arg((1, 8, 2), f32),
         {"rows": 128, "roles": ("x", "w"), "eps": 0.0}, {0: _small_ints, 1: _small_ints}),
        ("mv_argmax_norm", "matvec_argmax", [Arg((1, 1024), T), Arg((700, 1024), T), Arg((1024,), T)],
         Arg((1, 11, 2), f32), {"rows": 64, "roles": ("x", "w", "g"), "eps": 0.0},
         {0: _plus_minus_2, 1: _small_ints, 2: _small_ints}),
        # QKV heads: RMSNorm + RoPE into q; v straight into its KV cache row (a strided view)
        ("mv_heads_norm_rope", "matvec_heads", [Arg((1, 1024), T), Arg((512, 1024), T), Arg((1024,), T),
                                                Arg((32,), f32)], Arg((8, 64), T),
         {"rows": 64, "head_dim": 64, "roles": ("x", "w", "g", "inv_freq"), "eps": 1e-5, "pos": POS},
         {3: lambda v, g: v.copy_(v.abs() * 0.3)}),
        ("mv_heads_rope_hf", "matvec_heads", [Arg((1, 1024), T), Arg((512, 1024), T), Arg((32,), f32)], Arg((8, 64), T),
         {"rows": 64, "head_dim": 64, "roles": ("x", "w", "inv_freq"), "eps": 0.0, "pos": POS, "hf": True},
         {2: lambda v, g: v.copy_(v.abs() * 0.3)}),
        ("mv_heads_cache_row", "matvec_heads", [Arg((1, 512), T), Arg((256, 512), T)],
         Arg((2, 128), T, strides=(1024 * 128, 1)), {"rows": 128, "head_dim": 128, "roles": ("x", "w"), "eps": 0.0,
                                                    "pos": POS}, {}),
        # KV rows by slot and position (no two rows at one place: the order of their writes is free)
        ("kv_store", "kv_store", [Arg((6, 8, 64), T), Arg((6,), i32), Arg((6,), i32)], Arg((4, 8, 1024, 64), T), {},
         {1: _distinct(1024), 2: _randint(0, 4)}),
        ("kv_store_prompt", "kv_store", [Arg((100, 2, 128), T, strides=(512, 128, 1)), Arg((100,), i32),
                                         Arg((100,), i32)], Arg((2, 2, 300, 128), T), {},
         {1: _distinct(300), 2: _randint(1, 2)}),  # (two row tiles of 64)
        # ... rotated as they are stored (a batch's K rows; qwen3's k norm first, from a strided view)
        ("kv_store_rope", "kv_store", [Arg((6, 8, 64), T), Arg((6,), i32), Arg((6,), i32), Arg((32,), f32),
                                       Arg((6,), i32)], Arg((4, 8, 1024, 64), T),
         {"roles": ("new", "pos", "slot", "inv_freq", "pos_ids"), "eps": 0.0},
         {1: _distinct(1024), 2: _randint(0, 4), 3: lambda v, gen: v.copy_(v.abs() * 0.3), 4: _randint(0, 1024)}),
        ("kv_store_rope_hf", "kv_store", [Arg((6, 8, 64), T), Arg((6,), i32), Arg((6,), i32), Arg((32,), f32),
                                          Arg((6,), i32)], Arg((4, 8, 1024, 64), T),
         {"roles": ("new", "pos", "slot", "inv_freq", "pos_ids"), "eps": 0.0, "hf": True},
         {1: _distinct(1024), 2: _randint(0, 4), 3: lambda v, gen: v.copy_(v.abs() * 0.3), 4: _randint(0, 1024)}),
        ("kv_store_norm_rope", "kv_store", [Arg((70, 2, 128), T, strides=(512, 128, 1)), Arg((70,), i32),
                                            Arg((70,), i32), Arg((64,), f32), Arg((70,), i32), Arg((128,), T)],
         Arg((2, 2, 300, 128), T),
         {"roles": ("new", "pos", "slot", "inv_freq", "pos_ids", "g"), "eps": 1e-6},
         {1: _distinct(300), 2: _randint(0, 2), 3: lambda v, gen: v.copy_(v.abs() * 0.3), 4: _randint(0, 300)}),
        # ragged attention: each row its own slot and length, split over the cache rows at run time. The
        # positions are pinned so that every case has rows of one split (the output written straight from
        # the block) and rows of several (partials, then the last split's merge); 66 splits: more than the
        # merge's warp of 32
        *(("ragged_pm" + label, "ragged_partial_merge",
           [Arg((len(pos), hkv * g, d), T), Arg((slots, hkv, max_len, d), T), Arg((slots, hkv, max_len, d), T),
            Arg((len(pos),), i32), Arg((len(pos),), i32),
            Arg((max(len(pos) * hkv, SPLIT_WAVE * heads), g, d + 2), f32), Arg((len(pos) * hkv,), i32)],
           Arg((len(pos), hkv * g, d), T),
           {"splits": split_count(as_dim(length), chunk, len(pos) * -(-hkv // heads)), "group": g,
            "scale": d ** -0.5, "length": as_dim(length), "heads": heads},
           {3: _values(*pos), 4: _randint(0, slots), 6: lambda v, gen: v.zero_()})
          for label, pos, hkv, g, d, slots, max_len, length, chunk, heads in (
              ("_d64", [0, 100, 350, 351, 700, 500], 8, 4, 64, 4, 1024, 701, 64, 1),  # 2 splits of 351
              ("_d128_g8", [10, 255, 120], 8, 8, 128, 2, 512, 256, 16, 1),  # 5 splits of 52
              ("_many_splits", [999], 2, 4, 64, 1, 1024, 1000, 8, 1),  # 66 splits of 16 (63 of them)
              ("_d128_g2", [0, 28, 29, 288, 150], 2, 2, 128, 3, 300, 289, 32, 1),  # 10 splits of 29
              # several KV heads an instance (a warp group each): 4 of 8 (llama's batches), 2 of 4 (qwen3-moe's),
              # and a ragged last group (6 heads in groups of 4); one split and several
              ("_heads4_d64", [0, 100, 350, 351, 700, 500], 8, 4, 64, 4, 1024, 701, 64, 4),  # 11 splits of 64
              ("_heads2_d128_g8", [10, 255, 120, 400], 4, 8, 128, 2, 512, 401, 512, 2),  # 1 split
              ("_heads4_ragged", [3, 64, 299], 6, 4, 64, 2, 300, 300, 16, 4))),  # 19 splits of 16
        *([] if T != dt.bf16 else [
            # flash attention over prompts: rows of three slots at random positions (several passes a tile),
            # then one prompt of consecutive positions (one pass), ragged in tokens, D 64 and 128
            ("flash_rows", "ragged_flash", [Arg((40, 16, 64), T), Arg((3, 4, 300, 64), T), Arg((3, 4, 300, 64), T),
                                            Arg((40,), i32), Arg((40,), i32)], Arg((40, 16, 64), T),
             {"group": 4, "scale": 0.125, "length": as_dim(300)}, {3: _randint(0, 300), 4: _randint(0, 3)}),
            ("flash_prompt_d128", "ragged_flash", [Arg((150, 16, 128), T), Arg((2, 2, 200, 128), T),
                                                   Arg((2, 2, 200, 128), T), Arg((150,), i32), Arg((150,), i32)],
             Arg((150, 16, 128), T), {"group": 8, "scale": 0.08838834764831845, "length": as_dim(200)},
             {3: _arange(30), 4: _values(*([1] * 150))}),
       
            # ... with q rotated as it is loaded (llama), and normalised then rotated (qwen3's q norm)
            ("flash_rope_d64", "ragged_flash", [Arg((40, 16, 64), T), Arg((3, 4, 300, 64), T), Arg((3, 4, 300, 64), T),
                                                Arg((40,), i32), Arg((40,), i32), Arg((32,), f32), Arg((40,), i32)],
             Arg((40, 16, 64), T), {"group": 4, "scale": 0.125, "length": as_dim(300), "rope": ("inv_freq", "pos_ids"),
                                    "eps": 0.0},
             {3: _randint(0, 300), 4: _randint(0, 3), 5: lambda v, g: v.copy_(v.abs() * 0.3), 6: _randint(0, 4096)}),
            ("flash_rope_hf_d64", "ragged_flash", [Arg((40, 16, 64), T), Arg((3, 4, 300, 64), T), Arg((3, 4, 300, 64), T),
                                                   Arg((40,), i32), Arg((40,), i32), Arg((32,), f32), Arg((40,), i32)],
             Arg((40, 16, 64), T), {"group": 4, "scale": 0.125, "length": as_dim(300), "rope": ("inv_freq", "pos_ids"),
                                    "eps": 0.0, "hf": True},
             {3: _randint(0, 300), 4: _randint(0, 3), 5: lambda v, g: v.copy_(v.abs() * 0.3), 6: _randint(0, 4096)}),
            ("flash_rope_norm_d128", "ragged_flash", [Arg((150, 16, 128), T), Arg((2, 2, 200, 128), T),
                                                      Arg((2, 2, 200, 128), T), Arg((150,), i32), Arg((150,), i32),
                                                      Arg((64,), f32), Arg((150,), i32), Arg((128,), T)],
             Arg((150, 16, 128), T), {"group": 8, "scale": 0.08838834764831845, "length": as_dim(200),
                                      "rope": ("inv_freq", "pos_ids", "g"), "eps": 1e-6},
             {3: _arange(30), 4: _values(*([1] * 150)), 5: lambda v, g: v.copy_(v.abs() * 0.3), 6: _arange(30)}),
        ]),
        # sampling, bit for bit: greedy, top-k, top-p and plain rows
        ("sample", "sample", [Arg((4, 5000), T), Arg((4,), f32), Arg((4,), i32), Arg((4,), f32), Arg((4,), i32),
                              Arg((4,), i32)], Arg((4,), i32), {},
         {1: _values(0.0, 0.7, 1.0, 1.3), 2: _values(0, 50, 0, 5), 3: _values(1.0, 0.9, 0.5, 1.0),
          4: _randint(0, 1 << 30), 5: _randint(0, 1000)}),
    ]


def test_every_kind_has_a_gpu_case():
    """Every kind but the peer ones (run on two GPUs: tests/gpu/test_parallel_gpu.py) has a case in
    gpu_cases(), whose body test_cuda_bodies_match_cpu checks against its cpu() on a GPU; each case
    builds its op and renders its call."""
    for tname, dtype in DTYPES.items():
        for label, kind, ins, out, params, _fills in gpu_cases(dtype):
            kernel_source(f"g_{label}_{tname}", kind, ins, out, params)
    covered = {kind for _, kind, *_rest in gpu_cases(dt.bf16)}
    assert covered | PEER_KINDS | WHOLE_KERNEL_KINDS == set(REGISTRY), sorted(set(REGISTRY) - covered - PEER_KINDS - WHOLE_KERNEL_KINDS)


def _compare(label: str, got, want, dtype: dt.DType) -> float:
    """Assert close (NaN where unwritten on both sides); return the exactly-equal fraction."""
    import torch

    if not dtype.is_float:
        assert torch.equal(got, want), (label, got, want)
        return 1.0
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{label}: written elements differ"
    ok = ~w.isnan()
    g, w = g[ok], w[ok]
    if w.numel() == 0:
        return 1.0
    rtol = {"f32": 2e-4, "bf16": 1.6e-2, "f16": 2e-3}[dtype.name]
    torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * max(1e-3, w.abs().max().item()), msg=label)
    return (g == w).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("tname", ["bf16", "f32", "f16"])
def test_cuda_bodies_match_cpu(tname):
    torch = _torch_cuda()
    import itertools

    dtype = DTYPES[tname]
    env = {"pos": 700}
    specs = [s for s in gpu_cases(dtype) if re.search(os.environ.get("BODY_CASES", ""), s[0])]  # (a dev filter)
    names = [f"g_{label}_{tname}" for label, *_ in specs]
    files = sorted({k.cuda_file for k in REGISTRY.values() if k.name not in WHOLE_KERNEL_KINDS})
    src = [PRELUDE] + [f'#include "{f}"' for f in files]
    src += [kernel_source(n, kind, ins, out, params) for n, (_, kind, ins, out, params, _f) in zip(names, specs)]
    mod = Module("\n".join(src))
    gen = torch.Generator().manual_seed(1234)
    for name, (label, kind, ins, out, params, fills) in zip(names, specs):
        op = make_op(kind, ins, out, params)
        stores, views = zip(*(_strided(a, env, gen, fills.get(i)) for i, a in enumerate(ins)))
        out_store, out_view = _poisoned(out, env)
        if REGISTRY[kind].accumulates:  # instances add into their output: it starts at 0, as in the counter bank
            out_store.zero_()
        want_store = out_store.clone()
        want_view = want_store.as_strided(out_view.shape, out_view.stride())
        grid = [g.eval(env) for g in op.grid] or [1]
        for coords in itertools.product(*(range(g) for g in grid)):
            REGISTRY[kind].cpu(op, {**env, **{f"_i{a}": c for a, c in enumerate(coords)}}, list(views), want_view)
        dev = [s.cuda() for s in stores]
        dev_out = out_store.cuda()
        mod.launch(name, grid, [*dev, dev_out, env["pos"]])
        torch.cuda.synchronize()
        got = dev_out.cpu().as_strided(out_view.shape, out_view.stride())
        # an f32 sum of T products: T's tolerance (a T-rounded intermediate may round the other way); so are the
        # f32 partials of decode attention on tensor cores, whose p.V rounds p to T (attention.cuh: attn_partial)
        t_sums = REGISTRY[kind].accumulates or kind == "attn_partial"
        exact = _compare(name, got, want_view, ins[0].dtype if t_sums else out.dtype)
        r = mod.resources[name]
        print(f"{name:34s} exact {exact:6.1%}  regs {r.registers}")
    assert mod.error_code() == 0


@pytest.mark.gpu
def test_cuda_bodies_report_bad_indices():
    """An out-of-range token id / cache position reports MEGA_ERR_INDEX and writes nothing."""
    torch = _torch_cuda()
    T = dt.bf16
    specs = [("emb", "embedding", [Arg((50, 64), T), Arg((2,), dt.i32)], Arg((2, 64), T), {}),
             ("kv", "kv_append", [Arg((2, 64), T)], Arg((2, 16, 64), T), {"pos": POS})]
    mod = Module("\n".join([PRELUDE, '#include "embedding.cuh"', '#include "kv_append.cuh"']
                           + [kernel_source(f"bad_{n}", *rest) for n, *rest in specs]))
    table, ids = torch.randn(50 * 64).to(torch.bfloat16).cuda(), torch.tensor([3, 50], dtype=torch.int32).cuda()
    out = torch.full((2 * 64,), float("nan"), dtype=torch.bfloat16).cuda()
    mod.launch("bad_emb", (2, 1), [table, ids, out, 0])
    torch.cuda.synchronize()
    assert mod.error_code() == 2
    assert not out[:64].isnan().any() and out[64:].isnan().all()  # row 0 copied, row 1 (id 50) skipped
    cache = torch.zeros(2 * 16 * 64, dtype=torch.bfloat16).cuda()
    mod.launch("bad_kv", (1, 1), [torch.ones(2 * 64, dtype=torch.bfloat16).cuda(), cache, 16])
    torch.cuda.synchronize()
    assert not cache.any()


def test_an_older_nvrtc_is_named_in_a_warning(monkeypatch, caplog):
    import logging

    import megaegg.interpreter.nvrtc as nv

    for version, warned in (((13, 0), True), (nv.FAST_NVRTC, False)):
        monkeypatch.setattr(nv, "nvrtc_version", lambda v=version: v)
        nv._warn_if_slow_nvrtc.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=nv.__name__):
            nv._warn_if_slow_nvrtc()
        assert ("NVRTC 13.0 builds megakernels" in caplog.text) == warned
    nv._warn_if_slow_nvrtc.cache_clear()
