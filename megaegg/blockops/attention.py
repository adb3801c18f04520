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
from .base import BlockKind, Partition, Term, c_call, dimc, f32, fields, register, term
from ..ir.footprint import Full, Span, Tile


def kv_reads(params) -> tuple:
    """The K (and V) cache rows split ``(h, s)`` reads: KV head ``h``, rows ``[s*chunk, ...)`` below ``length``."""
    return (Tile(0, 1), Tile(1, params["chunk"], stop=params["length"]), Full())


def split_grid(kc, params) -> tuple:
    """``(Hkv, ceil(length / chunk))``: one instance per KV head and split."""
    return (kc.shape[0], ceildiv(params["length"], params["chunk"]))


def partial(q, kc, vc, params, h: int, s: int, length: int):
    """Split ``s`` of KV head ``h`` for its ``group`` query heads, f32: the unnormalised output
    ``[G, D]``, the max score and the sum of exponentials ``[G]`` (what ``attn_partial`` stores)."""
    g, c = params["group"], params["chunk"]
    p0, p1 = s * c, min(s * c + c, length)
    qh, k, v = f32(q[h * g : (h + 1) * g]), f32(kc[h, p0:p1]), f32(vc[h, p0:p1])
    scores = qh @ k.T * params["scale"]  # [G, C]
    m = scores.max(-1).values
    e = torch.exp(scores - m[:, None])
    return e @ v, m, e.sum(-1)


def merge(part: torch.Tensor) -> torch.Tensor:
    """``[R, S, D + 2]`` partials (output, max, sum) of ``R`` query heads -> their f32 outputs ``[R, D]``."""
    d = part.shape[-1] - 2
    m = part[:, :, d]
    wgt = torch.exp(m - m.max(-1, keepdim=True).values)  # [R, S]
    num = (part[:, :, :d] * wgt[:, :, None]).sum(1)
    return num / (part[:, :, d + 1] * wgt).sum(1)[:, None]


def partial_args(op, q, kc, vc) -> list[tuple[str, str]]:
    """The labelled arguments ``attn_partial`` and ``attn_partial_merge`` share, up to the partials."""
    p = op.params
    return [("smem", "smem"), ("q", q.view()), ("kc", kc.view()), ("vc", vc.view()), ("L", p["length"].to_c(dimc)),
            ("chunk", f"{p['chunk']}LL"), ("scale", f"{float(p['scale'])!r}f")]


