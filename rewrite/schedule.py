"""The rewrite stage's entry: graph -> BlockProgram, as a list of named passes."""

from __future__ import annotations

import math

import time
from dataclasses import dataclass, field

from ..graph import Graph
from .build import ProgramBuilder, build_program
from .cost import CostModel
from .critical import combine_readers, refine_tiles
from .encode import encode
from .extract import alternatives, choose, computing_nodes
from .layers import Repeats, expand, find_repeats, reduce
from ..ir.program import BlockProgram, Regime
from ..blockops import TERMS
from ..blockops.base import Sum
from .regimes import bands, large_rows_model, merge, row_symbol
from .rules import fusion, lowering, wave_tiles
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


# Ties at the hint broken at TIE_ROWS times its rows (at most the maximum): a TIE_WEIGHT share of that price
TIE_ROWS = 4
TIE_WEIGHT = 1e-3


def rewrite(
    graph: Graph, *, cost_model: CostModel | None = None, dims_hint: dict[str, int] | None = None,
    stats: RewriteStats | None = None, max_dims: dict[str, int] | None = None,
) -> BlockProgram:
    """``graph`` as block ops chosen for the runtime dims ``dims_hint``; with ``max_dims``, and a row
    count that may grow past its hint, the programs chosen for more rows (at each tile's height, at powers
    of 4 times the tallest, and at the most rows) join it, each run in the band of row counts where the cost model says it wins
    (``regimes.py``)."""
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
    egraph.run(wave_tiles(cost_model.sms))  # ... and for a tall matvec, the heights that fill the SMs
    egraph.run(fusion.saturate())  # fused alternatives beside the unfused ones
    t = stats.lap("saturate", t)
    alts = alternatives(egraph, small, computing_nodes(small, live))
    stats.alternatives = sum(len(a) for a in alts.values())
    t = stats.lap("alternatives", t)
    rows = row_symbol(graph, env, max_dims)

    def extract(env, tie_env=None):
        """The choices at ``env``: tensor-core tiles only from their height up (``Term.rows_needed``, against
        the value's rows: ``leading_rows``), then priced as their kernel image runs them (``large_rows_model``);
        each price gains TIE_WEIGHT x its price at ``tie_env``, which decides between alternatives that tie at
        ``env`` (or differ there by less than TIE_WEIGHT of their difference at ``tie_env``)
        (the hint's program also serves more rows: a split matvec runs as a matvec of half its tile height up
        to 16 rows and reads x less often past them, docs/perf-notes.md #87)."""
        allowed = {v: [c for c in cs if TERMS[c.term].rows_needed(c.named) <= leading_rows(small, v, env, TERMS[c.term].rows_from_all_leading)]
                   for v, cs in alts.items()}
        model = large_rows_model(cost_model) if any(TERMS[c.term].rows_needed(c.named) for cs in allowed.values() for c in cs) \
            else cost_model
        costs, estimates = _choice_costs(small, allowed, model, env)
        price = costs.__getitem__
        if tie_env is not None:
            more, _ = _choice_costs(small, allowed, model, tie_env)
            price = lambda c: costs[c] + TIE_WEIGHT * more[c]  # noqa: E731
        chosen = choose(small, allowed, price)  # DAG extraction by cost
        chosen = balance_siblings(small, allowed, chosen, estimates, model)  # Q, K, V share one wave
        if rows is None:  # a decode step: the tile heights that shorten the layer's critical path (critical.py)
            # (priced on the whole graph's program: the reduced graph's would weigh a layer's gain differently,
            # and a rewrite with repeats must choose what one without them does)
            readers = combine_readers(build_program(small, chosen, env))
            chosen = refine_tiles(chosen, allowed, readers,
                                  lambda ch: build_program(graph, expand(ch, repeats) if repeats else ch, env), env)
        return (expand(chosen, repeats) if repeats else chosen), model

    chosen, model = extract(env, {**env, rows: min(max_dims[rows], TIE_ROWS * env.get(rows, 1))} if rows else None)
    t = stats.lap("extract", t)
    program = build_program(graph, chosen, env)  # buffers, operands, block ops
    t = stats.lap("build", t)
    if rows is not None and program.ranks == 1:  # the choices for more rows, and where they start to win
        programs, models, last = [program], [model], chosen
        for at in row_points(alts, env[rows], max_dims[rows]):
            env_at = {**env, rows: at}
            chosen_at, model_at = extract(env_at)
            if chosen_at != last:  # (the same choices as the row count before: the same program)
                programs.append(build_program(graph, chosen_at, env_at))
                models.append(model_at)
                last = chosen_at
        kept, cuts = bands(programs, models, rows, env, max_dims[rows])
        if cuts:
            program = merge(kept, Regime(rows, cuts))
        stats.lap("regimes", t)
    return program


def row_points(alts, hint: int, top: int) -> list[int]:
    """The row counts past the hint to choose again at, ascending: each alternative's ``rows_needed`` between the hint
    and ``top`` (where a tile starts to fit), 4, 16, ... times the tallest of them (where the tallest tiles are
    still too few to fill the SMs, and smaller ones may win: docs/perf-notes.md #89), and ``top``."""
    heights = {TERMS[c.term].rows_needed(c.named) for cs in alts.values() for c in cs}
    tallest = max(heights, default=0)
    more = {tallest * 4 ** k for k in range(1, 8)} if tallest else set()
    return sorted(h for h in heights | more if hint < h < top) + [top]


def leading_rows(graph: Graph, v, env, all_leading: bool = False) -> int:
    """The leading dim of value ``v`` (a node id or a Sum) at ``env`` (``all_leading``: the product of all
    its dims but the last): the rows its tiles span."""
    shape = graph.nodes[v.node if isinstance(v, Sum) else v].shape
    if not shape:
        return 1
    return math.prod(d.eval(env) for d in shape[:-1]) if all_leading else shape[0].eval(env)


def _choice_costs(graph, alts, model: CostModel, env) -> dict:
    """Cost of each alternative (lower it alone and price its block ops), and its
    Estimate when it is a single block op."""
    costs, estimates = {}, {}
    for cs in alts.values():
        for c in cs:
            b = ProgramBuilder(graph, env)
            b.lower(c)
            costs[c] = sum(model.seconds(op.estimate.bytes, op.estimate.instances, op.estimate.flops, op.estimate.steps,
                                           op.estimate.hops) for op in b.ops
                           if op.estimate.instances > 0 or not op.grid)  # (an op that does not launch there: free)
            if len(b.ops) == 1:
                estimates[c] = b.ops[0].estimate
    return costs, estimates
