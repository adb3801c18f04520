"""all_reduce over the GPUs of a tensor-parallel group, as two block ops (interpreter/cuda/all_reduce.cuh).

``allreduce_send``: instance ``c`` stores tile ``c`` of this rank's ``x`` into row ``rank`` of the
``peer`` buffer ``recv [ranks, n]`` of EVERY rank (its own too), peer-to-peer over NVLink, then
signals a counter on every rank. ``allreduce_sum``: instance ``c`` waits until every rank's tile ``c``
has arrived in its own ``recv`` and writes their f32 sum, in rank order, rounded once.

The barrier derivation sees one rank's program: the send writes ``recv[rank, tile c]`` (``rank`` the
runtime symbol of the rank running it), the sum reads ``recv[:, tile c]``; because ``recv`` is a
``peer`` buffer, the counter family is a peer one: each rank counts every source rank's signals
apart, and the sum waits for each source (docs/parallel.md: the protocol and why it is sound).
"""

from __future__ import annotations

from ..dims import ceildiv, sym
from .base import BlockKind, Partition, Term, fields, register, term
from .footprint import At, Full, Tile

RANK = sym("rank")  # the rank running an instance (the kernel's args.rank; the simulator's device)


@register
class AllReduceSend(BlockKind):
    name = "allreduce_send"
    cuda_file = "all_reduce.cuh"

    def build(self, inputs, output, params) -> Partition:
        t = params["tile"]
        return Partition(grid=(ceildiv(inputs[0].shape[0], t),), reads=((Tile(0, t),),), writes=(At(RANK), Tile(0, t)))

    def cpu(self, op, env, ins, out):
        t, s = op.params["tile"], env["_i0"] * op.params["tile"]
        out[env["rank"], s : s + t] = ins[0][s : s + t]

    def bytes_moved(self, op, env):  # read once, stored to every rank
        n = op.inputs[0].shape[0].value * op.inputs[0].dtype.itemsize
        return n * (1 + op.params["ranks"])

    def cuda_call(self, op, ins, out):
        x, n = ins[0], op.inputs[0].shape[0].value
        args = [x.ptr, x.strides[0], out.ptr, f"{n}LL", f"{op.params['tile']}LL", "c0", "args.peers", "(int)D_rank"]
        return f"allreduce_send<{x.ctype}, {op.params['ranks']}>({', '.join(args)})"


@register
class AllReduceSum(BlockKind):
    name = "allreduce_sum"
    cuda_file = "all_reduce.cuh"

    def build(self, inputs, output, params) -> Partition:
        t = params["tile"]
        return Partition(grid=(ceildiv(output.shape[0], t),), reads=((Full(), Tile(0, t)),), writes=(Tile(0, t),))

    def cpu(self, op, env, ins, out):
        t, s = op.params["tile"], env["_i0"] * op.params["tile"]
        part = ins[0][:, s : s + t].float()
        total = part[0].clone()
        for r in range(1, part.shape[0]):  # rank order, as the CUDA body adds
            total += part[r]
        out[s : s + t] = total.to(out.dtype)

    def cuda_call(self, op, ins, out):
        recv, n = ins[0], op.output.shape[0].value
        args = [recv.ptr, out.ptr, out.strides[0], f"{n}LL", f"{op.params['tile']}LL", "c0"]
        return f"allreduce_sum<{out.ctype}, {op.params['ranks']}>({', '.join(args)})"


@term
class AllReduceTilesTerm(Term):
    """A tensor-parallel all-reduce: every rank sends its tiles to every rank, each sums what arrived."""

    name = "all_reduce_tiles"
    fields = fields("node:node tile:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        x = b.flat(b.operand(n.inputs[0]))
        out = b.flat(b.output(value))
        ranks, tile = n.attrs["ranks"], args["tile"]
        recv = b.peer(f"ar_recv{value}", (ranks, x.shape[0]), x.dtype)
        params = {"tile": tile, "ranks": ranks}
        b.emit("allreduce_send", [value], [x], recv, params)
        b.emit("allreduce_sum", [value], [recv], out, params)
