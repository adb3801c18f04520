"""The block-op registry: each kind is defined in ONE module of this package.

A kind (:class:`BlockKind`, in :data:`REGISTRY`) declares how a block op of that kind is
partitioned (``build``: launch grid and read/write footprints), what one instance computes
on the CPU (``cpu``: the living definition the simulator runs and the CUDA body is tested
against), how the CUDA interpreter calls its device body (``cuda_call``, body in
``<name>.cuh``; with ``waits_in_body`` the body does its own barrier waits) and how many
bytes it moves (``bytes_moved``, for the cost model). The interpreter's switch and the
simulator's dispatch are generated from :data:`REGISTRY`.

The same module declares the kind's :class:`Term` (in :data:`TERMS`): how the rewrite stage
sees it. A term is the e-graph constructor ``Op.<name>(**fields)`` for one way of computing
a value with block ops, the values it reads (``refs``) and its lowering into block ops
(``lower``, through the rewrite stage's ``ProgramBuilder``). The e-graph sort, extraction,
pricing and program building are generated from :data:`TERMS`; only ``rewrite/rules.py``
says which graph patterns become which terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch

from ..dims import Dim
from ..ir.footprint import Footprint

if TYPE_CHECKING:
    from ..ir.program import BlockOp, Operand

REGISTRY: dict[str, "BlockKind"] = {}
TERMS: dict[str, "Term"] = {}
NONE = -1  # an absent operand of a term


def register(cls: type["BlockKind"]) -> type["BlockKind"]:
    if cls.name in REGISTRY:
        raise ValueError(f"block op kind {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def term(cls: type["Term"]) -> type["Term"]:
    if cls.name in TERMS:
        raise ValueError(f"term {cls.name!r} registered twice")
    kinds = {f.kind for f in cls.fields} - set(FIELD_KINDS)
    if kinds:
        raise ValueError(f"term {cls.name!r}: unknown field kind(s) {sorted(kinds)}")
    TERMS[cls.name] = cls()
    return cls


# What a term's field holds. ref: a tensor it reads (a graph node id, NONE if absent); sum: an
# f32 sum it reads (the id of the graph node whose value the sum rounds to, NONE if absent);
# node: a graph node whose attributes and leaf operands it uses (NONE if absent); int / float /
# str: a constant (a tile size, eps, ...). The first three are node ids: a layer's copy shifts them.
FIELD_KINDS = ("ref", "sum", "node", "int", "float", "str")


@dataclass(frozen=True)
class Field:
    name: str
    kind: str


def fields(spec: str) -> tuple[Field, ...]:
    """``"x:ref w:ref eps:float"`` -> Fields, in that order (the e-graph constructor's arguments)."""
    return tuple(Field(*item.split(":")) for item in spec.split())


@dataclass(frozen=True)
class Sum:
    """The value id of an f32 sum that several instances add into (a ``glu_down`` accumulator):
    the sum whose rounding is graph node ``node``'s value. Graph values are plain node ids."""

    node: int

    def __str__(self) -> str:
        return f"sum(%{self.node})"


class Term:
    """One way to compute a value (a graph node's, or a :class:`Sum`) with block ops."""

    name: ClassVar[str]
    fields: ClassVar[tuple[Field, ...]]
    computes: ClassVar[str] = "node"  # "node": a graph node's value; "sum": a Sum's
    tile: ClassVar[str | None] = None  # the field that alone differs between tile-size alternatives
    needs: ClassVar[str | None] = None  # what ``fits`` asks of the operands, for the error when nothing fits
    # The fewest rows (of the graph's runtime row count, at the extraction's hint) for which this
    # alternative may be chosen: a tensor-core tile's height. Below it the tile is mostly empty, and its
    # kernel image's registers and shared memory would slow the memory-bound bodies beside it.
    min_rows: ClassVar[int] = 0
    # which dims of the value count as its rows for ``min_rows``: its leading one (tokens of an attention
    # output [N, heads, D]), or all but the last (a linear's [batch, seq, K] input flattened, as its tiles
    # take it)
    rows_from_all_leading: ClassVar[bool] = False

    def rows_needed(self, args: Mapping[str, Any]) -> int:
        """``min_rows`` for these arguments (a tile family's taller tiles need more rows)."""
        return self.min_rows

    def refs(self, graph, args: Mapping[str, Any]) -> tuple:
        """The values this alternative reads (node ids and Sums); its own node's inputs for a term
        with a ``node`` field and no ``ref``, else its ``ref`` and ``sum`` fields."""
        out = []
        for f in self.fields:
            v = args[f.name]
            if f.kind == "ref" and v != NONE:
                out.append(v)
            elif f.kind == "sum" and v != NONE:
                out.append(Sum(v))
        if not any(f.kind in ("ref", "sum") for f in self.fields):
            out += graph.nodes[args["node"]].inputs
        return tuple(out)

    def fits(self, graph, args: Mapping[str, Any]) -> bool:
        """Whether the block ops take these operands (shapes, layouts); else the alternative is dropped."""
        return True

    def siblings(self, args: Mapping[str, Any]) -> tuple | None:
        """Not None for a linear's block op that ``rewrite/siblings.py`` may re-pick beside the other
        linears of the same graph input (what it reads x as, for a matvec: x, its fused norm, a sum)."""
        return None

    def lower(self, b, value, args: Mapping[str, Any]) -> None:
        """Emit the block ops computing ``value`` (a node id, or a Sum) through ``b``, a ProgramBuilder."""
        raise NotImplementedError


@dataclass(frozen=True)
class Deferred:
    """A kind whose body runs after the interpreter's switch, once for all its entries: each entry's
    case fills the job ``var`` (C++ type ``struct``: operands, ``wl`` its waits, ``sig`` / ``nsig`` its
    signals) and ``run(var, smem)`` (false: stop the block) runs it and signals. For a body too large to
    inline into every case that must still be inlined into the kernel (a wgmma pipeline)."""

    struct: str
    var: str
    run: str


@dataclass(frozen=True)
class Partition:
    """What ``build`` returns: the launch grid and per-operand footprints."""

    grid: tuple[Dim, ...]
    reads: tuple[Footprint, ...]
    writes: Footprint


# The operand views of interpreter/cuda/common.cuh by rank: a pointer and per-dim strides.
VIEWS = {1: "Vec", 2: "Mat", 3: "Ten3", 4: "Ten4"}


def view_type(rank: int, ctype: str, const: bool = True) -> str:
    """C++ type of a rank-``rank`` view of ``ctype`` elements: ``Mat<const __nv_bfloat16>``."""
    return f"{VIEWS[rank]}<{'const ' if const else ''}{ctype}>"


def no_view(rank: int, ctype: str, const: bool = True) -> str:
    """An absent operand: the empty view (nullptr, zero strides), ``Mat<const T>{}``."""
    return view_type(rank, ctype, const) + "{}"


@dataclass(frozen=True)
class CudaOperand:
    """How generated CUDA addresses one operand: base pointer and per-dim strides (C exprs)."""

    ptr: str
    strides: tuple[str, ...]
    shape: tuple[str, ...]
    ctype: str
    tmap: str | None = None  # C: its TMA tensor map, for an input in the kind's tma_inputs


    def view(self, *dims: int, ptr: str | None = None, const: bool = True) -> str:
        """The operand as a view struct (common.cuh) over the strides of ``dims`` (default: every dim):
        ``Mat<const T>{in0, 2048LL, 1LL}`` for a 2-d input; ``o.view(1)``, the elements of its rows,
        ``Vec<const T>{in0, 1LL}``. ``ptr``: another base (the instance's first row, say);
        ``const=False``: an operand the body writes."""
        dims = dims or tuple(range(len(self.strides)))
        fields = [ptr or self.ptr, *(str(self.strides[d]) for d in dims)]
        return f"{view_type(len(dims), self.ctype, const)}{{{', '.join(fields)}}}"


class BlockKind:
    """What one block op runs: its grid and footprints (``build``), its CPU definition (``cpu``)
    and its CUDA call (``cuda_call``). docs/pipeline.md, "Adding a block op", lists what a new
    kind needs, tests included (every kind needs a case in tests/test_cuda_bodies_compile.py)."""

    name: ClassVar[str]
    cuda_file: ClassVar[str | None] = None
    # The body takes the instance's barrier waits (a `MegaWaits wl`, last argument) and
    # waits itself, after issuing the loads that need no input (weights): they overlap the
    # hand-off from the previous op. Else the interpreter waits before calling the body.
    waits_in_body: ClassVar[bool] = False
    # Instances whose write footprints overlap share the region, ready once all of them have run: the
    # last to finish writes it (an arrival counter in the body: attn_partial_merge), or each writes its
    # own data-dependent part of a declared hull (kv_store's row tiles of one head).
    last_writer: ClassVar[bool] = False
    # Instances add into their output, an f32 ``accum`` sum that every launch zeroes (glu_down): a test
    # of the body starts the output at 0 (not NaN: NaN + x compares equal to NaN + y and would pass).
    accumulates: ClassVar[bool] = False
    # Instances later in grid order run longer (causal attention: a later token tile reads more cache
    # rows): the interpreter hands them out last first, so the longest start first and the op's tail is
    # a short instance (longest-processing-time order). Only the claim order changes, not the coordinates.
    longest_last: ClassVar[bool] = False
    # The body runs after the switch, once in the kernel (Deferred); its cuda_call fills the job.
    deferred: ClassVar[Deferred | None] = None

    def internal_inputs(self, op: "BlockOp") -> tuple[int, ...]:
        """Inputs only this op's own instances write and read, ordered by its body's protocol (an
        arrival counter), not by barriers: no other op writes them, so no barrier covers them, and
        the simulator does not check their reads (the GPU op tests exercise the protocol)."""
        return ()

    def build(self, inputs: Sequence["Operand"], output: "Operand", params: dict) -> Partition:
        raise NotImplementedError

    def cpu(self, op: "BlockOp", env: dict, ins: list[torch.Tensor], out: torch.Tensor) -> None:
        """Compute the instance whose grid coordinates (``_i*``) and runtime dims are in ``env``."""
        raise NotImplementedError

    def cuda_call(self, op: "BlockOp", ins: list[CudaOperand], out: CudaOperand) -> str:
        raise NotImplementedError

    def bytes_moved(self, op: "BlockOp", env: dict) -> int:
        """Global-memory bytes of the whole op (all instances), for the cost model."""
        total = 0
        for operand in (*op.inputs, op.output):
            n = 1
            for d in operand.shape:
                n *= d.eval(env)
            total += n * operand.dtype.itemsize
        return total

    def flops(self, op: "BlockOp", env: dict) -> float:
        """Tensor-core FLOPs of the whole op that its time may be bound by (the cost model prices them
        beside the bytes); 0 for the memory-bound kinds."""
        return 0.0

    def pipeline_steps(self, op: "BlockOp", env: dict) -> float:
        """Steps of all instances that each wait for a copy through a shared-memory ring (k-tiles of a
        tile), priced at ``CostModel.step_latency``; 0 where loads overlap freely."""
        return 0

    def hops(self, op: "BlockOp", env: dict) -> int:
        """Dependent round trips inside the op after its instances' work (a last arrival's combine),
        each priced as a hand-off (``CostModel.op_overhead``); 0 for most kinds."""
        return 0

    def tma_inputs(self, op: "BlockOp") -> tuple[int, ...]:
        """The inputs the body reads through TMA tensor maps (interpreter/tensor_maps.py)."""
        return ()

    def deferred_template(self, ops: list["BlockOp"]) -> str:
        """A deferred kind's template arguments of its run function for these ops (one kernel image's)."""
        return ""

    def tma_box_rows(self, op: "BlockOp", k: int) -> int:
        """Rows of the box in which the body copies input ``k`` (a ``tma_inputs`` one; 64 columns wide)."""
        return 128


def c_call(fn: str, template: list, args: list[tuple[str, str]]) -> str:
    """``fn<template>(/*name*/ value, ...)``: each argument labelled with the C++ parameter it fills
    (``tests/test_cuda_calls.py`` checks the labels against the body's signature)."""
    targs = f"<{', '.join(map(str, template))}>" if template else ""
    return f"{fn}{targs}(" + ", ".join(f"/*{name}*/ {value}" for name, value in args) + ")"


def dimc(name: str) -> str:
    """C name of a runtime dim (or grid coordinate ``_i*``) inside the interpreter."""
    return f"D_{name}"


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def rms_normed(x: torch.Tensor, g: torch.Tensor, eps: float, dt: torch.dtype) -> torch.Tensor:
    """RMSNorm of f32 rows ``x`` rounded as the unfused op stores it, ``T(T(x * rinv) * g)``; f32."""
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float()
    return (y * f32(g)).to(dt).float()
