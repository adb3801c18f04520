"""One choice per runtime row count, no rebuild: a program per band of row counts in one kernel
(``ir/program.py``: Regime).

The extractor prices every alternative at one binding of the runtime dims (the hint). A batch of
16 rows and a prompt of 2048 want different block ops (the matvec path reads the weights once for
any row count up to a point; tensor-core tiles do 128 x 256 products per weight tile read): so when
the graph's row count (the leading dim of a linear's input) may grow past the hint, the choices are
made again where a term's ``min_rows`` lets new tiles in, at 4, 16, ... times the tallest tile (where
those tiles are still too few to fill the SMs) and at the largest row count. Each distinct
choice is a program; consecutive ones are split where the cost model puts their crossing
(``bands``), and a program that wins nowhere is dropped. The rest go into the kernel, one per band.

Each program's launch counts use its own derived dim (``Regime.derived``), equal to the row count
in its band and 0 in the others, so only one program launches instances. They share the graph's
inputs, weights, caches and outputs; their intermediates are their own. No barrier joins them: the
barrier derivation skips pairs of ops of different bands (they never run in one launch).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ..blockops import REGISTRY
from ..dims import dmin, sym, upper_bound
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


INTERMEDIATE = ("scratch", "accum", "peer")  # a program's own buffers; the others are the graph's, shared

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
              model: CostModel, model_large: CostModel, lo: int | None = None) -> int | None:
    """The most rows for which ``small`` is not dearer than ``large`` (each priced by its image's model;
    powers of two from ``lo`` (default: the hint) up, then a bisection; ``lo - 1`` when ``large`` wins
    at ``lo`` already), or None when ``small`` is never dearer up to ``top``."""
    def large_wins(v: int) -> bool:
        e = {**env, symbol: v}
        return program_seconds(large, e, model_large) < program_seconds(small, e, model)

    lo = max(1, env.get(symbol, 1) if lo is None else lo)
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


def bands(programs: list[BlockProgram], models: list[CostModel], symbol: str, env: Mapping[str, int],
          top: int) -> tuple[list[BlockProgram], tuple[int, ...]]:
    """The programs that win a band of row counts and the thresholds between them (strictly increasing).
    ``programs`` are the candidates in ascending order of the row count they were chosen at (the first at
    the hint ``env``), ``models`` their images' cost models. Each crossing is searched from the previous
    threshold up (the first from the hint). A candidate that never beats the last kept program up to ``top``
    is dropped; one that beats it all through its band (a crossing not above the previous threshold) drops
    that program instead, and is compared with the one before. The first band holds at least the hint's row
    count: the hint's program is the extractor's choice there among the terms that fit those rows, and a
    later program's taller tiles, priced at the hint, are priced as if they ran there at full speed, which
    they do not (64-row tiles at 16 rows do 4x their products and pay each instance's whole fixed cost:
    llama-3.2-1b's batch-16 step 1.97 ms against 1.49, docs/perf-notes.md #88)."""
    kept, costs, cuts = [programs[0]], [models[0]], []
    for p, m in zip(programs[1:], models[1:]):
        while True:
            at = threshold(kept[-1], p, symbol, env, top, costs[-1], m, lo=cuts[-1] + 1 if cuts else None)
            if at is None:  # ``p`` never beats the program before it
                break
            if not cuts:  # the hint's rows stay the hint's program's (see above)
                at = max(at, env.get(symbol, 1))
            if cuts and at <= cuts[-1]:  # ``p`` wins all of the last kept program's band: drop that one
                del kept[-1], costs[-1], cuts[-1]
                continue
            kept.append(p)
            costs.append(m)
            cuts.append(at)
            break
    return kept, tuple(cuts)


def merge(programs: list[BlockProgram], regime: Regime) -> BlockProgram:
    """Band ``i``'s ops are ``programs[i]``'s, in band order, each with its launch counts over its band's
    derived dim. Buffers the graph owns (inputs, weights, constants, caches) and the outputs are shared,
    matched by name (program 0's, first); each later program's intermediates are appended."""
    first = programs[0]
    assert len(programs) == regime.bands, (len(programs), regime)
    buffers = list(first.buffers)
    shared = {(b.name, b.kind, b.transposed): b.id for b in first.buffers if b.kind not in INTERMEDIATE}
    ops: list[BlockOp] = []
    for band, (p, dim) in enumerate(zip(programs, regime.derived)):
        remap = {b.id: b.id for b in p.buffers} if band == 0 else _shared_buffers(p, first, shared, buffers)

        def moved(o: Operand, remap=remap) -> Operand:
            return dataclasses.replace(o, buffer=remap[o.buffer])

        top = regime.thresholds[band] if band < len(regime.thresholds) else None
        for op in p.ops:
            op = gated(op, len(ops), band, regime.symbol, dim, moved)  # (op ids are positions)
            if not idle(op, dim, top):
                ops.append(op)
    return dataclasses.replace(first, buffers=buffers, ops=ops, symbols=first.symbols + regime.derived, regime=regime)


UNBOUNDED = 1 << 40  # the other runtime dims' bound when asking whether a launch count is 0 in a band


def idle(op: BlockOp, dim: str, top: int | None) -> bool:
    """Whether ``op``, gated to a band of row counts ``dim <= top``, launches no instance at any of them:
    one of a pair that only larger batches run (``ragged_attention.py``: the grouped heads' op below 64
    rows of 8 KV heads), which the band's queue then leaves out (no entry, no wait on it)."""
    if top is None or not op.grid:
        return False
    return upper_bound(op.launch_count, {**{s: UNBOUNDED for s in op.launch_count.symbols()}, dim: top}) <= 0


def _shared_buffers(p: BlockProgram, first: BlockProgram, shared: dict, buffers: list) -> dict[int, int]:
    """``p``'s buffer ids -> the merged program's: its outputs are ``first``'s, the graph's buffers those
    of ``shared`` (by name), the rest appended to ``buffers`` (and a graph's buffer added to ``shared``,
    so a later program finds it: a transposed weight that only the tiles of two bands read)."""
    remap = {o.buffer: first.outputs[name].buffer for name, o in p.outputs.items()}  # one buffer, whichever writes it
    for b in p.buffers:
        if b.id in remap:
            continue
        key = (b.name, b.kind, b.transposed)
        if key in shared:
            remap[b.id] = shared[key]
        else:
            remap[b.id] = len(buffers)
            buffers.append(dataclasses.replace(b, id=len(buffers)))
            if b.kind not in INTERMEDIATE:
                shared[key] = remap[b.id]
    return remap


def gated(op: BlockOp, new_id: int, regime: int, symbol: str, derived: str, moved: Callable[[Operand], Operand]) -> BlockOp:
    """``op`` in band ``regime``: its grid over the band's derived dim, and 0 outside the band (a single
    instance becomes a grid of ``min(1, derived)``); its operands moved to the merged program's buffers."""
    grid = tuple(g.subs({symbol: sym(derived)}) for g in op.grid)
    # the whole grid times min(1, derived): 0 outside the band even where the launch count does not
    # vanish with the rows (a grid over n + 8 rows, or none at all)
    grid = (grid[0] * dmin(1, sym(derived)), *grid[1:]) if grid else (dmin(1, sym(derived)),)
    out = BlockOp(id=new_id, kind=op.kind, sources=op.sources, inputs=tuple(moved(o) for o in op.inputs),
                  output=moved(op.output), grid=grid, reads=op.reads, writes=op.writes, params=op.params,
                  estimate=op.estimate, regime=regime)
    return out
