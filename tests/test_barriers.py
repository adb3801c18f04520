"""Barrier derivation against a brute-force oracle.

For concrete small dims the oracle enumerates, in buffer coordinates, the elements
every producer instance writes and every consumer instance reads (views applied to
an index array with numpy, independent of the layout algebra), hence the exact set
of producer instances each consumer instance depends on. Every derived plan must be
SOUND (each dependency signals a counter the consumer waits on, and ``expected``
equals the exact number of instances signalling that counter); on the classes the
derivation claims to handle exactly it must also be PRECISE (the waited-on
instances are exactly the dependencies).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaegg.ir.footprint import At, Full, Span, Tile, access_range, coord, grid_coords
from megaegg.dims import as_dim, ceildiv, dmin, sym
from megaegg.dtypes import f32
from megaegg.lowering.barriers import BarrierPlan, derive_barriers
from megaegg.ir.program import BlockOp, BlockProgram, Buffer, Operand, View

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --- the oracle --------------------------------------------------------------


def ev(d, env) -> int:
    return as_dim(d).eval(env)


def operand_index(buffer_shape: tuple[int, ...], views, env) -> np.ndarray:
    """Array of the operand's shape holding each element's linear index in the buffer."""
    arr = np.arange(math.prod(buffer_shape)).reshape(buffer_shape)
    for v in views:
        if v.kind == "reshape":
            arr = arr.reshape([ev(d, env) for d in v.args])
        elif v.kind == "permute":
            arr = arr.transpose(v.args)
        elif v.kind == "slice":
            d, start, stop = v.args
            arr = np.take(arr, np.arange(ev(start, env), ev(stop, env)), axis=d)
        elif v.kind == "expand":
            arr = np.broadcast_to(arr, [ev(d, env) for d in v.args])
        else:
            raise ValueError(v.kind)
    return arr


def instance_masks(op: BlockOp, operand: Operand, fp, env, buffer_shape) -> np.ndarray:
    """Boolean [instances, buffer elements]: what each instance of ``op`` touches through ``operand``."""
    idx = operand_index(buffer_shape, operand.views, env)
    grid = [ev(g, env) for g in op.grid]
    n = math.prod(grid)
    out = np.zeros((n, math.prod(buffer_shape)), dtype=bool)
    for i in range(n):
        e = dict(env, **{f"_i{a}": c for a, c in enumerate(grid_coords(i, grid))})
        sl = []
        for a, extent in zip(fp, idx.shape):
            lo, hi = (x.eval(e) for x in access_range(a, extent))
            lo, hi = max(lo, 0), min(hi, extent)
            sl.append(slice(lo, max(lo, hi)))
        out[i, idx[tuple(sl)].ravel()] = True
    return out


def instance_envs(op: BlockOp, env) -> list[dict]:
    grid = [ev(g, env) for g in op.grid]
    return [dict(env, **{f"_i{a}": c for a, c in enumerate(grid_coords(i, grid))}) for i in range(math.prod(grid))]


def check(program: BlockProgram, env: dict, *, precise: bool = False) -> BarrierPlan:
    """Assert the plan is sound (and precise when asked) for ``env``; returns it."""
    plan = derive_barriers(program)
    ops = {op.id: op for op in program.ops}
    pos = {op.id: i for i, op in enumerate(program.ops)}
    shapes = {b.id: tuple(ev(d, env) for d in b.shape) for b in program.buffers}
    writes = {op.id: instance_masks(op, op.output, op.writes, env, shapes[op.output.buffer]) for op in program.ops}
    sets = {s.id: s for s in plan.sets}
    signals, counts = {}, {}
    for s in plan.sets:
        n = s.count.eval(env)
        vals = [s.signal.eval(e) for e in instance_envs(ops[s.producer], env)]
        assert all(0 <= v < n for v in vals), f"{s}: signals {vals} outside [0, {n})"
        signals[s.id], counts[s.id] = np.array(vals), Counter(vals)
    assert len({(s.producer, s.count, s.signal) for s in plan.sets}) == len(plan.sets), "duplicate counter families"
    # (op, instance) -> every producer instance it has transitively waited for: what an
    # instance waited for had finished, and so had everything those instances waited for
    finished_before: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for consumer in program.ops:
        cenvs = instance_envs(consumer, env)
        deps = np.zeros((len(cenvs), 0), dtype=bool)
        cols: list[tuple[int, int]] = []  # (producer op id, producer instance) per column of deps
        for k, operand in enumerate(consumer.inputs):
            reads = instance_masks(consumer, operand, consumer.reads[k], env, shapes[operand.buffer])
            for p in program.ops[: pos[consumer.id]]:
                if p.output.buffer == operand.buffer:
                    hit = reads.astype(np.float32) @ writes[p.id].T.astype(np.float32) > 0  # [cons, prod] (BLAS)
                    deps = np.concatenate([deps, hit], axis=1)
                    cols += [(p.id, j) for j in range(hit.shape[1])]
        waits = plan.waits.get(consumer.id, [])
        for ci, e in enumerate(cenvs):
            covered: set[tuple[int, int]] = set()  # producer instances this instance waits for
            for w in waits:
                s = sets[w.barrier_set]
                assert pos[s.producer] < pos[consumer.id], f"{w} waits on a later op"
                expected = w.expected.eval(e)
                assert expected >= 0, f"{w}: expected {expected} < 0 at {e}"
                if expected == 0:
                    continue  # vacuous: this instance reads nothing that producer writes
                index = w.index.eval(e)
                assert 0 <= index < s.count.eval(env), f"{w}: index {index} out of range at {e}"
                assert expected == counts[s.id][index], (
                    f"{w}: expects {expected} but {counts[s.id][index]} instances signal {index} at {e}\n{plan}"
                )
                covered |= {(s.producer, int(j)) for j in np.nonzero(signals[s.id] == index)[0]}
            direct = set(covered)
            for dep in direct:
                covered |= finished_before[dep]
            finished_before[(consumer.id, ci)] = covered
            needed = {cols[j] for j in np.nonzero(deps[ci])[0]}
            assert needed <= covered, (
                f"UNSOUND: op{consumer.id} instance {e} reads data of {sorted(needed - covered)} without waiting"
                f"\n{plan}\n{program}"
            )
            if precise:
                covered = direct
                assert covered == needed, (
                    f"imprecise: op{consumer.id} instance {e} waits on {sorted(covered - needed)} it does not read"
                    f"\n{plan}\n{program}"
                )
    return plan


# --- program builders --------------------------------------------------------


def op(id, grid, *, out, writes, inputs=(), reads=(), kind="k"):
    return BlockOp(id, kind, (), tuple(inputs), out, tuple(as_dim(g) for g in grid), tuple(tuple(r) for r in reads), tuple(writes))


def operand(buf: Buffer, views=()) -> Operand:
    shape = buf.shape
    for v in views:
        if v.kind in ("reshape", "expand"):
            shape = tuple(as_dim(d) for d in v.args)
        elif v.kind == "permute":
            shape = tuple(shape[d] for d in v.args)
        else:
            d, start, stop = v.args
            shape = shape[:d] + (as_dim(stop) - start,) + shape[d + 1 :]
    return Operand(buf.id, shape, f32, tuple(views))


def pair_program(shape, pfp, pgrid, cfp, cgrid, *, pviews=(), cviews=()):
    buf = Buffer(0, "t", "scratch", tuple(as_dim(d) for d in shape), f32)
    dummy = Buffer(1, "o", "scratch", (as_dim(1),), f32)
    prod = op(1, pgrid, out=operand(buf, pviews), writes=pfp)
    cons = op(2, cgrid, out=operand(dummy), writes=(Full(),), inputs=[operand(buf, cviews)], reads=[cfp])
    return BlockProgram([buf, dummy], [prod, cons], {})


# --- strategies --------------------------------------------------------------

EXTENTS = [1, 2, 3, 5, 7, 8, 12, 16, 40, 64, 100, 200]
TILES = [1, 2, 3, 4, 8, 16, 32, 64]


@st.composite
def shapes(draw, max_rank=3, budget=4096):
    """(shape with some symbolic dims, env); symbolic dims are named S0, S1, ..."""
    rank = draw(st.integers(1, max_rank))
    dims, env, left = [], {}, budget
    for d in range(rank):
        e = draw(st.sampled_from([x for x in EXTENTS if x <= left // 2 ** (rank - d - 1)] or [1]))
        left //= e
        if draw(st.booleans()):
            env[f"S{d}"] = e
            dims.append(sym(f"S{d}"))
        else:
            dims.append(as_dim(e))
    return tuple(dims), env


def slack(draw) -> int:
    """Usually 0; sometimes a grid has one instance past the last tile (it touches nothing)."""
    return int(draw(st.integers(0, 7)) == 0)


@st.composite
def tiling(draw, shape, env, *, consumer: bool, axes=2):
    """A footprint over ``shape`` and its grid: each dim Full / Tile / At / Span / based tile; 1-2 axes."""
    fp, grid = [], []
    for d, extent in enumerate(shape):
        kinds = ["full", "at", "offset"] + (["tile"] if len(grid) < axes else []) + (["span"] if consumer else [])
        kind = draw(st.sampled_from(kinds))
        e = ev(extent, env)
        if kind == "full":
            fp.append(Full())
        elif kind == "tile":
            size = draw(st.sampled_from(TILES))
            stop = None
            if draw(st.integers(0, 4)) == 0:  # a ragged limit other than the extent
                stop_v = draw(st.integers(1, e))
                name = f"L{'c' if consumer else 'p'}{d}"
                stop = sym(name) if draw(st.booleans()) else as_dim(stop_v)
                env[name] = stop_v
            fp.append(Tile(len(grid), size, stop))
            grid.append(ceildiv(stop if stop is not None else extent, size) + slack(draw))
        elif kind == "at":
            choice = draw(st.integers(0, 2)) if consumer and len(grid) < axes else draw(st.integers(0, 1))
            if choice == 0:
                fp.append(At(as_dim(draw(st.integers(0, e - 1)))))
            elif choice == 1:
                name = f"P{'c' if consumer else 'p'}{d}"
                env[name] = draw(st.integers(0, e - 1))
                fp.append(At(sym(name)))
            else:  # GQA-like: instance i reads element i // g
                g = draw(st.sampled_from([1, 2, 3, 4]))
                fp.append(At(coord(len(grid)) // g))
                grid.append(extent * g)
        elif kind == "span":
            lo = draw(st.integers(0, e - 1))
            hi = draw(st.integers(lo + 1, e))
            name = f"N{d}"
            if draw(st.booleans()):
                env[name] = hi
                fp.append(Span(as_dim(lo), sym(name)))
            else:
                fp.append(Span(as_dim(lo), as_dim(hi)))
        elif kind == "offset" and len(grid) < axes:  # a tile grid starting at `base` (what a slice view gives)
            size = draw(st.sampled_from(TILES))
            base = draw(st.integers(0, e - 1))
            start = coord(len(grid)) * size + base
            fp.append(Span(start, dmin(start + size, extent)))
            grid.append(ceildiv(extent - base, size) + slack(draw))
        else:
            fp.append(Full())
    if not grid:
        grid.append(as_dim(draw(st.sampled_from([1, 2, 3]))))
    elif len(grid) < axes and draw(st.integers(0, 3)) == 0:  # an axis no dim uses
        at = draw(st.integers(0, len(grid)))
        grid.insert(at, as_dim(draw(st.sampled_from([1, 2, 3]))))
        fp = [shift_axes(a, at) for a in fp]
    return tuple(fp), tuple(grid)


def shift_axes(a, at: int):
    """The access with grid axes ``>= at`` renumbered one up (an axis was inserted at ``at``)."""
    moved = {f"_i{k}": coord(k + 1) for k in range(at, 4)}
    if isinstance(a, Tile):
        return Tile(a.axis + (a.axis >= at), a.size, a.stop)
    if isinstance(a, At):
        return At(a.index.subs(moved))
    if isinstance(a, Span):
        return Span(a.start.subs(moved), a.stop.subs(moved))
    return a


# --- soundness over random pairs ---------------------------------------------


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_random_pairs_are_sound(data):
    shape, env = data.draw(shapes())
    pfp, pgrid = data.draw(tiling(shape, env, consumer=False))
    cfp, cgrid = data.draw(tiling(shape, env, consumer=True))
    check(pair_program(shape, pfp, pgrid, cfp, cgrid), env)


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_random_multi_producer_multi_consumer_sound(data):
    """Several producers write (overlapping or disjoint parts of) one buffer; several consumers read it."""
    shape, env = data.draw(shapes(max_rank=2, budget=1024))
    buf = Buffer(0, "t", "scratch", shape, f32)
    sink = Buffer(1, "o", "scratch", (as_dim(1),), f32)
    ops = []
    for i in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()) or not ops:
            fp, grid = data.draw(tiling(shape, env, consumer=False))
            ops.append(op(i, grid, out=operand(buf), writes=fp))
        else:
            fp, grid = data.draw(tiling(shape, env, consumer=True))
            ops.append(op(i, grid, out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[fp]))
    fp, grid = data.draw(tiling(shape, env, consumer=True))
    ops.append(op(99, grid, out=operand(sink), writes=(Full(),), inputs=[operand(buf), operand(buf)], reads=[fp, fp]))
    check(BlockProgram([buf, sink], ops, {}), env)


# --- precision on the classes handled exactly --------------------------------


@st.composite
def exact_pair(draw):
    """Producer and consumer tile the same dims with nested (or equal) tiles, or the consumer
    reads a dim in full (reduction) or at one element."""
    shape, env = draw(shapes())
    pfp, cfp, pgrid, cgrid = [], [], [], []
    for d, extent in enumerate(shape):
        kind = draw(st.sampled_from(["same", "cmul", "pmul", "full", "at", "pfull"] if len(pgrid) < 2 else ["full", "at", "pfull"]))
        if kind == "pfull":  # producer writes the whole dim (no grid axis), consumer reads it whole
            pfp.append(Full())
            cfp.append(Full())
            continue
        tp = draw(st.sampled_from(TILES))
        pfp.append(Tile(len(pgrid), tp))
        pgrid.append(ceildiv(extent, tp))
        if kind == "full":
            cfp.append(Full())
        elif kind == "at":
            which = draw(st.sampled_from(["const", "runtime", "gqa"]))
            if which == "const":
                cfp.append(At(as_dim(draw(st.integers(0, ev(extent, env) - 1)))))
            elif which == "runtime":
                env[f"P{d}"] = draw(st.integers(0, ev(extent, env) - 1))
                cfp.append(At(sym(f"P{d}")))
            else:
                g = draw(st.sampled_from([1, 2, 4]))
                cfp.append(At(coord(len(cgrid)) // g))
                cgrid.append(extent * g)
        else:
            m = draw(st.sampled_from([1, 2, 4])) if kind != "same" else 1
            tc = tp * m if kind in ("same", "cmul") else max(1, tp // m) if tp % m == 0 else tp
            cfp.append(Tile(len(cgrid), tc))
            cgrid.append(ceildiv(extent, tc))
    if not pgrid:
        pgrid.append(as_dim(draw(st.sampled_from([1, 2]))))
    if not cgrid:
        cgrid.append(as_dim(1))
    # consumers may number their axes differently from the producer
    if len(cgrid) == 2 and draw(st.booleans()):
        cfp = [Tile(1 - a.axis, a.size, a.stop) if isinstance(a, Tile) else
               At(a.index.subs({"_i0": coord(1), "_i1": coord(0)})) if isinstance(a, At) else a for a in cfp]
        cgrid = cgrid[::-1]
    return shape, env, tuple(pfp), tuple(pgrid), tuple(cfp), tuple(cgrid)


@settings(max_examples=100, **SETTINGS)
@given(exact_pair())
def test_nested_tilings_reductions_and_at_reads_are_precise(case):
    shape, env, pfp, pgrid, cfp, cgrid = case
    check(pair_program(shape, pfp, pgrid, cfp, cgrid), env, precise=True)


@st.composite
def offset_pair(draw):
    """Tiles whose grids start at different offsets (what slice views of concat pieces give),
    nested, the offset a whole number of the smaller tile."""
    e = draw(st.sampled_from([40, 64, 100, 200, 300]))
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    m = draw(st.sampled_from([1, 2, 3, 4]))
    coarse_consumer = draw(st.booleans())
    tc = tp * m if coarse_consumer else tp
    tp = tp if coarse_consumer else tp * m
    small = min(tp, tc)
    bp = draw(st.integers(0, (e - 1) // small)) * small
    bc = draw(st.integers(0, (e - 1) // small)) * small
    symbolic = draw(st.booleans())
    extent = sym("S") if symbolic else as_dim(e)
    env = {"S": e} if symbolic else {}
    i = coord(0)
    pfp = (Span(i * tp + bp, dmin(i * tp + bp + tp, extent)), Full())
    cfp = (Span(i * tc + bc, dmin(i * tc + bc + tc, extent)), Full())
    return (extent, 2), env, pfp, (ceildiv(extent - bp, tp),), cfp, (ceildiv(extent - bc, tc),)


@settings(max_examples=80, **SETTINGS)
@given(offset_pair())
def test_offset_tiles_are_precise(case):
    shape, env, pfp, pgrid, cfp, cgrid = case
    check(pair_program(shape, pfp, pgrid, cfp, cgrid), env, precise=True)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 3072])
@pytest.mark.parametrize("tp,tc", [(64, 64), (32, 64), (16, 64), (64, 32), (64, 16), (64, 1)])
def test_ragged_rows(n, tp, tc):
    """Rows over tiles that do not divide them: counts stay exact for the ragged tail."""
    S = sym("S")
    plan = check(pair_program((S, 3), (Tile(0, tp), Full()), (ceildiv(S, tp),), (Tile(0, tc), Full()), (ceildiv(S, tc),)), {"S": n}, precise=True)
    assert len(plan.sets) == 1 and len(plan.waits[2]) == 1


def test_same_tiling_is_one_to_one():
    S = sym("S")
    plan = check(pair_program((S, 8), (Tile(0, 4), Tile(1, 4)), (ceildiv(S, 4), 2), (Tile(0, 4), Tile(1, 4)), (ceildiv(S, 4), 2)), {"S": 10}, precise=True)
    (s,) = plan.sets
    (w,) = plan.waits[2]
    assert str(s.signal) == str(w.index) and str(w.expected) == "1"


def test_reduction_waits_on_one_counter_for_everything():
    S = sym("S")
    prog = pair_program((S, 100), (Tile(0, 8), Tile(1, 32)), (ceildiv(S, 8), 4), (Full(), Full()), (1,))
    plan = check(prog, {"S": 20}, precise=True)
    (s,) = plan.sets
    (w,) = plan.waits[2]
    assert str(s.count) == "1" and str(s.signal) == "0" and str(w.index) == "0"
    assert w.expected.eval({"S": 20}) == 3 * 4
    # reduction over the columns only: one counter per row tile
    plan = check(pair_program((S, 100), (Tile(0, 8), Tile(1, 32)), (ceildiv(S, 8), 4), (Tile(0, 8), Full()), (ceildiv(S, 8),)), {"S": 20}, precise=True)
    (w,) = plan.waits[2]
    assert w.expected.eval({"S": 20, "_i0": 1}) == 4


def test_at_reads_gqa():
    """Attention q-head h reads KV head h // 4 written by kv_append at one position."""
    pos = sym("pos")
    cache = Buffer(0, "k_cache", "state", (as_dim(2), as_dim(16), as_dim(8)), f32)
    knew = Buffer(1, "k", "scratch", (as_dim(2), as_dim(8)), f32)
    out = Buffer(2, "o", "scratch", (as_dim(8), as_dim(8)), f32)
    append = op(1, (2,), out=operand(cache), writes=(Tile(0, 1), At(pos), Full()), inputs=[operand(knew)], reads=[(Tile(0, 1), Full())])
    attn = op(2, (8,), out=operand(out), writes=(Tile(0, 1), Full()), inputs=[operand(cache)],
              reads=[(At(coord(0) // 4), Span(as_dim(0), pos + 1), Full())])
    prog = BlockProgram([cache, knew, out], [append, attn], {})
    for p in (0, 5, 15):
        plan = check(prog, {"pos": p}, precise=True)
    (w,) = plan.waits[2]
    assert str(w.index) == "_i0 // 4" and str(w.expected) == "1"


def test_consumers_share_counter_families():
    """Two consumers with the same tiling share one family; a full reader adds one more."""
    S = sym("S")
    buf = Buffer(0, "t", "scratch", (S,), f32)
    sink = Buffer(1, "o", "scratch", (as_dim(1),), f32)
    ops = [
        op(0, (ceildiv(S, 16),), out=operand(buf), writes=(Tile(0, 16),)),
        op(1, (ceildiv(S, 64),), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Tile(0, 64),)]),
        op(2, (ceildiv(S, 64),), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Tile(0, 64),)]),
        op(3, (1,), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Full(),)]),
        op(4, (ceildiv(S, 64), 2), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Tile(0, 64),)]),
    ]
    plan = check(BlockProgram([buf, sink], ops, {}), {"S": 200}, precise=True)
    assert len(plan.sets) == 2
    assert plan.signals_per_instance() == {0: 2}
    assert plan.waits_per_instance() == {1: 1, 2: 1, 3: 1, 4: 1}
    assert plan.num_counters({"S": 200}) == 4 + 1
    assert plan.total_waits({"S": 200}) == 4 + 4 + 1 + 8


