"""matvec_argmax: the LM head fused with argmax partials, ``x[1, K] @ w[N, K]^T`` reduced
per instance to ``part[0, j] = (max, index)`` over its ``rows`` rows; ``argmax_reduce``
finishes. The logits themselves are never stored, so the e-graph's extractor picks
this only when nothing else reads them (e.g. a generation graph that outputs tokens).
"""

from __future__ import annotations

import torch

from ..dims import as_dim, ceildiv
from ..dtypes import f32
from .base import NONE, BlockKind, Partition, Term, c_call, fields, no_view, register, term
from .argmax import nan_rows
from ..ir.footprint import Full, Tile
from .matvec import fits_epilogue_tile, products, roles


@register
class MatVecArgmax(BlockKind):
    name = "matvec_argmax"
    cuda_file = "matvec_argmax.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows"]
        reads = []
        for role, o in zip(params["roles"], inputs):
            reads.append({"w": (Tile(1, rows), Full()), "x": (Tile(0, 1), Full())}.get(role, (Full(),)))
        n = inputs[list(params["roles"]).index("w")].shape[0]
        return Partition(grid=(as_dim(1), ceildiv(n, rows)), reads=tuple(reads), writes=(Full(), Tile(1, 1), Full()))

    def cpu(self, op, env, ins, out):
        k, p = roles(op), op.params
        j = env["_i1"]
        r0 = j * p["rows"]
        dt = op.inputs[k["w"]].dtype.torch
        y = products(op, ins, slice(0, 1), slice(r0, r0 + p["rows"]), dt)[0]  # the logits, rounded as stored
        nan_rows(y.float().reshape(1, -1), op)  # (a NaN logit is an error, as in argmax_partial)
        best = int(torch.argmax(y))  # first maximum
        out[0, j, 0] = y[best]
        out[0, j, 1] = float(r0 + best)

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, w = ins[k["x"]], ins[k["w"]]
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        kdim, n = op.inputs[k["w"]].shape[1].value, op.inputs[k["w"]].shape[0].value
        args = [("smem", "smem"), ("x", x.view()), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"), ("w", w.view()),
                ("part", out.view(1, const=False)), ("N", f"{n}LL"), ("n_tile", "c1")]
        return c_call("matvec_argmax", [x.ctype, kdim, p["rows"], "true" if "g" in k else "false"], args)

    def bytes_moved(self, op, env):
        w = op.inputs[roles(op)["w"]]
        n, kd, item = w.shape[0].value, w.shape[1].value, w.dtype.itemsize
        return n * kd * item + op.grid[1].eval(env) * (kd * item + 8)


@term
class MatVecArgmaxTerm(Term):
    """Argmax partials of ``x @ w^T`` [after RMSNorm(``g``)], then ``argmax_reduce``: the logits are never stored."""

    name = "matvec_argmax"
    fields = fields("x:ref w:ref g:ref eps:float rows:int")
    tile = "rows"

    def fits(self, graph, args) -> bool:
        return fits_epilogue_tile(graph, args)

    def lower(self, b, value, args):
        operands = {"x": args["x"], "w": args["w"], "g": args["g"]}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.operand(operands[r]) for r in present]
        tiles = ceildiv(inputs[present.index("w")].shape[0], args["rows"])
        part = b.scratch(f"argmax_part{value}", (1, tiles, 2), f32)
        params = {"rows": args["rows"], "roles": present, "eps": args["eps"]}
        b.emit("matvec_argmax", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, part, params)
        out = b.output(value)
        b.emit("argmax_reduce", [value], [part], out if len(out.shape) == 1 else b.view(out, "reshape", (as_dim(1),)), {})
