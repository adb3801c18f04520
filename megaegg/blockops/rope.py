"""rope: rotate-half rotary embedding of ``x[rows, D]`` rows; ``inv_freq[D/2]`` (f32).

The position is a runtime dim (``params["pos"]``) or, with a ``pos_ids`` operand, an i32
tensor giving the position of each group of ``params["group"]`` consecutive rows.
Rounding (``params["hf"]``, :func:`rotated`): in f32, rounded once, or as Hugging Face's
``apply_rotary_pos_emb`` rounds in the model's dtype (``ops.rope(rounding="hf")``).
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


def rotated(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, dt: torch.dtype, hf: bool = False) -> torch.Tensor:
    """Rotate-half RoPE of f32 rows ``x[n, D]`` (values of ``dt``) at f32 positions ``pos[n]``, in ``dt``: the
    angle ``pos * inv_freq`` in f32, then torch's cos and sin; ``x1 cos - x2 sin``, ``x2 cos + x1 sin`` in f32,
    rounded once, or (``hf``) as Hugging Face's ``apply_rotary_pos_emb`` computes them in ``dt``: cos and sin
    rounded to ``dt``, each product and each sum rounded to ``dt``. The CPU twin of rope.cuh's
    ``rope_rotate`` (every kind that rotates calls one of the two)."""
    ang = pos[:, None] * inv_freq.float()[None, :]
    cos, sin = ang.cos(), ang.sin()
    h = x.shape[1] // 2
    if hf:  # (torch's ops in dt: each rounds its f32 result)
        x, cos, sin = x.to(dt), cos.to(dt), sin.to(dt)
    x1, x2 = x[:, :h], x[:, h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dt)


def hf_rounding(node) -> bool:
    """Whether graph RoPE node ``node`` rounds as Hugging Face does (``ops.rope(rounding="hf")``)."""
    return node.attrs.get("rounding") == "hf"


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
        out[r0 : r0 + n] = rotated(x, pos, ins[k["inv_freq"]], out.dtype, p.get("hf", False))

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
        hf = ["true"] if p.get("hf") else []  # (HF = false: the body's default)
        return c_call("rope_rows", [x.ctype, op.inputs[0].shape[1].value, norm, *hf], args)


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
        inputs = [b.rows(b.operand(operands[k])) if k == "x" else b.adjacent(b.operand(operands[k])) if k == "inv_freq"
                  else b.operand(operands[k]) for k in present]
        out = b.cache_row(args["append"]) if args["append"] != NONE else b.rows(b.output(r.id))
        params = {"rows_per": args["rows_per"], "pos": r.attrs["pos"], "group": 1, "roles": present, "eps": args["eps"],
                  **hf_param(hf_rounding(r))}
        b.emit("rope", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, out, params)


def hf_param(hf) -> dict:
    """The block op's ``hf`` param: present only where set (the f32 rounding's ops are as before it)."""
    return {"hf": True} if hf else {}


def rope_input(b, x: int, like: int):
    """Operand ``x`` (the rows a RoPE rotates) seen with node ``like``'s shape: a fusion may read the rows
    from the tensor a row-preserving view of the RoPE's input was taken of (rules.py: ``rows_of``)."""
    o, shape = b.operand(x), b.graph.nodes[like].shape
    return o if o.shape == shape else b.view(o, "reshape", shape)


@term
class RopeIdsTerm(Term):
    """RoPE (node ``rope``'s value) at positions read from the i32 tensor ``pos`` (one per group of rows: the
    node's dims between its first and last), frequencies ``inv``, ``hf`` rounding, of the rows of ``x`` [after
    a per-row RMSNorm(``g``): qwen3's q/k norm of a batch or a prompt], written to its own buffer or, when
    ``append`` names a ``kv_append`` node, straight into its cache row. ``rope`` is a graph ``rope`` node or
    the sum of a RoPE written out as Hugging Face writes it (rules.py: ``_recover_rope``)."""

    name = "rope_ids"
    fields = fields("x:ref g:ref eps:float inv:ref pos:ref hf:int rope:node append:node rows_per:int")
    tile = "rows_per"

    needs = "the dims between the first and the last known at compile time (a position a group of rows)"

    def refs(self, graph, args):
        cache = graph.nodes[args["append"]].inputs[0] if args["append"] != NONE else NONE
        return tuple(i for i in (args["x"], args["g"], args["inv"], args["pos"], cache) if i != NONE)

    def fits(self, graph, args) -> bool:
        # (ops.rope checks it; a RoPE recovered from written-out ops may broadcast its position over a runtime dim)
        return all(d.is_const for d in graph.nodes[args["rope"]].shape[1:-1])

    def lower(self, b, value, args):
        r = b.graph.nodes[args["rope"]]
        operands = {"x": args["x"], "inv_freq": args["inv"], "pos_ids": args["pos"], "g": args["g"]}
        present = tuple(k for k, v in operands.items() if v != NONE)
        inputs = [b.rows(b.operand(operands[k])) if k == "x" else b.adjacent(b.operand(operands[k])) if k == "inv_freq"
                  else b.flat(b.operand(operands[k])) if k == "pos_ids"
                  else b.operand(operands[k]) for k in present]
        group = math.prod(d.value for d in r.shape[1:-1]) if len(r.shape) > 2 else 1
        out = b.cache_row(args["append"]) if args["append"] != NONE else b.rows(b.output(r.id))
        params = {"rows_per": args["rows_per"], "pos": None, "group": group, "roles": present, "eps": args["eps"],
                  **hf_param(args["hf"])}
        b.emit("rope", b.absorbed(value, {v for v in operands.values() if v != NONE}), inputs, out, params)
