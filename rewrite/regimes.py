"""One choice per runtime row count, no rebuild: two programs in one kernel (``ir/program.py``: Regime).

The extractor prices every alternative at one binding of the runtime dims (the hint). A batch of
16 rows and a prompt of 2048 want different block ops (the matvec path reads the weights once for
any row count up to a point; tensor-core tiles do 128 x 256 products per weight tile read): so when
the graph's row count (the leading dim of a linear's input) may grow past the hint, the choices are
made again at the largest row count. If they differ, both programs go into the kernel: the small one
for at most ``threshold`` rows, the large one past it, where the cost model puts their crossing.

Each program's launch counts use its own derived dim (``Regime.derived``), equal to the row count
in its regime and 0 in the other, so only one program launches instances. The two share the graph's
inputs, weights, caches and outputs; their intermediates are their own. No barrier joins them: the
barrier derivation skips pairs of ops of different regimes (they never run in one launch).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ..blockops import REGISTRY
from ..dims import dmin, sym
from ..graph import Graph
from ..ir.program import BlockOp, BlockProgram, Operand, Regime
from .cost import CostModel


def row_symbol(graph: Graph, env: Mapping[str, int], max_dims: Mapping[str, int] | None) -> str | None:
    """The runtime dim that counts the rows of the graph's linears and may grow past its hint (the
    largest such, by maximum), or None."""
    if not max_dims:
        return None
    found = set()
    for n in graph.nodes:
        if n.op == "linear":
            x = graph.nodes[n.inputs[0]]
            for d in x.shape[:-1]:
                if d.op == "sym" and max_dims.get(d.args[0], 0) > env.get(d.args[0], 0):
                    found.add(d.args[0])
    return max(sorted(found), key=lambda s: max_dims[s], default=None)


LARGE_ROWS_STAGES_IN_FLIGHT = 3  # a 128 x 256 gemm tile's ring in the large rows' image: 4 x 48 KB


def large_rows_model(model: CostModel) -> CostModel:
    """The cost model of an image with tensor-core tiles (interpreter/render.py: TILE_SMEM)."""
    return dataclasses.replace(model, stages_in_flight=LARGE_ROWS_STAGES_IN_FLIGHT)


def program_seconds(program: BlockProgram, env: Mapping[str, int], model: CostModel) -> float:
    """The cost model's time of every op of ``program`` at ``env``."""
    total = 0.0
    for op in program.ops:
        kind = REGISTRY[op.kind]
        inst = op.launch_count.eval(env) if op.grid else 1
        if inst <= 0:
            continue
        total += model.seconds(kind.bytes_moved(op, env), inst, kind.flops(op, env), kind.pipeline_steps(op, env),
                               kind.hops(op, env))
    return total


def threshold(small: BlockProgram, large: BlockProgram, symbol: str, env: Mapping[str, int], top: int,
              model: CostModel, model_large: CostModel) -> int | None:
    """The most rows for which ``small`` is not dearer than ``large`` (each priced by its image's model;
    powers of two from the hint up, then a bisection), or None when ``small`` is never dearer up to ``top``."""
    def large_wins(v: int) -> bool:
        e = {**env, symbol: v}
        return program_seconds(large, e, model_large) < program_seconds(small, e, model)

    lo = max(1, env.get(symbol, 1))
    if large_wins(lo):
        return lo - 1 if lo > 1 else 0
    hi = lo
    while not large_wins(hi):
        if hi >= top:
            return None
        hi = min(top, hi * 2)
    while hi - lo > 1:  # large_wins(hi), not large_wins(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if large_wins(mid) else (mid, hi)
    return lo


def merge(small: BlockProgram, large: BlockProgram, regime: Regime) -> BlockProgram:
    """``small``'s ops (regime 0) then ``large``'s (regime 1), each with its launch counts over its own
    derived dim. Buffers the graph owns (inputs, weights, constants, caches) and the outputs are shared,
    matched by name; ``large``'s intermediates are appended."""
    buffers = list(small.buffers)
    shared = {(b.name, b.kind, b.transposed): b.id for b in small.buffers if b.kind not in ("scratch", "accum", "peer")}
    remap: dict[int, int] = {}
    for name, o in large.outputs.items():  # an output is one buffer, whichever program writes it
        remap[o.buffer] = small.outputs[name].buffer
    for b in large.buffers:
        if b.id in remap:
            continue
        key = (b.name, b.kind, b.transposed)
        if key in shared:
            remap[b.id] = shared[key]
        else:
            remap[b.id] = len(buffers)
            buffers.append(dataclasses.replace(b, id=len(buffers)))

    def moved(o: Operand) -> Operand:
        return dataclasses.replace(o, buffer=remap[o.buffer])

    small_dim, large_dim = regime.derived
    ops = [gated(op, op.id, 0, regime.symbol, small_dim, lambda o: o) for op in small.ops]
    ops += [gated(op, len(small.ops) + op.id, 1, regime.symbol, large_dim, moved) for op in large.ops]
    return dataclasses.replace(small, buffers=buffers, ops=ops, symbols=small.symbols + regime.derived, regime=regime)


def gated(op: BlockOp, new_id: int, regime: int, symbol: str, derived: str, moved: Callable[[Operand], Operand]) -> BlockOp:
    """``op`` in ``regime``: its grid over the regime's derived dim, and 0 outside the regime (a single
    instance becomes a grid of ``min(1, derived)``); its operands moved to the merged program's buffers."""
    grid = tuple(g.subs({symbol: sym(derived)}) for g in op.grid)
    # the whole grid times min(1, derived): 0 outside the regime even where the launch count does not
    # vanish with the rows (a grid over n + 8 rows, or none at all)
    grid = (grid[0] * dmin(1, sym(derived)), *grid[1:]) if grid else (dmin(1, sym(derived)),)
    out = BlockOp(id=new_id, kind=op.kind, sources=op.sources, inputs=tuple(moved(o) for o in op.inputs),
                  output=moved(op.output), grid=grid, reads=op.reads, writes=op.writes, params=op.params,
                  estimate=op.estimate, regime=regime)
    return out
