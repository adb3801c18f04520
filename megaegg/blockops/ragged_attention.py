"""Ragged attention: row ``i`` of ``q[N, Hq, D]`` attends cache rows ``[0, pos[i]]`` of sequence slot
``slot[i]`` (caches ``[slots, Hkv, max_len, D]``), split over the KV rows as decode attention is
(``attention.py``): ``ragged_partial`` then ``ragged_merge``.

``ragged_partial``: grid ``(N, Hkv, ceil(length / chunk))`` (``length``: the op's bound on every
``pos[i] + 1``, a runtime dim, at most ``max_len``); instance ``(i, h, s)`` attends the
``group`` query heads of KV head ``h`` of row ``i`` over cache rows ``[s*chunk, min(s*chunk + chunk,
pos[i] + 1))`` and writes ``part[i, Hq, S, D + 2]`` (f32) as ``attn_partial`` does; a split past
the row's length writes an empty state (max -inf, sum 0). ``ragged_merge``: grid
``(N, ceil(Hq / rows_per))``; combines row ``i``'s ``ceil((pos[i] + 1) / chunk)`` splits. The
caches are read whole along slots and positions (which ones is data), so a reader waits for the
``kv_store`` instance of its head.
"""

from __future__ import annotations

import torch

from ..dims import as_dim, ceildiv
from ..dtypes import f32 as F32
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, term
from ..ir.footprint import Full, Tile
from .kv_store import row_index


def row_length(op, ins_pos, ins_slot, i: int, kc_shape) -> tuple[int, int]:
    """(length, slot) of row ``i``: ``pos[i] + 1`` cache rows of slot ``slot[i]``, checked."""
    p = row_index(op.kind, "position", int(ins_pos[i]), kc_shape[2])
    s = row_index(op.kind, "slot", int(ins_slot[i]), kc_shape[0])
    return p + 1, s


@register
class RaggedPartial(BlockKind):
    name = "ragged_partial"
    cuda_file = "attention.cuh"

    def build(self, inputs, output, params) -> Partition:
        q, kc, _, _, _ = inputs
        g, c = params["group"], params["chunk"]
        kv = (Full(), Tile(1, 1), Full(), Full())
        row = (Tile(0, 1),)
        return Partition(
            grid=(q.shape[0], kc.shape[1], ceildiv(params["length"], c)),
            reads=((Tile(0, 1), Tile(1, g), Full()), kv, kv, row, row),
            writes=(Tile(0, 1), Tile(1, g), Tile(2, 1), Full()),
        )

    def cpu(self, op, env, ins, out):
        q, kc, vc, pos, slot = ins
        p = op.params
        i, h, s = env["_i0"], env["_i1"], env["_i2"]
        length, sl = row_length(op, pos, slot, i, kc.shape)
        p0, p1 = s * p["chunk"], min(s * p["chunk"] + p["chunk"], length)
        rows = slice(h * p["group"], (h + 1) * p["group"])
        d = q.shape[2]
        if p1 <= p0:  # past the row's length: an empty state
            out[i, rows, s, :d + 1] = 0.0
            out[i, rows, s, d] = float("-inf")
            return
        qh = f32(q[i, rows])  # [G, D]
        k, v = f32(kc[sl, h, p0:p1]), f32(vc[sl, h, p0:p1])  # [C, D]
        scores = qh @ k.T * p["scale"]
        m = scores.max(-1).values
        e = torch.exp(scores - m[:, None])
        out[i, rows, s, :d] = e @ v
        out[i, rows, s, d] = m
        out[i, rows, s, d + 1] = e.sum(-1)

    def bytes_moved(self, op, env):
        q, kc = op.inputs[0], op.inputs[1]
        n, length = q.shape[0].eval(env), min(kc.shape[2].value, op.params["length"].eval(env))
        return n * 2 * kc.shape[1].value * length * kc.shape[3].value * kc.dtype.itemsize  # (at most: rows attend less)

    def cuda_call(self, op, ins, out):
        q, kc, vc, pos, slot = ins
        p = op.params
        d = op.inputs[0].shape[2].value
        slots, _, max_len, _ = (x.value for x in op.inputs[1].shape)
        args = [("smem", "smem"), ("q", q.view()), ("kc", kc.view()), ("vc", vc.view()), ("pos", pos.view(0)),
                ("slot", slot.view(0)), ("slots", f"{slots}LL"), ("max_len", f"{max_len}LL"), ("chunk", f"{p['chunk']}LL"),
                ("scale", f"{float(p['scale'])!r}f"), ("part", out.view(0, 1, 2, const=False)), ("c0", "c0"), ("c1", "c1"),
                ("c2", "c2")]
        return c_call("ragged_partial", [q.ctype, d, p["group"]], args)


