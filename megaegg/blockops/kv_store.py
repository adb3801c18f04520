"""kv_store: rows ``new[i] : [Hkv, D]`` written at position ``pos[i]`` of sequence slot ``slot[i]``
of a KV cache ``[slots, Hkv, max_len, D]``, in place (a batch of sequences, or a prompt's tokens).

Grid ``(Hkv, ceil(N / ROWS))``: instance ``(h, j)`` writes head ``h`` of rows ``[j*ROWS, j*ROWS + ROWS)``.
The rows' slots and positions are data, so every instance of a head declares the head's whole cache
(a reader waits for all of them, whatever rows it reads: ``last_writer``, the elements are ready once
every declaring instance ran); the rows of one launch never share a (slot, position), so no element is
written twice.

Paged (the role ``pages``, an i32 page table ``[slots, max_pages]``): the cache is a pool of pages ``[pages,
Hkv, page_len, D]`` and position ``p`` of sequence ``s`` its row ``p % page_len`` of page ``pages[s, p //
page_len]`` (``CacheRows``: the one place that maps them, for the attention kinds too).

Fusion (operand roles in ``params["roles"]``, after ``new, pos, slot``): ``inv_freq`` and ``pos_ids``
a RoPE prologue (row ``i`` rotated at ``pos_ids[i]``, as the ``rope`` kind does, ``params["hf"]`` its
rounding), with ``g`` a per-head RMSNorm before it (qwen3's k norm): the K projection's rows go into the
cache with no RoPE op between.
"""

from __future__ import annotations

import torch

from ..dims import ceildiv
from .base import NONE, BlockKind, Partition, Term, c_call, f32, fields, no_view, register, rms_normed, term
from ..ir.footprint import Full, Tile
from .rope import hf_param, rope_input, rotated

ROLES = ("new", "pos", "slot")  # a plain store's operands
ROWS = 64  # rows an instance (a prompt's 2048 rows: 32 instances a head, each a round trip of loads)


def row_index(op: str, what: str, value: int, hi: int) -> int:
    """``value`` checked to lie in ``[0, hi)``: an index read from a tensor at run time."""
    if not 0 <= value < hi:
        raise IndexError(f"{op}: {what} {value} outside [0, {hi - 1}]")
    return value


def roles(op) -> dict[str, int]:
    return {r: k for k, r in enumerate(op.params.get("roles", ROLES))}


