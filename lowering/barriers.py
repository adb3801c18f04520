"""Barrier derivation: which counter each producer instance signals, which counters
each consumer instance waits on, and how many signals it waits for.

One generic pass over the declared footprints (no per-op barrier code). For every
consumer op, input operand and EARLIER op in queue order that writes the same
buffer (several may: concat pieces, ``kv_append`` into a KV cache), both footprints
are mapped to the buffer's natural coordinates (:func:`_in_buffer_coords`, the only
place that sees views) and compared per dim, per producer grid axis:

=====================================  =====================  ===================  =====================
producer access / consumer access      producer signals       consumer waits       expected (this axis)
=====================================  =====================  ===================  =====================
no axis moves the dim (Full, At(pos))  --                     --                   1
Tile(p, Tp) / Full, Span, non-nested   0  (axis collapsed)    0                    G  (all instances)
Tile(p, Tp) / Tile(c, m*Tp)            p // m                 c                    min(m, G - c*m)
Tile(p, m*Tc) / Tile(c, Tc)            p                      c // m               1
Tile(p, Tp) / At(e)                    p                      e // Tp              1
Tile(p, Tp) / w wide at x, x % m*Tp=0  p // m (m*Tp >= w)     x // (m*Tp)          min(m, G - q*m)
=====================================  =====================  ===================  =====================

``G`` is the producer's grid extent along axis ``p`` (``ceildiv(extent, Tp)`` for
a canonical grid), so ragged tails count exactly. Tiles whose bases differ (slice
views) are handled when the offset is a whole number of tiles (``(p + r) // m``).
The counter index is the row-major linearization of the per-axis counter coords;
``expected`` is the product of the per-axis counts, times a 0/1 overlap guard per
dim where a consumer instance may fall outside the producer's region (a concat
piece, a partial tile): the guard makes ``expected`` 0 there, and the wait is
vacuous. One :class:`BarrierSet` exists per distinct ``(producer, count, signal)``,
so a producer signals each counter family once however many consumers share it.

Protocol (see docs/barriers.md):

- producer instance: all its stores; block barrier; then ONE thread does
  ``red.release.gpu`` add 1 on ``ctr[set][signal]`` for each set of its op (a
  release at gpu scope, cumulative through the block barrier, so it covers the
  whole block's stores; no fence before it: perf-notes #60).
- consumer instance: for each wait with ``expected > 0`` (a wait with
  ``expected <= 0`` is skipped without touching the counter, its ``index`` may be
  out of range), ONE thread spins ``ld.acquire.gpu`` on ``ctr[set][index]`` until
  it is ``>= expected`` (bounded: on timeout it records an error naming op, set and
  index, and exits); then block barrier; then activations are read with
  L1-bypassing loads (``ld.global.cg``).
- counters only ever count completions, never claims, so a consumer cannot slip
  through between a producer's claim and its stores (no claim/signal race), and
  ``expected`` is an exact count, not a "nobody in flight" test.
- counters live in two ping-pong banks; launch ``t`` uses bank ``t % 2`` and zeroes
  bank ``(t + 1) % 2`` (nothing in launch ``t`` touches it), so every launch starts
  from zero with no host-side rebuild even when runtime dims change counts.
- liveness: instances are claimed in queue (topological) order and every wait
  targets a set of an EARLIER op, so it waits only on instances already claimed
  by running blocks.

Runtime dims are assumed non-negative (sizes, positions).

>>> from megaegg.dims import sym, ceildiv
>>> from megaegg.dtypes import f32
>>> from megaegg.ir.footprint import Full, Tile
>>> from megaegg.ir.program import Buffer, Operand, BlockOp, BlockProgram
>>> S = sym("S")
>>> bufs = [Buffer(0, "y", "scratch", (S, 64), f32), Buffer(1, "z", "scratch", (S, 64), f32)]
>>> y, z = Operand(0, (S, 64), f32), Operand(1, (S, 64), f32)
>>> prod = BlockOp(1, "rows", (), (), y, (ceildiv(S, 32),), (), (Tile(0, 32), Full()))
>>> cons = BlockOp(2, "rows", (), (y,), z, (ceildiv(S, 64),), ((Tile(0, 64), Full()),), (Tile(0, 64), Full()))
>>> plan = derive_barriers(BlockProgram(bufs, [prod, cons], {}))
>>> print(plan.sets[0])
B0 op1 signals [_i0 // 2] of ceildiv(S, 64)
>>> (w,) = plan.waits[2]
>>> str(w.index), [w.expected.eval({"S": 200, "_i0": c}) for c in range(4)]  # 7 tiles of 32 rows
('_i0', [2, 2, 2, 1])
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from ..ir.footprint import At, Full, Span, Tile, coord
from ..dims import Dim, as_dim, binary, ceildiv, const, dmax, dmin
from ..ir.dimform import CanonMemo, canonical, const_diff, from_poly, nonneg, poly
from ..ir.dimsort import simplify_many
from ..ir.layout import pullback
from ..ir.program import BlockOp, BlockProgram, Buffer, Operand

__all__ = ["BarrierSet", "Wait", "BarrierPlan", "derive_barriers"]

_COORD = re.compile(r"_i(\d+)$")


# --- the plan ----------------------------------------------------------------


@dataclass(frozen=True)
class BarrierSet:
    """A family of ``count`` completion counters; producer instance adds 1 to ``[signal]``.

    ``signal`` is an expression of the producer's ``_i*`` and runtime dims, in ``[0, count)``.
    A ``peer`` family counts writes into a ``peer`` buffer, which every rank of a tensor-parallel
    group makes into every rank's copy: each rank holds ``count`` counters per SOURCE rank, a
    producer instance adds 1 to ``[signal]`` of its own rank's row on every rank, and the counters
    are never reset: they count across launches (docs/parallel.md).
    """

    id: int
    producer: int
    count: Dim
    signal: Dim
    peer: bool = False

    def __str__(self) -> str:
        return f"B{self.id} op{self.producer} signals [{self.signal}] of {self.count}" + (" on every rank" if self.peer else "")


@dataclass(frozen=True)
class Wait:
    """Consumer instance waits until ``B[barrier_set][index] >= expected`` before reading input ``input``.

    ``index`` and ``expected`` are expressions of the consumer's ``_i*`` and runtime dims;
    ``expected`` is the exact number of producer instances signalling that counter, or
    ``<= 0`` when this instance reads nothing that producer writes (the wait is skipped).
    """

    consumer: int
    input: int
    barrier_set: int
    index: Dim
    expected: Dim

    def __str__(self) -> str:
        return f"op{self.consumer}.in{self.input} B{self.barrier_set}[{self.index}] >= {self.expected}"


@dataclass(frozen=True)
class BarrierPlan:
    """All counter families and, per consumer op id, the waits of each of its instances."""

    sets: list[BarrierSet]
    waits: dict[int, list[Wait]]
    launches: dict[int, Dim] = field(default_factory=dict)  # op id -> launch count, for totals

    def num_counters(self, env: Mapping[str, int]) -> int:
        """Counters of one bank for concrete runtime dims."""
        return sum(s.count.eval(env) for s in self.sets)

    def waits_per_instance(self) -> dict[int, int]:
        return {op: len(ws) for op, ws in self.waits.items()}

    def signals_per_instance(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.sets:
            out[s.producer] = out.get(s.producer, 0) + 1
        return out

    def total_waits(self, env: Mapping[str, int]) -> int:
        """Spins over the whole launch (vacuous waits included) for concrete runtime dims."""
        return sum(len(ws) * self.launches[op].eval(env) for op, ws in self.waits.items() if op in self.launches)

    def summary(self, env: Mapping[str, int]) -> str:
        return (
            f"{len(self.sets)} sets, {self.num_counters(env)} counters, "
            f"{sum(self.waits_per_instance().values())} waits/instance over {len(self.waits)} ops, "
            f"{self.total_waits(env)} waits in all"
        )

    def __str__(self) -> str:
        lines = ["sets:"] + [f"  {s}" for s in self.sets]
        lines += ["waits:"] + [f"  {w}" for ws in self.waits.values() for w in ws]
        return "\n".join(lines)


# --- the pass ----------------------------------------------------------------


def derive_barriers(program: BlockProgram) -> BarrierPlan:
    """Counter families and waits for every producer -> consumer pair of ``program``."""
    buffers = {b.id: b for b in program.buffers}
    raw: list[tuple[BlockOp, int, BlockOp, _Pair]] = []
    for pos, consumer in enumerate(program.ops):
        for k, operand in enumerate(consumer.inputs):
            buf = buffers[operand.buffer]
            for producer in program.ops[:pos]:  # queue order: only earlier ops (liveness)
                if producer.output.buffer != operand.buffer:
                    continue
                if None not in (producer.regime, consumer.regime) and producer.regime != consumer.regime:
                    continue  # two bands of a row regime never run in one launch (ir/program.py: Regime)
                peer = buf.kind == "peer"
                pair = _derive_pair(_as_rank0(producer) if peer else producer, consumer, k, buf)
                if pair is not None:
                    raw.append((producer, k, consumer, pair, peer))
    # one batch through the simplifier, then dedupe counter families
    exprs = [e for *_, p, _peer in raw for e in (p.count, p.signal, p.index, p.expected)]
    simple = dict(zip(exprs, _simplify_many(exprs)))
    sets: dict[tuple[int, Dim, Dim, bool], BarrierSet] = {}
    waits: dict[int, list[Wait]] = {op.id: [] for op in program.ops}
    for producer, k, consumer, p, peer in raw:
        key = (producer.id, simple[p.count], simple[p.signal], peer)
        if peer and not (key[1].is_const and all(_COORD.match(x) for x in simple[p.expected].symbols())):
            # a peer counter is never reset: the host knows its count after n launches only if
            # every launch adds the same number
            raise ValueError(f"op{consumer.id} {consumer.kind}: waits on op{producer.id} {producer.kind} across ranks "
                             f"with a count that depends on runtime dims ({simple[p.count]}, {simple[p.expected]}); "
                             "a tensor-parallel collective needs a static shape")
        if key not in sets:
            sets[key] = BarrierSet(len(sets), producer.id, key[1], key[2], peer)
        w = Wait(consumer.id, k, sets[key].id, simple[p.index], simple[p.expected])
        if not any((x.barrier_set, x.index, x.expected) == (w.barrier_set, w.index, w.expected) for x in waits[consumer.id]):
            waits[consumer.id].append(w)
    launches = {op.id: _launch_count(op) for op in program.ops}
    waits = _drop_implied(program, list(sets.values()), waits, launches)
    # sets nobody waits on any more are not signalled either; renumber the rest
    used = sorted({w.barrier_set for ws in waits.values() for w in ws})
    renum = {old: new for new, old in enumerate(used)}
    by_id = {s.id: s for s in sets.values()}
    kept = [dataclasses.replace(by_id[i], id=renum[i]) for i in used]
    waits = {op: [dataclasses.replace(w, barrier_set=renum[w.barrier_set]) for w in ws] for op, ws in waits.items() if ws}
    return BarrierPlan(kept, waits, launches)


def _drop_implied(program: BlockProgram, sets: list[BarrierSet], waits: dict[int, list[Wait]],
                  launches: dict[int, Dim]) -> dict[int, list[Wait]]:
    """Drop the waits that another wait of the same instance already implies.

    A wait is *whole* when it waits for every instance of a producer P (one counter,
    expected = P's constant, non-zero launch count). Once all of P has finished, so has
    every op that P waits for whole, transitively (release/acquire chains are causal).
    So a consumer that waits for the whole of P need not wait on any of those ops:
    ``down = x_glu @ w + h`` waits for all of the GLU, which waited for all of the O
    projection that wrote ``h``, so the per-tile wait on ``h`` goes.
    """
    by_id = {s.id: s for s in sets}

    def whole(w: Wait) -> int | None:  # the producer a wait covers entirely
        s = by_id[w.barrier_set]
        if s.peer:  # (kept simple: a wait across ranks implies nothing and is never dropped)
            return None
        n = launches[s.producer]
        if s.count.is_const and s.count.value == 1 and n.is_const and n.value >= 1 and w.expected == n:
            return s.producer
        return None

    done_with: dict[int, set[int]] = {}  # op -> ops certainly finished once it has (queue order)
    out: dict[int, list[Wait]] = {}
    for op in program.ops:
        ws = waits.get(op.id, [])
        wholes = {p for w in ws if (p := whole(w)) is not None}
        implied = set().union(*(done_with[p] for p in wholes))
        out[op.id] = [w for w in ws if by_id[w.barrier_set].peer or by_id[w.barrier_set].producer not in implied]
        done_with[op.id] = wholes | implied
    return out


def _as_rank0(producer: BlockOp) -> BlockOp:
    """A peer buffer's producer as rank 0 runs it. Every source rank writes its own row of the peer
    buffer in the same pattern, and a peer family counts each source apart, so the counts derived
    for one source hold for each (the row itself is what the consumer's Full reads of every rank)."""
    writes = tuple(At(a.index.subs({"rank": 0})) if isinstance(a, At) else a for a in producer.writes)
    return dataclasses.replace(producer, writes=writes)


def _launch_count(op: BlockOp) -> Dim:
    n = const(1)
    for g in op.grid:
        n = n * g
    return n


def _in_buffer_coords(operand: Operand, buffer: Buffer, fp) -> tuple:
    """The footprint in the buffer's natural coordinates: the one place that sees views."""
    return tuple(fp) if not operand.views else tuple(pullback(operand.views, buffer.shape, fp))


def _simplify_many(exprs: Sequence[Dim]) -> list[Dim]:
    """Put in normal form here (``megaegg/ir/dimform.py``), the rest by the e-graph."""
    memo = CanonMemo()
    tidy = [canonical(e, memo) for e in exprs]
    try:
        return simplify_many(tidy) if tidy else []
    except Exception:  # an optimization only: keep the tidy form of whatever it cannot take
        out = []
        for e in tidy:
            try:
                out.append(simplify_many([e])[0])
            except Exception:
                out.append(e)
        return out


# --- per-dim accesses, normalized --------------------------------------------


@dataclass(frozen=True)
class _Fixed:
    """``[lo, hi)``, the same for every instance (Full, At/Span of runtime dims)."""

    lo: Dim
    hi: Dim


@dataclass(frozen=True)
class _Tiled:
    """``[base + _i{axis}*size, min(base + _i{axis}*size + size, limit))``."""

    axis: int
    size: int
    base: Dim
    limit: Dim


@dataclass(frozen=True)
class _Moving:
    """Any other instance-dependent ``[lo, hi)``; ``point`` when it is one element."""

    lo: Dim
    hi: Dim
    axes: frozenset
    point: bool


_Acc = Union[_Fixed, _Tiled, _Moving]


def _normalize(a, extent: Dim) -> _Acc:
    extent = as_dim(extent)
    if isinstance(a, Full):
        return _Fixed(const(0), extent)
    if isinstance(a, Tile):
        return _Tiled(a.axis, a.size, const(0), as_dim(a.stop) if a.stop is not None else extent)
    if isinstance(a, At):
        e = as_dim(a.index)
        axes = _coords(e)
        if not axes:
            return _Fixed(e, e + 1)
        ax, size, base = _one_coord(e)
        if size == 1:  # _iA + base: a 1-element tile
            return _Tiled(ax, 1, base, extent)
        return _Moving(e, e + 1, frozenset(axes), True)
    if isinstance(a, Span):
        lo, hi = as_dim(a.start), as_dim(a.stop)
        axes = _coords(lo) | _coords(hi)
        if not axes:
            return _Fixed(lo, hi)
        return _parse_tile(lo, hi, extent) or _Moving(lo, hi, frozenset(axes), False)
    raise TypeError(f"unknown access {a!r}")


def _parse_tile(lo: Dim, hi: Dim, extent: Dim) -> _Tiled | None:
    """Recognize ``Span(b + _iA*T, min(b + _iA*T + T, L))`` (or ``... + T``) as a tile."""
    ax, size, base = _one_coord(lo)
    if size is None or size <= 0:
        return None
    if const_diff(hi, lo) == size:
        return _Tiled(ax, size, base, extent)
    if hi.op == "min":
        for x, limit in (hi.args, hi.args[::-1]):
            if const_diff(x, lo) == size and not _coords(limit):
                return _Tiled(ax, size, base, limit)
    return None


def _instance_range(a: _Acc) -> tuple[Dim, Dim]:
    """``[lo, hi)`` of one instance (expressions of its ``_i*``); empty when ``hi <= lo``."""
    if isinstance(a, _Tiled):
        start = a.base + coord(a.axis) * a.size
        return start, dmin(start + a.size, a.limit)
    return a.lo, a.hi


def _hull(a: _Acc, extent: Dim, grid: Sequence[Dim]) -> tuple[Dim, Dim]:
    """``[lo, hi)`` containing every instance's range."""
    if isinstance(a, _Fixed):
        return a.lo, a.hi
    if isinstance(a, _Tiled):
        g = grid[a.axis]
        if _le(ceildiv(a.limit - a.base, a.size), g):  # the grid covers the range
            return a.base, a.limit
        return a.base, dmin(a.limit, a.base + g * a.size)
    lo, hi = _bounds(a.lo, grid), _bounds(a.hi, grid)
    return (lo[0] if lo else const(0)), (hi[1] if hi else as_dim(extent))


def _all_nonempty(a: _Acc, grid: Sequence[Dim]) -> bool:
    if isinstance(a, _Tiled):  # no instance past the last tile
        return _le(grid[a.axis], ceildiv(a.limit - a.base, a.size))
    if isinstance(a, _Fixed):
        return _le(a.lo + 1, a.hi)
    return a.point


# --- one producer -> consumer pair -------------------------------------------


@dataclass(frozen=True)
class _Pair:
    count: Dim
    signal: Dim
    index: Dim
    expected: Dim


@dataclass(frozen=True)
class _Group:
    """Producer instances along one axis grouped ``(p + r) // m``; the consumer waits group ``q``."""

    m: int
    r: int
    q: Dim


def _derive_pair(producer: BlockOp, consumer: BlockOp, k: int, buf: Buffer) -> _Pair | None:
    shape = tuple(as_dim(e) for e in buf.shape)
    pw = _in_buffer_coords(producer.output, buf, producer.writes)
    cr = _in_buffer_coords(consumer.inputs[k], buf, consumer.reads[k])
    P = [_normalize(a, e) for a, e in zip(pw, shape)]
    C = [_normalize(a, e) for a, e in zip(cr, shape)]
    phull = [_hull(a, e, producer.grid) for a, e in zip(P, shape)]
    chull = [_hull(a, e, consumer.grid) for a, e in zip(C, shape)]
    if any(_le(ch, pl) or _le(ph, cl) for (pl, ph), (cl, ch) in zip(phull, chull)):
        return None  # provably disjoint somewhere: no instance pair conflicts

    # which dims each producer axis moves; an axis moving exactly one dim as a tile may be grouped
    moves: dict[int, list[int]] = {}
    for d, a in enumerate(P):
        for ax in ({a.axis} if isinstance(a, _Tiled) else a.axes if isinstance(a, _Moving) else ()):
            moves.setdefault(ax, []).append(d)
    plans: dict[int, _Group | None] = {}
    for ax, g in enumerate(producer.grid):
        ds = moves.get(ax, [])
        ok = len(ds) == 1 and isinstance(P[ds[0]], _Tiled)
        plan = _match(P[ds[0]], C[ds[0]]) if ok else None
        plans[ax] = None if plan is not None and plan.r == 0 and _le(g, plan.m) else plan  # one group: collapse

    # counter coords per axis, row-major
    count, signal, index, expected = const(1), const(0), const(0), const(1)
    for ax, g in enumerate(producer.grid):
        plan = plans[ax]
        if plan is None:  # collapsed: every instance along the axis signals coord 0
            expected = expected * g
            continue
        m, r, q = plan.m, plan.r, plan.q
        n = ceildiv(g + r, m)
        count, signal, index = count * n, signal * n + (coord(ax) + r) // m, index * n + q
        if r:
            expected = expected * (dmin(g, q * m + (m - r)) - dmax(0, q * m - r))
        elif m > 1:
            qb = _bounds(q, consumer.grid)
            full = qb is not None and _le((qb[1] + 1) * m, g)  # no consumer reaches the ragged last group
            expected = expected * (m if full else dmin(m, g - q * m))

    # overlap guards: 0 where this consumer instance misses the producer's region on a dim
    guards = const(1)
    for d, (a, c) in enumerate(zip(P, C)):
        grouped = isinstance(a, _Tiled) and plans.get(a.axis) is not None
        (pl, ph), (cl, ch) = phull[d], chull[d]
        inside = _le(pl, cl) and _le(ch, ph)
        if grouped:  # q must be in range whenever expected > 0
            needed = not (inside and _all_nonempty(c, consumer.grid))
        else:  # precision only: drop when every consumer instance overlaps
            covers = isinstance(c, _Fixed) and _le(c.lo, pl) and _le(ph, c.hi)
            needed = not (inside or covers)
        if needed:
            guards = guards * _overlaps(c, consumer.grid, phull[d], chull[d])
    return _Pair(count, signal, index, guards * expected)


def _overlaps(c: _Acc, grid: Sequence[Dim], phull: tuple[Dim, Dim], chull: tuple[Dim, Dim]) -> Dim:
    """1 if this consumer instance's range meets ``[pl, ph)``, else 0 (a min/max expression)."""
    (pl, ph), (cl, ch) = phull, chull
    lo, hi = _instance_range(c)
    if _all_nonempty(c, grid):  # [lo, hi) not empty: one comparison decides when the other side is known
        if _le(pl, cl):
            return _lt01(lo, ph)
        if _le(ch, ph):
            return _lt01(pl, hi)
    lo = lo if _le(pl, cl) else dmax(lo, pl)
    hi = hi if _le(ch, ph) else dmin(hi, ph)
    return _lt01(lo, hi)


def _lt01(a: Dim, b: Dim) -> Dim:
    """``1 if a < b else 0`` for integers."""
    return dmin(1, dmax(0, b - a))


def _match(p: _Tiled, c: _Acc) -> _Group | None:
    """Group producer tiles along ``p.axis`` so that consumer instance ``c`` needs one group."""
    tp = p.size
    if isinstance(c, _Tiled):
        delta = const_diff(c.base, p.base)
        if delta is None:
            return None
        tc, cc = c.size, coord(c.axis)
        if tc % tp == 0 and delta % tp == 0:  # consumer tile = m whole producer tiles
            m, k = tc // tp, delta // tp
            r = (-k) % m
            return _Group(m, r, cc + (k + r) // m)
        if tp % tc == 0 and delta % tc == 0:  # consumer tile inside one producer tile
            return _Group(1, 0, (cc + delta // tc) // (tp // tc))
        return None  # non-nested tiles: the axis collapses (sound, less precise)
    # a range of constant width w at offset x from the producer's base: it lies in the group of
    # m = ceil(w / tp) tiles x // (m*tp) when x is visibly a multiple of some g >= w dividing m*tp
    x, w = poly(c.lo - p.base), const_diff(c.hi, c.lo)
    if w is None or w < 1:
        return None
    if not any(x):  # a constant range: inside one tile?
        x0 = x.get((), 0)
        if x0 // tp == (x0 + w - 1) // tp:
            return _Group(1, 0, const(x0 // tp))
    m = -(-w // tp)
    if w <= math.gcd(m * tp, *(abs(k) for k in x.values())):
        return _Group(m, 0, (c.lo - p.base) // (m * tp))
    return None


# --- small symbolic reasoning on dimform's normal form: a coordinate term, bounds, <= ---


def _coords(e: Dim) -> set[int]:
    return {int(m[1]) for s in e.symbols() if (m := _COORD.match(s))}


def _one_coord(e: Dim) -> tuple[int | None, int | None, Dim | None]:
    """``(A, k, base)`` when ``e == _iA * k + base`` with ``base`` free of grid coordinates, else Nones."""
    p = poly(e)
    moving = [m for m in p if any(_coords(a) for a in m)]
    if len(moving) != 1 or len(moving[0]) != 1 or moving[0][0].op != "sym":
        return None, None, None
    (m,) = moving
    return _coords(m[0]).pop(), p[m], from_poly({t: c for t, c in p.items() if t != m})


def _le(a: Dim, b: Dim) -> bool:
    """Provably ``a <= b`` for all non-negative runtime dims (False may mean unknown)."""
    a, b = as_dim(a), as_dim(b)
    if nonneg(b - a):
        return True
    if a.op == "min" and (_le(a.args[0], b) or _le(a.args[1], b)):
        return True
    if a.op == "max" and _le(a.args[0], b) and _le(a.args[1], b):
        return True
    if b.op == "max" and (_le(a, b.args[0]) or _le(a, b.args[1])):
        return True
    return b.op == "min" and _le(a, b.args[0]) and _le(a, b.args[1])


def _bounds(e: Dim, grid: Sequence[Dim]) -> tuple[Dim, Dim] | None:
    """Inclusive ``[lo, hi]`` of ``e`` over the grid (``_iA`` in ``[0, grid[A] - 1]``), if monotone."""
    if e.op == "const":
        return e, e
    if e.op == "sym":
        m = _COORD.match(e.args[0])
        if not m:
            return e, e  # a runtime dim is one value for the whole launch
        ax = int(m[1])
        return (const(0), as_dim(grid[ax]) - 1) if ax < len(grid) else None
    a, b = (_bounds(x, grid) for x in e.args)
    if a is None or b is None:
        return None
    if e.op == "add":
        return a[0] + b[0], a[1] + b[1]
    if e.op in ("min", "max"):
        f = dmin if e.op == "min" else dmax
        return f(a[0], b[0]), f(a[1], b[1])
    k = e.args[1]
    if e.op == "mul" and k.is_const:
        return (a[0] * k, a[1] * k) if k.value >= 0 else (a[1] * k, a[0] * k)
    if e.op == "mul" and nonneg(a[0]) and nonneg(b[0]):
        return a[0] * b[0], a[1] * b[1]
    if e.op in ("floordiv", "ceildiv") and k.is_const and k.value > 0:
        return binary(e.op, a[0], k), binary(e.op, a[1], k)
    if e.op == "mod" and k.is_const and k.value > 0:
        return const(0), const(k.value - 1)
    return None