@register
class RaggedMerge(BlockKind):
    name = "ragged_merge"
    cuda_file = "attention.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        return Partition(
            grid=(output.shape[0], ceildiv(output.shape[1], rows)),
            reads=((Tile(0, 1), Tile(1, rows), Full(), Full()), (Tile(0, 1),)),
            writes=(Tile(0, 1), Tile(1, rows), Full()),
        )

    def cpu(self, op, env, ins, out):
        part, pos = ins
        p = op.params
        i, r0 = env["_i0"], env["_i1"] * p["rows_per"]
        length = row_index(op.kind, "position", int(pos[i]), min(p["max_len"], p["length"].eval(env))) + 1
        nsplit = -(-length // p["chunk"])
        blk = part[i, r0 : r0 + p["rows_per"], :nsplit]  # [R, S, D+2]
        d = out.shape[2]
        m = blk[:, :, d]
        big = m.max(-1, keepdim=True).values
        wgt = torch.exp(m - big)
        num = (blk[:, :, :d] * wgt[:, :, None]).sum(1)
        den = (blk[:, :, d + 1] * wgt).sum(1)
        out[i, r0 : r0 + p["rows_per"]] = (num / den[:, None]).to(out.dtype)

    def cuda_call(self, op, ins, out):
        part, pos = ins
        p = op.params
        hq, d = (x.value for x in op.output.shape[1:])
        bound = f"min_i64({p['max_len']}LL, {p['length'].to_c(dimc)})"  # (rows past it: an error, as in cpu)
        args = [("part", part.view(0, 1, 2)), ("pos", pos.view(0)), ("max_len", bound), ("chunk", f"{p['chunk']}LL"),
                ("Hq", f"{hq}LL"), ("rows_per", str(p["rows_per"])), ("out", out.view(const=False)), ("c0", "c0"),
                ("c1", "c1")]
        return c_call("ragged_merge", [out.ctype, d], args)


@term
class RaggedSplitTerm(Term):
    """Ragged attention as ``ragged_partial`` over ``chunk`` cache rows per instance, then ``ragged_merge``."""

    name = "ragged_split"
    fields = fields("node:node chunk:int")
    tile = "chunk"

    def lower(self, b, value, args):
        n, chunk = b.graph.nodes[value], args["chunk"]
        q, kc, vc, pos, slot = (b.operand(i) for i in n.inputs)
        pos, slot = b.flat(pos), b.flat(slot)
        out = b.output(value)
        rows, hq, d = q.shape
        hkv, max_len, length = kc.shape[1].value, kc.shape[2].value, n.attrs["length"]
        part = b.scratch(f"ragged_part{value}", (rows, hq, ceildiv(length, chunk), as_dim(d.value + 2)), F32)
        group = hq.value // hkv
        common = {"chunk": chunk, "length": length}
        b.emit("ragged_partial", [value], [q, kc, vc, pos, slot], part, {**common, "group": group, "scale": n.attrs["scale"]})
        b.emit("ragged_merge", [value], [part, pos], out, {**common, "max_len": max_len, "rows_per": max(1, group)})