def test_waits_implied_by_a_whole_wait_are_dropped():
    """C reads a tile of t and all of u; u's producer B read all of t first, so once C has
    waited for all of B, t is complete: C's per-tile wait on t goes, and so does t's
    per-tile counter family (nobody else waits on it). If B reads only part of t, it stays."""
    t = Buffer(0, "t", "scratch", (as_dim(64), as_dim(8)), f32)
    u = Buffer(1, "u", "scratch", (as_dim(64),), f32)
    sink = Buffer(2, "o", "scratch", (as_dim(64),), f32)

    def program(b_reads):
        return BlockProgram([t, u, sink], [
            op(0, (8,), out=operand(t), writes=(Tile(0, 8), Full())),
            op(1, (4,), out=operand(u), writes=(Tile(0, 16),), inputs=[operand(t)], reads=[b_reads]),
            op(2, (8,), out=operand(sink), writes=(Tile(0, 8),), inputs=[operand(t), operand(u)],
               reads=[(Tile(0, 8), Full()), (Full(),)]),
        ], {})

    plan = check(program((Full(), Full())), {})
    assert [(plan.sets[w.barrier_set].producer, w.input) for w in plan.waits[2]] == [(1, 1)]
    assert {s.producer for s in plan.sets} == {0, 1} and len(plan.sets) == 2  # B's whole wait on t, C's on u
    plan = check(program((Tile(0, 16), Full())), {})  # B reads 2 tiles of t each: nothing implied
    assert sorted(plan.sets[w.barrier_set].producer for w in plan.waits[2]) == [0, 1]


