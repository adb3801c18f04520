"""Split-KV decode attention, as two block ops or as one.

``attn_partial``: grid ``(Hkv, ceil(L / chunk))``; instance ``(h, s)`` attends the
``group`` query heads of KV head ``h`` over cache rows ``[s*chunk, min(s*chunk+chunk, L))``
and writes, per query head, the unnormalised output, the running max and the sum
of exponentials into ``part[Hq, S, D + 2]`` (f32). ``attn_merge``: combines the
``ceil(L / chunk)`` partials of ``rows_per`` query heads into ``out[Hq, D]``.
``attn_partial_merge``: both in one op, the last split of each KV head to finish merging
its query heads (an arrival counter per KV head), so the merge needs no hand-off of its own.
"""

from __future__ import annotations

import torch

from ..dims import as_dim, ceildiv
from ..dtypes import f32 as F32
from ..dtypes import i32 as I32
from .base import BlockKind, Partition, Term, dimc, f32, fields, register, term
from .footprint import Full, Span, Tile


@register
class AttnPartial(BlockKind):
    name = "attn_partial"
    cuda_file = "attention.cuh"

    def build(self, inputs, output, params) -> Partition:
        q, kc, _ = inputs
        g, c, length = params["group"], params["chunk"], params["length"]
        kv = (Tile(0, 1), Tile(1, c, stop=length), Full())
        return Partition(
            grid=(kc.shape[0], ceildiv(length, c)),
            reads=((Tile(0, g), Full()), kv, kv),
            writes=(Tile(0, g), Tile(1, 1), Full()),
        )

    def cpu(self, op, env, ins, out):
        q, kc, vc = ins
        p = op.params
        h, s = env["_i0"], env["_i1"]
        length = p["length"].eval(env)
        p0, p1 = s * p["chunk"], min(s * p["chunk"] + p["chunk"], length)
        qh = f32(q[h * p["group"] : (h + 1) * p["group"]])  # [G, D]
        k, v = f32(kc[h, p0:p1]), f32(vc[h, p0:p1])  # [C, D]
        scores = qh @ k.T * p["scale"]  # [G, C]
        m = scores.max(-1).values
        e = torch.exp(scores - m[:, None])
        d = q.shape[1]
        rows = slice(h * p["group"], (h + 1) * p["group"])
        out[rows, s, :d] = e @ v
        out[rows, s, d] = m
        out[rows, s, d + 1] = e.sum(-1)

    def cuda_call(self, op, ins, out):
        q, kc, vc = ins
        p = op.params
        hq, d = (x.value for x in op.inputs[0].shape)
        args = [
            "smem",
            q.ptr, *q.strides[:2],
            kc.ptr, *kc.strides[:3],
            vc.ptr, *vc.strides[:3],
            p["length"].to_c(dimc), f"{p['chunk']}LL", f"{float(p['scale'])!r}f",
            out.ptr, out.strides[0], out.strides[1],
            "c0", "c1",
        ]
        return f"attn_partial<{q.ctype}, {d}, {p['group']}>({', '.join(args)})"


@register
class AttnMerge(BlockKind):
    name = "attn_merge"
    cuda_file = "attention.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        nsplit = ceildiv(params["length"], params["chunk"])
        return Partition(
            grid=(ceildiv(output.shape[0], rows),),
            reads=((Tile(0, rows), Span(0, nsplit), Full()),),
            writes=(Tile(0, rows), Full()),
        )

    def cpu(self, op, env, ins, out):
        p = op.params
        r0 = env["_i0"] * p["rows_per"]
        nsplit = ceildiv(p["length"], p["chunk"]).eval(env)
        part = ins[0][r0 : r0 + p["rows_per"], :nsplit]  # [R, S, D+2]
        d = out.shape[1]
        m = part[:, :, d]
        big = m.max(-1, keepdim=True).values
        wgt = torch.exp(m - big)  # [R, S]
        num = (part[:, :, :d] * wgt[:, :, None]).sum(1)
        den = (part[:, :, d + 1] * wgt).sum(1)
        out[r0 : r0 + p["rows_per"]] = (num / den[:, None]).to(out.dtype)

    def cuda_call(self, op, ins, out):
        part = ins[0]
        p = op.params
        hq, d = (x.value for x in op.output.shape)
        args = [
            part.ptr, part.strides[0], part.strides[1],
            p["length"].to_c(dimc), f"{p['chunk']}LL", f"{hq}LL", str(p["rows_per"]),
            out.ptr, out.strides[0], out.strides[1],
            "c0",
        ]
        return f"attn_merge<{out.ctype}, {d}>({', '.join(args)})"


