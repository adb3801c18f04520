"""TMA tensor maps: the descriptors through which a tensor-core body (``gemm``) copies tiles of its
operands into shared memory.

A kind lists the inputs it reads this way (``BlockKind.tma_inputs``); :func:`plan` gives each such
(op, input) one map of the kernel's table (``args.tmaps``, 128 bytes each, 64-byte aligned in global
memory), described by a :class:`TensorMapSpec`: a 2-D bf16 view ``[rows, cols]`` with contiguous
rows, box ``{64, box_rows}`` (64 elements = one 128-byte swizzle row; the rows the kind copies at once:
``BlockKind.tma_box_rows``), 128-byte swizzle, zeros out of bounds. The host encodes them (:class:`TensorMapTable`, the driver's
``cuTensorMapEncodeTiled``): arena and weight operands once, a caller's tensor again whenever its
pointer or its row count changes. Rows past the runtime row count of an arena buffer hold stale data;
the bodies never store the products of those rows.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Mapping

from ..blockops import REGISTRY
from ..lowering.queue import WorkQueue, upper_bound

BOX_COLS = 64
MAP_BYTES = 128


class TensorMapError(ValueError):
    """An operand a TMA body reads cannot be described by a tensor map (layout, alignment)."""


@dataclass(frozen=True)
class TensorMapSpec:
    """Input ``input`` of op ``op``: buffer ``buffer`` seen as ``[rows, cols]`` from element ``offset``,
    ``row_stride`` elements apart. ``rows`` is a C-free description: an int (the bound at the kernel's
    largest dims) for the arena and weights, or the shape expression's value per launch (``rows_dim``)
    for a caller's tensor."""

    op: int
    input: int
    buffer: int
    offset: int
    cols: int
    row_stride: int
    rows_dim: object  # Dim: the view's row count
    itemsize: int
    box_rows: int = 128


def plan(q: WorkQueue) -> tuple[list[TensorMapSpec], dict[tuple[int, int], int]]:
    """Every tensor map the kernel uses, and its index by (op id, input)."""
    specs, index = [], {}
    for e in q.entries:
        op = e.op
        for k in REGISTRY[op.kind].tma_inputs(op):
            o = op.inputs[k]
            lay = q.layout(o)
            what = f"op{op.id} {op.kind} input {k} ({q.program.buffers[o.buffer].name!r})"
            if len(lay.shape) != 2 or not lay.stride[1].is_const or lay.stride[1].value != 1:
                raise TensorMapError(f"{what}: a tensor map needs rows of contiguous elements, got strides {lay.stride}")
            if not (lay.stride[0].is_const and lay.offset.is_const and lay.shape[1].is_const):
                raise TensorMapError(f"{what}: a tensor map needs a constant row stride, offset and width")
            item = o.dtype.itemsize
            if (lay.stride[0].value * item) % 16 or (lay.offset.value * item) % 16:
                raise TensorMapError(f"{what}: a tensor map needs 16-byte aligned rows")
            index[(op.id, k)] = len(specs)
            specs.append(TensorMapSpec(op.id, k, o.buffer, lay.offset.value, lay.shape[1].value, lay.stride[0].value,
                                       lay.shape[0], item, REGISTRY[op.kind].tma_box_rows(op, k)))
    return specs, index


def c_ref(i: int) -> str:
    """C: a pointer to tensor map ``i`` of the kernel's table."""
    return f"mega_tmap(args.tmaps, {i})"


def encode(base: int, spec: TensorMapSpec, rows: int) -> bytes:
    """The 128-byte CUtensorMap of ``spec`` at device address ``base`` (the buffer's) with ``rows`` rows."""
    from cuda.bindings import driver as d

    from .runtime import _drv

    addr = base + spec.offset * spec.itemsize
    if addr % 16:
        raise TensorMapError(f"op{spec.op} input {spec.input}: its rows start at {addr:#x}, not 16-byte aligned "
                             "(a tensor map needs it)")
    rows = max(1, rows)  # (an empty launch still encodes a valid map; nothing reads it)
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tmap = _drv(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, addr,
        [u64(spec.cols), u64(rows)], [u64(spec.row_stride * spec.itemsize)], [u32(BOX_COLS), u32(spec.box_rows)],
        [u32(1), u32(1)], d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), f"cuTensorMapEncodeTiled (op{spec.op} input {spec.input})")
    return ctypes.string_at(tmap.getPtr(), MAP_BYTES)


class TensorMapTable:
    """The kernel's tensor maps on the device, re-encoded when a caller's tensor moves."""

    def __init__(self, q: WorkQueue, device, arena_ptr: int, bound: Mapping[int, int]) -> None:
        import torch

        self.specs, _ = plan(q)
        self.q = q
        self.dev = torch.zeros(max(1, len(self.specs)) * MAP_BYTES, dtype=torch.uint8, device=device)
        assert self.dev.data_ptr() % 64 == 0, "a CUtensorMap in global memory must be 64-byte aligned"
        self.host = bytearray(len(self.dev))
        self.per_call: list[int] = []  # specs of a caller's tensor
        self.last: dict[int, tuple[int, int]] = {}  # spec -> (base, rows) it was encoded with
        mem = q.memory
        for i, s in enumerate(self.specs):
            if s.buffer in mem.arena_offset:  # (rows: as many as the buffer holds, lowering/queue.py band_rows)
                dims = q.max_dims if s.buffer not in mem.band_rows else \
                    {**q.max_dims, q.program.regime.symbol: mem.band_rows[s.buffer]}
                self._put(i, arena_ptr + mem.arena_offset[s.buffer], upper_bound(s.rows_dim, dims))
            elif s.buffer in bound:
                self._put(i, bound[s.buffer], s.rows_dim.eval({}))
            else:
                self.per_call.append(i)
        self._upload()

    @property
    def ptr(self) -> int:
        return self.dev.data_ptr()

    def _put(self, i: int, base: int, rows: int) -> bool:
        if self.last.get(i) == (base, rows):
            return False
        self.host[i * MAP_BYTES:(i + 1) * MAP_BYTES] = encode(base, self.specs[i], rows)
        self.last[i] = (base, rows)
        return True

    def _upload(self) -> None:
        import torch

        self.dev.copy_(torch.frombuffer(self.host, dtype=torch.uint8))

    def update(self, ptrs: Mapping[int, int], env: Mapping[str, int]) -> None:
        """Before a launch: re-encode the maps of callers' tensors whose pointer or row count changed."""
        changed = False
        try:
            for i in self.per_call:
                s = self.specs[i]
                changed |= self._put(i, ptrs[s.buffer], s.rows_dim.eval(env))
        finally:  # (what was encoded goes up even if a later map failed: `last` must match the device)
            if changed:  # (a copy in stream order: it lands after the launches that read the old maps)
                self._upload()
