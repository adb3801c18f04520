"""Read each value's alternatives out of the e-graph and choose one per value the outputs need.

A value is a graph node's (its e-class ``node(i)``) or an f32 sum's (``acc(i)``, a :class:`Sum`).
egglog's built-in extractor costs a term as a tree; our choice is a DAG problem (a fused
matvec makes its intermediate dead only if no other consumer keeps it), so we extract
greedily over the DAG: consumers first, each alternative charged its own cost plus the
cheapest cost of every value it would newly keep alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from egglog import EGraph, get_callable_args, get_callable_fn, get_literal_value

from ..blockops import TERMS
from ..blockops.base import Sum
from ..dims import fmt_shape
from ..graph import LEAF_OPS, Graph, GraphError
from .encode import VIEW_OPS, base_node
from .terms import Op, acc, node

MAX_ALTERNATIVES = 256


@dataclass(frozen=True)
class Choice:
    """One executable alternative of ``value``: term ``term`` with its fields ``args`` (name, value)."""

    value: Any  # int (a graph node) | Sum
    term: str
    args: tuple[tuple[str, Any], ...]

    @cached_property
    def named(self) -> dict[str, Any]:
        return dict(self.args)

    def refs(self, graph: Graph) -> tuple:
        return TERMS[self.term].refs(graph, self.named)

    def __str__(self) -> str:
        return f"{self.value} = {self.term}(" + ", ".join(f"{k}={v}" for k, v in self.args) + ")"


def order(v) -> float:
    """Topological position of a value: a Sum sits just after its node's own producers."""
    return v.node - 0.5 if isinstance(v, Sum) else float(v)


def _read(expr, fn_names: dict) -> tuple[str, tuple] | None:
    name = fn_names.get(get_callable_fn(expr))
    if name is None:  # a graph-op term (what the user wrote), not executable
        return None
    values = tuple(get_literal_value(a) for a in get_callable_args(expr))
    return name, tuple(zip((f.name for f in TERMS[name].fields), values))


def alternatives(egraph: EGraph, graph: Graph, nodes: list[int]) -> dict[Any, list[Choice]]:
    """Every executable alternative of each computing node, and of each sum some alternative reads."""
    fn_names = {getattr(Op, name): name for name in TERMS}
    out: dict[Any, list[Choice]] = {}
    unfit: dict[Any, set[str]] = {}  # what the alternatives that did not fit need
    todo: list = list(nodes)
    while todo:
        v = todo.pop()
        if v in out:
            continue
        eclass, computes = (acc(v.node), "sum") if isinstance(v, Sum) else (node(v), "node")
        choices = []
        for expr in egraph.extract_multiple(eclass, MAX_ALTERNATIVES):
            read = _read(expr, fn_names)
            if read is None or TERMS[read[0]].computes != computes:
                continue
            c = Choice(v, *read)
            if TERMS[c.term].fits(graph, c.named):
                choices.append(c)
                todo += [r for r in c.refs(graph) if isinstance(r, Sum)]
            elif TERMS[c.term].needs:
                unfit.setdefault(v, set()).add(TERMS[c.term].needs)
        out[v] = choices
    _drop_unbuildable(graph, out)
    # A node with no alternative is an error only where an output needs it: a primitive of a recognised
    # pattern (rules.py: _recover_rms_norm) is bypassed by its consumer's fused alternative. The error names
    # the first such node upstream of an output that cannot be computed.
    for o in graph.outputs.values():
        if not _computable(graph, out, o):
            v = _first_without_alternatives(graph, out, o)
            n = graph.nodes[v]
            ins = ", ".join(f"{graph.nodes[i].label} {graph.nodes[i].dtype}{fmt_shape(graph.nodes[i].shape)}" for i in n.inputs)
            needs = "".join(f"; it needs {x}" for x in sorted(unfit.get(v, ())))
            raise GraphError(f"{n.op} {n.label}: no block op of the megakernel takes it with these operands ({ins}){needs}")
    return {v: cs for v, cs in out.items() if cs}


