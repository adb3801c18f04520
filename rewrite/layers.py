"""Identical layers are rewritten and priced once.

A model graph repeats a block of nodes (a decoder layer) many times: node ``i + P`` is
node ``i`` shifted by the period ``P`` (same op, attributes, shape and dtype; each input
either shifted by ``P`` too or the very same node, like the RoPE table; a leaf may differ
only in its name, i.e. its weights or cache). :func:`find_repeats` finds the longest such
run. The rewrite then runs on a *reduced* graph that keeps the first ``KEEP`` blocks (the
ones before, the template in the middle, the ones after: every block whose context is not
a middle block's) and the nodes after the run, and :func:`expand` copies the template's
choices, shifted, onto every middle block. The margin of ``MARGIN`` blocks on each side
of the template covers fusions and pricing that look across a layer boundary (the MLP's
sum folded into the next layer's projections); ``tests/test_layers.py`` checks that the
program equals a full rewrite.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..blockops import TERMS
from ..blockops.base import NONE, Sum
from ..graph import Graph, Node
from .extract import Choice

MARGIN = 2  # blocks kept on each side of the template block
KEEP = 2 * MARGIN + 1
MAX_PERIODS_TRIED = 8


@dataclass(frozen=True)
class Repeats:
    """``count`` blocks of ``period`` nodes from node ``start``: node ``start + k*period + j`` is
    node ``start + j`` shifted ``k`` times."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count * self.period

    @property
    def removed(self) -> int:
        """Nodes the reduced graph leaves out."""
        return (self.count - KEEP) * self.period

    def block(self, i: int) -> int | None:
        """The block of node ``i``, or None outside the run."""
        return (i - self.start) // self.period if self.start <= i < self.stop else None


def _signature(n: Node):
    attrs = tuple(sorted((k, repr(v)) for k, v in n.attrs.items() if k != "value"))
    return (n.op, n.dtype, n.shape, attrs)


def _shifted(graph: Graph, sigs: list, i: int, p: int, outputs: set[int]) -> bool:
    """Whether node ``i`` is node ``i - p`` shifted by ``p`` (``sigs``: every node's signature)."""
    a, b = graph.nodes[i - p], graph.nodes[i]
    if sigs[i - p] != sigs[i] or (a.id in outputs) != (b.id in outputs) or len(a.inputs) != len(b.inputs):
        return False
    if "value" in a.attrs and not torch.equal(a.attrs["value"], b.attrs["value"]):
        return False
    return all(y == x + p or y == x for x, y in zip(a.inputs, b.inputs))


def find_repeats(graph: Graph) -> Repeats | None:
    """The longest run of at least ``KEEP + 1`` shifted blocks, or None."""
    outputs = set(graph.outputs.values())
    sigs = [_signature(n) for n in graph.nodes]
    last: dict = {}
    gaps: Counter = Counter()
    for n in graph.nodes:
        if n.inputs:  # computing nodes: their spacing is the layer's length
            if sigs[n.id] in last:
                gaps[n.id - last[sigs[n.id]]] += 1
            last[sigs[n.id]] = n.id
    best = None
    for p, _ in gaps.most_common(MAX_PERIODS_TRIED):
        run = 0
        for i in range(p, len(graph.nodes) + 1):
            if i < len(graph.nodes) and _shifted(graph, sigs, i, p, outputs):
                run += 1
                continue
            if run:  # nodes [i - run - p, i) are `run // p + 1` shifted blocks (whole ones counted)
                count = run // p + 1
                if count > KEEP and (best is None or count * p > best.count * best.period):
                    best = Repeats(i - run - p, p, count)
            run = 0
    if best is None or not _closed(graph, best):
        return None
    return best


def _closed(graph: Graph, rep: Repeats) -> bool:
    """Nodes after the run read only its last block (and what is before it), so that the reduced
    graph's last block stands for the real last one; every block reads the same nodes from
    before the run (a copied block must not read another block's inputs); and an input a block
    does not shift is from before the run (a copied choice shifts every node of the run it reads)."""
    last = rep.start + (rep.count - 1) * rep.period
    if not all(j < rep.start or j >= last for n in graph.nodes[rep.stop:] for j in n.inputs):
        return False
    for i in range(rep.start + rep.period, rep.stop):
        before = graph.nodes[i - rep.period].inputs
        if any(y < rep.start and y != x or y >= rep.start and y == x for x, y in zip(before, graph.nodes[i].inputs)):
            return False
    return True


def reduce(graph: Graph, rep: Repeats) -> Graph:
    """The graph with the middle blocks left out: blocks ``0..KEEP-1`` and the nodes after the run,
    renumbered so that they read block ``KEEP-1`` where they read the last block."""
    small = Graph(f"{graph.name}[{KEEP} of {rep.count} blocks]")
    for n in graph.nodes:
        if rep.start + KEEP * rep.period <= n.id < rep.stop:
            continue
        small.nodes.append(Node(to_small(rep, n.id), n.op, tuple(to_small(rep, j) for j in n.inputs), n.shape,
                                n.dtype, n.attrs, n.name))
    left_out = range(rep.start + KEEP * rep.period, rep.stop - rep.period)  # the last block's stay: block KEEP-1's
    # (a left-out block's output has its twin in every block: the template's stands for it)
    small.outputs = {name: to_small(rep, i) for name, i in graph.outputs.items() if i not in left_out}
    return small


def to_small(rep: Repeats, i: int) -> int:
    """Node ``i``'s id in the reduced graph (for nodes after the run and what they read of its last block)."""
    return i - rep.removed if i >= rep.stop - rep.period else i


def expand(chosen: dict, rep: Repeats) -> dict:
    """The full graph's choices from the reduced graph's: blocks before and after the template
    keep theirs (the last ``MARGIN`` moved to the end), every middle block gets the template's."""
    out = {}
    template = MARGIN
    for v, c in chosen.items():
        i = v.node if isinstance(v, Sum) else v
        k = rep.block(i) if i < rep.start + KEEP * rep.period else None
        if k is None:  # before the run, or after it
            shift = rep.removed if i >= rep.start + KEEP * rep.period else 0
            out[_shift_value(v, shift)] = _shift_choice(c, shift, rep.start)
        elif k < template:
            out[v] = c
        elif k > template:
            shift = rep.removed
            out[_shift_value(v, shift)] = _shift_choice(c, shift, rep.start)
        else:
            for target in range(template, rep.count - MARGIN):
                shift = (target - template) * rep.period
                out[_shift_value(v, shift)] = _shift_choice(c, shift, rep.start)
    return out


def _shift_value(v, shift: int):
    return Sum(v.node + shift) if isinstance(v, Sum) else v + shift


def _shift_choice(c: Choice, shift: int, start: int) -> Choice:
    """``c`` with its node-id fields moved by ``shift`` where they point into the run (or after it)."""
    if not shift:
        return c
    ids = {f.name for f in TERMS[c.term].fields if f.kind in ("ref", "sum", "node")}
    args = tuple((k, v + shift if k in ids and v != NONE and v >= start else v) for k, v in c.args)
    return Choice(_shift_value(c.value, shift), c.term, args)
