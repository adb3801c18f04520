"""ragged_flash: ragged attention over a prompt on tensor cores (``interpreter/cuda/flash.cuh``), the
prompt-side alternative to ``ragged_partial_merge`` (``ragged_attention.py``).

Instance ``(i, h)``: the ``BT = 128 // G`` rows ``[i*BT, i*BT + BT)`` of ``q [N, Hq, D]`` and the ``G``
query heads of KV head ``h``, 128 (row, head) pairs sharing K/V. Row ``r`` attends cache rows ``[0,
pos[r]]`` of slot ``slot[r]``: the instance runs one flash-attention pass (64 cache rows a block, online
softmax, QK^T and PV on ``mma.sync`` m16n8k16) per distinct slot of its rows, so the rows of one
prompt (one slot, consecutive positions) share every K/V block read. A tile of rows of different
sequences (decode rows) runs one pass per sequence: correct, but no faster than the split-KV path,
which the cost model picks for batches of such rows (``decode_like``).

With ``splits`` (the attention's ``sequences``: ``dmin(8, sequences)`` where the rows outnumber the cache
slots, a runtime dim), instance ``(i, h, c)`` runs the tile's passes ``c, c + splits, ...`` (numbered in
order of their slot's first row): a mixed step's tile of 32 decode rows runs its 32 passes on 8 SMs
instead of one. The instances of a tile share its rows (``last_writer``: each writes its passes' rows).
The cost: a tile of one prompt's rows runs its one pass in one of them, and the others wait for their
inputs, count the tile's slots and stop (a prompt alone, ``r`` = 1, has one split; several prompts in
one step pay this for every tile).

Fused (``ragged_flash_rope``): q read unrotated (the Q projection's rows) and rotated at its tokens'
positions as each instance loads it, after qwen3's q norm where there is one: the prompt's RoPE op and
its hand-off leave the layer's critical path (perf-notes #81). Its extra operands, by role: ``inv_freq``,
``pos_ids`` (each token's RoPE position) and ``g`` (the norm's weight).

Paged caches (``params["paged"]``: the page table after ``slot``): each cache row a pass copies is found
through the table (``kv_store.CacheRows``).
"""

from __future__ import annotations

import torch

from ..dims import ceildiv, dmax, dmin
from ..dtypes import bf16
from .base import NONE, BlockKind, Partition, Term, c_call, dimc, f32, fields, no_view, register, rms_normed, term
from ..ir.footprint import Full, Tile
from .kv_store import CacheRows, kv_pages, pages_of
from .ragged_attention import row_length
from .rope import hf_param, rotated

ROWS = 128  # (row, head) pairs an instance: 8 warps x 16
PASS_SPLITS = 8  # instances a tile's passes spread over, at most
BLOCK = 64  # the term's chunk field (the body streams K/V blocks of 64 or 128 cache rows: flash.cuh block_rows)
HEAD_DIMS = (64, 128)


def tokens_per_tile(group: int) -> int:
    return ROWS // group


