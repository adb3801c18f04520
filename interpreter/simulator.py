"""A CPU simulator of the megakernel: the same queue, barriers and expressions.

Simulated SMs claim instances in queue order, wait on the derived barrier
counters, run each instance's CPU semantics (the kind's ``cpu``) and signal. An
:class:`Interleaving` picks which SM moves next at random, or adversarially (one chosen op's
instances are delayed as long as anything else can move). Scratch buffers start
as NaN, and every element an instance reads must already have been written in
this launch (or come from outside it): a barrier that lets a consumer in early
fails the run, naming the op, the instance and the buffer. An ``accum`` element
(a sum several instances add into, zero at launch) is ready once every instance
that adds into it has run, and so is an element of a ``last_writer`` op's output (the
last of the instances that share it writes it: ``attn_partial_merge``).

:func:`run_launches` runs the ranks of a tensor-parallel group together over several launches, one
Simulation a rank and launch, each rank with its own SMs and claim order and its launches one after
the other, as on its stream: an instance that writes a ``peer`` buffer writes its row into every
rank's copy (the half of the launch's parity) and signals every rank's counter of its source rank;
peer counters count across launches, and a wait on a peer family waits for every source rank to
reach the launch number times its count. The interleaving mixes the ranks at random, or delays
one rank (and one op) as long as anything else can move, so the others run ahead into their next
launches; a rank that writes into a half another rank's earlier launch still reads fails the run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..blockops import REGISTRY
from ..ir.footprint import footprint_slices, grid_coords
from ..lowering.queue import WorkQueue
from ..ir.program import Operand


class SimulationError(AssertionError):
    """The queue misbehaved: an early read, a double write, or a deadlock."""


@dataclass(frozen=True)
class Interleaving:
    """How the simulated SMs interleave: ``sms`` of them, the random order drawn from ``seed``;
    ``adversarial``: one op's instances (and, across ranks, one rank) delayed as long as anything
    else can move. (Not the rewrite stage's ``schedule.py``, the order of its passes.)"""

    sms: int = 8
    seed: int = 0
    adversarial: bool = False  # delay one op's instances as long as possible


@dataclass
class RankState:
    """What a rank keeps across its launches: the peer counters of its region (never reset) and how
    many launches it finished."""

    counters: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (set, index, source rank)
    done: int = 0


def poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-(2**31))


