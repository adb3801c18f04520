"""Ragged attention: row ``i`` of ``q[N, Hq, D]`` attends cache rows ``[0, pos[i]]`` of sequence slot
``slot[i]`` (caches ``[slots, Hkv, max_len, D]``), split over the KV rows as decode attention is
(``attention.py``), in one op: ``ragged_partial_merge``.

Grid ``(N, ceil(Hkv / heads), splits)``, ``heads`` KV heads an instance (``params["heads"]``, 1 if absent).
The split count is a run-time expression (``split_count``): about one wave of instances whatever the batch,
so one sequence's 513 cache rows go to 9 splits of 57 rows and 16 sequences' to one split each (a fixed chunk
gave 384 instances of 256 rows or 1 row at batch 16, perf-notes #74). Split ``s`` covers cache rows
``[s*chunk, s*chunk + chunk)``, ``chunk = ceil(length / splits)`` (``length``: the op's bound on every
``pos[i] + 1``, a runtime dim, at most ``max_len``); a row has ``ceil((pos[i] + 1) / chunk)`` splits and an
instance past them does nothing. Each split writes its partials (f32: unnormalised output, max, sum of
exponentials) to the op's own ``part``; the last of a (row, KV head group)'s splits to arrive (a counter in
the launch-zeroed counter bank) merges them into the row's query heads, so the merge needs no op and no
hand-off of its own. The caches are read whole along slots and positions (which ones is data), so an
instance waits for the ``kv_store`` instances of its heads.

Grouped heads: on the tensor-core body the lowering emits two of these ops, of which one launches
(``params["active"]``, a run-time 0 or 1 on the grid): one head an instance, or, where a batch's rows alone
fill a wave (``grouped``), 2 or 4 KV heads of a row an instance in one split (``heads_per_instance``; a warp
group a head), so a 64-row batch runs as one wave of long instances instead of four waves of short ones, each
paying the instance's fixed chain (the wait, the row's position and slot, q, the ring's first steps, the
combine; perf-notes #92, #116). Two ops rather than one with a run-time head count keep both ops' waits per
head (a run-time span of heads waits for every head's ``kv_store``: +5% at 1 and 16 rows); a row band whose
rows never reach the grouped op's threshold leaves it out (``rewrite/regimes.py: idle``).

Paged caches (``ragged_attention(..., pages=)``, the op's last input; ``params["paged"]``): on the
tensor-core body (bf16 / f16, ``group`` <= 8, head dim 64 or 128: ``"rows"``) the splits are as above and
the body finds each cache row's page in the table; otherwise (``"split"``) split ``s`` is page ``s`` of
the row's sequence (``chunk`` = the page's rows, ``ceil(length / page_len)`` splits), each instance one
page, contiguous, through the same bodies.
"""

from __future__ import annotations

import torch

from ..dims import DimLike, as_dim, ceildiv, dmax, dmin
from ..dtypes import bf16, f16
from ..dtypes import f32 as F32
from ..dtypes import i32 as I32
from .attention import merge, partial
from .base import BlockKind, Partition, Term, c_call, dimc, fields, register, term
from ..ir.footprint import Full, Tile
from .kv_store import CacheRows, kv_pages, pages_of, row_index

SPLIT_WAVE = 132  # instances the split count aims at: one wave of an H100 / H200 (CostModel.sms)


