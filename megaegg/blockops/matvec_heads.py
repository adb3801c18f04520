"""matvec_heads: ``x[1, K] @ w[N, K]^T`` whose rows are heads of size D, written to an
``[N/D, D]`` view, optionally rotated by RoPE first: QKV projection + RoPE + KV append
in one op. The destination is the q buffer, or a KV cache row at ``pos`` (a view).

Each instance computes ``rows`` rows (whole heads) into a shared-memory tile, then its
epilogue rotates and stores them. Rounding follows the unfused ops: the projection
rounds to the storage dtype, RoPE rotates that as the ``rope`` kind does (``rope.rotated``,
``params["hf"]`` its rounding).
"""

from __future__ import annotations

import torch

from ..dims import as_dim, ceildiv
from .base import NONE, BlockKind, Partition, Term, c_call, dimc, fields, no_view, register, term
from ..ir.footprint import Full, Tile
from .matvec import fits_epilogue_tile, products, roles
from .rope import hf_param, hf_rounding, rotated


@register
class MatVecHeads(BlockKind):
    name = "matvec_heads"
    cuda_file = "matvec_heads.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows, d = params["rows"], params["head_dim"]
        reads = []
        for role, o in zip(params["roles"], inputs):
            if role == "w":
                reads.append((Tile(1, rows), Full()))
            elif role == "x":
                reads.append((Tile(0, 1), Full()))
            else:  # g, inv_freq
                reads.append((Full(),))
        grid = (as_dim(1), ceildiv(inputs[roles_index(params, "w")].shape[0], rows))
        return Partition(grid=grid, reads=tuple(reads), writes=(Tile(1, rows // d), Full()))

    def cpu(self, op, env, ins, out):
        k, p = roles(op), op.params
        dt, d = out.dtype, p["head_dim"]
        r0 = env["_i1"] * p["rows"]
        r1 = min(r0 + p["rows"], ins[k["w"]].shape[0])
        y = products(op, ins, slice(0, 1), slice(r0, r1), dt).reshape(-1, d)  # [heads, D]
        if "inv_freq" in k:
            y = rotated(y.float(), torch.full((y.shape[0],), float(p["pos"].eval(env))), ins[k["inv_freq"]], dt,
                        p.get("hf", False))
        out[r0 // d : r0 // d + y.shape[0]] = y.to(dt)

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, w = ins[k["x"]], ins[k["w"]]
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        inv = ins[k["inv_freq"]].ptr if "inv_freq" in k else "nullptr"
        pos = p["pos"].to_c(dimc) if "inv_freq" in k else "0"
        kdim, n = op.inputs[k["w"]].shape[1].value, op.inputs[k["w"]].shape[0].value
        flags = ["true" if "g" in k else "false", "true" if "inv_freq" in k else "false", *(["true"] if p.get("hf") else [])]
        args = [("smem", "smem"), ("x", x.view()), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"), ("w", w.view()),
                ("inv_freq", inv), ("pos", pos), ("out", out.view(const=False)), ("N", f"{n}LL"), ("n_tile", "c1")]
        return c_call("matvec_heads", [x.ctype, kdim, p["rows"], p["head_dim"], *flags], args)

    def bytes_moved(self, op, env):
        k = roles(op)
        w = op.inputs[k["w"]]
        n, kd, item = w.shape[0].value, w.shape[1].value, w.dtype.itemsize
        return n * kd * item + op.grid[1].eval(env) * kd * item + n * item


def roles_index(params, role: str) -> int:
    return list(params["roles"]).index(role)


@term
class MatVecHeadsTerm(Term):
    """A head-split projection ``x @ w^T`` [after RMSNorm(``g``)] [rotated as RoPE node ``rope`` does]
    [written into the cache row of ``kv_append`` node ``append``]."""

    name = "matvec_heads"
    fields = fields("x:ref w:ref g:ref eps:float rows:int rope:node append:node")
    tile = "rows"

    def fits(self, graph, args) -> bool:
        return fits_epilogue_tile(graph, args)

    def refs(self, graph, args):
        inv = graph.nodes[args["rope"]].inputs[1] if args["rope"] != NONE else NONE
        cache = graph.nodes[args["append"]].inputs[0] if args["append"] != NONE else NONE
        return tuple(i for i in (args["x"], args["w"], args["g"], inv, cache) if i != NONE)

    def lower(self, b, value, args):
        rope, append = args["rope"], args["append"]
        operands = {"x": args["x"], "w": args["w"], "g": args["g"],
                    "inv_freq": b.graph.nodes[rope].inputs[1] if rope != NONE else NONE}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.rows(b.operand(operands[r])) if r == "x" else b.adjacent(b.operand(operands[r])) if r == "inv_freq"
                  else b.operand(operands[r]) for r in present]
        heads = b.graph.nodes[append].shape[0] if append != NONE else b.graph.nodes[value].shape[0]
        head_dim = inputs[present.index("w")].shape[0].value // heads.value
        pos = b.graph.nodes[rope].attrs["pos"] if rope != NONE else as_dim(0)
        out = b.cache_row(append) if append != NONE else b.output(value)
        params = {"rows": args["rows"], "head_dim": head_dim, "roles": present, "eps": args["eps"], "pos": pos,
                  **hf_param(rope != NONE and hf_rounding(b.graph.nodes[rope]))}
        b.emit("matvec_heads", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, out, params)
