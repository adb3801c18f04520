"""rope: rotate-half rotary embedding of ``x[rows, D]`` rows; ``inv_freq[D/2]`` (f32).

The position is a runtime dim (``params["pos"]``) or, with a ``pos_ids`` operand, an i32
tensor giving the position of each group of ``params["group"]`` consecutive rows.
Fusions (operand roles in ``params["roles"]``): ``g`` a per-row RMSNorm prologue
(qwen3's q/k norm: ``x <- T(T(x * rsqrt(mean(x^2) + eps)) * g)``, as the ``rms_norm``
kind rounds); the output may be a KV cache row (RoPE + ``kv_append`` in one op), which
only changes where the rows are written.
"""

from __future__ import annotations

import math

import torch

from ..dims import ceildiv
from .base import NONE, BlockKind, Partition, Term, c_call, dimc, f32, fields, no_view, register, rms_normed, term
from ..ir.footprint import Full, Tile
from .matvec import roles


def rotated(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Rotate-half RoPE of f32 rows ``x[n, D]`` at f32 positions ``pos[n]``, rounded to ``dt`` (the angle
    ``pos * inv_freq`` in f32, then torch's cos and sin)."""
    ang = pos[:, None] * inv_freq.float()[None, :]
    cos, sin = ang.cos(), ang.sin()
    h = x.shape[1] // 2
    x1, x2 = x[:, :h], x[:, h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dt)


@register
class Rope(BlockKind):
    name = "rope"
    cuda_file = "rope.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        tile = (Tile(0, rows), Full())
        reads = tuple(tile if role == "x" else (Full(),) for role in params["roles"])
        return Partition(grid=(ceildiv(inputs[0].shape[0], rows),), reads=reads, writes=tile)

    def cpu(self, op, env, ins, out):
        k, p = roles(op), op.params
        rows = p["rows_per"]
        r0 = env["_i0"] * rows
        x = f32(ins[k["x"]][r0 : r0 + rows])
        n = x.shape[0]
        if "g" in k:
            x = rms_normed(x, ins[k["g"]], p["eps"], out.dtype)
        if "pos_ids" in k:
            pos = ins[k["pos_ids"]].long()[(torch.arange(r0, r0 + n) // p["group"])].float()
        else:
            pos = torch.full((n,), float(p["pos"].eval(env)))
        out[r0 : r0 + n] = rotated(x, pos, ins[k["inv_freq"]], out.dtype)

    def cuda_call(self, op, ins, out):
        k, p = roles(op), op.params
        x, inv = ins[k["x"]], ins[k["inv_freq"]]
        pos_ids = ins[k["pos_ids"]].view() if "pos_ids" in k else no_view(1, "int")
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        pos = p["pos"].to_c(dimc) if p.get("pos") is not None else "0"
        args = [("x", x.view()), ("inv_freq", inv.ptr), ("pos_ids", pos_ids), ("pos", pos),
                ("group", f"{p.get('group', 1)}LL"), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"),
                ("out", out.view(const=False)), ("rows", op.inputs[0].shape[0].to_c(dimc)),
                ("rows_per", str(p["rows_per"])), ("c0", "c0")]
        norm = "true" if "g" in k else "false"
        return c_call("rope_rows", [x.ctype, op.inputs[0].shape[1].value, norm], args)


@term
class RopeRowsTerm(Term):
    """RoPE of node ``rope`` (a runtime-dim position) read from ``x`` [after a per-row RMSNorm(``g``)],
    written to its own buffer or, when ``append`` names a ``kv_append`` node, straight into its cache row."""

    name = "rope_rows"
    fields = fields("x:ref g:ref eps:float rope:node append:node rows_per:int")
    tile = "rows_per"

    def refs(self, graph, args):
        cache = graph.nodes[args["append"]].inputs[0] if args["append"] != NONE else NONE
        return tuple(i for i in (args["x"], args["g"], graph.nodes[args["rope"]].inputs[1], cache) if i != NONE)

    def lower(self, b, value, args):
        r = b.graph.nodes[args["rope"]]
        operands = {"x": args["x"], "inv_freq": r.inputs[1], "g": args["g"]}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.rows(b.operand(operands[k])) if k == "x" else b.operand(operands[k]) for k in present]
        out = b.cache_row(args["append"]) if args["append"] != NONE else b.rows(b.output(r.id))
        params = {"rows_per": args["rows_per"], "pos": r.attrs["pos"], "group": 1, "roles": present, "eps": args["eps"]}
        b.emit("rope", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, out, params)


@term
class RopeIdsTerm(Term):
    """RoPE of node ``rope`` at positions read from its i32 tensor (one per group of rows), read from ``x``
    [after a per-row RMSNorm(``g``): qwen3's q/k norm of a batch or a prompt]."""

    name = "rope_ids"
    fields = fields("x:ref g:ref eps:float rope:node rows_per:int")
    tile = "rows_per"

    def refs(self, graph, args):
        r = graph.nodes[args["rope"]]
        return tuple(i for i in (args["x"], args["g"], r.inputs[1], r.inputs[2]) if i != NONE)

    def lower(self, b, value, args):
        r = b.graph.nodes[args["rope"]]
        operands = {"x": args["x"], "inv_freq": r.inputs[1], "pos_ids": r.inputs[2], "g": args["g"]}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.rows(b.operand(operands[k])) if k == "x" else b.operand(operands[k]) for k in present]
        group = math.prod(d.value for d in r.shape[1:-1]) if len(r.shape) > 2 else 1
        params = {"rows_per": args["rows_per"], "pos": None, "group": group, "roles": present, "eps": args["eps"]}
        b.emit("rope", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, b.rows(b.output(r.id)), params)