def split_count(length: DimLike, min_chunk: int, pairs: DimLike):
    """Splits of each (row, KV head) pair: as many as fill ``SPLIT_WAVE`` instances, at least one, and
    none shorter than ``min_chunk`` cache rows of ``length``. ``pairs * splits <= max(pairs, SPLIT_WAVE)``."""
    return dmax(1, dmin(ceildiv(length, min_chunk), SPLIT_WAVE // dmax(1, pairs)))


def row_length(op, ins_pos, ins_slot, i: int, where: CacheRows, bound: int | None = None) -> tuple[int, int]:
    """(length, slot) of row ``i``: ``pos[i] + 1`` cache rows (``pos[i] < bound``, a sequence's rows by
    default) of slot ``slot[i]``, checked."""
    p = row_index(op.kind, "position", int(ins_pos[i]), where.rows if bound is None else bound)
    s = row_index(op.kind, "slot", int(ins_slot[i]), where.slots)
    return p + 1, s


WAVE_PAIRS = 128  # (row, KV head group)s that count as a wave: 132 SMs less the few a last wave may leave idle


def heads_per_instance(hkv: int, tensor_core: bool) -> int:
    """KV heads an instance of the grouped op takes: on the tensor-core body the most of 4 and 2 that divides
    ``hkv`` into at least two groups (8 KV heads: 4, so a 64-row batch is 128 instances), else 1 (no grouped
    op). Its 8 warps split evenly among them."""
    return next((h for h in (4, 2) if tensor_core and hkv % h == 0 and hkv // h >= 2), 1)


def grouped(rows: DimLike, hkv: int, heads: int):
    """1 (at run time) where ``rows`` x ``hkv`` / ``heads`` >= WAVE_PAIRS: the rows alone fill a wave of
    instances of ``heads`` KV heads, so the grouped op needs no split; else 0. Grouping that needs splits
    loses (a 16-row batch, 4 heads in 4 splits instead of 1 head in 1: +3.7%, the splits' merge)."""
    return dmin(1, as_dim(rows) * hkv // (heads * WAVE_PAIRS))


def tensor_core_body(dtype, group: int, head_dim: int) -> bool:
    """Whether the tensor-core body runs the attention (attention.cuh: MmaPath): it can read a paged cache's
    rows through the page table."""
    return dtype in (bf16, f16) and group <= 8 and head_dim in (64, 128)


def paged_splits(length: DimLike, page_len: int):
    """A paged cache's splits of a (row, KV head): one a page of ``length`` rows."""
    return ceildiv(length, page_len)


@register
class RaggedPartialMerge(BlockKind):
    """Inputs ``q, k_cache, v_cache, pos, slot, part, arrive[, pages]``: ``part`` (the partials) and ``arrive``
    (a counter per (row, KV head group)) are the op's own, ordered by its arrival counter; ``pages`` a paged
    cache's page table (``params["paged"]``); ``params["heads"]``: KV heads an instance (1 if absent)."""

    name = "ragged_partial_merge"
    cuda_file = "attention.cuh"
    last_writer = True  # a (row, KV head)'s splits all declare its output; the last to arrive writes it
    waits_in_body = True  # its cache rows start streaming into L2 while it waits (attention.cuh)

    def internal_inputs(self, op):
        return (5, 6)

    def build(self, inputs, output, params) -> Partition:
        q, kc = inputs[0], inputs[1]
        g, h = params["group"], params.get("heads", 1)
        kv = (Full(), Tile(1, h), Full(), Full())
        row = (Tile(0, 1),)
        return Partition(
            grid=(q.shape[0] * as_dim(params.get("active", 1)), ceildiv(kc.shape[1], h), params["splits"]),
            reads=((Tile(0, 1), Tile(1, g * h), Full()), kv, kv, row, row, (Full(), Full(), Full()), (Full(),),
                   *(((Full(), Full()),) if params.get("paged") else ())),
            writes=(Tile(0, 1), Tile(1, g * h), Full()),
        )

    def cpu(self, op, env, ins, out):
        # every split computes its (row, KV head)'s result, as the splits' partials then their merge (the
        # simulator lets readers in once all of them have run); P in f32 (the tensor-core body rounds it
        # to T for P.V: agreement to T's rounding)
        q, kc, vc, pos, slot = ins[:5]
        p = op.params
        where = CacheRows(op.kind, kc.shape, ins[7] if p.get("paged") else None)
        i, heads = env["_i0"], p.get("heads", 1)
        length, splits = p["length"].eval(env), p["splits"].eval(env)
        rows, sl = row_length(op, pos, slot, i, where, min(where.rows, length))
        chunk = where.page_len if p.get("paged") == "split" else -(-length // splits)
        k, v = where.sequence(kc, sl, rows), where.sequence(vc, sl, rows)
        for h in range(env["_i1"] * heads, min((env["_i1"] + 1) * heads, kc.shape[1])):
            parts = [partial(q[i], k, v, {**p, "chunk": chunk}, h, s, rows) for s in range(-(-rows // chunk))]
            part = torch.stack([torch.cat([num, m[:, None], l[:, None]], 1) for num, m, l in parts], 1)  # [G, S, D+2]
            out[i, h * p["group"] : (h + 1) * p["group"]] = merge(part).to(out.dtype)

    def bytes_moved(self, op, env):
        q, kc = op.inputs[0], op.inputs[1]
        rows = kc.shape[2].value * (op.inputs[7].shape[1].value if op.params.get("paged") else 1)  # a sequence's
        n = q.shape[0].eval(env) * as_dim(op.params.get("active", 1)).eval(env)  # (0: the other op of the pair runs)
        length = min(rows, op.params["length"].eval(env))
        hq, d = q.shape[1].value, q.shape[2].value
        splits = op.params["splits"].eval(env)  # (one split: the output straight from the block, no partials)
        partials = 2 * n * hq * splits * (d + 2) * 4 if splits > 1 else 0  # written, then read by the merge
        # (at most: rows attend less)
        return n * 2 * kc.shape[1].value * length * d * kc.dtype.itemsize + 2 * n * hq * d * q.dtype.itemsize + partials

    def cuda_call(self, op, ins, out):
        q, kc, vc, pos, slot, part, arrive = ins[:7]
        p = op.params
        d = op.inputs[0].shape[2].value
        hkv = op.inputs[1].shape[1].value
        pages = kv_pages(op, op.inputs[1].shape, ins, 7 if p.get("paged") else None)
        args = [("smem", "smem"), ("q", q.view()), ("kc", kc.view()), ("vc", vc.view()), ("pos", pos.view(0)),
                ("slot", slot.view(0)), ("pages", pages),
                ("length", p["length"].to_c(dimc)), ("splits", p["splits"].to_c(dimc)), ("Hkv", f"{hkv}LL"),
                ("scale", f"{float(p['scale'])!r}f"), ("part", f"(float*){part.ptr}"), ("arrive", f"(unsigned*){arrive.ptr}"),
                ("out", out.view(const=False)), ("c0", "c0"), ("c1", "c1"), ("c2", "c2"), ("wl", "wl")]
        paging = {None: 0, "split": 1, "rows": 2}[p.get("paged")]
        return c_call("ragged_partial_merge", [q.ctype, d, p["group"], paging, p.get("heads", 1)], args)


@term
class RaggedSplitTerm(Term):
    """Ragged attention as ``ragged_partial_merge``, splits of at least ``chunk`` cache rows."""

    name = "ragged_split"
    fields = fields("node:node chunk:int")
    tile = "chunk"

    def lower(self, b, value, args):
        n, chunk = b.graph.nodes[value], args["chunk"]
        q, kc, vc, pos, slot = (b.operand(i) for i in n.inputs[:5])
        pages = pages_of(n.inputs, 5)
        pos, slot = b.flat(pos), b.flat(slot)
        out = b.output(value)
        rows, hq, d = q.shape
        hkv, length = kc.shape[1].value, n.attrs["length"]
        group = hq.value // hkv
        params = {"length": length, "group": group, "scale": n.attrs["scale"]}
        if pages is not None and tensor_core_body(q.dtype, group, d.value):  # each row's page found by the body
            params["paged"] = "rows"
        if pages is None or params.get("paged") == "rows":
            # partials [rows * Hkv * splits, G, D + 2] in all (pairs * splits <= max(pairs, SPLIT_WAVE)): laid
            # out [rows, Hq, splits, D + 2] by the body
            params["splits"] = split_count(length, chunk, rows * hkv)
            part_rows = dmax(rows * hkv, SPLIT_WAVE)
            heads = heads_per_instance(hkv, tensor_core_body(q.dtype, group, d.value))
        else:  # a split a page: at most a sequence's pages a (row, KV head)
            params["splits"], params["paged"] = paged_splits(length, kc.shape[2].value), "split"
            part_rows = rows * hkv * b.graph.nodes[pages].shape[1].value
            heads = 1
        extra = [b.operand(pages)] if pages is not None else []

        def emit(tag: str, params: dict) -> None:  # (each op its own partials and arrival counters)
            part = b.scratch(f"ragged_part{value}{tag}", (part_rows, as_dim(group), as_dim(d.value + 2)), F32)
            arrive = b.accum(f"ragged_arrive{value}{tag}", (rows * hkv,), I32)
            b.emit("ragged_partial_merge", [value], [q, kc, vc, pos, slot, part, arrive, *extra], out, params)

        if heads == 1:
            emit("", params)
        else:  # one head an instance, or `heads` in one split where the rows fill a wave: one of the two runs
            on = grouped(rows, hkv, heads)
            emit("", {**params, "active": 1 - on})
            emit("_heads", {**params, "heads": heads, "splits": as_dim(1), "active": on})
