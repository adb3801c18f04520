"""Independent linears that read the same input run side by side: choose their block ops together.

The extractor prices each op alone, so Q, K and V each get the tile that is best for a
whole chip (llama-3.2-1b: 128 + 64 + 64 instances, two waves on 132 SMs). Nothing orders
them, so the queue runs them concurrently and what costs is their combined waves. This
pass re-picks the block op of each group of siblings (linears of one graph input, no path
between them, each chosen as a term with a ``siblings`` key: a matvec or a gemm tile) among
their alternatives (a matvec's weight-row tile, its fused norm, or a gemm tile in its place)
to minimise

    waves(total instances) * (slowest instance: its bytes at the per-SM bandwidth, or its
                              tensor-core FLOPs at the per-SM rate; + instance latency)

and keeps the extractor's choice unless that is strictly better. (At 2048 prompt rows,
llama-3.2-1b's K and V alone are cheaper as 128 matvec tiles each than as 34 gemm tiles, but
beside Q's 128 gemm tiles they make three waves of instances dearer in all: perf-notes #81.)
An alternative is taken only where every value it reads is computed already; a value no
longer read afterwards (an rms_norm op that every sibling now fuses) is dropped.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from ..blockops import TERMS
from ..blockops.base import Sum
from ..graph import LEAF_OPS, Graph
from ..ir.program import Estimate
from .cost import CostModel
from .encode import base_node
from .extract import Choice, order, storage

MAX_GROUP = 4  # siblings tiled jointly (MAX_OPTIONS ** MAX_GROUP combinations at most are tried)
MAX_OPTIONS = 12


def group_seconds(estimates: list[Estimate], model: CostModel) -> float:
    """Time of block ops running side by side (each op's Estimate)."""
    total = sum(e.instances for e in estimates)
    per_sm_bw, per_sm_flops = model.bandwidth / model.sms, model.tensor_flops / model.sms
    step = model.step_latency / model.stages_in_flight
    slowest = max(max(e.bytes / per_sm_bw, e.flops / per_sm_flops, e.steps * step) / max(1, e.instances)
                  for e in estimates)
    return math.ceil(total / model.sms) * (slowest + model.instance_latency)


def balance_siblings(graph: Graph, alts: dict[int, list[Choice]], chosen: dict[int, Choice],
                     estimates: dict[Choice, Estimate], model: CostModel) -> dict[int, Choice]:
    groups: dict[int, list[int]] = defaultdict(list)
    for v, c in sorted(chosen.items(), key=lambda vc: order(vc[0])):
        if not isinstance(v, Sum) and graph.nodes[v].op == "linear" and TERMS[c.term].siblings(c.named) is not None:
            groups[storage(graph, graph.nodes[v].inputs[0])].append(v)
    out = dict(chosen)
    for members in groups.values():
        members = _independent(graph, members)[:MAX_GROUP]
        if len(members) < 2 or any(out[i] not in estimates for i in members):
            continue

        def usable(a: Choice) -> bool:
            return a in estimates and TERMS[a.term].siblings(a.named) is not None and \
                all(_available(graph, out, r) for r in a.refs(graph))

        options = [_shortlist([a for a in alts[i] if usable(a)], out[i], estimates, model) for i in members]
        best = [out[i] for i in members]
        best_t = group_seconds([estimates[c] for c in best], model)
        for combo in itertools.product(*options):
            t = group_seconds([estimates[c] for c in combo], model)
            if t < best_t * (1 - 1e-9):
                best, best_t = list(combo), t
        out.update(zip(members, best))
    return _read_only(graph, out)


def _shortlist(options: list[Choice], current: Choice, estimates: dict, model: CostModel) -> list[Choice]:
    """A member's current choice and its other options that are fastest alone, MAX_OPTIONS in all (tile
    sizes x fused forms x terms come to ~20 a linear: four members' product would be ~10^5 combinations)."""
    ranked = sorted((a for a in options if a != current), key=lambda a: group_seconds([estimates[a]], model))
    return [current, *ranked[:MAX_OPTIONS - 1]]


def _available(graph: Graph, chosen: dict, r) -> bool:
    """Whether value ``r`` is a leaf or computed by a chosen alternative."""
    return storage(graph, r) in chosen or (not isinstance(r, Sum) and graph.nodes[base_node(graph, r)].op in LEAF_OPS)


def _read_only(graph: Graph, chosen: dict) -> dict:
    """The chosen values that an output needs (through the chosen alternatives' reads)."""
    needed, stack = set(), [storage(graph, i) for i in graph.outputs.values()]
    while stack:
        v = stack.pop()
        if v in needed or v not in chosen:
            continue
        needed.add(v)
        stack.extend(storage(graph, r) for r in chosen[v].refs(graph))
    return {v: c for v, c in chosen.items() if v in needed}


def _independent(graph: Graph, members: list[int]) -> list[int]:
    """The members none of which reads another's output (directly or not)."""
    ancestors: dict[int, set[int]] = {}

    def up(i: int) -> set[int]:
        if i not in ancestors:
            seen, stack = set(), list(graph.nodes[i].inputs)
            while stack:
                j = stack.pop()
                if j not in seen:
                    seen.add(j)
                    stack.extend(graph.nodes[j].inputs)
            ancestors[i] = seen
        return ancestors[i]

    return [i for i in members if not any(j in up(i) or i in up(j) for j in members if j != i)]
