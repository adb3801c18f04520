"""Host runtime: load the cubin with the driver API and launch one persistent kernel per call.

Weights and constants are bound once; the arena (scratch), the barrier counters
and the control record are allocated once. Each call packs the runtime dims and
the pointers of the caller's tensors into the kernel's by-value argument struct
(``kernel_args.py``: ``MegaArgs``, written by field name) and launches on torch's
current stream. Nothing else changes between calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..lowering.queue import WorkQueue
from ..sampling import NaNError
from . import tensor_maps
from .kernel_args import args_type
from .render import image_defines, launch_shape
from .trace import TRACE_WORDS

CONTROL_WORDS = 8
ERR_TIMEOUT, ERR_INDEX, ERR_LAYOUT = 1, 2, 3
ERR_NAN, ERR_NAN_SETTING = 4, 5  # (runtime.cuh: MEGA_ERR_NAN, MEGA_ERR_NAN_SETTING; sample.cuh, argmax.cuh)


class MegakernelError(RuntimeError):
    """The kernel stopped itself: a barrier timed out or a data-dependent index was out of range."""


class MegakernelNaNError(MegakernelError, NaNError):
    """NaN logits (or a NaN temperature / top_p) reached ``sample`` or ``argmax``: the same
    :class:`~megaegg.sampling.NaNError` that the reference and the simulator raise."""


def _drv(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class LaunchStats:
    launches: int = 0


class CudaRunner:
    def __init__(self, queue: WorkQueue, cubins: list[bytes], bound: dict[int, torch.Tensor], device: torch.device,
                 *, defines: dict[str, int], table: list[int], trace_instances: int = 0) -> None:
        self.q = queue
        self.device = device
        torch.empty(1, device=device)  # torch creates the primary context lazily: touch it first
        props = torch.cuda.get_device_properties(device)
        self.sms = props.multi_processor_count
        # the kernel image, or one a band of the row regime (render.py: image_defines), each launched as compiled
        self._regime = regime = queue.program.regime
        variants = image_defines(queue, defines)
        if len(cubins) != len(variants) or any(c is None for c in cubins):
            raise RuntimeError(f"the program needs {len(variants)} kernel image(s), one a band of its row regime; "
                               f"got {len(cubins)} (compile_cuda builds them)")
        self.images = [KernelImage.load(c, d, device) for c, d in zip(cubins, variants)]
        self._rows_dim = None if regime is None else queue.program.symbols.index(regime.symbol)
        self.func, self.threads, self.smem = self.images[0].func, self.images[0].threads, self.images[0].smem
        mem = queue.memory
        try:  # (megaegg.compiler.Kernel checked these fit; another process may have taken the memory since)
            self.arena = torch.empty(mem.arena_bytes, dtype=torch.uint8, device=device)
            self.counters = torch.zeros(2 * max(1, mem.counters), dtype=torch.int32, device=device)
        except torch.OutOfMemoryError:
            from ..graph import GraphError, fmt_bytes

            raise GraphError(f"the kernel's work area ({fmt_bytes(mem.arena_bytes + 8 * max(1, mem.counters))}: arena and "
                             f"counters) does not fit the free memory of {device}: free some, or compile with smaller "
                             "max_dims") from None
        self.control = torch.zeros(CONTROL_WORDS, dtype=torch.int64, device=device)
        self.parity = 0
        self.bound = bound  # weights and constants, kept alive here
        self.trace = torch.zeros(TRACE_WORDS * max(1, trace_instances), dtype=torch.int64, device=device) if trace_instances else None
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        # the kernel's by-value argument struct (kernel_args.py), zeroed; launch() rewrites its fields in place
        self.args = a = args_type(len(queue.program.symbols), len(mem.pointer_slot))()
        a.arena, a.counters, a.control = self.arena.data_ptr(), self.counters.data_ptr(), self.control.data_ptr()
        a.trace = self.trace.data_ptr() if self.trace is not None else 0
        a.table = self.table.data_ptr()
        self._dims, self._ptr = a.dims, a.ptr  # (views of a's arrays, taken once: launch() writes through them)
        # a tensor-parallel program's peer region (lowering/queue.py: PeerPlan): on its own, rank 0
        # of a group of one; megaegg/parallel.py points the peers at each other
        self.peer_region = torch.zeros(mem.peer.region_bytes, dtype=torch.uint8, device=device) if mem.peer else None
        self.seq = 0
        if self.peer_region is not None:
            self.set_peers(0, [self.peer_region.data_ptr()])
        for buf, t in bound.items():
            self._ptr[mem.pointer_slot[buf]] = t.data_ptr()
        # TMA tensor maps of the tensor-core bodies (none without a gemm op)
        self.tmaps = None
        if tensor_maps.plan(queue)[0]:
            self.tmaps = tensor_maps.TensorMapTable(queue, device, self.arena.data_ptr(),
                                                    {b: t.data_ptr() for b, t in bound.items()})
            a.tmaps = self.tmaps.ptr
        self._param = (ctypes.c_void_p * 1)(ctypes.addressof(a))
        self.stats = LaunchStats()

    def set_peers(self, rank: int, regions: list[int]) -> None:
        """This rank's number and every rank's peer region (device addresses this GPU can reach)."""
        self.args.rank = rank
        self.args.peers[: len(regions)] = regions

    def reset_peers(self) -> None:
        """Zero the peer counters and restart the launch numbers (every rank of the group at once)."""
        if self.peer_region is not None:
            self.peer_region.zero_()
        self.seq = 0

    def launch(self, dims: list[int], tensors: dict[int, torch.Tensor]) -> None:
        from cuda.bindings import driver

        a = self.args
        a.parity = self.parity
        self.seq += 1
        a.seq = self.seq
        self._dims[: len(dims)] = dims
        ptr, slot = self._ptr, self.q.memory.pointer_slot
        for buf, t in tensors.items():
            ptr[slot[buf]] = t.data_ptr()
        if self.tmaps is not None and self.tmaps.per_call:
            self.tmaps.update({buf: t.data_ptr() for buf, t in tensors.items()}, dict(zip(self.q.program.symbols, dims)))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        img = self.images[0 if self._rows_dim is None else self._regime.band(dims[self._rows_dim])]
        grid, params = (img.func, self.sms, 1, 1, img.threads, 1, 1, img.smem, stream), ctypes.addressof(self._param)
        _drv(driver.cuLaunchKernel(*grid, params, 0), "cuLaunchKernel")
        self.parity ^= 1
        self.stats.launches += 1

    def control_copy(self) -> torch.Tensor:
        """The control block (the launches' error record) copied into pinned host memory, queued on the current
        stream without waiting: pass it to ``check`` once the stream has passed the copy."""
        host = torch.empty(self.control.shape, dtype=self.control.dtype, pin_memory=True)
        return host.copy_(self.control, non_blocking=True)

    def check(self, recorded: torch.Tensor | None = None) -> None:
        """Synchronize and raise MegakernelError if the last launches recorded an error (``recorded``: a
        ``control_copy`` the stream has passed, read instead, with no wait)."""
        rec = (self.control.cpu() if recorded is None else recorded).tolist()
        if rec[3] == 0:
            return
        self.counters.zero_()
        self.control.zero_()
        self.parity = 0
        self.reset_peers()
        code, entry, inst, detail = rec[3], rec[4], rec[5], rec[6]
        op = self.q.entries[entry].op if 0 <= entry < len(self.q.entries) else None
        what = op.label if op else f"entry {entry}"
        if code == ERR_TIMEOUT:
            w, rank = self.q.spins(self.q.entries[entry])[detail]
            src = f" of rank {rank}" if rank is not None else ""
            raise MegakernelError(
                f"barrier wait timed out in {what}, instance {inst}: waiting on barrier set {w.barrier_set} "
                f"(producer op{self.q.barriers.sets[w.barrier_set].producer}{src}), counter {w.index}, expected {w.expected}")
        if code == ERR_INDEX:
            raise MegakernelError(f"index out of range in {what}, instance {inst}: value {detail}")
        if code == ERR_NAN:
            raise MegakernelNaNError(f"NaN logits in row {detail} of {what}")
        if code == ERR_NAN_SETTING:
            raise MegakernelNaNError(f"NaN {('temperature', 'top_p')[detail % 2]} in row {detail // 2} of {what}")
        if code == ERR_LAYOUT:
            raise MegakernelError(f"unsupported operand layout in {what}, instance {inst}: its body takes "
                                  "contiguous, 16-byte aligned rows")
        raise MegakernelError(f"megakernel error code {code} in {what}, instance {inst}")


@dataclass
class KernelImage:
    """One loaded cubin's ``megakernel`` and the block shape it was compiled for."""

    module: object
    func: object
    threads: int
    smem: int

    @staticmethod
    def load(cubin: bytes, defines: dict[str, int], device: torch.device) -> "KernelImage":
        from cuda.bindings import driver

        module = _drv(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        func = _drv(driver.cuModuleGetFunction(module, b"megakernel"), "cuModuleGetFunction")
        threads, smem = launch_shape(defines)  # launch what was compiled
        if smem_bytes(device) < smem:
            raise RuntimeError(f"the megakernel needs {smem} bytes of shared memory per block; this GPU offers {smem_bytes(device)}")
        static = _drv(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
                      "cuFuncGetAttribute")
        optin = smem_bytes(device) + 8 * 1024
        if static + smem > optin:
            raise RuntimeError(f"the megakernel needs {static} bytes of static shared memory (its entry tables) and "
                               f"{smem} dynamic per block; this GPU offers {optin} in all")
        _drv(driver.cuFuncSetAttribute(
            func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "cuFuncSetAttribute")
        return KernelImage(module, func, threads, smem)


def smem_bytes(device: torch.device) -> int:
    """The device's opt-in maximum of dynamic shared memory per block, less room for static."""
    from cuda.bindings import driver

    dev = _drv(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(_drv(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")) - 8 * 1024