def test_fan_in_concat_halves_as_spans():
    """Two producers write rows [0, A) and [A, A + B) of one buffer (offset tiles); consumers
    read everything (fan-in) or row tiles that straddle neither piece."""
    A, B = 64, 96
    buf = Buffer(0, "cat", "scratch", (as_dim(A + B), as_dim(4)), f32)
    sink = Buffer(1, "o", "scratch", (as_dim(1),), f32)
    i = coord(0)
    ops = [
        op(0, (A // 32,), out=operand(buf), writes=(Tile(0, 32, as_dim(A)), Full())),
        op(1, (B // 16,), out=operand(buf), writes=(Span(i * 16 + A, dmin(i * 16 + A + 16, A + B)), Full())),
        op(2, (1,), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Full(), Full())]),
        op(3, (ceildiv(A + B, 32),), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Tile(0, 32), Full())]),
    ]
    plan = check(BlockProgram([buf, sink], ops, {}), {}, precise=True)
    assert len(plan.waits[2]) == 2  # fan-in: one wait per piece


# --- views (through megaegg.ir.layout.pullback) --------------------------------


def test_fan_in_concat_halves_via_slice_views():
    S = sym("S")
    A = 64
    buf = Buffer(0, "cat", "scratch", (S + A, as_dim(4)), f32)
    sink = Buffer(1, "o", "scratch", (as_dim(1),), f32)
    lo = operand(buf, [View("slice", (0, as_dim(0), as_dim(A)))])
    hi = operand(buf, [View("slice", (0, as_dim(A), S + A))])
    ops = [
        op(0, (A // 32,), out=lo, writes=(Tile(0, 32), Full())),
        op(1, (ceildiv(S, 16),), out=hi, writes=(Tile(0, 16), Full())),
        op(2, (1,), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Full(), Full())]),
        op(3, (ceildiv(S + A, 32),), out=operand(sink), writes=(Full(),), inputs=[operand(buf)], reads=[(Tile(0, 32), Full())]),
        op(4, (ceildiv(S, 16),), out=operand(sink), writes=(Full(),), inputs=[hi], reads=[(Tile(0, 16), Full())]),
    ]
    for s in (1, 16, 40, 96):
        plan = check(BlockProgram([buf, sink], ops, {}), {"S": s}, precise=True)
    assert len(plan.waits[2]) == 2
    assert [plan.sets[w.barrier_set].producer for w in plan.waits[4]] == [1]  # the other piece is skipped


