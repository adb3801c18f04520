"""A mixture of gated-MLP experts, routed inside the kernel (``moe_mlp``, Qwen3-MoE).

``moe_glu_down``: instance ``(j, t)`` routes the row itself from the router's logits (softmax,
top-k, the optional renormalisation: ``reference.moe_routing``), takes slot ``j``'s expert
``e`` and weight ``p_j``, and adds ``p_j * h[tile] @ wd_t[e][tile, :]`` into an f32 sum, where
``h[tile]`` is rows ``[t*rows, ...)`` of expert ``e``'s gated MLP (the ``glu_down`` body on
expert ``e``'s weights). Only the chosen experts' weights are read: the expert is a value
computed in this launch, so its weight operands are addressed at run time; their footprint
is the whole expert axis (weights are never written in a launch, so no barrier depends on it).
Its waits: the logits (all of them: the softmax reads every expert's) and x.

Routing in every instance instead of a separate top-k op saves a dependent hop a layer: the
logits are a few hundred bytes, already waited for.
"""

from __future__ import annotations

import math

from ..dims import as_dim, ceildiv
from ..reference import expert_mlp, moe_routing
from .base import NONE, BlockKind, Partition, Term, c_call, f32, fields, no_view, register, rms_normed, term
from .elementwise import elementwise_params
from ..ir.footprint import Full, Tile
from .matvec import roles


@register
class MoeGluDown(BlockKind):
    name = "moe_glu_down"
    cuda_file = "moe.cuh"
    accumulates = True  # every instance adds its rows' share into the sum

    def build(self, inputs, output, params) -> Partition:
        rows = params["rows"]
        expert_tile = (Full(), Tile(1, rows), Full())  # [E, F, K]: any expert, this instance's rows
        reads = tuple({"x": (Full(), Full()), "g": (Full(),), "logits": (Full(), Full())}.get(role, expert_tile)
                      for role in params["roles"])
        f = inputs[list(params["roles"]).index("w")].shape[1]
        return Partition(grid=(as_dim(params["top_k"]), ceildiv(f, rows)), reads=reads, writes=(Full(), Full()))

    def cpu(self, op, env, ins, out):
        k, p = roles(op), op.params
        dt = op.inputs[k["w"]].dtype.torch
        weight, ids = moe_routing(ins[k["logits"]][0:1], p["top_k"], p["normalize"], dt)
        slot, e = env["_i0"], int(ids[0, env["_i0"]])
        tile = slice(env["_i1"] * p["rows"], env["_i1"] * p["rows"] + p["rows"])
        x = f32(ins[k["x"]][0:1])
        if "g" in k:
            x = rms_normed(x, ins[k["g"]], p["eps"], dt)
        h = expert_mlp(x, ins[k["w"]][e][tile], ins[k["w2"]][e][tile], dt)
        out += weight[0, slot].float() * (h @ ins[k["wd"]][e][tile].float())

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, logits, w, w2, wd = (ins[k[r]] for r in ("x", "logits", "w", "w2", "wd"))
        g = ins[k["g"]].view() if "g" in k else no_view(1, x.ctype)
        experts, f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[2].value
        args = [("smem", "smem"), ("x", x.view(1)), ("g", g), ("eps", f"{float(p.get('eps', 0.0))!r}f"),
                ("logits", logits.view(1)), ("E", str(experts)), ("top_k", str(p["top_k"])),
                ("normalize", "true" if p["normalize"] else "false"), ("slot", "c0"), ("w", w.view()), ("w2", w2.view()),
                ("wd", wd.view()), ("acc", out.ptr), ("F", f"{f}LL"), ("n_tile", "c1")]
        norm = "true" if "g" in k else "false"
        return c_call("moe_glu_down", [x.ctype, logits.ctype, kdim, n, p["rows"], norm], args)

    def bytes_moved(self, op, env):
        """The chosen experts' rows only (top_k of them), plus each instance's x, logits and sum."""
        k = roles(op)
        _, f, kdim = (d.value for d in op.inputs[k["w"]].shape)
        n = op.inputs[k["wd"]].shape[2].value
        item = op.inputs[k["w"]].dtype.itemsize
        experts = op.inputs[k["logits"]].shape[1].value
        inst = op.launch_count.eval(env)
        return op.params["top_k"] * (2 * f * kdim + f * n) * item + inst * (kdim * item + experts * 4 + n * 4)


