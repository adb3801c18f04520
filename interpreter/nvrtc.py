"""Toolchain discovery and NVRTC compilation, with an on-disk cubin cache.

The cache key covers the source, the options and the NVRTC version, so a changed
kernel, flag or toolkit never reuses a stale cubin. A cached cubin carries its sha256: one
that does not match (corrupt, truncated) is recompiled, with one warning; a cache folder
that cannot be used turns the cubin cache off, with one warning (``megaegg.artifact.cache_dir``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
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


CACHE_FORMAT = b"megaegg-cubin-v2"  # a cached file: the cubin's sha256 (32 bytes), then the cubin


def cubin_dir() -> Path | None:
    """``$MEGAEGG_CACHE/cubin``, or None when the cache cannot be used (then it is off, with one warning)."""
    from ..artifact import cache_subdir

    return cache_subdir("cubin")


def read_cached_cubin(path: Path) -> bytes | None:
    """The cubin cached at ``path``, or None: absent, or unusable (corrupt: one warning; it is recompiled)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cubin cache: cannot read %s (%s); recompiling", path, e.strerror or e)
        return None
    cubin = data[32:]
    if len(data) <= 32 or hashlib.sha256(cubin).digest() != data[:32]:
        log.warning("cubin cache: %s is corrupt (%s); recompiling", path,
                    "truncated" if len(data) <= 32 else "its hash does not match")
        return None
    return cubin


def write_cached_cubin(path: Path, cubin: bytes) -> None:
    """Best effort: written whole, then renamed (no torn reads); a failed write turns the cache off, warning once."""
    from ..artifact import disable_cache

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_bytes(hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)
    except OSError as e:
        disable_cache(path, f"cannot write it: {e.strerror or e}")
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


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
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo", "--ptxas-options=-v"]
    opts += [f"-I{d}" for d in include_dirs()]
    opts += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    headers = "".join(p.read_text() for p in sorted(CUDA_DIR.glob("*.cuh")))
    fields = [source, headers, *opts, str(nvrtc_version())]
    key = hashlib.sha256(b"\0".join([CACHE_FORMAT, *(f.encode() for f in fields)]))
    folder = cubin_dir()
    path = None if folder is None else folder / f"{key.hexdigest()}.cubin"
    if use_cache and path is not None:
        cubin = read_cached_cubin(path)
        if cubin is not None:
            return CompiledCubin(cubin, "", 0.0, True)
    _warn_if_slow_nvrtc()
    t0 = time.perf_counter()
    cubin, text = _nvrtc_compile(source, opts)
    if path is not None:
        write_cached_cubin(path, cubin)
    return CompiledCubin(cubin, text, time.perf_counter() - t0, False)


def _nvrtc_compile(source: str, opts: list[str]) -> tuple[bytes, str]:
    """NVRTC: (the cubin, the compile log); CompileError with the log when it fails."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"megakernel.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        text = buf.decode(errors="replace").rstrip("\0 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile the megakernel:\n{text}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, text