@register
class RaggedFlash(BlockKind):
    name = "ragged_flash"
    cuda_file = "flash.cuh"
    longest_last = True  # (a prompt's later token tiles attend more rows)
    last_writer = True  # (with splits, a tile's instances share its rows: each writes its passes')

    def build(self, inputs, output, params) -> Partition:
        q, kc = inputs[0], inputs[1]
        g = params["group"]
        bt = tokens_per_tile(g)
        kv = (Full(), Tile(1, 1), Full(), Full())
        rows = (Tile(0, bt),)
        rope = {"inv_freq": (Full(),), "pos_ids": rows, "g": (Full(),)}
        grid = (ceildiv(q.shape[0], bt), kc.shape[1]) + ((params["splits"],) if "splits" in params else ())
        pages = ((Full(), Full()),) if params.get("paged") else ()
        return Partition(grid=grid,
                         reads=((Tile(0, bt), Tile(1, g), Full()), kv, kv, rows, rows, *pages,
                                *(rope[r] for r in params.get("rope", ()))),
                         writes=(Tile(0, bt), Tile(1, g), Full()))

    def cpu(self, op, env, ins, out):
        q, kc, vc, pos, slot = ins[:5]
        paged = int(bool(op.params.get("paged")))
        where = CacheRows(op.kind, kc.shape, ins[5] if paged else None)
        rope = dict(zip(op.params.get("rope", ()), ins[5 + paged:]))
        g = op.params["group"]
        bt = tokens_per_tile(g)
        i, h = env["_i0"], env["_i1"]
        heads = slice(h * g, (h + 1) * g)
        rows = range(i * bt, min(i * bt + bt, q.shape[0]))
        if "splits" in op.params:  # this instance's passes only: c, c + splits, ... by first row
            splits, passes = op.params["splits"].eval(env), {}
            for r in rows:
                passes.setdefault(row_length(op, pos, slot, r, where)[1], len(passes))
            rows = [r for r in rows if passes[row_length(op, pos, slot, r, where)[1]] % splits == env["_i2"]]
        for r in rows:
            length, s = row_length(op, pos, slot, r, where)
            k, v = f32(where.sequence(kc, s, length, h)), f32(where.sequence(vc, s, length, h))  # [L, D]
            qr = f32(q[r, heads])  # [G, D]
            if rope:
                if "g" in rope:
                    qr = rms_normed(qr, rope["g"], op.params["eps"], q.dtype)
                p = torch.full((qr.shape[0],), float(rope["pos_ids"][r]))
                qr = f32(rotated(qr, p, rope["inv_freq"], q.dtype, op.params.get("hf", False)))
            scores = qr @ k.T * op.params["scale"]  # [G, L]
            out[r, heads] = (torch.softmax(scores, -1) @ v).to(out.dtype)

    def bytes_moved(self, op, env):
        q, kc = op.inputs[0], op.inputs[1]
        n, length = q.shape[0].eval(env), min(sequence_rows(op), op.params["length"].eval(env))
        hkv, d = kc.shape[1].value, kc.shape[3].value
        tiles = -(-n // tokens_per_tile(op.params["group"]))
        passes = tiles * (tokens_per_tile(op.params["group"]) if decode_like(op, env) else 1)
        return passes * hkv * 2 * length * d * kc.dtype.itemsize + 2 * n * q.shape[1].value * d * q.dtype.itemsize

    def flops(self, op, env) -> float:
        q, kc = op.inputs[0], op.inputs[1]
        n, length = q.shape[0].eval(env), min(sequence_rows(op), op.params["length"].eval(env))
        tiles = -(-n // tokens_per_tile(op.params["group"])) * kc.shape[1].value
        passes = tokens_per_tile(op.params["group"]) if decode_like(op, env) else 1
        return 4.0 * tiles * passes * ROWS * length * kc.shape[3].value  # (causal rows skip blocks past them)

    def cuda_call(self, op, ins, out):
        q, kc, vc, pos, slot = ins[:5]
        p = op.params
        paged = int(bool(p.get("paged")))
        rope = dict(zip(p.get("rope", ()), ins[5 + paged:]))
        d = op.inputs[0].shape[2].value
        pages = kv_pages(op, op.inputs[1].shape, ins, 5 if paged else None)
        args = [("smem", "smem"), ("q", q.view()), ("kc", kc.view()), ("vc", vc.view()), ("pos", pos.view(0)),
                ("slot", slot.view(0)), ("N", q.shape[0]), ("pages", pages),
                ("scale", f"{float(p['scale'])!r}f"), ("out", out.view(const=False)), ("c0", "c0"), ("c1", "c1"),
                ("splits", p["splits"].to_c(dimc) if "splits" in p else "1LL"), ("c2", "c2" if "splits" in p else "0")]
        if not rope:
            return c_call("ragged_flash", [d, p["group"], "false", "false"], [*args, ("qr", "FlashQRope{}")])
        g = rope["g"].view() if "g" in rope else no_view(1, q.ctype)
        qr = f"FlashQRope{{{rope['inv_freq'].ptr}, {rope['pos_ids'].view(0)}, {g}, {float(p['eps'])!r}f}}"
        hf = ["true"] if p.get("hf") else []
        return c_call("ragged_flash", [d, p["group"], "true", "true" if "g" in rope else "false", *hf], [*args, ("qr", qr)])


def sequence_rows(op) -> int:
    """Rows a sequence of the op's caches holds (a paged cache: its page table's pages of rows)."""
    kc = op.inputs[1]
    return kc.shape[2].value * (op.inputs[5].shape[1].value if op.params.get("paged") else 1)


def cache_slots(op) -> int:
    """The sequences the op's caches hold: the cache's slots, or a paged cache's page table rows."""
    return op.inputs[5 if op.params.get("paged") else 1].shape[0].value


def pass_splits(node, q, slots: int) -> dict:
    """``{"splits": ...}`` where the attention says how many sequences its rows are of (``ragged_attention(...,
    sequences=)``): ``dmin(PASS_SPLITS, sequences)`` where the rows outnumber the cache slots (so some are a
    prompt's: a mixed step), else 1 (rows that may each be a sequence's are the split-KV path's, and the
    cost model prices them as one pass a row, ``decode_like``); else nothing (one instance a tile)."""
    seqs = node.attrs.get("sequences")
    if seqs is None:
        return {}
    more_rows_than_slots = dmin(1, dmax(0, q.shape[0] - slots))
    return {"splits": 1 + (dmin(PASS_SPLITS, dmax(1, seqs)) - 1) * more_rows_than_slots}


def decode_like(op, env) -> bool:
    """Whether the rows may each be another sequence's (no more rows than cache slots): then a tile
    runs a pass per row, and the cost model prices it so."""
    return op.inputs[0].shape[0].eval(env) <= cache_slots(op)


@term
class RaggedFlashTerm(Term):
    """Ragged attention as one flash-attention pass per tile of rows and KV head (``ragged_flash``)."""

    name = "ragged_flash"
    fields = fields("node:node chunk:int")
    tile = "chunk"
    min_rows = 64  # tokens: a decode batch keeps the split-KV path
    needs = "bf16, head dim 64 or 128, query heads a multiple of the KV heads"

    def fits(self, graph, args) -> bool:
        n = graph.nodes[args["node"]]
        q, kc = (graph.nodes[i] for i in n.inputs[:2])
        d = q.shape[-1]
        if args["chunk"] != BLOCK or q.dtype != bf16 or kc.dtype != bf16 or not d.is_const or d.value not in HEAD_DIMS:
            return False
        hq, hkv = q.shape[1], kc.shape[1]
        return hq.is_const and hkv.is_const and hq.value % hkv.value == 0 and hq.value // hkv.value <= ROWS

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        q, kc, vc, pos, slot = (b.operand(i) for i in n.inputs[:5])
        pages = paged_operands(b, n)
        group = q.shape[1].value // kc.shape[1].value
        params = {"group": group, "scale": n.attrs["scale"], "length": n.attrs["length"],
                  **pass_splits(n, q, node_slots(b.graph, n)), **({"paged": True} if pages else {})}
        b.emit("ragged_flash", [value], [q, kc, vc, b.flat(pos), b.flat(slot), *pages], b.output(value), params)


@term
class RaggedFlashRopeTerm(Term):
    """``ragged_flash`` of attention node ``node`` whose q is a RoPE (at positions from the i32 tensor ``pos``,
    frequencies ``inv``, ``hf`` rounding: a ``rope_ids``'s fields) of ``x`` [after a per-row RMSNorm(``g``)]:
    each instance rotates its q rows as it loads them."""

    name = "ragged_flash_rope"
    fields = fields("x:ref g:ref eps:float inv:ref pos:ref hf:int node:node")
    min_rows = RaggedFlashTerm.min_rows
    needs = RaggedFlashTerm.needs + ", q rotated at one position a token"

    def refs(self, graph, args):
        n = graph.nodes[args["node"]]
        return tuple(i for i in (args["x"], *n.inputs[1:], args["inv"], args["pos"], args["g"]) if i != NONE)

    def fits(self, graph, args) -> bool:
        q, x = graph.nodes[graph.nodes[args["node"]].inputs[0]], graph.nodes[args["x"]]
        return (RaggedFlashTerm().fits(graph, {"node": args["node"], "chunk": BLOCK}) and len(q.shape) == 3
                and x.shape == q.shape and x.dtype == q.dtype and len(graph.nodes[args["pos"]].shape) == 1
                and (args["g"] == NONE or graph.nodes[args["g"]].dtype == bf16))

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        kc, vc, pos, slot = (b.operand(i) for i in n.inputs[1:5])
        pages = paged_operands(b, n)
        rope = {"inv_freq": args["inv"], "pos_ids": args["pos"], "g": args["g"]}
        roles = tuple(k for k, v in rope.items() if v != NONE)
        group = n.shape[1].value // kc.shape[1].value
        x = b.operand(args["x"])
        params = {"group": group, "scale": n.attrs["scale"], "length": n.attrs["length"], "rope": roles,
                  "eps": args["eps"], **pass_splits(n, x, node_slots(b.graph, n)),
                  **({"paged": True} if pages else {}), **hf_param(args["hf"])}
        inputs = [x, kc, vc, b.flat(pos), b.flat(slot), *pages,
                  *(b.adjacent(b.operand(rope[k])) if k == "inv_freq" else b.flat(b.operand(rope[k])) if k == "pos_ids"
                    else b.operand(rope[k]) for k in roles)]
        refs = {args["x"], *n.inputs[1:], *(v for v in rope.values() if v != NONE)}
        b.emit("ragged_flash", b.absorbed(value, refs), inputs, b.output(value), params)


def paged_operands(b, n) -> list:
    """The attention node's page table as the block op's operand list (empty: a cache of slots)."""
    pages = pages_of(n.inputs, 5)
    return [b.operand(pages)] if pages is not None else []


def node_slots(graph, n) -> int:
    """The sequences an attention node's caches hold: the cache's slots or its page table's rows."""
    pages = pages_of(n.inputs, 5)
    return graph.nodes[pages if pages is not None else n.inputs[1]].shape[0].value
