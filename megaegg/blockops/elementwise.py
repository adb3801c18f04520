"""elementwise: ``out = fn(a[, b])`` over operands of the output's shape (broadcasts are
stride-0 views); tiles of ``tile`` elements along dim ``axis``. ``fn`` also covers
``copy`` (materialize a view, or write one piece of a concat)."""

from __future__ import annotations

import torch

from ..dims import ceildiv
from .base import BlockKind, Partition, dimc, f32, register
from .footprint import Full, Tile

FUNCTIONS = {
    "copy": lambda a: a,
    "cast": lambda a: a,
    "silu": lambda a: torch.nn.functional.silu(a),
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
}


@register
class Elementwise(BlockKind):
    name = "elementwise"
    cuda_file = "elementwise.cuh"

    def build(self, inputs, output, params) -> Partition:
        axis, tile = params["axis"], params["tile"]
        fp = tuple(Tile(0, tile) if d == axis else Full() for d in range(len(output.shape)))
        grid = (ceildiv(output.shape[axis], tile),) if output.shape else ()
        return Partition(grid=grid, reads=tuple(fp for _ in inputs), writes=fp)

    def cpu(self, op, env, ins, out):
        if not out.dim():
            out.copy_(FUNCTIONS[op.params["fn"]](*(f32(t) for t in ins)).to(out.dtype))
            return
        axis, tile = op.params["axis"], op.params["tile"]
        s = env["_i0"] * tile
        idx = (slice(None),) * axis + (slice(s, s + tile),)
        args = [f32(t[idx]) for t in ins]
        out[idx] = FUNCTIONS[op.params["fn"]](*args).to(out.dtype)

    def cuda_call(self, op, ins, out):
        nd = len(op.output.shape)
        if nd > 4:
            raise NotImplementedError(f"elementwise: the CUDA body takes at most 4 dims, op{op.id} has {nd}")

        def idx(values) -> str:  # a scalar output is one element of a 1-d tile
            return f"Idx4{{{', '.join(values) or '0'}}}"

        shape = [d.to_c(dimc) for d in op.output.shape] or ["1"]
        types = ", ".join([out.ctype] + [o.ctype for o in ins])
        args = [idx(shape), str(op.params["axis"]), f"{op.params['tile']}LL", "c0", out.ptr, idx(out.strides)]
        for o in ins:
            args += [o.ptr, idx(o.strides)]
        return f"elementwise<Ew{op.params['fn'].capitalize()}, {max(nd, 1)}, {types}>({', '.join(args)})"
