"""kv_append: write ``new[Hkv, D]`` into row ``pos`` of a KV cache ``[Hkv, Smax, D]`` in place."""

from __future__ import annotations

from ..dims import as_dim
from .base import BlockKind, Partition, Term, c_call, dimc, fields, register, term
from ..ir.footprint import At, Full


@register
class KvAppend(BlockKind):
    name = "kv_append"
    cuda_file = "kv_append.cuh"

    def build(self, inputs, output, params) -> Partition:
        return Partition(grid=(as_dim(1),), reads=((Full(), Full()),),
                         writes=(Full(), At(params["pos"]), Full()))

    def cpu(self, op, env, ins, out):
        pos = op.params["pos"].eval(env)
        if not 0 <= pos < out.shape[1]:
            raise IndexError(f"kv_append: position {pos} outside the cache's {out.shape[1]} rows")
        out[:, pos, :] = ins[0]

    def bytes_moved(self, op, env):
        new = op.inputs[0]
        return 2 * new.shape[0].value * new.shape[1].value * new.dtype.itemsize  # one cache row per head

    def cuda_call(self, op, ins, out):
        new = ins[0]
        hkv, smax, d = (x.value for x in op.output.shape)
        args = [("src", new.view()), ("cache", out.view(const=False)), ("Hkv", f"{hkv}LL"), ("Smax", f"{smax}LL"),
                ("D", f"{d}LL"), ("pos", op.params["pos"].to_c(dimc))]
        return c_call("kv_append", [new.ctype], args)


@term
class KvAppendRowTerm(Term):
    """One new row written into a KV cache in place."""

    name = "kv_append_row"
    fields = fields("node:node")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        _cache, new = (b.operand(i) for i in n.inputs)
        b.emit("kv_append", [value], [new], b.operand(value), {"pos": n.attrs["pos"]})
