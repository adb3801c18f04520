"""BlockProgram: the rewrite stage's output, a plain typed value that prints readably.

A program is a list of buffers and a list of block ops in queue (topological)
order. Each op reads operands and writes one operand; an operand is a buffer seen
through a chain of views (reshape, permute, slice, expand) that the layout algebra
(:mod:`megaegg.ir.layout`) composes into ``shape:stride`` form.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Mapping

from .footprint import Footprint, fmt_footprint
from ..dims import Dim, fmt_shape
from ..dtypes import DType

BUFFER_KINDS = ("input", "weight", "constant", "state", "scratch", "accum", "output", "peer")


@dataclass(frozen=True)
class Buffer:
    """Storage for one tensor. ``state`` buffers (KV caches) are inputs written in place;
    ``accum`` buffers are f32 sums that several instances add into (or counters), zero at every launch;
    ``peer`` buffers are written by every rank of a tensor-parallel group (an all-reduce's
    receive rows: row ``r`` is rank ``r``'s), each rank holding its own; a ``transposed`` weight holds the user's weight ``name`` with its last two dims swapped."""

    id: int
    name: str
    kind: str
    shape: tuple[Dim, ...]
    dtype: DType
    transposed: bool = False

    def __str__(self) -> str:
        t = " transposed" if self.transposed else ""
        return f"b{self.id} {self.kind}{t} {self.name!r} {self.dtype}{fmt_shape(self.shape)}"


def swap_last(shape: tuple) -> tuple:
    """``shape`` with its last two dims swapped: a ``transposed`` buffer's shape <-> the user's."""
    return (*shape[:-2], shape[-1], shape[-2])


@dataclass(frozen=True)
class View:
    """One view step. ``kind``: reshape(shape) | permute(dims) | slice(dim, start, stop) | expand(shape)."""

    kind: str
    args: tuple

    def __str__(self) -> str:
        return f"{self.kind}{tuple(str(a) if isinstance(a, Dim) else a for a in self.args)}"


@dataclass(frozen=True)
class Operand:
    """A buffer seen through ``views`` (applied in order to its natural contiguous shape)."""

    buffer: int
    shape: tuple[Dim, ...]
    dtype: DType
    views: tuple[View, ...] = ()

    def __str__(self) -> str:
        v = "".join(f".{x}" for x in self.views)
        return f"b{self.buffer}{v}"


@dataclass(frozen=True)
class Estimate:
    """Cost-model figures of one block op (bytes at a representative dims binding; tensor-core FLOPs)."""

    bytes: int
    instances: int
    flops: float = 0.0
    steps: float = 0  # pipelined steps of all instances (CostModel.step_latency)
    hops: int = 0  # dependent round trips after the instances' work (CostModel.op_overhead each)


@dataclass
class BlockOp:
    """An op partitioned over a launch grid; each instance runs on one SM.

    ``reads[k]`` is the footprint of input ``k`` for the instance at grid coordinates
    ``_i0, _i1, ...``; ``writes`` that of the output. ``params`` holds op constants
    (tile sizes, eps, scale, flags) and runtime-dim expressions (positions, lengths).
    """

    id: int
    kind: str
    sources: tuple[int, ...]
    inputs: tuple[Operand, ...]
    output: Operand
    grid: tuple[Dim, ...]
    reads: tuple[Footprint, ...]
    writes: Footprint
    params: dict[str, Any] = field(default_factory=dict)
    estimate: Estimate | None = None
    # Which band of the program's row regime runs this op (``Regime``: its index, by row count), or
    # None: always. Ops of different bands never run in the same launch.
    regime: int | None = None

    @property
    def launch_count(self) -> Dim:
        n = self.grid[0] if self.grid else None
        for g in self.grid[1:]:
            n = n * g
        return n

    @property
    def label(self) -> str:
        """How errors name the op (the CPU bodies, ``CudaRunner.check``): ``op3 sample (graph nodes [41])``."""
        return f"op{self.id} {self.kind} (graph nodes {list(self.sources)})"

    def __str__(self) -> str:
        ins = ", ".join(f"{o}{fmt_footprint(fp)}" for o, fp in zip(self.inputs, self.reads))
        ps = ", ".join(f"{k}={v}" for k, v in self.params.items())
        src = ",".join(f"%{s}" for s in self.sources)
        est = f"  ~{self.estimate.bytes / 1e6:.2f} MB" if self.estimate else ""
        return (
            f"op{self.id} {self.kind} grid{fmt_shape(self.grid)} [{src}]\n"
            f"    {self.output}{fmt_footprint(self.writes)} <- {ins}\n"
            f"    {{{ps}}}{est}"
        )


@dataclass(frozen=True)
class RangeCheck:
    """A runtime-dim expression that must lie in ``[lo, hi]`` at every call (an attention
    length within its cache, a KV append inside it): checked on the host before a launch,
    so a bad ``pos`` is an error instead of a read past the cache."""

    what: str  # names the op and the quantity, e.g. "attention %12: length"
    value: Dim
    lo: Dim
    hi: Dim

    def __str__(self) -> str:
        return f"{self.what} {self.value} in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Regime:
    """A choice by runtime row count, made on the device at no rebuild: the program holds one set of ops
    per band of row counts of runtime dim ``symbol`` (the matvec path for a decode batch, tensor-core
    tiles for a prompt). Band ``i`` holds the counts ``n`` with ``thresholds[i - 1] < n <= thresholds[i]``
    (band 0: ``n <= thresholds[0]``; the last band: ``n > thresholds[-1]``). Each set's launch counts are
    expressions of its own derived dim, ``symbol`` itself in its band and 0 in the others, so the other
    sets launch no instance."""

    symbol: str
    thresholds: tuple[int, ...]  # strictly increasing: k - 1 of them for k bands

    def __post_init__(self) -> None:
        t = self.thresholds
        if not t or any(a >= b for a, b in zip(t, t[1:])):
            raise ValueError(f"row regime of {self.symbol!r}: thresholds {t} are not strictly increasing")

    @property
    def bands(self) -> int:
        return len(self.thresholds) + 1

    @property
    def derived(self) -> tuple[str, ...]:
        """The derived dims, one a band, in band order."""
        s, t = self.symbol, self.thresholds
        middle = tuple(f"{s}_rows_gt{a}_le{b}" for a, b in zip(t, t[1:]))
        return (f"{s}_rows_le{t[0]}", *middle, f"{s}_rows_gt{t[-1]}")

    def band(self, n: int) -> int:
        """The band of row count ``n``."""
        return bisect.bisect_left(self.thresholds, n)

    def most_rows(self, band: int, top: int) -> int:
        """The most rows band ``band`` runs, with ``top`` the most of the runtime dim."""
        return min(top, self.thresholds[band]) if band < len(self.thresholds) else top

    def values(self, dims: Mapping[str, int]) -> dict[str, int]:
        """Each derived dim's value: the row count in its band, 0 in the others."""
        n = dims[self.symbol]
        b = self.band(n)
        return {d: n if i == b else 0 for i, d in enumerate(self.derived)}


@dataclass
class BlockProgram:
    buffers: list[Buffer]
    ops: list[BlockOp]
    outputs: dict[str, Operand]
    symbols: tuple[str, ...] = ()
    checks: tuple[RangeCheck, ...] = ()
    ranks: int = 1  # GPUs of the tensor-parallel group every rank's copy of the program runs on
    # inputs and weights the graph declares but no output reads: a call may pass them (as
    # run_reference needs them) and the kernel ignores them
    unused_leaves: tuple[str, ...] = ()
    regime: Regime | None = None  # its derived dims come last in ``symbols``

    @property
    def user_symbols(self) -> tuple[str, ...]:
        """The runtime dims a caller gives (``symbols`` less the regime's derived ones)."""
        derived = self.regime.derived if self.regime else ()
        return tuple(s for s in self.symbols if s not in derived)

    def with_derived(self, dims: Mapping[str, int]) -> dict[str, int]:
        """The caller's dims and the regime's derived ones: every dim the kernel reads."""
        return {**dims, **self.regime.values(dims)} if self.regime else dict(dims)

    def __str__(self) -> str:
        lines = ["buffers:"] + [f"  {b}" for b in self.buffers]
        lines += ["ops:"] + [f"  {op}" for op in self.ops]
        lines += ["outputs:"] + [f"  {k} = {v}" for k, v in self.outputs.items()]
        return "\n".join(lines)
