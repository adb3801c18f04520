"""rms_norm: row-wise RMSNorm of ``x[rows, D]`` with weight ``g[D]``, ``rows_per`` rows per instance."""

from __future__ import annotations

from ..dims import ceildiv
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, rms_normed, term
from ..ir.footprint import Full, Tile


@register
class RmsNorm(BlockKind):
    name = "rms_norm"
    cuda_file = "rownorm.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        tile = (Tile(0, rows), Full())
        return Partition(grid=(ceildiv(inputs[0].shape[0], rows),), reads=(tile, (Full(),)), writes=tile)

    def cpu(self, op, env, ins, out):
        rows = op.params["rows_per"]
        r0 = env["_i0"] * rows
        x = f32(ins[0][r0 : r0 + rows])
        out[r0 : r0 + rows] = rms_normed(x, ins[1], op.params["eps"], out.dtype).to(out.dtype)

    def cuda_call(self, op, ins, out):
        x, g = ins
        p = op.params
        args = [("smem", "smem"), ("x", x.view()), ("g", g.view()), ("eps", f"{float(p['eps'])!r}f"),
                ("out", out.view(const=False)), ("rows", op.inputs[0].shape[0].to_c(dimc)), ("rows_per", str(p["rows_per"])),
                ("c0", "c0")]
        d = op.inputs[0].shape[1].value
        return c_call("rms_norm_rows", [x.ctype, d, norm_team(d, p["rows_per"])], args)


def norm_team(d: int, rows_per: int) -> str:
    """Threads a row (interpreter/cuda/rownorm.cuh): a warp where a lane holds at most 128 elements and the
    op's instances take rows for several warps (``rows_per``, the tile the extractor chose; an instance at the
    ragged end may hold fewer), or the row is short; else the block."""
    return "32" if d <= 1024 or (d <= 4096 and rows_per >= 4) else "MEGA_THREADS"


@term
class RmsNormRowsTerm(Term):
    """RMSNorm of ``x`` over its last dim with weight ``g``, ``rows_per`` rows per instance (the graph's
    ``rms_norm``, or the pattern a rule recognises as one: rewrite/rules.py, ``_recover_rms_norm``)."""

    name = "rms_norm_rows"
    fields = fields("x:ref g:ref eps:float rows_per:int")

    def lower(self, b, value, args):
        x, g = b.operand(args["x"]), b.operand(args["g"])
        b.emit("rms_norm", b.absorbed(value, {args["x"], args["g"]}), [b.rows(x), g], b.rows(b.output(value)),
               {"rows_per": args["rows_per"], "eps": args["eps"]})