class CacheRows:
    """Where a sequence's rows of a cache are (``ops.kv_store``): ``cache[slot, :, position]``, or through a
    page table row ``position % page_len`` of page ``pages[slot, position // page_len]``; indices checked
    (``row_index``: an IndexError naming the op)."""

    def __init__(self, op: str, cache_shape, pages=None):
        self.op, self.pages = op, None if pages is None else pages.tolist()
        self.page_len, self.count = cache_shape[2], cache_shape[0]
        self.slots = self.count if self.pages is None else len(self.pages)
        self.rows = self.page_len * (1 if self.pages is None else len(self.pages[0]))  # a sequence's rows

    def at(self, s: int, p: int) -> tuple[int, int]:
        """(index along the cache's first dim, row) of position ``p`` of sequence ``s`` (both checked before)."""
        if self.pages is None:
            return s, p
        return row_index(self.op, "page", self.pages[s][p // self.page_len], self.count), p % self.page_len

    def sequence(self, cache, s: int, length: int, head=slice(None)):
        """Rows ``[0, length)`` of sequence ``s`` (of KV head ``head``: ``[length, D]``; all: ``[Hkv, length, D]``)."""
        if self.pages is None:
            return cache[s, head, :length]
        for j in range(-(-length // self.page_len)):  # (each page checked)
            self.at(s, j * self.page_len)
        pos = torch.arange(length)
        pages = torch.tensor(self.pages[s], dtype=torch.long)[pos // self.page_len]
        rows = cache[pages, :, pos % self.page_len]  # [L, Hkv, D]
        return rows[:, head].movedim(0, -2)


def kv_pages(op, cache_shape, ins, index: int | None) -> str:
    """The bodies' ``KvPages`` argument (kv_store.cuh) of the page table ``ins[index]`` (None: a cache of
    slots): the table, the sequences, a sequence's rows, the rows of a page, the pool's pages (or slots)."""
    count, _, page_len, _ = (d.value for d in cache_shape)
    if index is None:
        return f"KvPages{{Mat<const int>{{}}, {count}LL, {page_len}LL, {page_len}LL, {count}LL}}"
    slots, per_seq = (d.value for d in op.inputs[index].shape)
    return f"KvPages{{{ins[index].view()}, {slots}LL, {per_seq * page_len}LL, {page_len}LL, {count}LL}}"


def pages_of(node_inputs: tuple, first: int):
    """A cache op's page table node (its input past ``first``), or None."""
    return node_inputs[first] if len(node_inputs) > first else None


@register
class KvStore(BlockKind):
    name = "kv_store"
    cuda_file = "kv_store.cuh"
    last_writer = True  # a head's row tiles all declare the head's cache

    def build(self, inputs, output, params) -> Partition:
        head, rows = Tile(0, 1), Tile(1, ROWS)  # grid axis 0: heads, 1: row tiles
        extra = tuple((Full(),) * len(i.shape) for i in inputs[3:])  # pages, inv_freq, pos_ids, g
        return Partition(grid=(output.shape[1], ceildiv(inputs[0].shape[0], ROWS)),
                         reads=((rows, head, Full()), (rows,), (rows,), *extra), writes=(Full(), head, Full(), Full()))

    def cpu(self, op, env, ins, out):
        k = roles(op)
        new, pos, slot = (ins[k[r]] for r in ROLES)
        h, r0 = env["_i0"], env["_i1"] * ROWS
        new, pos, slot = new[r0 : r0 + ROWS], pos[r0 : r0 + ROWS], slot[r0 : r0 + ROWS]
        rows = new[:, h]
        if "inv_freq" in k:  # RoPE (after the head's RMSNorm) as the rope kind rounds
            x = f32(rows)
            if "g" in k:
                x = rms_normed(x, ins[k["g"]], op.params["eps"], out.dtype)
            rows = rotated(x, ins[k["pos_ids"]][r0 : r0 + ROWS].long().float(), ins[k["inv_freq"]], out.dtype,
                           op.params.get("hf", False))
        where = CacheRows("kv_store", out.shape, ins[k["pages"]] if "pages" in k else None)
        for i in range(new.shape[0]):
            p = row_index("kv_store", "position", int(pos[i]), where.rows)
            s = row_index("kv_store", "slot", int(slot[i]), where.slots)
            page, row = where.at(s, p)
            out[page, h, row] = rows[i]

    def bytes_moved(self, op, env):
        new = op.inputs[0]
        return 2 * new.shape[0].eval(env) * new.shape[1].value * new.shape[2].value * new.dtype.itemsize

    def cuda_call(self, op, ins, out):
        k = roles(op)
        new, pos, slot = (ins[k[r]] for r in ROLES)
        d = op.output.shape[3].value
        args = [("src", new.view()), ("pos", pos.view()), ("slot", slot.view()), ("n", new.shape[0])]
        pages = kv_pages(op, op.output.shape, ins, k.get("pages"))
        if "inv_freq" in k:
            g = ins[k["g"]].view() if "g" in k else no_view(1, new.ctype)
            args += [("inv_freq", ins[k["inv_freq"]].ptr), ("pos_ids", ins[k["pos_ids"]].view()), ("g", g),
                     ("eps", f"{float(op.params.get('eps', 0.0))!r}f")]
        args += [("cache", out.view(const=False)), ("pages", pages)]
        if "inv_freq" in k:
            return c_call("kv_store_rope", [new.ctype, d, "true" if "g" in k else "false", ROWS,
                                            *(["true"] if op.params.get("hf") else [])],
                          [*args, ("c0", "c0"), ("c1", "c1")])
        return c_call("kv_store", [new.ctype], [*args, ("D", f"{d}LL"), ("rows_per", str(ROWS)), ("c0", "c0"), ("c1", "c1")])


@term
class KvStoreHeadsTerm(Term):
    """New KV rows written into the cache in place, a head of 64 rows per instance."""

    name = "kv_store_heads"
    fields = fields("node:node")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        new, pos, slot = (b.operand(i) for i in n.inputs[1:4])
        pages = pages_of(n.inputs, 4)
        if pages is None:
            b.emit("kv_store", [value], [new, b.flat(pos), b.flat(slot)], b.operand(value), {})
        else:
            b.emit("kv_store", [value], [new, b.flat(pos), b.flat(slot), b.operand(pages)], b.operand(value),
                   {"roles": (*ROLES, "pages")})


@term
class KvStoreRopeTerm(Term):
    """The ``kv_store`` node ``store`` of a RoPE (at positions from the i32 tensor ``pos``, frequencies ``inv``,
    ``hf`` rounding: a ``rope_ids``'s fields) of ``x`` [after a per-row RMSNorm(``g``)]: the rows rotated as
    they are stored, a head of 64 rows per instance."""

    name = "kv_store_rope"
    fields = fields("x:ref g:ref eps:float inv:ref pos:ref hf:int store:node")

    def refs(self, graph, args):
        s = graph.nodes[args["store"]]
        cache, _new, pos, slot = s.inputs[:4]
        return tuple(i for i in (args["x"], args["g"], args["inv"], args["pos"], cache, pos, slot, pages_of(s.inputs, 4))
                     if i not in (NONE, None))

    def lower(self, b, value, args):
        s = b.graph.nodes[value]
        _cache, new, pos, slot = s.inputs[:4]
        operands = {"new": args["x"], "pos": pos, "slot": slot, "pages": pages_of(s.inputs, 4), "inv_freq": args["inv"],
                    "pos_ids": args["pos"], "g": args["g"]}
        present = tuple(k for k, v in operands.items() if v not in (NONE, None))
        inputs = [rope_input(b, args["x"], new) if k == "new" else
                  b.adjacent(b.operand(operands[k])) if k == "inv_freq" else
                  b.flat(b.operand(operands[k])) if k in ("pos", "slot", "pos_ids") else b.operand(operands[k])
                  for k in present]
        params = {"roles": present, "eps": args["eps"], **hf_param(args["hf"])}
        b.emit("kv_store", b.absorbed(value, {operands[k] for k in present}), inputs, b.operand(value), params)
