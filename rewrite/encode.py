"""Graph -> e-graph: one ``Op`` term per computing node, unioned into ``node(i)``."""

from __future__ import annotations

from egglog import EGraph, union

from ..graph import LEAF_OPS, Graph, Node
from .terms import Op, node

VIEW_OPS = ("reshape", "permute", "slice", "expand")


def base_node(graph: Graph, i: int) -> int:
    """Follow view nodes down to the node that owns the storage."""
    while graph.nodes[i].op in VIEW_OPS:
        i = graph.nodes[i].inputs[0]
    return i


def term_of(graph: Graph, n: Node) -> Op:
    ins = n.inputs
    same = int(all(graph.nodes[j].shape == n.shape for j in ins))
    if n.op == "linear":
        return Op.linear(*ins)
    if n.op == "rms_norm":
        return Op.rms_norm(ins[0], ins[1], n.attrs["eps"])
    if n.op == "add":
        return Op.add(ins[0], ins[1], same)
    if n.op == "mul":
        return Op.mul(ins[0], ins[1], same)
    if n.op == "silu":
        return Op.silu(ins[0])
    if n.op == "rope" and n.attrs["pos"] is not None:
        return Op.rope(ins[0], n.id)
    if n.op == "kv_append":
        return Op.kv_append(ins[0], ins[1])
    if n.op == "argmax" and _is_row_vector(graph.nodes[ins[0]].shape) and n.attrs["dim"] == 1:
        return Op.argmax(ins[0], n.id)
    return Op.other(n.op, n.id)


def _is_row_vector(shape) -> bool:
    return len(shape) == 2 and shape[0].is_const and shape[0].value == 1


def heads_view(graph: Graph, n: Node) -> Op | None:
    """``Op.heads`` for a reshape ``[1, H*D] -> [H, D]`` (what QKV fusion looks through)."""
    if n.op != "reshape" or len(n.shape) != 2 or not all(d.is_const for d in n.shape):
        return None
    src = graph.nodes[n.inputs[0]].shape
    if len(src) == 2 and src[0].is_const and src[0].value == 1 and src[1] == n.shape[0] * n.shape[1]:
        return Op.heads(n.inputs[0], n.shape[1].value)
    return None


def encode(graph: Graph, live: set[int]) -> EGraph:
    """An e-graph holding every live computing node's term (leaves and views have none)."""
    egraph = EGraph()
    actions = [
        union(node(n.id)).with_(term_of(graph, n))
        for n in graph.nodes
        if n.id in live and n.op not in LEAF_OPS and n.op not in VIEW_OPS
    ]
    actions += [union(node(n.id)).with_(t) for n in graph.nodes if n.id in live and (t := heads_view(graph, n)) is not None]
    if actions:
        egraph.register(*actions)
    return egraph