MAX_EXPERTS = 16384  # the routing holds E f32 probabilities in shared memory (moe.cuh)
MOE_FIELDS = fields("x:ref g:ref eps:float logits:ref w:ref w2:ref wd:ref node:node rows:int")


ROW_BYTES = 16  # the glu_down body reads the experts' rows in vectors of this many bytes
MOE_NEEDS = (f"one x row, expert weights that are graph weights (or row slices of one) with rows of a multiple of {ROW_BYTES} "
             f"bytes, at most {MAX_EXPERTS} experts")


def expert_weight(graph, ref: int) -> bool:
    """Whether node ``ref`` is a stack of expert weights the bodies read as they are: a weight, or a slice of one
    along its rows (transformers' gate_up_proj [E, 2F, K] as the gate's and the up projection's halves)."""
    n = graph.nodes[ref]
    if n.op == "slice" and n.attrs["dim"] == 1:
        n = graph.nodes[n.inputs[0]]
    return n.op == "weight"


def expert_rows_fit(k_dim: int, dtype) -> bool:
    """Whether the experts' rows of ``k_dim`` elements are whole vectors of ROW_BYTES."""
    return k_dim * dtype.itemsize % ROW_BYTES == 0


def _fits(graph, args) -> bool:
    """One row, 16-byte weight rows (the glu_down body's vectors), and the routing's E probabilities in
    shared memory."""
    xs = graph.nodes[args["x"]].shape
    if not all(d.is_const for d in xs) or math.prod(d.value for d in xs[:-1]) != 1:
        return False
    if not all(expert_weight(graph, args[r]) for r in ("w", "w2")) or graph.nodes[args["wd"]].op != "weight":
        return False
    experts, _, kdim = (d.value for d in graph.nodes[args["w"]].shape)
    return expert_rows_fit(kdim, graph.nodes[args["w"]].dtype) and experts <= MAX_EXPERTS


def _emit(b, args, node: int):
    """The moe_glu_down op adding into the f32 sum of node ``node``; returns that sum."""
    n = b.graph.nodes[node]
    operands = {"x": args["x"], "g": args["g"], "logits": args["logits"], "w": args["w"], "w2": args["w2"]}
    present = tuple(r for r, v in operands.items() if v != NONE)
    inputs = [b.rows(b.operand(operands[r])) if r in ("x", "logits") else b.operand(operands[r]) for r in present]
    acc = b.sum(node)
    reads = {v for v in (*operands.values(), args["wd"]) if v != NONE}
    params = {"rows": args["rows"], "roles": (*present, "wd"), "eps": args["eps"], "top_k": n.attrs["top_k"],
              "normalize": n.attrs["normalize"]}
    b.emit("moe_glu_down", b.absorbed(node, reads), [*inputs, b.transposed_weight(args["wd"])], acc, params)
    return acc


@term
class MoeSumTerm(Term):
    """The f32 sum of a ``moe_mlp`` (computes a Sum): its reader rounds it (``acc_residual``, or a
    matvec staging ``r + T(sum)``), as a ``glu_down`` sum's. The many-row form (moe_rows.py) is this
    term with its own ``fits`` and ``emit``."""

    name = "moe_sum"
    fields = MOE_FIELDS
    computes = "sum"
    tile = "rows"
    needs = MOE_NEEDS

    def fits(self, graph, args):
        return _fits(graph, args)

    def emit(self, b, args, node: int):
        """The op(s) adding into the f32 sum of node ``node``; returns that sum."""
        return _emit(b, args, node)

    def lower(self, b, value, args):
        self.emit(b, args, value.node)


@term
class MoeRoundedTerm(MoeSumTerm):
    """A ``moe_mlp`` value on its own: the sum, then rounded to the node's dtype (a cast)."""

    name = "moe_rounded"
    computes = "node"

    def lower(self, b, value, args):
        acc = self.emit(b, args, value)
        out = b.rows(b.output(value))
        b.emit("elementwise", [value], [acc], out, elementwise_params("cast", out.shape, b.env_hint))
