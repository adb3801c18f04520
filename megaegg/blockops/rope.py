"""rope: rotate-half rotary embedding of ``x[rows, D]`` rows; ``inv_freq[D/2]`` (f32).

The position is a runtime dim (``params["pos"]``) or, with a third operand, an i32
tensor giving the position of each group of ``params["group"]`` consecutive rows.
"""

from __future__ import annotations

import torch

from ..dims import ceildiv
from .base import BlockKind, Partition, dimc, f32, register
from .footprint import Full, Tile


@register
class Rope(BlockKind):
    name = "rope"
    cuda_file = "rope.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows_per"]
        tile = (Tile(0, rows), Full())
        reads = [tile, (Full(),)]
        if len(inputs) == 3:
            reads.append((Full(),))
        return Partition(grid=(ceildiv(inputs[0].shape[0], rows),), reads=tuple(reads), writes=tile)

    def cpu(self, op, env, ins, out):
        rows = op.params["rows_per"]
        r0 = env["_i0"] * rows
        x = f32(ins[0][r0 : r0 + rows])
        n = x.shape[0]
        if len(ins) == 3:
            pos = ins[2].long()[(torch.arange(r0, r0 + n) // op.params["group"])].float()
        else:
            pos = torch.full((n,), float(op.params["pos"].eval(env)))
        ang = pos[:, None] * ins[1].float()[None, :]
        cos, sin = ang.cos(), ang.sin()
        h = x.shape[1] // 2
        x1, x2 = x[:, :h], x[:, h:]
        out[r0 : r0 + n] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(out.dtype)

    def cuda_call(self, op, ins, out):
        x, inv = ins[0], ins[1]
        p = op.params
        pos_ids = [ins[2].ptr, ins[2].strides[0]] if len(ins) == 3 else ["nullptr", "0"]
        pos = p["pos"].to_c(dimc) if p.get("pos") is not None else "0"
        args = [
            x.ptr, x.strides[0], x.strides[1], inv.ptr,
            *pos_ids, pos, f"{p.get('group', 1)}LL",
            out.ptr, out.strides[0], out.strides[1],
            op.inputs[0].shape[0].to_c(dimc), str(p["rows_per"]), "c0",
        ]
        return f"rope_rows<{x.ctype}, {op.inputs[0].shape[1].value}>({', '.join(args)})"
