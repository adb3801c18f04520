"""Independent ops that read the same input run side by side: choose their tiles together.

The extractor prices each op alone, so Q, K and V each get the tile that is best for a
whole chip (llama-3.2-1b: 128 + 64 + 64 instances, two waves on 132 SMs). Nothing orders
them, so the queue runs them concurrently and what costs is their combined waves. This
pass re-picks the tiles of each group of siblings (a term's ``siblings`` key: for a matvec,
same x and fused norm; no path between them) to minimise

    waves(total instances) * (largest instance's bytes / per-SM bandwidth + instance latency)

and keeps the extractor's choice unless that is strictly better.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from ..graph import Graph
from .cost import CostModel
from ..blockops import TERMS
from ..blockops.base import Sum
from .extract import Choice, order

MAX_GROUP = 4  # siblings tiled jointly (options ** MAX_GROUP combinations are tried)


def group_seconds(estimates: list[tuple[int, int]], model: CostModel) -> float:
    """Time of matvecs running side by side: (bytes, instances) each."""
    total = sum(n for _, n in estimates)
    widest = max(b / max(1, n) for b, n in estimates)
    return math.ceil(total / model.sms) * (widest / (model.bandwidth / model.sms) + model.instance_latency)


def balance_siblings(graph: Graph, alts: dict[int, list[Choice]], chosen: dict[int, Choice],
                     estimates: dict[Choice, tuple[int, int]], model: CostModel) -> dict[int, Choice]:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for v, c in sorted(chosen.items(), key=lambda vc: order(vc[0])):
        key = TERMS[c.term].siblings(c.named)
        if key is not None and not isinstance(v, Sum):
            groups[key].append(v)
    out = dict(chosen)
    for members in groups.values():
        members = _independent(graph, members)[:MAX_GROUP]
        if len(members) < 2:
            continue
        options = [[a for a in alts[i] if a in estimates and _same_but_tile(a, chosen[i])] for i in members]
        best = [chosen[i] for i in members]
        best_t = group_seconds([estimates[c] for c in best], model)
        for combo in itertools.product(*options):
            t = group_seconds([estimates[c] for c in combo], model)
            if t < best_t * (1 - 1e-9):
                best, best_t = list(combo), t
        out.update(zip(members, best))
    return out


def _same_but_tile(a: Choice, b: Choice) -> bool:
    tile = TERMS[b.term].tile
    return a.term == b.term and all(v == b.named[k] for k, v in a.args if k != tile)


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
