"""Routed experts over a runtime number of rows (a batch, a prompt: ``moe_mlp`` in the step graph),
grouped by expert so that each chosen expert's weights are read once a launch, not once a row.

Both ops work in one buffer of the op's own, ``state [n, W]`` f32: columns ``[0, N)`` the rows' f32 sum
(what ``moe_glu_down`` keeps in an ``accum`` buffer for its one row), ``[N, N + top_k)`` the routing
weights, ``[N + top_k, N + 2 * top_k)`` the expert ids (exact in f32), ``W`` rounded up to 4 columns (16-byte
rows for the vector atomics). Why not an ``accum`` sum: the counter bank is zeroed whole every launch at
its largest size, and ``[max rows, N]`` a layer a row band is qwen3-30b-a3b's 769 MB at 512 rows; here the
routing zeroes the launch's rows only.

``moe_route``: instance ``t`` routes rows ``[t*rows_per, ...)`` from the router's logits
(``reference.moe_routing``: softmax in f32, the ``top_k`` largest, ties to the lower expert, the optional
renormalisation, rounded to the model's dtype) and zeroes their sums. NaN logits are an error naming the
row (MEGA_ERR_NAN in the CUDA body).

``moe_experts``: instance ``(b, t)`` takes block ``b`` of the routed rows: the experts in increasing id
order, each one's rows (at most one hit a row: a row's experts are distinct) in row order, cut into blocks
of ``block`` rows (past the last block: nothing to do); for them it computes rows ``[t*rows, ...)`` of the
expert's gated MLP (RMSNorm prologue when fused) and adds ``p_r * h[tile] @ wd_t[e][tile, :]`` into row
``r``'s sum, as ``moe_glu_down`` does for one row. Its grid is ``ceildiv(n * top_k, block) + min(E, n *
top_k)`` (a bound on the blocks: each expert's last one may be partial) by the MLP's row tiles. It waits
for the whole route (which experts, which rows is data; the sums zeroed) and the whole of x.

Why grouped: a prompt of 512 rows routes ~4000 (row, expert) pairs to 128 experts; per pair the
weights would be read ~32 times each. Here an expert's tile is read from HBM about once and from L2 once
a block; and a block is one tensor-core tile (bf16 / f16: ``block`` 16, or 8 where 16 normalised x rows
do not stage), h and the down projection on ``mma.sync``, as vLLM's fused MoE cuts an expert's rows into
tiles. Blocks, not one instance an expert: an expert that many rows chose (random weights route most of a
prompt to a few) is spread over many SMs. Elsewhere (f32, odd K) CUDA cores, ``EXPERT_ROWS`` rows a pass.
"""

from __future__ import annotations

import math

import torch

from ..dims import ceildiv, dmin
from ..dtypes import as_dtype, f32
from ..ir.footprint import Full, Tile
from ..reference import expert_mlp, moe_routing
from ..sampling import NaNError
from .base import NONE, BlockKind, Partition, c_call, dimc, no_view, register, rms_normed, term
from .matvec import roles, staged_rows
from .moe import MoeRoundedTerm, MoeSumTerm, expert_rows_fit, expert_weight

ROUTE_ROWS = 8  # rows a routing instance: one a warp (moe_rows.cuh)
ROUTE_FLOATS = 2048  # a routing warp's E probabilities and 2 * top_k picks in shared memory (8 warps: 64 KB)
EXPERT_ROWS = 4  # x rows the CUDA-core body stages and multiplies at a time (M: the batch matvec body's)
CUDA_CORE_BLOCK = 16  # rows of one expert an instance takes on CUDA cores (EXPERT_ROWS a pass)
NEEDS = (f"several x rows, expert weights that are graph weights (or row slices of one) with 16-byte rows, experts + 2 * top_k "
         f"at most {ROUTE_FLOATS}")


def expert_block(k_dim: int, dtype, *, norm: bool) -> tuple[int, bool]:
    """(rows of one expert an instance takes, whether on tensor cores): bf16 / f16 with K in 32-column blocks
    take one tensor-core tile of x rows as the staged matvec body does (matvec.staged_rows: 16, or 8); else
    CUDA cores."""
    rows = staged_rows(k_dim, dtype, norm=norm) if dtype.name in ("bf16", "f16") and k_dim % 32 == 0 else 0
    return (rows, True) if rows else (CUDA_CORE_BLOCK, False)


