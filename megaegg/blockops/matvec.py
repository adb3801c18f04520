"""matvec: ``out[M, N] = x[M, K] @ w[N, K]^T`` with R rows of ``w`` per instance.

Fusion options (operand roles in ``params["roles"]``): ``g`` an RMSNorm prologue on
``x`` (weight ``g[K]``, ``eps``); ``w2`` a gated pair, ``out = silu(x w^T) * (x w2^T)``;
``r`` a residual epilogue, ``out = r + x w^T``. Rounding follows the unfused ops:
each fused stage rounds to the storage dtype, as the reference executor does.
"""

from __future__ import annotations

import torch

from ..dims import ceildiv
from .base import BlockKind, CudaOperand, Partition, f32, register
from .footprint import Full, Tile


def roles(op) -> dict[str, int]:
    return {r: k for k, r in enumerate(op.params["roles"])}


@register
class MatVec(BlockKind):
    name = "matvec"
    cuda_file = "matvec.cuh"

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows"]
        tile_n = (Full(), Tile(0, rows))  # [M, N]: all M, R rows of N
        reads = []
        for role in params["roles"]:
            if role in ("w", "w2"):
                reads.append((Tile(0, rows), Full()))
            elif role == "r":
                reads.append(tile_n)
            else:  # x, g: read whole
                reads.append(tuple(Full() for _ in inputs[len(reads)].shape))
        return Partition(grid=(ceildiv(inputs[1].shape[0], rows),), reads=tuple(reads), writes=tile_n)

    def cpu(self, op, env, ins, out):
        k = roles(op)
        dt = out.dtype
        rows = op.params["rows"]
        r0 = env["_i0"] * rows
        r1 = min(r0 + rows, ins[k["w"]].shape[0])
        x = f32(ins[k["x"]])
        if "g" in k:
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + op.params["eps"])).to(dt).float()
            x = (x * f32(ins[k["g"]])).to(dt).float()
        y = (x @ f32(ins[k["w"]][r0:r1]).T).to(dt)
        if "w2" in k:
            up = (x @ f32(ins[k["w2"]][r0:r1]).T).to(dt)
            y = (torch.nn.functional.silu(y.float()).to(dt).float() * up.float()).to(dt)
        if "r" in k:
            y = (f32(ins[k["r"]][:, r0:r1]) + y.float()).to(dt)
        out[:, r0:r1] = y

    def cuda_call(self, op, ins, out: CudaOperand) -> str:
        k = roles(op)
        p = op.params
        x, w = ins[k["x"]], ins[k["w"]]

        def optional(role: str, n_strides: int) -> list[str]:  # absent operands: nullptr, zero strides
            if role not in k:
                return ["nullptr"] + ["0"] * n_strides
            o = ins[k[role]]
            return [o.ptr, *o.strides[:n_strides]]

        m = op.inputs[k["x"]].shape[0].value
        kdim = op.inputs[k["w"]].shape[1].value
        n = op.inputs[k["w"]].shape[0].value
        flags = ", ".join("true" if role in k else "false" for role in ("g", "w2", "r"))
        args = [
            "smem",
            x.ptr, x.strides[0], x.strides[1],
            *optional("g", 1), f"{float(p.get('eps', 0.0))!r}f",
            w.ptr, w.strides[0], w.strides[1],
            *optional("w2", 2),
            *optional("r", 2),
            out.ptr, out.strides[0], out.strides[1],
            f"{n}LL", "c0",
        ]
        return f"matvec<{x.ctype}, {m}, {kdim}, {p['rows']}, {flags}>({', '.join(args)})"

    def bytes_moved(self, op, env):
        k = roles(op)
        n_inst = op.grid[0].eval(env)
        w_bytes = sum(op.inputs[k[r]].shape[0].value * op.inputs[k[r]].shape[1].value * op.inputs[k[r]].dtype.itemsize
                      for r in ("w", "w2") if r in k)
        x = op.inputs[k["x"]]
        x_bytes = x.shape[0].value * x.shape[1].value * x.dtype.itemsize
        out_bytes = op.output.shape[0].value * op.output.shape[1].value * op.output.dtype.itemsize
        return w_bytes + n_inst * x_bytes + out_bytes * (2 if "r" in k else 1)
