"""The kernel argument struct ``MegaArgs`` is described once (``interpreter/kernel_args.py``):
the C declaration rendered into the megakernel carries a static_assert of every field's offset
as the host's ctypes struct has it, so a disagreement does not compile (NVRTC, no GPU needed);
``CudaRunner`` fills the fields by name at those offsets (driver stubbed, CPU tensors)."""

from __future__ import annotations

import ctypes
import re
import types

import pytest
import torch

from megaegg.compiler import build_artifact
from megaegg.interpreter import kernel_args as ka
from megaegg.interpreter.nvrtc import CUDA_DIR
from megaegg.models import ModelConfig, build_decode_graph

ASSERT = re.compile(r"static_assert\(__builtin_offsetof\(MegaArgs, (\w+)\) == (\d+),")


def compile_declaration(ndims: int, nptrs: int):
    """The declaration alone, with megakernel.cu's own MEGA_MAX_RANKS, and a kernel that reads every field."""
    nvrtc = pytest.importorskip("megaegg.interpreter.nvrtc")
    macro = re.search(r"#define MEGA_MAX_RANKS \d+", (CUDA_DIR / "megakernel.cu").read_text()).group()
    reads = " + ".join(f"(long long)a.{f.name}{'' if f.count == 1 else '[0]'}" for f in ka.FIELDS)
    src = (f"{macro}\n{ka.c_declaration(ndims, nptrs)}\n"
           f'extern "C" __global__ void k(const __grid_constant__ MegaArgs a, long long* out) {{ *out = {reads}; }}\n')
    try:
        return nvrtc.compile_cubin(src, use_cache=False)
    except ImportError as e:  # (no NVRTC on this machine)
        pytest.skip(str(e))


@pytest.mark.parametrize("ndims,nptrs", [(1, 1), (3, 188)])
def test_the_declaration_compiles_and_asserts_every_field(ndims, nptrs):
    decl = ka.c_declaration(ndims, nptrs)
    t = ka.args_type(ndims, nptrs)
    assert dict(ASSERT.findall(decl)) == {f.name: str(getattr(t, f.name).offset) for f in ka.FIELDS}
    assert f"sizeof(MegaArgs) == {ctypes.sizeof(t)}," in decl
    assert f"long long dims[{ndims}];" in decl and f"void* ptr[{nptrs}];" in decl
    assert compile_declaration(ndims, nptrs).cubin


def test_a_drifted_description_does_not_compile(monkeypatch):
    """The host believes peers has 4 entries, megakernel.cu says 8: the offsets after it disagree."""
    nvrtc = pytest.importorskip("megaegg.interpreter.nvrtc")
    monkeypatch.setitem(ka.C_MACROS, "MEGA_MAX_RANKS", 4)
    ka.args_type.cache_clear()
    try:
        with pytest.raises(nvrtc.CompileError, match=r"MegaArgs\.dims: offset differs from interpreter/kernel_args\.py"):
            compile_declaration(2, 3)
    finally:
        monkeypatch.undo()
        ka.args_type.cache_clear()


def test_the_kernel_source_declares_the_struct_of_its_program():
    graph, _ = build_decode_graph(ModelConfig.preset("tiny"), max_len=64, logits=False)
    art = build_artifact(graph, max_dims={"pos": 63}, compile_cuda=False)
    q, src = art.queue, art.source
    assert ka.c_declaration(len(q.program.symbols), len(q.memory.pointer_slot)) in src
    assert src.count("struct MegaArgs {") == 1 and "/*@" not in src


def test_the_runner_writes_the_fields_by_name(monkeypatch):
    """CudaRunner on CPU tensors, the driver stubbed: the bytes it passes hold every value at the
    offset that the kernel's static_asserts name."""
    from cuda.bindings import driver  # (imports without a GPU)

    from megaegg.interpreter import runtime

    ok = driver.CUresult.CUDA_SUCCESS
    launched = []
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (ok, "module"))
    monkeypatch.setattr(driver, "cuModuleGetFunction", lambda m, name: (ok, "func"))
    monkeypatch.setattr(driver, "cuFuncSetAttribute", lambda *a: (ok,))
    monkeypatch.setattr(driver, "cuFuncGetAttribute", lambda *a: (ok, 1536))  # (static shared memory)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: launched.append(a[-2]) or (ok,))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(runtime, "smem_bytes", lambda d: 1 << 20)

    graph, _ = build_decode_graph(ModelConfig.preset("tiny"), max_len=64, logits=False, tp=2)
    art = build_artifact(graph, max_dims={"pos": 63}, compile_cuda=False)
    q, slots = art.queue, art.queue.memory.pointer_slot
    assert q.memory.peer is not None
    bound = {b: torch.empty(2) for b in list(slots)[::2]}
    tensors = {b: torch.empty(2) for b in slots if b not in bound}
    r = runtime.CudaRunner(q, [b""], bound, torch.device("cpu"), defines=art.defines, table=art.table)
    r.set_peers(1, [111, 222])
    r.launch([37] * len(q.program.symbols), tensors)
    r.launch([41] * len(q.program.symbols), tensors)

    at = {name: int(off) // 8 for name, off in ASSERT.findall(art.source)}
    size = int(re.search(r"sizeof\(MegaArgs\) == (\d+)", art.source).group(1))
    params = ctypes.cast(launched[-1], ctypes.POINTER(ctypes.c_void_p))[0]  # kernelParams[0]: the struct
    w = list((ctypes.c_int64 * (size // 8)).from_address(params))
    assert w[at["arena"]] == r.arena.data_ptr() and w[at["counters"]] == r.counters.data_ptr()
    assert w[at["control"]] == r.control.data_ptr() and w[at["table"]] == r.table.data_ptr() and w[at["trace"]] == 0
    assert (w[at["parity"]], w[at["rank"]], w[at["seq"]]) == (1, 1, 2)  # (the second launch: parity 1, launch number 2)
    assert w[at["peers"]:at["peers"] + 2] == [111, 222]
    assert w[at["dims"]:at["dims"] + len(q.program.symbols)] == [41] * len(q.program.symbols)
    for b, t in {**bound, **tensors}.items():
        assert w[at["ptr"] + slots[b]] == t.data_ptr()


def test_an_image_whose_shared_memory_passes_the_gpus_is_one_error(monkeypatch):
    """Static (the entry tables) and dynamic shared memory past what the GPU offers a block: one error with
    the numbers, not the driver's INVALID_VALUE."""
    from cuda.bindings import driver  # (imports without a GPU)

    from megaegg.interpreter import runtime

    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (ok, "module"))
    monkeypatch.setattr(driver, "cuModuleGetFunction", lambda m, name: (ok, "func"))
    monkeypatch.setattr(driver, "cuFuncSetAttribute", lambda *a: (ok,))
    monkeypatch.setattr(driver, "cuFuncGetAttribute", lambda *a: (ok, 40000))
    monkeypatch.setattr(runtime, "smem_bytes", lambda d: 227 * 1024 - 8 * 1024)
    with pytest.raises(RuntimeError, match=r"needs 40000 bytes of static shared memory .* and 204800 dynamic .* offers 232448"):
        runtime.KernelImage.load(b"", {"MEGA_THREADS": 256, "MEGA_SMEM": 200 * 1024}, torch.device("cpu"))
    assert runtime.KernelImage.load(b"", {"MEGA_THREADS": 256, "MEGA_SMEM": 120 * 1024}, torch.device("cpu")).smem == 120 * 1024
