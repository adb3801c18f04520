"""softmax: row-wise softmax of ``x[rows, D]`` (other dims reach it as permuted views)."""

from __future__ import annotations

from ..dims import ceildiv
from ..graph import GraphError
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, term
from ..ir.footprint import Full, Tile


@register
class Softmax(BlockKind):
    name = "softmax"
    cuda_file = "softmax.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        tile = (Tile(0, rows), Full())
        return Partition(grid=(ceildiv(inputs[0].shape[0], rows),), reads=(tile,), writes=tile)

    def cpu(self, op, env, ins, out):
        rows = op.params["rows_per"]
        r0 = env["_i0"] * rows
        out[r0 : r0 + rows] = f32(ins[0][r0 : r0 + rows]).softmax(-1).to(out.dtype)

    def cuda_call(self, op, ins, out):
        x = ins[0]
        rows, d = op.inputs[0].shape
        args = [("smem", "smem"), ("x", x.view()), ("out", out.view(const=False)), ("D", d.to_c(dimc)),
                ("rows", rows.to_c(dimc)), ("rows_per", str(op.params["rows_per"])), ("c0", "c0")]
        return c_call("softmax_rows", [x.ctype], args)


@term
class SoftmaxRowsTerm(Term):
    """Softmax over the last dim, ``rows_per`` rows per instance."""

    name = "softmax_rows"
    fields = fields("node:node rows_per:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        if n.attrs["dim"] != len(n.shape) - 1:
            raise GraphError(f"softmax {n.label}: only the last dim is supported by the megakernel (dim={n.attrs['dim']})")
        b.emit("softmax", [value], [b.rows(b.operand(n.inputs[0]))], b.rows(b.output(value)), {"rows_per": args["rows_per"]})
