"""The rewrite stage's entry: graph -> BlockProgram, as a list of named passes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..graph import Graph
from .build import ProgramBuilder, build_program
from .cost import CostModel
from .encode import encode
from .extract import alternatives, choose, computing_nodes
from .layers import Repeats, expand, find_repeats, reduce
from ..ir.program import BlockProgram
from .rules import fusion, lowering
from .siblings import balance_siblings

DEFAULT_DIM_HINT = 512  # representative value of every runtime dim for cost estimates


@dataclass
class RewriteStats:
    seconds: dict[str, float] = field(default_factory=dict)
    alternatives: int = 0
    repeats: Repeats | None = None  # the repeated layers found, if any

    def lap(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[name] = now - t0
        return now


def rewrite(
    graph: Graph, *, cost_model: CostModel | None = None, dims_hint: dict[str, int] | None = None,
    stats: RewriteStats | None = None,
) -> BlockProgram:
    cost_model = cost_model or CostModel()
    env = {s: DEFAULT_DIM_HINT for s in graph.symbols()} | dict(dims_hint or {})
    stats = stats or RewriteStats()
    t = time.perf_counter()
    repeats = find_repeats(graph)  # identical layers: rewrite a few, copy the middle one's choices
    small = reduce(graph, repeats) if repeats else graph
    stats.repeats = repeats
    live = small.live_nodes()  # dead ops never reach the e-graph
    t = stats.lap("layers", t)
    egraph = encode(small, live)  # one SSA term per computing node
    t = stats.lap("encode", t)
    egraph.run(lowering.saturate())  # block-op alternatives: tile sizes per op
    egraph.run(fusion.saturate())  # fused alternatives beside the unfused ones
    t = stats.lap("saturate", t)
    alts = alternatives(egraph, small, computing_nodes(small, live))
    stats.alternatives = sum(len(a) for a in alts.values())
    t = stats.lap("alternatives", t)
    costs, estimates = _choice_costs(small, alts, cost_model, env)
    chosen = choose(small, alts, costs.__getitem__)  # DAG extraction by cost
    chosen = balance_siblings(small, alts, chosen, estimates, cost_model)  # Q, K, V share one wave
    if repeats:
        chosen = expand(chosen, repeats)
    t = stats.lap("extract", t)
    program = build_program(graph, chosen, env)  # buffers, operands, block ops
    stats.lap("build", t)
    return program


def _choice_costs(graph, alts, model: CostModel, env) -> dict:
    """Cost of each alternative (lower it alone and price its block ops), and its
    (bytes, instances) when it is a single block op."""
    costs, estimates = {}, {}
    for cs in alts.values():
        for c in cs:
            b = ProgramBuilder(graph, env)
            b.lower(c)
            costs[c] = sum(model.seconds(op.estimate.bytes, op.estimate.instances) for op in b.ops)
            if len(b.ops) == 1:
                estimates[c] = (b.ops[0].estimate.bytes, b.ops[0].estimate.instances)
    return costs, estimates
