"""argmax in two block ops: partials over column chunks, then one reduce.

``argmax_partial``: ``x[M, N]`` -> ``part[M, T, 2]`` (f32: best value, its index),
``T = ceil(N / chunk)``, one chunk per instance. ``argmax_reduce``: ``part`` -> i32
``out[M]``. Ties resolve to the lowest index, as ``torch.argmax`` does (a row of -inf: 0); a NaN
is an error naming its row (``megaegg.sampling.NaNError``; MEGA_ERR_NAN in the CUDA body).
"""

from __future__ import annotations

import torch

from ..dims import as_dim, ceildiv
from ..dtypes import f32 as F32
from ..graph import GraphError
from ..sampling import NaNError
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, term
from ..ir.footprint import Full, Tile


def nan_rows(x: torch.Tensor, op) -> None:
    """Raise NaNError naming the first row of ``x [M, n]`` that holds a NaN."""
    bad = torch.isnan(x).any(-1).nonzero()
    if bad.numel():
        raise NaNError(f"NaN logits in row {int(bad[0])} of {op.label}")


@register
class ArgmaxPartial(BlockKind):
    name = "argmax_partial"
    cuda_file = "argmax.cuh"

    def build(self, inputs, output, params) -> Partition:
        chunk = params["chunk"]
        return Partition(
            grid=(ceildiv(inputs[0].shape[1], chunk),),
            reads=((Full(), Tile(0, chunk)),),
            writes=(Full(), Tile(0, 1), Full()),
        )

    def cpu(self, op, env, ins, out):
        chunk, t = op.params["chunk"], env["_i0"]
        x = f32(ins[0][:, t * chunk : (t + 1) * chunk])
        nan_rows(x, op)
        val, idx = x.max(-1)
        out[:, t, 0] = val
        out[:, t, 1] = (idx + t * chunk).float()

    def cuda_call(self, op, ins, out):
        x = ins[0]
        m, n = op.inputs[0].shape
        args = [("smem", "smem"), ("x", x.view()), ("M", m.to_c(dimc)), ("N", n.to_c(dimc)),
                ("chunk", f"{op.params['chunk']}LL"), ("part", out.view(0, 1, const=False)), ("c0", "c0")]
        return c_call("argmax_partial", [x.ctype], args)


@register
class ArgmaxReduce(BlockKind):
    name = "argmax_reduce"
    cuda_file = "argmax.cuh"

    def build(self, inputs, output, params) -> Partition:
        return Partition(grid=(ceildiv(inputs[0].shape[0], 1),), reads=((Tile(0, 1), Full(), Full()),), writes=(Tile(0, 1),))

    def cpu(self, op, env, ins, out):
        m = env["_i0"]
        part = ins[0][m]
        best = torch.argmax(part[:, 0])  # first maximal chunk holds the lowest index
        out[m] = int(part[best, 1].item())

    def cuda_call(self, op, ins, out):
        p = ins[0]
        args = [("smem", "smem"), ("part", p.view(0, 1)), ("T", op.inputs[0].shape[1].to_c(dimc)),
                ("out", out.view(const=False)), ("c0", "c0")]
        return c_call("argmax_reduce", [], args)


@term
class ArgmaxChunksTerm(Term):
    """Argmax over the last dim as ``argmax_partial`` over ``chunk`` columns per instance, then ``argmax_reduce``."""

    name = "argmax_chunks"
    fields = fields("node:node chunk:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        x, out = b.operand(n.inputs[0]), b.output(value)
        if n.attrs["dim"] != len(x.shape) - 1:
            raise GraphError(f"argmax {n.label}: only the last dim is supported by the megakernel")
        x = b.rows(x) if len(x.shape) != 1 else b.view(x, "reshape", (as_dim(1), x.shape[0]))
        m, cols = x.shape
        part = b.scratch(f"argmax_part{value}", (m, ceildiv(cols, args["chunk"]), as_dim(2)), F32)
        b.emit("argmax_partial", [value], [x], part, {"chunk": args["chunk"]})
        b.emit("argmax_reduce", [value], [part], out if len(out.shape) == 1 else b.view(out, "reshape", (m,)), {})
