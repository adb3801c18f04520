"""Toolchain discovery and NVRTC compilation, with an on-disk cubin cache.

The cache key covers the source, the options and the NVRTC version, so a changed
kernel, flag or toolkit never reuses a stale cubin.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

CUDA_DIR = Path(__file__).parent / "cuda"
# NVRTC 13.5's megakernels ran 4-8% faster than 13.0's on an H100 (docs/perf-notes.md #57); an older
# one still works, with a warning (a torch build may pin its own nvidia-cuda-nvrtc)
FAST_NVRTC = (13, 5)
log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """NVRTC rejected the generated source; the message carries its log."""


@dataclass(frozen=True)
class CompiledCubin:
    cubin: bytes
    log: str
    seconds: float
    cached: bool


def cubin_dir() -> Path:
    from ..artifact import cache_dir

    path = cache_dir() / "cubin"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check(result, what: str):
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


@functools.cache
def _warn_if_slow_nvrtc() -> None:
    v = nvrtc_version()
    if v < FAST_NVRTC:
        log.warning("NVRTC %d.%d builds megakernels 4-8%% slower than %d.%d: pip install -U 'nvidia-cuda-nvrtc>=%d.%d'",
                    *v, *FAST_NVRTC, *FAST_NVRTC)


def include_dirs() -> list[str]:
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("CUDA headers (cuda_bf16.h) not found: install the nvidia-cuda-runtime wheel or a CUDA toolkit")
    return [str(CUDA_DIR), found]


def compile_cubin(source: str, *, arch: str = "sm_90a", defines: dict[str, int] | None = None,
                  use_cache: bool = True) -> CompiledCubin:
    from cuda.bindings import nvrtc

    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo", "--ptxas-options=-v"]
    opts += [f"-I{d}" for d in include_dirs()]
    opts += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    headers = "".join(p.read_text() for p in sorted(CUDA_DIR.glob("*.cuh")))
    key = hashlib.sha256("\0".join([source, headers, *opts, str(nvrtc_version())]).encode()).hexdigest()
    path = cubin_dir() / f"{key}.cubin"
    if use_cache and path.exists():
        return CompiledCubin(path.read_bytes(), "", 0.0, True)
    _warn_if_slow_nvrtc()
    t0 = time.perf_counter()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"megakernel.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.decode(errors="replace").rstrip("\0 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile the megakernel:\n{log}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed: no torn reads
    tmp.write_bytes(cubin)
    os.replace(tmp, path)
    return CompiledCubin(cubin, log, time.perf_counter() - t0, False)