def _first_without_alternatives(graph: Graph, alts: dict, v: int) -> int:
    """The earliest node upstream of ``v`` (``v`` included) that has no alternative at all."""
    seen, stack, found = set(), [base_node(graph, v)], []
    while stack:
        j = stack.pop()
        if j in seen or graph.nodes[j].op in LEAF_OPS:
            continue
        seen.add(j)
        if j in alts and not alts[j]:
            found.append(j)
        stack.extend(base_node(graph, i) for i in graph.nodes[j].inputs)
    return min(found) if found else base_node(graph, v)


def _drop_unbuildable(graph: Graph, alts: dict) -> None:
    """Drop alternatives that read a value no alternative computes (a sum whose only producer did
    not fit), until none is left."""
    changed = True
    while changed:
        changed = False
        for v, cs in alts.items():
            keep = [c for c in cs if all(_computable(graph, alts, r) for r in c.refs(graph))]
            if len(keep) != len(cs):
                alts[v], changed = keep, True


def _computable(graph: Graph, alts: dict, r) -> bool:
    if isinstance(r, Sum):
        return bool(alts.get(r))
    i = base_node(graph, r)
    return graph.nodes[i].op in LEAF_OPS or bool(alts.get(i))


def choose(graph: Graph, alts: dict[Any, list[Choice]], cost: Callable[[Choice], float]) -> dict[Any, Choice]:
    """Greedy DAG extraction: returns the chosen alternative of every value left live.

    An alternative is charged its own cost plus the cheapest cost of the values it alone
    would keep alive: its operands and their producers, walked down to what is already
    needed or upstream of every alternative of the value (needed whichever is chosen).
    """
    own = {c: cost(c) for cs in alts.values() for c in cs}
    local_best = {v: min(cs, key=own.__getitem__) for v, cs in alts.items()}
    n = len(graph.nodes)

    def bit(v) -> int:
        return 1 << (n + v.node if isinstance(v, Sum) else v)

    def deps(c: Choice) -> set:
        return {storage(graph, r) for r in c.refs(graph)}

    # must[v]: v and every value needed to compute v whichever alternatives are chosen (a node that
    # a fused alternative bypasses, e.g. a sum's rounding, is not needed by its consumers)
    must: dict = {}
    for v in sorted([*range(n), *(v for v in alts if isinstance(v, Sum))], key=order):
        if v in alts:
            common = ~0
            for c in alts[v]:
                reach = 0
                for d in deps(c):
                    reach |= must[d]
                common &= reach
        else:  # a leaf (or a node no output needs): its graph inputs
            common = 0
            for j in graph.nodes[v].inputs:
                common |= must[j]
        must[v] = bit(v) | common

    needed = {storage(graph, i) for i in graph.outputs.values()}
    chosen: dict = {}
    for v in sorted(alts, key=order, reverse=True):  # consumers first
        if v not in needed:
            continue
        upstream = must[v] & ~bit(v)  # needed whichever alternative is chosen

        def total(c: Choice) -> float:
            """Own cost plus the region this alternative alone keeps alive (down to the common upstream)."""
            cost_sum, seen, stack = own[c], set(), list(deps(c))
            while stack:
                j = stack.pop()
                if j in seen or j in needed or upstream & bit(j) or j not in alts:
                    continue
                seen.add(j)
                cost_sum += own[local_best[j]]
                stack.extend(deps(local_best[j]))
            return cost_sum

        best = min(alts[v], key=total)
        chosen[v] = best
        needed |= deps(best)
    return chosen


def storage(graph: Graph, v):
    """The value that owns ``v``'s storage: views resolve to their base node."""
    return v if isinstance(v, Sum) else base_node(graph, v)


def computing_nodes(graph: Graph, live: set[int]) -> list[int]:
    return [n.id for n in graph.nodes if n.id in live and n.op not in LEAF_OPS and n.op not in VIEW_OPS]
