"""The symbolic work queue and the memory plan.

One queue entry per block op, in topological order: its launch count and every
offset, barrier index and expected count stay *expressions* of the runtime dims,
evaluated on the device each launch. Changing ``pos`` changes only the dims array.

Memory plan: scratch buffers live in one arena, each at its own offset. Nothing is
reused inside a launch (docs/design.md, barrier rule 6), so no anti-dependency barriers
are needed. Weights and constants are bound once; inputs, KV caches and outputs
are the caller's tensors, passed by pointer each call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ..dims import Dim, as_dim, upper_bound
from ..ir.layout import Layout, layout_of
from ..ir.program import BlockOp, BlockProgram, Operand
from .barriers import BarrierPlan, BarrierSet, Wait, derive_barriers

ARENA_ALIGN = 256
ACCUM_ALIGN_WORDS = 32


@dataclass(frozen=True)
class QueueEntry:
    op: BlockOp
    launch: Dim  # instances, an expression of the runtime dims
    waits: tuple[Wait, ...]
    signals: tuple[BarrierSet, ...]


@dataclass(frozen=True)
class MemoryPlan:
    arena_bytes: int
    arena_offset: dict[int, int]  # scratch buffer id -> byte offset in the arena
    pointer_slot: dict[int, int]  # non-arena buffer id -> slot in the kernel's pointer table
    counter_base: dict[int, int]  # barrier set id -> first counter
    counters: int  # counters per parity (barrier counters, then accum buffers)
    accum_word: dict[int, int] = field(default_factory=dict)  # accum buffer id -> first word in the bank
    peer: PeerPlan | None = None  # a tensor-parallel program's peer region
    # a scratch buffer only one band of the row regime uses -> the most rows it is sized for (band_rows)
    band_rows: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerPlan:
    """Each rank's peer region, which every rank of the group writes into: first the peer counters
    (``ranks`` per counter of every peer barrier set: one per source rank, never reset), then the
    peer buffers twice, the launch's half chosen by the parity of its sequence number (a rank one
    launch ahead writes the other half: docs/parallel.md)."""

    ranks: int
    counter_base: dict[int, int]  # peer barrier set id -> its first counter
    counters: int  # counters of all peer sets; counter k of source rank r is u32 word k * ranks + r
    offset: dict[int, int]  # peer buffer id -> byte offset in a half
    half_bytes: int

    def word(self, counter: int, source: int) -> int:
        """The u32 word of counter ``counter`` (of all peer sets) counting rank ``source``'s signals."""
        return counter * self.ranks + source

    @property
    def data_at(self) -> int:
        """Byte offset of the first half of the buffers (after the counters' words)."""
        return -(-4 * self.counters * self.ranks // ARENA_ALIGN) * ARENA_ALIGN

    @property
    def region_bytes(self) -> int:
        return self.data_at + 2 * self.half_bytes


@dataclass(frozen=True)
class WorkQueue:
    program: BlockProgram
    barriers: BarrierPlan
    entries: tuple[QueueEntry, ...]
    memory: MemoryPlan
    max_dims: dict[str, int]

    def layout(self, operand: Operand) -> Layout:
        layout = layout_of(self.program.buffers[operand.buffer].shape, operand.views)
        if layout is None:  # the rewrite inserts copies, so this is a stage-invariant breach
            raise AssertionError(f"operand {operand} has no strided layout")
        return layout

    def spins(self, e: QueueEntry) -> list[tuple[Wait, int | None]]:
        """The counters an instance of entry ``e`` spins on, in order: (wait, None) for a counter of
        this rank; a wait on a peer family is one spin per source rank, (wait, rank)."""
        out = []
        for w in e.waits:
            out += [(w, r) for r in range(self.program.ranks)] if self.barriers.sets[w.barrier_set].peer else [(w, None)]
        return out

    def summary(self) -> dict[str, int]:
        return {
            "entries": len(self.entries),
            "barrier_sets": len(self.barriers.sets),
            "counters": self.memory.counters,
            "waits": sum(len(e.waits) for e in self.entries),
            "arena_bytes": self.memory.arena_bytes,
        }


def build_queue(program: BlockProgram, max_dims: Mapping[str, int]) -> WorkQueue:
    if program.regime is not None:  # each derived dim is the row count itself, or 0
        top = max_dims.get(program.regime.symbol, 0)
        max_dims = {**max_dims, **{d: top for d in program.regime.derived}}
    missing = set(program.symbols) - set(max_dims)
    if missing:
        raise ValueError(f"no maximum given for runtime dim(s) {sorted(missing)}")
    barriers = derive_barriers(program)
    signals: dict[int, list[BarrierSet]] = {}
    for s in barriers.sets:
        signals.setdefault(s.producer, []).append(s)
    entries = tuple(
        QueueEntry(op, op.launch_count if op.grid else as_dim(1), tuple(barriers.waits.get(op.id, ())),
                   tuple(signals.get(op.id, ())))
        for op in program.ops
    )
    return WorkQueue(program, barriers, entries, plan_memory(program, barriers, max_dims), dict(max_dims))


def band_rows(program: BlockProgram, max_dims: Mapping[str, int]) -> dict[int, tuple[int, int]]:
    """The scratch buffers that only one band of the program's row regime uses: buffer id -> (band, the
    most rows that band runs). Only that band's launches touch them, at no more rows than that."""
    regime = program.regime
    if regime is None:
        return {}
    users: dict[int, set] = {}
    for op in program.ops:
        for o in (*op.inputs, op.output):
            users.setdefault(o.buffer, set()).add(op.regime)
    top = max_dims[regime.symbol]
    return {b.id: (band, regime.most_rows(band, top)) for b in program.buffers
            if b.kind == "scratch" and len(users.get(b.id, ())) == 1 and (band := next(iter(users[b.id]))) is not None}


def plan_memory(program: BlockProgram, barriers: BarrierPlan, max_dims: Mapping[str, int]) -> MemoryPlan:
    """The arena (scratch buffers), pointer slots, counters and accum words. A scratch buffer that one band
    of a row regime uses alone is sized for that band's most rows, and the bands' own buffers share one
    region of the arena: a launch runs one band (a band's intermediates live within its launch), so
    bands of four programs take the arena of about their largest instead of the sum (perf-notes #88)."""
    owned = band_rows(program, max_dims)

    def nbytes(b) -> int:  # at the largest dims (a band's own buffer: its band's most rows)
        dims = max_dims if b.id not in owned else {**max_dims, program.regime.symbol: owned[b.id][1]}
        n = b.dtype.itemsize * math.prod(upper_bound(d, dims) for d in b.shape)
        return -(-n // ARENA_ALIGN) * ARENA_ALIGN

    arena, offset, slots = 0, {}, {}
    for b in program.buffers:
        if b.kind in ("accum", "peer"):  # in the counter bank, or the peer region, below
            continue
        if b.kind == "scratch" and b.id not in owned:
            offset[b.id] = arena
            arena += nbytes(b)
        elif b.kind != "scratch":
            slots[b.id] = len(slots)
    band_end: dict[int, int] = {}  # each band's own buffers from the same start
    for b in program.buffers:
        if b.id in owned:
            band = owned[b.id][0]
            offset[b.id] = band_end.get(band, arena)
            band_end[band] = offset[b.id] + nbytes(b)
    arena = max([arena, *band_end.values()])
    base, counters = {}, 0
    for s in barriers.sets:
        if s.peer:
            continue
        base[s.id] = counters
        counters += max(1, upper_bound(s.count, max_dims))
    # accum buffers (f32 sums) live in the counter bank, which every launch zeroes for the
    # next one: they start at 0 with no host work. 128-byte aligned for vector atomics.
    accum = {}
    for b in program.buffers:
        if b.kind == "accum":
            counters = -(-counters // ACCUM_ALIGN_WORDS) * ACCUM_ALIGN_WORDS
            accum[b.id] = counters
            counters += math.prod(upper_bound(d, max_dims) for d in b.shape)
    counters = -(-counters // ACCUM_ALIGN_WORDS) * ACCUM_ALIGN_WORDS  # the second bank stays aligned
    return MemoryPlan(max(arena, ARENA_ALIGN), offset, slots, base, counters, accum, plan_peer(program, barriers),
                      {b: rows for b, (_, rows) in owned.items()})


def plan_peer(program: BlockProgram, barriers: BarrierPlan) -> PeerPlan | None:
    peers = [b for b in program.buffers if b.kind == "peer"]
    if not peers:
        return None
    base, counters = {}, 0
    for s in barriers.sets:
        if s.peer:
            base[s.id] = counters
            counters += s.count.value
    offset, half = {}, 0
    for b in peers:
        offset[b.id] = half
        half += -(-b.dtype.itemsize * math.prod(d.value for d in b.shape) // ARENA_ALIGN) * ARENA_ALIGN
    return PeerPlan(program.ranks, base, counters, offset, half)