def routed_blocks(ids: torch.Tensor, block: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The blocks of routed rows, in instance order: (expert, its rows, their slots) for each ``block`` rows of
    each expert any row chose, the experts in increasing id order and each one's rows in row order."""
    out = []
    for e in torch.unique(ids).tolist():  # sorted
        rows, slots = (ids == e).nonzero(as_tuple=True)  # row order, one slot a row
        out += [(e, rows[i : i + block], slots[i : i + block]) for i in range(0, rows.numel(), block)]
    return out


def state_width(n: int, top_k: int) -> int:
    """Columns of the state buffer: the sum's ``n``, then the weights and ids, rounded up to whole 16-byte vectors."""
    return -(-(n + 2 * top_k) // 4) * 4


@register
class MoeRoute(BlockKind):
    name = "moe_route"
    cuda_file = "moe_rows.cuh"

    def build(self, inputs, output, params) -> Partition:
        per = params["rows_per"]
        return Partition(grid=(ceildiv(inputs[0].shape[0], per),), reads=((Tile(0, per), Full()),),
                         writes=(Tile(0, per), Full()))

    def cpu(self, op, env, ins, out):
        p = op.params
        r0, n, k = env["_i0"] * p["rows_per"], p["sum"], p["top_k"]
        logits = ins[0][r0 : r0 + p["rows_per"]]
        bad = torch.isnan(logits.float()).any(-1).nonzero()
        if bad.numel():
            raise NaNError(f"NaN router logits in row {r0 + int(bad[0])} of {op.label}")
        weight, ids = moe_routing(logits, k, p["normalize"], as_dtype(p["dtype"]).torch)
        rows = out[r0 : r0 + p["rows_per"]]
        rows.zero_()  # (the sums, and the padding)
        rows[:, n : n + k] = weight.float()
        rows[:, n + k : n + 2 * k] = ids.float()

    def cuda_call(self, op, ins, out) -> str:
        (logits,), p = ins, op.params
        args = [("smem", "smem"), ("logits", logits.view()), ("E", str(op.inputs[0].shape[1].value)),
                ("top_k", str(p["top_k"])), ("normalize", "true" if p["normalize"] else "false"),
                ("state", out.view(const=False)), ("N", str(p["sum"])), ("W", str(op.output.shape[1].value)),
                ("n", op.inputs[0].shape[0].to_c(dimc)), ("rows_per", str(p["rows_per"])), ("c0", "c0")]
        return c_call("moe_route", [as_dtype(p["dtype"]).c_type, logits.ctype], args)


@register
class MoeExperts(BlockKind):
    name = "moe_experts"
    cuda_file = "moe_rows.cuh"
    accumulates = True  # every instance adds its rows' share into the sum
    last_writer = True  # (its instances share the sum, ready once all of them have added: the routing zeroed it)

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows"]
        expert_tile = (Full(), Tile(1, rows), Full())  # [E, F, K]: any expert, this instance's rows
        reads = tuple({"x": (Full(), Full()), "g": (Full(),), "route": (Full(), Full(), Full())}.get(role, expert_tile)
                      for role in params["roles"])
        experts, f = inputs[list(params["roles"]).index("w")].shape[:2]
        picks = output.shape[0] * params["top_k"]
        blocks = ceildiv(picks, params["block"]) + dmin(experts, picks)  # each chosen expert's last block partial, at most
        return Partition(grid=(blocks, ceildiv(f, rows)), reads=reads, writes=(Full(), Full()))

    def cpu(self, op, env, ins, out):
        k, p = roles(op), op.params
        dt = op.inputs[k["w"]].dtype.torch
        route = ins[k["route"]]  # [n, 2, top_k]: weights, ids
        blocks = routed_blocks(route[:, 1].long(), p["block"])
        if env["_i0"] >= len(blocks):
            return
        e, rows, slots = blocks[env["_i0"]]
        tile = slice(env["_i1"] * p["rows"], env["_i1"] * p["rows"] + p["rows"])
        x = ins[k["x"]][rows].float()
        if "g" in k:
            x = rms_normed(x, ins[k["g"]], p["eps"], dt)
        h = expert_mlp(x, ins[k["w"]][e][tile], ins[k["w2"]][e][tile], dt)
        out.index_add_(0, rows, route[rows, 0, slots][:, None] * (h @ ins[k["wd"]][e][tile].float()))

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, route, w, w2, wd = (ins[k[r]] for r in ("x", "route", "w", "w2", "wd"))
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        experts, f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[2].value
        args = [("smem", "smem"), ("x", x.view()), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"),
                ("route", route.view()), ("n", op.inputs[k["x"]].shape[0].to_c(dimc)), ("E", str(experts)),
                ("top_k", str(p["top_k"])), ("w", w.view()), ("w2", w2.view()), ("wd", wd.view()),
                ("acc", out.view(const=False)), ("F", f"{f}LL"), ("b", "c0"), ("n_tile", "c1")]
        norm = "true" if "g" in k else "false"
        mma = "true" if p["mma"] else "false"
        return c_call("moe_experts", [x.ctype, EXPERT_ROWS, p["block"], mma, kdim, n, p["rows"], norm], args)

    def bytes_moved(self, op, env):
        """The experts the rows likely chose (each of ``n * top_k`` picks a uniformly random expert: the expected
        number of distinct ones), each read once; plus every hit's x row and sum row, per row tile."""
        k, p = roles(op), op.params
        experts, f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[2].value
        item = op.inputs[k["w"]].dtype.itemsize
        rows = op.inputs[k["x"]].shape[0].eval(env)
        used = experts * (1 - (1 - p["top_k"] / experts) ** rows)
        hits = rows * p["top_k"] * op.grid[1].eval(env)
        return int(used * (2 * f * kdim + f * n) * item + hits * (kdim * item + n * 4))


def _fits(graph, args) -> bool:
    """Rows of x that are not one constant row (that is ``moe_glu_down``'s), expert weights read as rows of
    16 bytes, and a routing warp's probabilities in shared memory."""
    xs = graph.nodes[args["x"]].shape
    if all(d.is_const for d in xs) and math.prod(d.value for d in xs[:-1]) == 1:
        return False
    if not all(expert_weight(graph, args[r]) for r in ("w", "w2")) or graph.nodes[args["wd"]].op != "weight":
        return False
    experts, _, kdim = (d.value for d in graph.nodes[args["w"]].shape)
    top_k = graph.nodes[args["node"]].attrs["top_k"]
    return expert_rows_fit(kdim, graph.nodes[args["w"]].dtype) and experts + 2 * top_k <= ROUTE_FLOATS


def _emit(b, args, node: int):
    """The routing op and the expert op adding into the f32 sum of node ``node``; returns that sum."""
    n = b.graph.nodes[node]
    top_k, width = n.attrs["top_k"], n.shape[-1].value
    logits = b.rows(b.operand(args["logits"]))
    rows = logits.shape[0]
    state = b.scratch(f"moe{node}", (rows, state_width(width, top_k)), f32)
    b.emit("moe_route", [node], [logits], state, {"rows_per": ROUTE_ROWS, "top_k": top_k, "sum": width,
                                                  "normalize": n.attrs["normalize"],
                                                  "dtype": b.graph.nodes[args["w"]].dtype.name})
    route = b.view(b.view(state, "slice", (1, width, width + 2 * top_k)), "reshape", (rows, 2, top_k))
    acc = b.view(state, "slice", (1, 0, width))
    b.keep_sum(node, acc)
    operands = {"x": args["x"], "g": args["g"]}
    present = tuple(r for r, v in operands.items() if v != NONE)
    inputs = [b.rows(b.operand(operands[r])) if r == "x" else b.operand(operands[r]) for r in present]
    reads = {v for v in (*operands.values(), args["logits"], args["w"], args["w2"], args["wd"]) if v != NONE}
    w = b.graph.nodes[args["w"]]
    block, mma = expert_block(w.shape[2].value, w.dtype, norm="g" in present)
    params = {"rows": args["rows"], "roles": (*present, "route", "w", "w2", "wd"), "eps": args["eps"], "top_k": top_k,
              "block": block, "mma": mma}
    weights = [b.operand(args["w"]), b.operand(args["w2"]), b.transposed_weight(args["wd"])]
    b.emit("moe_experts", b.absorbed(node, reads), [*inputs, route, *weights], acc, params)
    return acc


@term
class MoeRowsSumTerm(MoeSumTerm):
    """The f32 sum of a ``moe_mlp`` over many rows (computes a Sum), rounded by its reader as ``moe_sum``'s."""

    name = "moe_rows_sum"
    needs = NEEDS

    def fits(self, graph, args):
        return _fits(graph, args)

    def emit(self, b, args, node: int):
        return _emit(b, args, node)


@term
class MoeRowsRoundedTerm(MoeRowsSumTerm):
    """A ``moe_mlp`` value over many rows on its own: the sum, then rounded to the node's dtype (a cast)."""

    name = "moe_rows_rounded"
    computes = "node"
    lower = MoeRoundedTerm.lower