def attention_bytes(hq: int, hkv: int, d: int, item: int, length: int, chunk: int, *, splits: bool, merges: bool) -> int:
    """Bytes the split part (q, the KV rows below ``length``, the partials written) and the merge part
    (the partials read, the output) move, for the cost model."""
    partials = hq * -(-length // chunk) * (d + 2) * 4
    split = hq * d * item + 2 * hkv * length * d * item + partials
    return (split if splits else 0) + (partials + hq * d * item if merges else 0)


@register
class AttnPartial(BlockKind):
    name = "attn_partial"
    cuda_file = "attention.cuh"

    def build(self, inputs, output, params) -> Partition:
        q, kc, _ = inputs
        kv = kv_reads(params)
        return Partition(grid=split_grid(kc, params), reads=((Tile(0, params["group"]), Full()), kv, kv),
                         writes=(Tile(0, params["group"]), Tile(1, 1), Full()))

    def cpu(self, op, env, ins, out):
        h, s, g = env["_i0"], env["_i1"], op.params["group"]
        num, m, l = partial(*ins, op.params, h, s, op.params["length"].eval(env))
        d = num.shape[1]
        rows = slice(h * g, (h + 1) * g)
        out[rows, s, :d], out[rows, s, d], out[rows, s, d + 1] = num, m, l

    def cuda_call(self, op, ins, out):
        q, kc, vc = ins
        d = op.inputs[0].shape[1].value
        args = [*partial_args(op, q, kc, vc), ("part", out.view(0, 1, const=False)), ("c0", "c0"), ("c1", "c1")]
        return c_call("attn_partial", [q.ctype, d, op.params["group"]], args)

    def bytes_moved(self, op, env):
        (hq, d), hkv = (x.value for x in op.inputs[0].shape), op.inputs[1].shape[0].value
        return attention_bytes(hq, hkv, d, op.inputs[0].dtype.itemsize, op.params["length"].eval(env),
                               op.params["chunk"], splits=True, merges=False)


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
        out[r0 : r0 + p["rows_per"]] = merge(ins[0][r0 : r0 + p["rows_per"], :nsplit]).to(out.dtype)

    def cuda_call(self, op, ins, out):
        part = ins[0]
        p = op.params
        hq, d = (x.value for x in op.output.shape)
        args = [("part", part.view(0, 1)), ("L", p["length"].to_c(dimc)), ("chunk", f"{p['chunk']}LL"), ("Hq", f"{hq}LL"),
                ("rows_per", str(p["rows_per"])), ("out", out.view(const=False)), ("c0", "c0")]
        return c_call("attn_merge", [out.ctype, d], args)

    def bytes_moved(self, op, env):
        hq, d = (x.value for x in op.output.shape)
        return attention_bytes(hq, 0, d, op.output.dtype.itemsize, op.params["length"].eval(env), op.params["chunk"],
                               splits=False, merges=True)


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
        g, kv = params["group"], kv_reads(params)
        return Partition(grid=split_grid(inputs[1], params),
                         reads=((Tile(0, g), Full()), kv, kv, (Tile(0, g), Full(), Full()), (Tile(0, 1),)),
                         writes=(Tile(0, g), Full()))

    def cpu(self, op, env, ins, out):
        # every split computes its KV head's result, as partials then their merge (the simulator
        # lets readers in once all the head's splits have run)
        p, h = op.params, env["_i0"]
        length = p["length"].eval(env)
        parts = [partial(*ins[:3], p, h, s, length) for s in range(-(-length // p["chunk"]))]
        part = torch.stack([torch.cat([num, m[:, None], l[:, None]], 1) for num, m, l in parts], 1)  # [G, S, D+2]
        out[h * p["group"] : (h + 1) * p["group"]] = merge(part).to(out.dtype)

    def cuda_call(self, op, ins, out):
        q, kc, vc, part, arrive = ins
        d = op.inputs[0].shape[1].value
        args = [*partial_args(op, q, kc, vc), ("part", part.view(0, 1, ptr=f"(float*){part.ptr}", const=False)),
                ("arrive", f"(unsigned*){arrive.ptr}"), ("out", out.view(const=False)), ("c0", "c0"), ("c1", "c1")]
        return c_call("attn_partial_merge", [q.ctype, d, op.params["group"]], args)

    def bytes_moved(self, op, env):
        (hq, d), hkv = (x.value for x in op.inputs[0].shape), op.inputs[1].shape[0].value
        return attention_bytes(hq, hkv, d, op.inputs[0].dtype.itemsize, op.params["length"].eval(env),
                               op.params["chunk"], splits=True, merges=True)


def split_operands(b, value, chunk):
    """The attention node's q and caches, its output, and the partials scratch ``[Hq, splits, D + 2]``."""
    n = b.graph.nodes[value]
    q, kc, vc = (b.operand(i) for i in n.inputs)
    out = b.output(value)
    hq, d = (x.value for x in q.shape)
    part = b.scratch(f"attn_part{value}", (hq, ceildiv(kc.shape[1], chunk), as_dim(d + 2)), F32)
    params = {"length": n.attrs["length"], "chunk": chunk, "group": hq // kc.shape[0].value, "scale": n.attrs["scale"]}
    return q, kc, vc, out, part, params


@term
class AttentionSplitTerm(Term):
    """Decode attention as ``attn_partial`` over ``chunk`` cache rows per instance, then ``attn_merge``."""

    name = "attention_split"
    fields = fields("node:node chunk:int")

    def lower(self, b, value, args):
        q, kc, vc, out, part, params = split_operands(b, value, args["chunk"])
        b.emit("attn_partial", [value], [q, kc, vc], part, params)
        b.emit("attn_merge", [value], [part], out,
               {"length": params["length"], "chunk": params["chunk"], "rows_per": max(1, params["group"])})


@term
class AttentionFoldTerm(Term):
    """Decode attention as one ``attn_partial_merge`` over ``chunk`` cache rows per instance."""

    name = "attention_fold"
    fields = fields("node:node chunk:int")

    def lower(self, b, value, args):
        q, kc, vc, out, part, params = split_operands(b, value, args["chunk"])
        arrive = b.accum(f"attn_arrive{value}", (kc.shape[0],), I32)
        b.emit("attn_partial_merge", [value], [q, kc, vc, part, arrive], out, params)