class Simulation:
    def __init__(self, queue: WorkQueue, buffers: dict[int, torch.Tensor], env: dict[str, int], rank: int = 0,
                 seq: int = 1, state: RankState | None = None, halves: int = 2) -> None:
        """``buffers`` maps every buffer id to a flat tensor; scratch ones are poisoned here (peer ones
        by their owner: a half serves several launches). ``rank``: this device's rank in its
        tensor-parallel group, ``seq`` the launch's number (from 1), ``state`` what the rank keeps
        across launches, ``halves`` how many copies of the peer buffers a rank's region holds
        (``run_launches``)."""
        self.q, self.buf, self.env, self.rank = queue, buffers, {**env, "rank": rank}, rank
        self.seq, self.state, self.halves = seq, state or RankState(), halves
        self.group: list[Simulation] = [self]  # this launch's simulations of every rank, by rank
        self._index: dict[int, torch.Tensor] = {}  # flat element ids per buffer, built once
        self.ready = {}
        fresh = ("scratch", "peer")  # written during the launch: nothing in them is ready at first
        for b in queue.program.buffers:
            if b.kind == "scratch":
                poison(buffers[b.id])
            self.ready[b.id] = torch.full((buffers[b.id].numel(),), b.kind not in fresh)
        self.written = {b: torch.zeros_like(r) for b, r in self.ready.items()}
        self.instances = []  # (entry index, local index) in queue order
        for k, e in enumerate(queue.entries):
            n = e.launch.eval(env)
            self.instances += [(k, i) for i in range(max(0, n))]
        self.adders: dict[int, torch.Tensor] = {}  # accum buffer -> instances yet to add into each element
        outputs = {e.op.output.buffer for e in queue.entries}
        for e in queue.entries:  # an op's own working buffers: nothing else may write them
            for j in REGISTRY[e.op.kind].internal_inputs(e.op):
                b = queue.program.buffers[e.op.inputs[j].buffer]
                if b.id in outputs or b.kind not in ("scratch", "accum"):
                    raise SimulationError(f"op{e.op.id} {e.op.kind}: internal input {b.name!r} is written by an op "
                                          f"or is not a scratch / accum buffer")
        for k, i in self.instances:  # elements written in place this launch are not ready yet
            op = queue.entries[k].op
            kind = queue.program.buffers[op.output.buffer].kind
            idx = self.elements(op.output, op.writes, self.coords(k, i))
            if self.shared_write(op):
                pending = self.adders.setdefault(op.output.buffer, torch.zeros_like(self.ready[op.output.buffer], dtype=torch.int64))
                pending[idx] += 1
            if kind not in fresh:
                self.ready[op.output.buffer][idx] = False
        self.counters: dict[tuple[int, int], int] = {}  # (set, index) -> signals this launch (peer sets: state)
        self.peer_sets = {s.id for s in queue.barriers.sets if s.peer}
        # buffers written during the launch: only their reads need checking
        self.tracked = {b.id for b in queue.program.buffers if b.kind in fresh}
        self.tracked |= {e.op.output.buffer for e in queue.entries}

    def shared_write(self, op) -> bool:
        """Whether ``op``'s instances share output elements that are ready once all of them ran: an
        ``accum`` sum, or a ``last_writer`` op's output."""
        return self.q.program.buffers[op.output.buffer].kind == "accum" or REGISTRY[op.kind].last_writer

    # --- addressing ------------------------------------------------------------------
    def coords(self, k: int, i: int) -> dict[str, int]:
        op = self.q.entries[k].op
        grid = [g.eval(self.env) for g in op.grid] or [1]
        return {**self.env, **{f"_i{a}": c for a, c in enumerate(grid_coords(i, grid))}}

    def met(self, set_id: int, index: int, expected: int) -> bool:
        """Whether counter ``index`` of a set has ``expected`` signals of this launch; a peer set's
        counter of every source rank, counting across launches, ``seq`` times that many."""
        if set_id in self.peer_sets:
            return all(self.state.counters.get((set_id, index, r), 0) >= self.seq * expected
                       for r in range(self.q.program.ranks))
        return self.counters.get((set_id, index), 0) >= expected

    def view(self, o: Operand, env: dict[str, int], base: torch.Tensor | None = None) -> torch.Tensor:
        lay = self.q.layout(o)
        t = self.buf[o.buffer] if base is None else base
        shape = [d.eval(env) for d in lay.shape]
        stride = [d.eval(env) for d in lay.stride]
        return t.as_strided(shape, stride, t.storage_offset() + lay.offset.eval(env))

    def elements(self, o: Operand, fp, env: dict[str, int]) -> torch.Tensor:
        if o.buffer not in self._index:
            self._index[o.buffer] = torch.arange(self.buf[o.buffer].numel())
        index = self._index[o.buffer]
        region = self.view(o, env, index)[footprint_slices(fp, o.shape, env)]
        return region.reshape(-1)

    # --- one instance ----------------------------------------------------------------
    def waits_met(self, k: int, i: int) -> bool:
        e = self.q.entries[k]
        env = self.coords(k, i)
        return all(self.met(w.barrier_set, w.index.eval(env), w.expected.eval(env)) for w in e.waits)

    def where(self, k: int, i: int) -> str:
        op = self.q.entries[k].op
        return f"op{op.id} {op.kind} (entry {k}) instance {i}"

    def execute(self, k: int, i: int) -> None:
        """Run instance ``i`` of entry ``k`` and signal."""
        e = self.q.entries[k]
        op = e.op
        env = self.coords(k, i)
        where = self.where(k, i)
        internal = REGISTRY[op.kind].internal_inputs(op)
        for j, (o, fp) in enumerate(zip(op.inputs, op.reads)):
            if o.buffer not in self.tracked or j in internal:  # weights, constants, inputs nothing writes
                continue
            idx = self.elements(o, fp, env)
            if not bool(self.ready[o.buffer][idx].all()):
                name = self.q.program.buffers[o.buffer].name
                raise SimulationError(f"{where} read unwritten elements of buffer {name!r}: a barrier let it in early")
        out_idx = self.elements(op.output, op.writes, env)
        pending = self.adders.get(op.output.buffer) if self.shared_write(op) else None
        if pending is None and bool(self.written[op.output.buffer][out_idx].any()):
            raise SimulationError(f"{where} writes elements another instance already wrote in this launch")
        ins = [self.view(o, env) for o in op.inputs]
        REGISTRY[op.kind].cpu(op, env, ins, self.view(op.output, env))
        if pending is not None:  # an accum sum is ready when its last adder has run
            pending[out_idx] -= 1
            self.ready[op.output.buffer][out_idx] = pending[out_idx] == 0
        else:
            self.ready[op.output.buffer][out_idx] = True
        self.written[op.output.buffer][out_idx] = True
        if self.q.program.buffers[op.output.buffer].kind == "peer":  # the same row of every rank's copy
            for other in self.group:
                if other is not self:
                    if other.state.done < self.seq - self.halves:  # its launch that used this half still runs
                        raise SimulationError(f"rank {self.rank} launch {self.seq} {where} writes rank {other.rank}'s "
                                              f"peer buffer half, which its launch {self.seq - self.halves} still reads")
                    if bool(other.written[op.output.buffer][out_idx].any()):
                        raise SimulationError(f"rank {self.rank} {where} writes peer elements already written on rank {other.rank}")
                    other.buf[op.output.buffer][out_idx] = self.buf[op.output.buffer][out_idx]
                    other.ready[op.output.buffer][out_idx] = True
                    other.written[op.output.buffer][out_idx] = True
        for s in e.signals:
            if s.peer:  # this rank's counter on every rank
                for other in self.group:
                    key = (s.id, s.signal.eval(env), self.rank)
                    other.state.counters[key] = other.state.counters.get(key, 0) + 1
            else:
                key = (s.id, s.signal.eval(env))
                self.counters[key] = self.counters.get(key, 0) + 1

    # --- the interleaving ------------------------------------------------------------------
    def run(self, interleaving: Interleaving) -> None:
        rng = random.Random(interleaving.seed)
        victim = rng.randrange(len(self.q.entries)) if interleaving.adversarial and self.q.entries else None
        held: list[tuple[int, int] | None] = [None] * interleaving.sms
        nxt = 0
        while nxt < len(self.instances) or any(h is not None for h in held):
            movable = [s for s, h in enumerate(held) if (h is None and nxt < len(self.instances)) or (h is not None and self.waits_met(*h))]
            if not movable:
                stuck = [h for h in held if h is not None]
                k, i = stuck[0]
                op = self.q.entries[k].op
                raise SimulationError(f"deadlock: op{op.id} {op.kind} instance {i} waits forever ({len(stuck)} SMs stuck)")
            preferred = [s for s in movable if held[s] is None or held[s][0] != victim]
            s = rng.choice(preferred or movable)
            if held[s] is None:
                held[s] = self.instances[nxt]
                nxt += 1
            else:
                self.execute(*held[s])
                held[s] = None


