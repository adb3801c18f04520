"""all_reduce over the GPUs of a tensor-parallel group, as two block ops (interpreter/cuda/all_reduce.cuh).

``allreduce_send``: instance ``c`` stores tile ``c`` of this rank's ``x`` into row ``rank`` of the
``peer`` buffer ``recv [ranks, n]`` of EVERY rank (its own too), peer-to-peer over NVLink, then
signals a counter on every rank; ``x`` may be an f32 sum (a ``glu_down`` accumulator), rounded to
the dtype as it is sent. ``allreduce_sum``: instance ``c`` waits until every rank's tile ``c`` has
arrived in its own ``recv`` and writes their f32 sum, in rank order, rounded once; with a residual
``r``, ``T(r + T(sum))`` (the residual add of a row-parallel projection, one hop fewer).

The barrier derivation sees one rank's program: the send writes ``recv[rank, tile c]`` (``rank`` the
runtime symbol of the rank running it), the sum reads ``recv[:, tile c]``; because ``recv`` is a
``peer`` buffer, the counter family is a peer one: each rank counts every source rank's signals
apart, and the sum waits for each source (docs/parallel.md: the protocol and why it is sound).

all_gather is the same send, then ``allgather_copy``: instance ``c`` waits for tile ``c`` of every
rank, as the sum does, and copies the ``ranks`` tiles to their places in the output (rank ``d``'s at
``d * n``). Its consumers wait on that local op only: a consumer reading the gathered row straight
from ``recv`` would read one source's row, which a peer family (derived for rank 0) cannot name.
"""

from __future__ import annotations

from ..dims import ceildiv, sym
from .base import NONE, BlockKind, Partition, Term, c_call, fields, no_view, register, term
from ..ir.footprint import At, Full, Tile

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
        args = [("x", x.view(0)), ("recv", out.ptr), ("n", f"{n}LL"), ("tile", f"{op.params['tile']}LL"), ("c0", "c0"),
                ("peers", "args.peers"), ("rank", "(int)D_rank")]
        return c_call("allreduce_send", [x.ctype, out.ctype, op.params["ranks"]], args)


@register
class AllReduceSum(BlockKind):
    name = "allreduce_sum"
    cuda_file = "all_reduce.cuh"

    def build(self, inputs, output, params) -> Partition:
        t = params["tile"]
        reads = ((Full(), Tile(0, t)),) + (((Tile(0, t),),) if len(inputs) > 1 else ())
        return Partition(grid=(ceildiv(output.shape[0], t),), reads=reads, writes=(Tile(0, t),))

    def cpu(self, op, env, ins, out):
        t, s = op.params["tile"], env["_i0"] * op.params["tile"]
        part = ins[0][:, s : s + t].float()
        total = part[0].clone()
        for r in range(1, part.shape[0]):  # rank order, as the CUDA body adds
            total += part[r]
        if len(ins) > 1:  # the residual: r + T(sum)
            total = total.to(out.dtype).float() + ins[1][s : s + t].float()
        out[s : s + t] = total.to(out.dtype)

    def cuda_call(self, op, ins, out):
        recv, n = ins[0], op.output.shape[0].value
        r = ins[1] if len(ins) > 1 else None
        args = [("recv", recv.ptr), ("r", r.view(0) if r else no_view(1, out.ctype)), ("out", out.view(0, const=False)),
                ("n", f"{n}LL"), ("tile", f"{op.params['tile']}LL"), ("c0", "c0")]
        return c_call("allreduce_sum", [out.ctype, op.params["ranks"]], args)


@register
class AllGatherCopy(BlockKind):
    name = "allgather_copy"
    cuda_file = "all_reduce.cuh"

    def build(self, inputs, output, params) -> Partition:
        t = params["tile"]
        return Partition(grid=(ceildiv(inputs[0].shape[1], t),), reads=((Full(), Tile(0, t)),), writes=(Full(), Tile(0, t)))

    def cpu(self, op, env, ins, out):
        t, s = op.params["tile"], env["_i0"] * op.params["tile"]
        out[:, s : s + t] = ins[0][:, s : s + t]

    def cuda_call(self, op, ins, out):
        recv, n = ins[0], op.inputs[0].shape[1].value
        args = [("recv", recv.ptr), ("out", out.view(0, 1, const=False)), ("n", f"{n}LL"),
                ("tile", f"{op.params['tile']}LL"), ("c0", "c0")]
        return c_call("allgather_copy", [out.ctype, op.params["ranks"]], args)


@term
class AllReduceTilesTerm(Term):
    """A tensor-parallel all-reduce (graph node ``node``): every rank sends its tiles of ``x`` (or of
    the f32 sum ``xs``, rounded as sent) to every rank, each sums what arrived (plus the residual
    ``r`` when the term computes ``r + all_reduce(...)``)."""

    name = "all_reduce_tiles"
    fields = fields("x:ref xs:sum r:ref node:node tile:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[args["node"]]
        x = b.flat(b.sum(args["xs"]) if args["xs"] != NONE else b.operand(args["x"]))
        out = b.flat(b.output(value))
        ranks, tile = n.attrs["ranks"], args["tile"]
        recv = b.peer(f"ar_recv{args['node']}", (ranks, x.shape[0]), n.dtype)
        params = {"tile": tile, "ranks": ranks}
        b.emit("allreduce_send", [args["node"]], [x], recv, params)
        residual = [b.flat(b.operand(args["r"]))] if args["r"] != NONE else []
        b.emit("allreduce_sum", [value], [recv, *residual], out, params)


@term
class AllGatherTilesTerm(Term):
    """A tensor-parallel all-gather (graph node ``node``, one row): every rank sends its tiles to every
    rank, each copies what arrived into its output in rank order."""

    name = "all_gather_tiles"
    fields = fields("node:node tile:int")

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        x = b.flat(b.operand(n.inputs[0]))
        ranks, tile = n.attrs["ranks"], args["tile"]
        recv = b.peer(f"ag_recv{value}", (ranks, x.shape[0]), n.dtype)
        params = {"tile": tile, "ranks": ranks}
        b.emit("allreduce_send", [value], [x], recv, params)
        out = b.view(b.flat(b.output(value)), "reshape", (ranks, x.shape[0]))
        b.emit("allgather_copy", [value], [recv], out, params)
