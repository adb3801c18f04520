"""The gated MLP and its down projection as one streaming op, split over the MLP's rows.

``glu_down``: instance ``j`` computes rows ``[j*rows, ...)`` of ``h = silu(x w^T) * (x w2^T)``
(the gated ``matvec``, RMSNorm prologue optional), then adds its share of the down
projection, ``h[tile] @ wd_t[tile, :]``, into an f32 accumulator ``acc[1, N]`` with atomic
adds. ``wd_t`` is the down weight ``[N, F]`` stored transposed (``[F, N]``, done once when
the weights are bound), so an instance's share is one contiguous block of rows. Every
instance adds into all of ``acc``: its consumer waits for all of them. ``acc`` lives in the
launch-zeroed counter bank (buffer kind ``accum``), so it starts at 0 every launch.

``acc_residual``: ``out = T(r + T(acc))``, the down projection's rounding and the residual
add of the unfused ops, instance ``(row, column tile)`` (many rows: a ``moe_experts`` sum).

Why: the down projection reads the whole of ``h``, so unfused it waits for the last gated
instance and then ramps up from an idle memory system; split this way the chip streams
gate, up and down weights back to back (docs/perf-notes.md #32).
"""

from __future__ import annotations

import math

from ..dims import as_dim, ceildiv
from .base import NONE, BlockKind, Partition, Term, c_call, fields, no_view, register, term
from ..ir.footprint import Full, Tile
from .matvec import gated, roles


@register
class GluDown(BlockKind):
    name = "glu_down"
    cuda_file = "glu_down.cuh"
    accumulates = True  # every instance adds its rows' share into the sum
    waits_in_body = True  # the gated weights' first loads are in flight while it waits

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows"]
        reads = []
        for role in params["roles"]:
            reads.append({"x": (Tile(0, 1), Full()), "g": (Full(),)}.get(role, (Tile(1, rows), Full())))
        f = inputs[list(params["roles"]).index("w")].shape[0]
        return Partition(grid=(as_dim(1), ceildiv(f, rows)), reads=tuple(reads), writes=(Tile(0, 1), Full()))

    def cpu(self, op, env, ins, out):
        k, rows = roles(op), op.params["rows"]
        dt = op.inputs[k["w"]].dtype.torch
        r0 = env["_i1"] * rows
        tile = slice(r0, r0 + rows)
        h = gated(op, ins, slice(0, 1), tile, dt)  # [1, rows], as the unfused gated matvec stores it
        out += h @ ins[k["wd"]][tile].float()

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, w, w2, wd = (ins[k[r]] for r in ("x", "w", "w2", "wd"))
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[1].value
        args = [("smem", "smem"), ("x", x.view(1)), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"), ("w", w.view()),
                ("w2", w2.view()), ("wd", wd.view()), ("acc", out.ptr), ("F", f"{f}LL"), ("n_tile", "c1"), ("wl", "wl"),
                ("scale", "1.0f")]
        return c_call("glu_down", [x.ctype, kdim, n, p["rows"], "true" if "g" in k else "false"], args)

    def bytes_moved(self, op, env):
        k = roles(op)
        f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[1].value
        item = op.inputs[k["w"]].dtype.itemsize
        inst = op.grid[1].eval(env)
        return (2 * f * kdim + f * n) * item + inst * (kdim * item + n * 4)


@register
class AccResidual(BlockKind):
    name = "acc_residual"
    cuda_file = "glu_down.cuh"

    def build(self, inputs, output, params) -> Partition:
        fp = (Tile(0, 1), Tile(1, params["tile"]))  # one row (instance (row, column tile))
        return Partition(grid=(output.shape[0], ceildiv(output.shape[1], params["tile"])), reads=(fp, fp), writes=fp)

    def cpu(self, op, env, ins, out):
        r, acc = ins
        t, row = op.params["tile"], slice(env["_i0"], env["_i0"] + 1)
        s = slice(env["_i1"] * t, env["_i1"] * t + t)
        out[row, s] = (r[row, s].float() + acc[row, s].to(out.dtype).float()).to(out.dtype)

    def cuda_call(self, op, ins, out) -> str:
        r, acc = ins
        n = op.output.shape[1].value
        one = op.grid[0] == as_dim(1)  # (a decode step's one row: no row offset)

        def row(o) -> str:  # the operand advanced to the instance's row
            return o.ptr if one else f"({o.ptr} + c0 * {o.strides[0]})"

        args = [("r", r.view(1, ptr=row(r))), ("acc", row(acc)), ("out", out.view(1, ptr=row(out), const=False)),
                ("n", f"{n}LL"), ("tile", f"{op.params['tile']}LL"), ("c1", "c1")]
        return c_call("acc_residual", [out.ctype], args)


ACC_RESIDUAL_TILE = 1024  # elements per acc_residual instance: a few instances, one round trip each


@term
class GluDownTerm(Term):
    """The f32 sum of ``(gated MLP of x) @ wd^T``, split over the MLP's rows (computes a Sum)."""

    name = "glu_down"
    fields = fields("x:ref w:ref w2:ref g:ref eps:float wd:ref rows:int")
    computes = "sum"
    tile = "rows"

    def fits(self, graph, args):
        """One x row, and weights read directly (no view: the body assumes contiguous rows) with 16-byte rows."""
        xs, ws, wds = (graph.nodes[args[k]].shape for k in ("x", "w", "wd"))
        if any(graph.nodes[args[k]].op != "weight" for k in ("w", "w2", "wd")) or len(ws) != 2 or len(wds) != 2:
            return False
        if not all(d.is_const for d in xs):
            return False
        vec = 16 // graph.nodes[args["w"]].dtype.itemsize
        return math.prod(d.value for d in xs[:-1]) == 1 and ws[1].value % vec == 0 and wds[0].value % vec == 0

    def lower(self, b, value, args):
        operands = {"x": args["x"], "g": args["g"], "w": args["w"], "w2": args["w2"]}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.rows(b.operand(operands[k])) if k == "x" else b.operand(operands[k]) for k in present]
        acc = b.sum(value.node)
        reads = {v for v in (*operands.values(), args["wd"]) if v != NONE}
        params = {"rows": args["rows"], "roles": (*present, "wd"), "eps": args["eps"]}
        b.emit("glu_down", b.absorbed(value.node, reads), [*inputs, b.transposed_weight(args["wd"])], acc, params)


@term
class AccResidualTerm(Term):
    """``r + T(acc)``: the rounding of a ``glu_down`` sum and the residual add."""

    name = "acc_residual"
    fields = fields("r:ref acc:sum")

    def lower(self, b, value, args):
        out = b.rows(b.output(value))
        residual = b.rows(b.operand(args["r"]))
        b.emit("acc_residual", [value], [residual, b.sum(args["acc"])], out, {"tile": ACC_RESIDUAL_TILE})
