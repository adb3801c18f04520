"""elementwise: ``out = fn(a[, b])`` over operands of the output's shape (broadcasts are
stride-0 views); tiles of ``tile`` elements along dim ``axis``. ``fn`` also covers
``copy`` (materialize a view, or write one piece of a concat)."""

from __future__ import annotations

import math

import torch

from ..dims import as_dim, ceildiv, fmt_shape
from ..graph import GraphError
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, term
from ..ir.footprint import Full, Tile

MAX_DIMS = 4  # the CUDA body addresses its operands through Idx4 (elementwise.cuh)
FUNCTIONS = {
    "copy": lambda a: a,
    "cast": lambda a: a,
    "silu": lambda a: torch.nn.functional.silu(a),
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: a - b,
    "div": lambda a, b: a / b,
    "neg": lambda a: -a,
    "sigmoid": torch.sigmoid,
    "gelu": lambda a: torch.nn.functional.gelu(a),
    "gelu_tanh": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
    "tanh": torch.tanh,
    "exp": torch.exp,
    "cos": torch.cos,
    "sin": torch.sin,
}


@register
class Elementwise(BlockKind):
    name = "elementwise"
    cuda_file = "elementwise.cuh"

    def build(self, inputs, output, params) -> Partition:
        axis, tile = params["axis"], params["tile"]
        fp = tuple(Tile(0, tile) if d == axis else Full() for d in range(len(output.shape)))
        grid = (ceildiv(output.shape[axis], tile),) if output.shape else ()
        return Partition(grid=grid, reads=tuple(fp for _ in inputs), writes=fp)

    def cpu(self, op, env, ins, out):
        if not out.dim():
            out.copy_(FUNCTIONS[op.params["fn"]](*(f32(t) for t in ins)).to(out.dtype))
            return
        axis, tile = op.params["axis"], op.params["tile"]
        s = env["_i0"] * tile
        idx = (slice(None),) * axis + (slice(s, s + tile),)
        args = [f32(t[idx]) for t in ins]
        out[idx] = FUNCTIONS[op.params["fn"]](*args).to(out.dtype)

    def cuda_call(self, op, ins, out):
        nd = len(op.output.shape)
        if nd > MAX_DIMS:
            raise NotImplementedError(f"elementwise: the CUDA body takes at most {MAX_DIMS} dims, op{op.id} has {nd}")

        def idx(values) -> str:  # a scalar output is one element of a 1-d tile
            return f"Idx4{{{', '.join(values) or '0'}}}"

        shape = [d.to_c(dimc) for d in op.output.shape] or ["1"]
        types = ", ".join([out.ctype] + [o.ctype for o in ins])
        args = [("shape", idx(shape)), ("axis", str(op.params["axis"])), ("tile", f"{op.params['tile']}LL"), ("c0", "c0"),
                ("out", out.ptr), ("out_st", idx(out.strides))]
        for name, o in zip("ab", ins):
            args += [(name, o.ptr), (f"{name}_st", idx(o.strides))]
        functor = "Ew" + "".join(part.capitalize() for part in op.params["fn"].split("_"))  # (gelu_tanh: EwGeluTanh)
        return c_call("elementwise", [functor, max(nd, 1), types], args)


def elementwise_params(fn: str, shape, env: dict[str, int], tile: int = 8192) -> dict:
    """Tile along the largest dim, ``tile`` elements per instance in all."""
    if not shape:
        return {"fn": fn, "axis": 0, "tile": 1}
    sizes = [d.eval(env) for d in shape]
    axis = max(range(len(shape)), key=lambda k: sizes[k])
    other = math.prod(sizes) // max(1, sizes[axis])
    return {"fn": fn, "axis": axis, "tile": max(1, tile // max(1, other))}


def emit_elementwise(b, sources, fn: str, ins, out, tile: int = 8192) -> None:
    """One elementwise op; past MAX_DIMS dims, its operands seen with adjacent dims merged where
    every operand's strides allow it (a 5-d add of contiguous tensors is a 4-d one)."""
    if len(out.shape) > MAX_DIMS:
        merged = b.merged([*(b.strided(o, sources) for o in ins), out], MAX_DIMS)
        if merged is None:
            n = b.graph.nodes[sources[0]]
            raise GraphError(f"{n.op} {n.label}: an elementwise op takes at most {MAX_DIMS} dims once the dims its "
                             f"operands' strides allow are merged; {fmt_shape(out.shape)} keeps more (reshape it first)")
        *ins, out = merged
    b.emit("elementwise", sources, ins, out, elementwise_params(fn, out.shape, b.env_hint, tile))


def materialize(b, src, dst, sources) -> None:
    """Copy ``src`` (a view with no strided layout) into the contiguous ``dst``: the rewrite
    stage inserts this where a block op cannot read an operand through its views."""
    emit_elementwise(b, sources, "copy", [src], dst)


@term
class ElementwiseTilesTerm(Term):
    """An elementwise graph op (FUNCTIONS: add, sub, mul, div, neg, silu, sigmoid, gelu, tanh, exp, cos, sin,
    cast; anything else: copy) of operands broadcast to the output, ``tile`` elements per instance."""

    name = "elementwise_tiles"
    fields = fields("node:node tile:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        ins, out = [b.operand(i) for i in n.inputs], b.output(value)
        fn = n.op if n.op in FUNCTIONS else "copy"
        if n.op == "gelu" and n.attrs["approximate"] == "tanh":
            fn = "gelu_tanh"
        ins = [b.broadcast(o, out.shape) for o in ins]
        emit_elementwise(b, [value], fn, ins, out, args["tile"])


@term
class SiluTilesTerm(Term):
    """``silu(x)`` computing node ``node`` (a written-out ``x * sigmoid(x)``: rewrite/rules.py), ``tile``
    elements per instance."""

    name = "silu_tiles"
    fields = fields("x:ref node:node tile:int")

    def lower(self, b, value, args):
        emit_elementwise(b, b.absorbed(value, {args["x"]}), "silu", [b.operand(args["x"])], b.output(value), args["tile"])


@term
class ConcatTilesTerm(Term):
    """Concatenation as one copy per piece into a slice of the output."""

    name = "concat_tiles"
    fields = fields("node:node tile:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        ins, out = [b.operand(i) for i in n.inputs], b.output(value)
        d, start = n.attrs["dim"], as_dim(0)
        for o in ins:
            stop = start + o.shape[d]
            piece = b.view(out, "slice", (d, start, stop))
            emit_elementwise(b, [value], "copy", [o], piece, args["tile"])
            start = stop
