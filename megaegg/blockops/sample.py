"""sample: a token drawn from each row of ``logits[R, V]`` (``megaegg.sampling`` is the rule); one
row per instance. The per-row settings (temperature, top-k, top-p, seed, counter) are i32 / f32
vectors read at the instance's row. NaN logits (or a NaN temperature / top_p) are an error naming
the row (``sampling.NaNError`` here, MEGA_ERR_NAN / MEGA_ERR_NAN_SETTING in the CUDA body, which then
writes token 0)."""

from __future__ import annotations

from ..sampling import sample_row
from .base import BlockKind, Partition, Term, c_call, fields, register, term
from ..ir.footprint import Full, Tile


@register
class Sample(BlockKind):
    name = "sample"
    cuda_file = "sample.cuh"

    def build(self, inputs, output, params) -> Partition:
        row = (Tile(0, 1),)
        return Partition(grid=(inputs[0].shape[0],), reads=((Tile(0, 1), Full()), *[row] * 5), writes=row)

    def cpu(self, op, env, ins, out):
        logits, temperature, top_k, top_p, seed, counter = ins
        i = env["_i0"]
        out[i] = sample_row(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), int(seed[i]), int(counter[i]),
                            row=i, where=op.label)

    def bytes_moved(self, op, env):
        rows, vocab = (d.eval(env) for d in op.inputs[0].shape)
        return 12 * rows * vocab * op.inputs[0].dtype.itemsize  # (radix passes re-read the row)

    def cuda_call(self, op, ins, out):
        logits, temperature, top_k, top_p, seed, counter = ins
        args = [("smem", "smem"), ("logits", logits.view()), ("V", f"{op.inputs[0].shape[1].value}LL"),
                ("temperature", temperature.view()), ("top_k", top_k.view()), ("top_p", top_p.view()), ("seed", seed.view()),
                ("counter", counter.view()), ("out", out.view(const=False)), ("c0", "c0")]
        return c_call("sample_row", [logits.ctype], args)


@term
class SampleRowsTerm(Term):
    """A token drawn per row of logits, one row per instance."""

    name = "sample_rows"
    fields = fields("node:node")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        logits, *rest = (b.operand(i) for i in n.inputs)
        b.emit("sample", [value], [b.rows(logits), *(b.flat(o) for o in rest)], b.flat(b.output(value)), {})
