"""Read each node's alternatives out of the e-graph and choose one per live node.

egglog's built-in extractor costs a term as a tree; our choice is a DAG problem (a
fused matvec makes its intermediate dead only if no other consumer keeps it), so we
extract greedily over the DAG: consumers first, each alternative charged its own
cost plus the cheapest cost of every operand it would newly keep alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from egglog import EGraph, get_callable_args, get_callable_fn, get_literal_value

from ..graph import LEAF_OPS, Graph
from .encode import VIEW_OPS, base_node
from .terms import NONE, Op, node

MAX_ALTERNATIVES = 256


@dataclass(frozen=True)
class Choice:
    """One executable alternative of node ``node``: a matvec or a single-node block op."""

    node: int
    kind: str  # "matvec" or a block family ("rms_norm", "attention", ...)
    args: tuple  # matvec: (x, w, w2, g, eps, r, rows); block: (tile,)

    def refs(self, graph: Graph) -> tuple[int, ...]:
        if self.kind == "matvec":
            x, w, w2, g, _eps, r, _rows = self.args
            return tuple(i for i in (x, w, w2, g, r) if i != NONE)
        return graph.nodes[self.node].inputs


def alternatives(egraph: EGraph, graph: Graph, nodes: list[int]) -> dict[int, list[Choice]]:
    out: dict[int, list[Choice]] = {}
    for i in nodes:
        choices = []
        for expr in egraph.extract_multiple(node(i), MAX_ALTERNATIVES):
            fn = get_callable_fn(expr)
            if fn == Op.matvec:
                args = tuple(get_literal_value(a) for a in get_callable_args(expr))
                choices.append(Choice(i, "matvec", args))
            elif fn == Op.block:
                kind, _, tile = (get_literal_value(a) for a in get_callable_args(expr))
                choices.append(Choice(i, kind, (tile,)))
        if not choices:
            raise RuntimeError(f"rewrite: no block-op lowering for node %{i} ({graph.nodes[i].op})")
        out[i] = choices
    return out


def choose(graph: Graph, alts: dict[int, list[Choice]], cost: Callable[[Choice], float]) -> dict[int, Choice]:
    """Greedy DAG extraction: returns the chosen alternative of every node left live.

    An alternative is charged its own cost plus the cheapest cost of each operand it
    alone would keep alive: operands already needed, or upstream of every alternative
    of the node (needed whichever is chosen), are free.
    """
    own = {c: cost(c) for cs in alts.values() for c in cs}
    cheapest = {i: min(own[c] for c in cs) for i, cs in alts.items()}
    ancestors: list[int] = []  # bitset of each node and its graph ancestors
    for n in graph.nodes:
        bits = 1 << n.id
        for j in n.inputs:
            bits |= ancestors[j]
        ancestors.append(bits)

    def storage(i: int) -> int:
        return base_node(graph, i)

    needed = {storage(i) for i in graph.outputs.values()}
    chosen: dict[int, Choice] = {}
    for i in sorted(alts, reverse=True):  # node ids are topological: consumers first
        if i not in needed:
            continue
        deps = {c: {storage(r) for r in c.refs(graph)} for c in alts[i]}
        upstream = ~0
        for ds in deps.values():
            reach = 0
            for j in ds:
                reach |= ancestors[j]
            upstream &= reach

        def total(c: Choice) -> float:
            extra = [j for j in deps[c] if j not in needed and not (upstream >> j) & 1]
            return own[c] + sum(cheapest.get(j, 0.0) for j in extra)

        best = min(alts[i], key=total)
        chosen[i] = best
        needed |= deps[best]
    return chosen


def computing_nodes(graph: Graph, live: set[int]) -> list[int]:
    return [n.id for n in graph.nodes if n.id in live and n.op not in LEAF_OPS and n.op not in VIEW_OPS]