@register
class AttnPartialMerge(BlockKind):
    """``attn_partial`` whose last split of each KV head merges it (interpreter/cuda/attention.cuh).
    Inputs ``q, k_cache, v_cache, part, arrive``: ``part`` (the partials) and ``arrive`` (a
    launch-zeroed counter per KV head) are the op's own, ordered by its arrival counter."""

    name = "attn_partial_merge"
    cuda_file = "attention.cuh"
    last_writer = True  # the KV head's splits all declare its output rows; the last to arrive writes them

    def internal_inputs(self, op):
        return (3, 4)

    def build(self, inputs, output, params) -> Partition:
        q, kc = inputs[0], inputs[1]
        g, c, length = params["group"], params["chunk"], params["length"]
        kv = (Tile(0, 1), Tile(1, c, stop=length), Full())
        return Partition(
            grid=(kc.shape[0], ceildiv(length, c)),
            reads=((Tile(0, g), Full()), kv, kv, (Tile(0, g), Full(), Full()), (Tile(0, 1),)),
            writes=(Tile(0, g), Full()),
        )

    def cpu(self, op, env, ins, out):
        # every split computes the head's result (the simulator lets readers in once all have run)
        q, kc, vc = ins[:3]
        p = op.params
        h, g, length = env["_i0"], p["group"], p["length"].eval(env)
        rows = slice(h * g, (h + 1) * g)
        qh, k, v = f32(q[rows]), f32(kc[h, :length]), f32(vc[h, :length])
        out[rows] = (torch.softmax(qh @ k.T * p["scale"], -1) @ v).to(out.dtype)

    def cuda_call(self, op, ins, out):
        q, kc, vc, part, arrive = ins
        p = op.params
        d = op.inputs[0].shape[1].value
        args = [
            "smem",
            q.ptr, *q.strides[:2],
            kc.ptr, *kc.strides[:3],
            vc.ptr, *vc.strides[:3],
            p["length"].to_c(dimc), f"{p['chunk']}LL", f"{float(p['scale'])!r}f",
            f"(float*){part.ptr}", part.strides[0], part.strides[1], f"(unsigned*){arrive.ptr}",
            out.ptr, out.strides[0], out.strides[1],
            "c0", "c1",
        ]
        return f"attn_partial_merge<{q.ctype}, {d}, {p['group']}>({', '.join(args)})"

    def bytes_moved(self, op, env):
        q, kc, vc, part, _ = op.inputs
        length = op.params["length"].eval(env)
        hkv, d = kc.shape[0].value, kc.shape[2].value
        kv = 2 * hkv * length * d * kc.dtype.itemsize
        hq = q.shape[0].value
        partials = 2 * hq * -(-length // op.params["chunk"]) * (d + 2) * 4  # written, then read by the last split
        return kv + partials + hq * d * (q.dtype.itemsize + op.output.dtype.itemsize)


@term
class AttentionSplitTerm(Term):
    """Decode attention as ``attn_partial`` over ``chunk`` cache rows per instance, then ``attn_merge``."""

    name = "attention_split"
    fields = fields("node:node chunk:int")

    def lower(self, b, value, args):
        n, chunk = b.graph.nodes[value], args["chunk"]
        q, kc, vc = (b.operand(i) for i in n.inputs)
        out = b.output(value)
        hq, d = (x.value for x in q.shape)
        hkv, smax = kc.shape[0].value, kc.shape[1]
        part = b.scratch(f"attn_part{value}", (hq, ceildiv(smax, chunk), as_dim(d + 2)), F32)
        common = {"length": n.attrs["length"], "chunk": chunk}
        b.emit("attn_partial", [value], [q, kc, vc], part, {**common, "group": hq // hkv, "scale": n.attrs["scale"]})
        b.emit("attn_merge", [value], [part], out, {**common, "rows_per": max(1, hq // hkv)})


@term
class AttentionFoldTerm(Term):
    """Decode attention as one ``attn_partial_merge`` over ``chunk`` cache rows per instance."""

    name = "attention_fold"
    fields = fields("node:node chunk:int")

    def lower(self, b, value, args):
        n, chunk = b.graph.nodes[value], args["chunk"]
        q, kc, vc = (b.operand(i) for i in n.inputs)
        out = b.output(value)
        hq, d = (x.value for x in q.shape)
        hkv, smax = kc.shape[0].value, kc.shape[1]
        part = b.scratch(f"attn_part{value}", (hq, ceildiv(smax, chunk), as_dim(d + 2)), F32)
        arrive = b.accum(f"attn_arrive{value}", (hkv,), I32)
        params = {"length": n.attrs["length"], "chunk": chunk, "group": hq // hkv, "scale": n.attrs["scale"]}
        b.emit("attn_partial_merge", [value], [q, kc, vc, part, arrive], out, params)
