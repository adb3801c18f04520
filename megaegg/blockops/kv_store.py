"""kv_store: rows ``new[i] : [Hkv, D]`` written at position ``pos[i]`` of sequence slot ``slot[i]``
of a KV cache ``[slots, Hkv, max_len, D]``, in place (a batch of sequences, or a prompt's tokens).

Grid ``(Hkv,)``: instance ``h`` writes head ``h`` of every row. The rows' slots and positions
are data, so the write footprint covers every slot and position of the head (a reader of the
cache waits for the instance of its head, whatever rows it reads), and instances of different
heads never write the same element.
"""

from __future__ import annotations

from .base import BlockKind, Partition, Term, c_call, fields, register, term
from ..ir.footprint import Full, Tile


def row_index(op: str, what: str, value: int, hi: int) -> int:
    """``value`` checked to lie in ``[0, hi)``: an index read from a tensor at run time."""
    if not 0 <= value < hi:
        raise IndexError(f"{op}: {what} {value} outside [0, {hi - 1}]")
    return value


@register
class KvStore(BlockKind):
    name = "kv_store"
    cuda_file = "kv_store.cuh"

    def build(self, inputs, output, params) -> Partition:
        head = Tile(0, 1)
        return Partition(grid=(output.shape[1],), reads=((Full(), head, Full()), (Full(),), (Full(),)),
                         writes=(Full(), head, Full(), Full()))

    def cpu(self, op, env, ins, out):
        new, pos, slot = ins
        h = env["_i0"]
        for i in range(new.shape[0]):
            p = row_index("kv_store", "position", int(pos[i]), out.shape[2])
            s = row_index("kv_store", "slot", int(slot[i]), out.shape[0])
            out[s, h, p] = new[i, h]

    def bytes_moved(self, op, env):
        new = op.inputs[0]
        return 2 * new.shape[0].eval(env) * new.shape[1].value * new.shape[2].value * new.dtype.itemsize

    def cuda_call(self, op, ins, out):
        new, pos, slot = ins
        slots, _, max_len, d = (x.value for x in op.output.shape)
        args = [("src", new.view()), ("pos", pos.view()), ("slot", slot.view()), ("n", new.shape[0]),
                ("cache", out.view(const=False)), ("slots", f"{slots}LL"), ("max_len", f"{max_len}LL"), ("D", f"{d}LL"),
                ("c0", "c0")]
        return c_call("kv_store", [new.ctype], args)


@term
class KvStoreHeadsTerm(Term):
    """New KV rows written into the cache in place, one head per instance."""

    name = "kv_store_heads"
    fields = fields("node:node")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        _cache, new, pos, slot = (b.operand(i) for i in n.inputs)
        b.emit("kv_store", [value], [new, b.flat(pos), b.flat(slot)], b.operand(value), {})