@st.composite
def viewed(draw, shape, env, *, write: bool):
    """A random view chain over ``shape`` (permute, slice, split/merge reshape; expand for reads)."""
    views, cur = [], list(shape)
    for _ in range(draw(st.integers(0, 2))):
        kinds = ["permute", "slice", "reshape"] + ([] if write else ["expand"])
        kind = draw(st.sampled_from(kinds))
        if kind == "permute" and len(cur) > 1:
            perm = tuple(draw(st.permutations(range(len(cur)))))
            views.append(View("permute", perm))
            cur = [cur[d] for d in perm]
        elif kind == "slice":
            d = draw(st.integers(0, len(cur) - 1))
            e = ev(cur[d], env)
            lo = draw(st.integers(0, e - 1))
            hi = draw(st.integers(lo + 1, e))
            views.append(View("slice", (d, as_dim(lo), as_dim(hi))))
            cur[d] = as_dim(hi - lo)
        elif kind == "reshape":
            d = draw(st.integers(0, len(cur) - 1))
            e = cur[d]
            if len(cur) < 3 and e.is_const and e.value > 1 and (fs := [f for f in (2, 3, 4, 8) if e.value % f == 0]):
                f = draw(st.sampled_from(fs))  # split
                cur = cur[:d] + [as_dim(e.value // f), as_dim(f)] + cur[d + 1 :]
            elif d + 1 < len(cur):  # merge with the next dim
                cur = cur[:d] + [cur[d] * cur[d + 1]] + cur[d + 2 :]
            else:
                continue
            views.append(View("reshape", tuple(cur)))
        elif kind == "expand" and len(cur) < 3:
            g = draw(st.sampled_from([2, 3]))
            d = draw(st.integers(0, len(cur)))
            cur = cur[:d] + [as_dim(1)] + cur[d:]
            views.append(View("reshape", tuple(cur)))
            cur = cur[:d] + [as_dim(g)] + cur[d + 1 :]
            views.append(View("expand", tuple(cur)))
    return tuple(views), tuple(cur)


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_random_pairs_through_views_are_sound(data):
    shape, env = data.draw(shapes(budget=2048))
    pviews, pshape = data.draw(viewed(shape, env, write=True))
    cviews, cshape = data.draw(viewed(shape, env, write=False))
    pfp, pgrid = data.draw(tiling(pshape, env, consumer=False))
    cfp, cgrid = data.draw(tiling(cshape, env, consumer=True))
    check(pair_program(shape, pfp, pgrid, cfp, cgrid, pviews=pviews, cviews=cviews), env)


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_permuted_consumer_is_precise(data):
    """A consumer reading through a permute with the matching permuted tiling waits one-to-one."""
    shape, env = data.draw(shapes(max_rank=3))
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    tiles = [data.draw(st.sampled_from(TILES)) for _ in shape]
    pfp = tuple(Tile(d, t) for d, t in enumerate(tiles))
    pgrid = tuple(ceildiv(e, t) for e, t in zip(shape, tiles))
    cfp = tuple(Tile(perm[j], tiles[perm[j]]) for j in range(len(shape)))
    check(pair_program(shape, pfp, pgrid, cfp, pgrid, cviews=[View("permute", perm)]), env, precise=True)


def test_matvec_to_attention_heads_through_reshape():
    """q = x @ Wq^T as a flat [Hq*D] vector tiled by 64 rows; attention reads head h as q.reshape(Hq, D)[h]."""
    hq, d = 8, 64
    q = Buffer(0, "q", "scratch", (as_dim(hq * d),), f32)
    sink = Buffer(1, "o", "scratch", (as_dim(hq), as_dim(d)), f32)
    heads = operand(q, [View("reshape", (as_dim(hq), as_dim(d)))])
    for rows in (32, 64, 128):
        ops = [
            op(0, (hq * d // rows,), out=operand(q), writes=(Tile(0, rows),)),
            op(1, (hq,), out=operand(sink), writes=(Tile(0, 1), Full()), inputs=[heads], reads=[(Tile(0, 1), Full())]),
            # one head chosen at run time
            op(2, (1,), out=operand(sink), writes=(Full(), Full()), inputs=[heads], reads=[(At(sym("h")), Full())]),
        ]
        for h in (0, 3, 7):
            plan = check(BlockProgram([q, sink], ops, {}), {"h": h}, precise=True)
        assert len(plan.waits[1]) == 1 and len(plan.waits[2]) == 1


def test_broadcast_read_is_precise():
    """A [D] vector tiled by 16, read broadcast to [S, D] by row/column tiles: column tile j waits on tile j only."""
    S = sym("S")
    views = [View("reshape", (as_dim(1), as_dim(48))), View("expand", (S, as_dim(48)))]
    prog = pair_program((48,), (Tile(0, 16),), (3,), (Tile(0, 4), Tile(1, 16)), (ceildiv(S, 4), 3), cviews=views)
    plan = check(prog, {"S": 10}, precise=True)
    (w,) = plan.waits[2]
    assert str(w.index) == "_i1" and str(w.expected) == "1"
