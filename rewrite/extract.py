"""Read each node's alternatives out of the e-graph and choose one per live node.

egglog's built-in extractor costs a term as a tree; our choice is a DAG problem (a
fused matvec makes its intermediate dead only if no other consumer keeps it), so we
extract greedily over the DAG: consumers first, each alternative charged its own
cost plus the cheapest cost of every operand it would newly keep alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from egglog import EGraph, get_callable_args, get_callable_fn, get_literal_value

from ..blockops.glu_down import supported
from ..graph import LEAF_OPS, Graph
from .encode import VIEW_OPS, base_node
from .terms import NONE, Op, node

MAX_ALTERNATIVES = 256
FUSED_KINDS = {
    Op.matvec: "matvec", Op.matvec_heads: "matvec_heads", Op.matvec_argmax: "matvec_argmax", Op.glu_down: "glu_down",
    Op.rope_rows: "rope_rows",
}


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
        if self.kind == "matvec_argmax":
            x, w, g, _eps, _rows = self.args
            return tuple(i for i in (x, w, g) if i != NONE)
        if self.kind == "glu_down":
            x, w, w2, g, _eps, wd, r, _rows = self.args
            return tuple(i for i in (x, w, w2, g, wd, r) if i != NONE)
        if self.kind == "rope_rows":
            x, g, _eps, rope, append, _tile = self.args
            cache = graph.nodes[append].inputs[0] if append != NONE else NONE
            return tuple(i for i in (x, g, graph.nodes[rope].inputs[1], cache) if i != NONE)
        if self.kind == "matvec_heads":
            x, w, g, _eps, _rows, rope, append = self.args
            inv = graph.nodes[rope].inputs[1] if rope != NONE else NONE
            cache = graph.nodes[append].inputs[0] if append != NONE else NONE
            return tuple(i for i in (x, w, g, inv, cache) if i != NONE)
        return graph.nodes[self.node].inputs


def alternatives(egraph: EGraph, graph: Graph, nodes: list[int]) -> dict[int, list[Choice]]:
    out: dict[int, list[Choice]] = {}
    for i in nodes:
        choices = []
        for expr in egraph.extract_multiple(node(i), MAX_ALTERNATIVES):
            fn = get_callable_fn(expr)
            if fn in FUSED_KINDS:
                args = tuple(get_literal_value(a) for a in get_callable_args(expr))
                if fn == Op.glu_down and not glu_down_fits(graph, args):
                    continue
                choices.append(Choice(i, FUSED_KINDS[fn], args))
            elif fn == Op.block:
                kind, _, tile = (get_literal_value(a) for a in get_callable_args(expr))
                choices.append(Choice(i, kind, (tile,)))
        if not choices:
            raise RuntimeError(f"rewrite: no block-op lowering for node %{i} ({graph.nodes[i].op})")
        out[i] = choices
    return out


def glu_down_fits(graph: Graph, args: tuple) -> bool:
    """Whether the ``glu_down`` body takes these operands: one x row, and weights read
    directly (no view: the body assumes contiguous rows) with 16-byte rows."""
    x, w, w2, _g, _eps, wd, _r, _rows = args
    xs, ws, wds = (graph.nodes[j].shape for j in (x, w, wd))
    if any(graph.nodes[j].op != "weight" for j in (w, w2, wd)) or len(ws) != 2 or len(wds) != 2 or not all(d.is_const for d in xs):
        return False
    m = math.prod(d.value for d in xs[:-1])
    return supported(m, ws[1].value, wds[0].value, graph.nodes[w].dtype.itemsize)


def choose(graph: Graph, alts: dict[int, list[Choice]], cost: Callable[[Choice], float]) -> dict[int, Choice]:
    """Greedy DAG extraction: returns the chosen alternative of every node left live.

    An alternative is charged its own cost plus the cheapest cost of the nodes it alone
    would keep alive: its operands and their producers, walked down to what is already
    needed or upstream of every alternative of the node (needed whichever is chosen).
    """
    own = {c: cost(c) for cs in alts.values() for c in cs}
    local_best = {i: min(cs, key=own.__getitem__) for i, cs in alts.items()}
    ancestors: list[int] = []  # bitset of each node and its graph ancestors
    for n in graph.nodes:
        bits = 1 << n.id
        for j in n.inputs:
            bits |= ancestors[j]
        ancestors.append(bits)

    def storage(i: int) -> int:
        return base_node(graph, i)

    def deps(c: Choice) -> set[int]:
        return {storage(r) for r in c.refs(graph)}

    needed = {storage(i) for i in graph.outputs.values()}
    chosen: dict[int, Choice] = {}
    for i in sorted(alts, reverse=True):  # node ids are topological: consumers first
        if i not in needed:
            continue
        upstream = ~0  # needed whichever alternative is chosen
        for c in alts[i]:
            reach = 0
            for j in deps(c):
                reach |= ancestors[j]
            upstream &= reach

        def total(c: Choice) -> float:
            """Own cost plus the region this alternative alone keeps alive (down to the common upstream)."""
            cost_sum, seen, stack = own[c], set(), list(deps(c))
            while stack:
                j = stack.pop()
                if j in seen or j in needed or (upstream >> j) & 1 or j not in alts:
                    continue
                seen.add(j)
                cost_sum += own[local_best[j]]
                stack.extend(deps(local_best[j]))
            return cost_sum

        best = min(alts[i], key=total)
        chosen[i] = best
        needed |= deps(best)
    return chosen


def computing_nodes(graph: Graph, live: set[int]) -> list[int]:
    return [n.id for n in graph.nodes if n.id in live and n.op not in LEAF_OPS and n.op not in VIEW_OPS]