def run_launches(launches: list[list[Simulation]], interleaving: Interleaving) -> None:
    """Launches of a tensor-parallel group, ``launches[t][r]`` rank ``r``'s launch ``t`` (numbered
    ``t + 1``, sharing the rank's ``state``): each rank claims its own instances in queue order on
    ``interleaving.sms`` SMs and starts its next launch once the last one finished; the next move is a
    random SM of a random rank, or, adversarially, anything but one victim rank and one victim op
    while anything else can move. Fails on an early read, a double write, a peer half overwritten
    early or a deadlock, naming the rank."""
    ranks = len(launches[0])
    for group in launches:
        for s in group:
            s.group = group
    rng = random.Random(interleaving.seed)
    entries = len(launches[0][0].q.entries)
    victim_op = rng.randrange(entries) if interleaving.adversarial and entries else None
    victim_rank = rng.randrange(ranks) if interleaving.adversarial else None
    cur = [0] * ranks  # each rank's current launch
    held = [[None] * interleaving.sms for _ in range(ranks)]
    nxt = [0] * ranks

    def sim(r: int) -> Simulation:
        return launches[cur[r]][r]

    while any(c < len(launches) for c in cur):
        for r in range(ranks):  # a launch whose instances all ran ends; the rank's next one starts
            if cur[r] < len(launches) and nxt[r] == len(sim(r).instances) and all(h is None for h in held[r]):
                sim(r).state.done += 1
                cur[r], nxt[r] = cur[r] + 1, 0
        active = [r for r in range(ranks) if cur[r] < len(launches)]
        movable = [(r, s) for r in active for s, h in enumerate(held[r])
                   if (h is None and nxt[r] < len(sim(r).instances)) or (h is not None and sim(r).waits_met(*h))]
        if not active:
            break
        if not movable:
            r, h = next((r, h) for r in active for h in held[r] if h is not None)
            op = sim(r).q.entries[h[0]].op
            raise SimulationError(f"deadlock: rank {r} launch {cur[r] + 1} op{op.id} {op.kind} instance {h[1]} waits forever")
        preferred = [(r, s) for r, s in movable if r != victim_rank and (held[r][s] is None or held[r][s][0] != victim_op)]
        r, s = rng.choice(preferred or movable)
        if held[r][s] is None:
            held[r][s] = sim(r).instances[nxt[r]]
            nxt[r] += 1
        else:
            try:
                sim(r).execute(*held[r][s])
            except SimulationError as e:
                raise SimulationError(f"rank {r}: {e}") from None
            held[r][s] = None
