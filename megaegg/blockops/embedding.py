"""embedding: ``out[t, :] = table[ids[t], :]``, one row per instance."""

from __future__ import annotations

from .base import BlockKind, Partition, Term, c_call, fields, register, term
from ..ir.footprint import Full, Tile


@register
class Embedding(BlockKind):
    name = "embedding"
    cuda_file = "embedding.cuh"

    def build(self, inputs, output, params) -> Partition:
        return Partition(grid=(inputs[1].shape[0],), reads=((Full(), Full()), (Tile(0, 1),)), writes=(Tile(0, 1), Full()))

    def cpu(self, op, env, ins, out):
        t = env["_i0"]
        row = int(ins[1][t].item())
        if not 0 <= row < ins[0].shape[0]:
            raise IndexError(f"embedding: token id {row} outside the table's {ins[0].shape[0]} rows")
        out[t] = ins[0][row]

    def bytes_moved(self, op, env):
        rows = op.inputs[1].shape[0].eval(env)
        return 2 * rows * op.output.shape[1].value * op.output.dtype.itemsize  # one table row in, one out

    def cuda_call(self, op, ins, out):
        table, ids = ins
        d = op.inputs[0].shape[1].value
        # (the table may be an activation of runtime rows: a gather of chosen rows)
        args = [("table", table.view()), ("ids", ids.view()), ("V", f"({table.shape[0]})"), ("D", f"{d}LL"),
                ("out", out.view(const=False)), ("c0", "c0")]
        return c_call("embedding_row", [table.ctype, ids.ctype], args)


@term
class EmbeddingRowsTerm(Term):
    """Table rows gathered by id, one row per instance."""

    name = "embedding_rows"
    fields = fields("node:node")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        table, ids = (b.operand(i) for i in n.inputs)
        b.emit("embedding", [value], [table, b.flat(ids)], b.rows(b.output(value)), {})
