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
import re
import secrets
import struct
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


class MissingHeaders(CompileError):
    """A header directory a body needs is not there: the message is the one line to print."""


def cutlass_include() -> str:
    """CUTLASS's include directory (CuTe: the tensor-core bodies' TMA and wgmma atoms): ``$CUTLASS_INCLUDE``,
    else the nvidia-cutlass wheel's (``cutlass_library/source/include``), found by importlib."""
    import importlib.util

    env = os.environ.get("CUTLASS_INCLUDE")
    if env:
        d, how = Path(env), "$CUTLASS_INCLUDE"
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise MissingHeaders("CUTLASS headers not found: pip install nvidia-cutlass (or set CUTLASS_INCLUDE "
                                 "to a folder holding cute/ and cutlass/)")
        d, how = Path(list(spec.submodule_search_locations)[0]) / "source" / "include", "the cutlass_library package"
    if not (d / "cute" / "tensor.hpp").is_file() or not (d / "cutlass" / "cutlass.h").is_file():
        raise MissingHeaders(f"CUTLASS headers not found: {d} (from {how}) has no cute/tensor.hpp and cutlass/cutlass.h")
    return str(d)


def cccl_include() -> str:
    """libcu++'s include directory (cuda/std/...), which CuTe includes under NVRTC: ``$CCCL_INCLUDE``, else
    the nvidia-cuda-cccl wheel's or the CUDA toolkit's."""
    env = os.environ.get("CCCL_INCLUDE")
    cands = [env] if env else []
    if not env:
        try:
            from cuda.pathfinder import find_nvidia_header_directory

            cands.append(find_nvidia_header_directory("cccl"))
        except Exception:
            pass
        cands += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include", "cccl")]
    for d in cands:
        if d and os.path.isfile(os.path.join(d, "cuda", "std", "cstdint")):
            return d
    raise MissingHeaders(f"libcu++ headers (cuda/std/cstdint) not found in {[c for c in cands if c]}: install the "
                         "nvidia-cuda-cccl wheel or a CUDA toolkit, or set CCCL_INCLUDE")


def cute_options() -> list[str]:
    """What a source including CuTe needs besides :func:`include_dirs`: CUTLASS's and libcu++'s include
    paths (CUTLASS includes libcu++ both as cuda/std/... and as cccl/cuda/std/...: both roots) and
    -default-device (CUTLASS has unannotated constexpr helpers)."""
    cccl = cccl_include()
    return ["-default-device", "-DNDEBUG"] + [f"-I{d}" for d in (cutlass_include(), cccl, os.path.dirname(cccl))]


def uses_cute(source: str, defines: dict[str, int] | None = None) -> bool:
    """Whether the source includes CuTe (a gemm body): not when its only include is guarded out for this
    band's image (render.py: regime_guard: ``#if MEGA_REGIME < 0 || MEGA_REGIME == 1 || ...``)."""
    band = (defines or {}).get("MEGA_REGIME", -1)
    for m in re.finditer(r'(?:#if (MEGA_REGIME < 0[^\n]*)\n)?#include "gemm(?:_tile)?\.cuh"', source):
        guarded = m.group(1) and {int(b) for b in re.findall(r"MEGA_REGIME == (\d+)", m.group(1))}
        if not guarded or band < 0 or band in guarded:
            return True
    return False


def compile_cubin(source: str, *, arch: str = "sm_90a", defines: dict[str, int] | None = None,
                  use_cache: bool = True) -> CompiledCubin:
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo", "--ptxas-options=-v"]
    opts += [f"-I{d}" for d in include_dirs()]
    if uses_cute(source, defines):
        opts += cute_options()
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


def function_sizes(elf: bytes) -> dict[str, int]:
    """{symbol: bytes} of the FUNC symbols of an ELF64 little-endian image (a cubin)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    sizes = {}
    for _name, kind, _f, _a, off, size, link, _i, _al, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info, _o, _shndx, _value, st_size = struct.unpack_from("<IBBHQQ", elf, off + k * entsize)
            if st_info & 0xF == 2 and st_size:  # STT_FUNC
                end = elf.index(b"\0", strtab + st_name)
                sizes[elf[strtab + st_name:end].decode()] = st_size
    return sizes
