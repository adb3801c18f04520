"""The weight page ring on the CPU simulator (docs/design.md, "Weight pages"; cuda/pages.cuh).

With ``Schedule.ring`` set, each simulated SM is two actors, as a block of the megakernel is
with ``MEGA_PAGES > 0`` (cuda/megakernel.cu):

- its **loader** claims instances in queue order into a ring of ``slots`` instruction slots (at
  most ``slots`` claimed and unfinished; while the body is busy, only an instance whose weights
  it streams), or with ``Schedule.static`` takes its SM's own next instance (``s, s + sms, ...``)
  whenever a slot is free, then fills that instance's pages in order: page ``k`` of the SM lives in ring
  slot ``k % pages`` and is filled only after the body released page ``k - pages``. A fill is a
  copy that lands later, in any order. The loader never waits on an activation counter;
- its **body** takes the slots in order, waits for the instance's barrier counters, reads its
  pages in order (each once its copy landed), checks that each holds exactly the rows it
  expects, releases it, and computes the instance from the page copies: every other weight
  row reads as NaN, so rows that did not come through the pages spoil the result.

Both sides take an instance's streams from ``render.paged_streams``, the rule that renders the
kernel's loader and body code. The scheduler moves one actor (or lands one copy) at a time, at
random; adversarially, one op's instances and copies wait as long as anything else can move.
``Breakage`` (tests only) breaks one rule of the protocol, to show that the checks catch it.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .render import Stream, paged_streams
from .simulator import Schedule, Simulation, SimulationError


@dataclass(frozen=True)
class Breakage:
    """Test-only protocol violations: a run with any of them set must fail."""

    refill_before_release: bool = False  # the loader fills page k before page k - pages is released
    read_before_fill: bool = False  # the body reads page k before its copy landed
    loader_streams_reversed: bool = False  # the loader streams an instance's inputs in reverse order


@dataclass(frozen=True)
class Ring:
    """The page ring's geometry (MEGA_PAGES, MEGA_PAGE_BYTES, MEGA_SLOTS)."""

    pages: int = 10
    page_bytes: int = 16384
    slots: int = 2
    breakage: Breakage = Breakage()

    def __post_init__(self) -> None:
        if self.pages < 1 or self.slots < 1:
            raise ValueError(f"a page ring needs at least one page and one slot, got {self}")

    def defines(self) -> dict[str, int]:
        """The kernel defines this ring stands for: what ``paged_streams`` decides with."""
        return {"MEGA_PAGES": self.pages, "MEGA_PAGE_BYTES": self.page_bytes, "MEGA_SLOTS": self.slots}


@dataclass(frozen=True)
class PageTag:
    """What a page holds: rows ``[first, first + n)`` of input ``input`` of instance ``instance`` of
    queue entry ``entry``."""

    entry: int
    instance: int
    input: int
    first: int
    n: int

    def __str__(self) -> str:
        return f"entry {self.entry} instance {self.instance} input {self.input} rows {self.first}..{self.first + self.n - 1}"


@dataclass(frozen=True)
class Page:
    number: int  # k: the SM's k-th page this launch
    tag: PageTag
    rows: torch.Tensor  # the copied weight rows, [n, row elements]


@dataclass(frozen=True)
class Claim:
    """An instruction slot: instance ``i`` of queue entry ``k``; ``stop``: no more instances."""

    k: int = -1
    i: int = -1
    page0: int = 0  # the instance's first page
    stop: bool = False


@dataclass
class BodyWork:
    """The body's progress on the instance at the head of its slots."""

    claim: Claim
    expected: list[PageTag]  # its pages, in the order the body reads them
    read: list[Page] = field(default_factory=list)
    waited: bool = False


@dataclass
class SM:
    index: int
    ring: list[Page | None]  # what each ring slot holds
    slots: deque[Claim] = field(default_factory=deque)  # handed to the body, not finished
    claims: int = 0  # instances (and the stop) handed over
    finished: int = 0  # instances the body finished
    to_fill: deque[tuple[int, PageTag, Stream]] = field(default_factory=deque)  # claimed pages not yet issued
    issued: int = 0
    in_flight: dict[int, Page] = field(default_factory=dict)  # page number -> copy not landed yet
    landed: set[int] = field(default_factory=set)  # pages whose copy landed, not yet read
    released: int = 0  # pages the body released (in order): page k is free once k < released
    body: BodyWork | None = None
    stopped: bool = False  # the loader handed over its stop
    done: bool = False  # the body took it


@dataclass
class RingStats:
    """What a run exercised (tests check the interesting paths were taken)."""

    pages: int = 0  # pages filled, all SMs
    claimed_ahead: int = 0  # instances a loader claimed while its body was busy
    wrapped: int = 0  # instances with more pages than the ring: pages reused within one instance


@dataclass(frozen=True)
class Move:
    entry: int | None  # the queue entry it advances (None: a claim): the adversary delays one
    act: Callable[[], None]


def page_plan(k: int, i: int, streams: list[Stream], env: dict[str, int], page_bytes: int) -> list[PageTag]:
    """Instance ``i`` of entry ``k``: its pages in stream order: a stream of n rows takes ceil(n / rows per page) pages."""
    tags = []
    for s in streams:
        per_page = page_bytes // s.row_bytes
        rows = s.row_range(env)
        tags += [PageTag(k, i, s.input, r, min(per_page, rows.stop - r)) for r in range(rows.start, rows.stop, per_page)]
    return tags


def row_elements(s: Stream, tag: PageTag) -> torch.Tensor:
    """Flat element indices of a page's rows in the weight buffer, [n, row elements]."""
    return _row_elements(s.row_stride, s.row_elems, tag.first, tag.n)


@functools.lru_cache(maxsize=4096)
def _row_elements(row_stride: int, row_elems: int, first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n)[:, None] * row_stride + torch.arange(row_elems)[None, :]


def copy_rows(weight: torch.Tensor, s: Stream, tag: PageTag) -> torch.Tensor:
    """The loader's copy: the page's weight rows, as they land in shared memory."""
    return weight[row_elements(s, tag)].clone()


class RingRun:
    """One launch on the page ring: the shared claim counter, the SMs' loaders and bodies."""

    def __init__(self, sim: Simulation, schedule: Schedule) -> None:
        self.sim, self.ring = sim, schedule.ring
        self.streams = [paged_streams(sim.q, e.op, self.ring.defines()) for e in sim.q.entries]
        self.sms = [SM(s, [None] * self.ring.pages) for s in range(schedule.sms)]
        self.static = schedule.static  # SM s takes instances s, s + sms, ... (no claim counter)
        self.next = 0  # the claim counter: instances are claimed in queue order
        self.stats = RingStats()
        # weight buffer -> a poisoned copy the bodies read their pages into, and which elements it holds
        self.staging: dict[int, torch.Tensor] = {}
        self.carried: dict[int, torch.Tensor] = {}

    # --- the loader ------------------------------------------------------------------
    def loader_moves(self, sm: SM) -> list[Move]:
        if sm.to_fill:  # it fills the claimed instance's pages before it claims again
            k, tag, _ = sm.to_fill[0]
            free = k < self.ring.pages or k - self.ring.pages < sm.released
            if free or self.ring.breakage.refill_before_release:
                return [Move(tag.entry, lambda: self.fill(sm))]
            return []
        if sm.stopped or sm.claims - sm.finished >= self.ring.slots:
            return []
        if self.static:  # its own next instance, whenever a slot is free
            return [Move(None, lambda: self.claim(sm, sm.finished == sm.claims))]
        idle = sm.finished == sm.claims
        # busy: only an instance whose weights go through the pages (its loads start now); any
        # other waits for an idle body, so it is never parked behind a busy one (megakernel.cu)
        if idle or (self.next < len(self.sim.instances) and self.is_paged(self.next)):
            return [Move(None, lambda: self.claim(sm, idle))]
        return []

    def is_paged(self, g: int) -> bool:
        return self.streams[self.sim.instances[g][0]] is not None

    def claim(self, sm: SM, idle: bool) -> None:
        if self.static:
            g = sm.index + sm.claims * len(self.sms)
        else:
            g, self.next = self.next, self.next + 1
        sm.claims += 1
        if g >= len(self.sim.instances):
            sm.slots.append(Claim(stop=True))
            sm.stopped = True
            return
        k, i = self.sim.instances[g]
        sm.slots.append(Claim(k, i, sm.issued))
        if not idle:
            self.stats.claimed_ahead += 1
        streams = self.streams[k]
        if streams is None:
            return
        if self.ring.breakage.loader_streams_reversed:
            streams = streams[::-1]
        by_input = {s.input: s for s in streams}
        plan = page_plan(k, i, streams, self.sim.coords(k, i), self.ring.page_bytes)
        sm.to_fill.extend((sm.issued + j, tag, by_input[tag.input]) for j, tag in enumerate(plan))
        if len(plan) > self.ring.pages:
            self.stats.wrapped += 1

    def fill(self, sm: SM) -> None:
        k, tag, s = sm.to_fill.popleft()
        op = self.sim.q.entries[tag.entry].op
        sm.in_flight[k] = Page(k, tag, copy_rows(self.sim.buf[op.inputs[tag.input].buffer], s, tag))
        sm.issued += 1
        self.stats.pages += 1

    def land(self, sm: SM, k: int) -> None:
        page = sm.in_flight.pop(k)
        sm.ring[k % self.ring.pages] = page
        sm.landed.add(k)

    def copy_moves(self, sm: SM) -> list[Move]:
        return [Move(p.tag.entry, lambda k=k: self.land(sm, k)) for k, p in sm.in_flight.items()]

    # --- the body --------------------------------------------------------------------
    def body_moves(self, sm: SM) -> list[Move]:
        w = sm.body
        if w is None:
            return [Move(None, lambda: self.take(sm))] if sm.slots and not sm.done else []
        if not w.waited:
            return [Move(w.claim.k, lambda: self.pass_waits(w))] if self.sim.waits_met(w.claim.k, w.claim.i) else []
        if len(w.read) < len(w.expected):
            k = w.claim.page0 + len(w.read)
            if k in sm.landed or self.ring.breakage.read_before_fill:
                return [Move(w.claim.k, lambda: self.read_page(sm))]
            return []
        return [Move(w.claim.k, lambda: self.run_instance(sm))]

    def take(self, sm: SM) -> None:
        c = sm.slots[0]
        if c.stop:
            sm.done = True
            return
        streams = self.streams[c.k] or []
        sm.body = BodyWork(c, page_plan(c.k, c.i, streams, self.sim.coords(c.k, c.i), self.ring.page_bytes))

    @staticmethod
    def pass_waits(w: BodyWork) -> None:
        w.waited = True

    def read_page(self, sm: SM) -> None:
        w = sm.body
        k = w.claim.page0 + len(w.read)
        page = sm.ring[k % self.ring.pages]
        self.check_page(sm, k, w.expected[len(w.read)], page)
        w.read.append(page)
        sm.landed.discard(k)
        sm.released += 1  # (all body warps: the release is one step here)

    def check_page(self, sm: SM, k: int, expected: PageTag, page: Page | None) -> None:
        """The page in slot k % pages must be page k with exactly the rows the body reads next."""
        if page is not None and page.number == k and page.tag == expected:
            return
        if page is None or (page.number < k and k not in sm.landed):
            why = "read before its fill landed"
        elif page.number != k:  # a later page, or an earlier one whose copy landed over page k's
            why = "its ring slot was refilled before the body released it"
        else:
            why = "the loader streamed other rows than the body reads"
        held = "nothing" if page is None else f"page {page.number} ({page.tag})"
        c = sm.body.claim
        raise SimulationError(f"{self.sim.where(c.k, c.i)} on SM {sm.index}: page {k} (ring slot {k % self.ring.pages}) "
                              f"should hold {expected} but holds {held}: {why}")

    def run_instance(self, sm: SM) -> None:
        c = sm.body.claim
        bases, staged = self.stage(c, sm.body.read)
        try:
            self.sim.execute(c.k, c.i, bases)
        finally:  # the next instance sees only its own pages
            for buf, idx in staged:
                self.staging[buf][idx] = float("nan")
                self.carried[buf][idx] = False
        sm.slots.popleft()
        sm.finished += 1
        sm.body = None

    def stage(self, c: Claim, pages: list[Page]) -> tuple[dict[int, torch.Tensor], list[tuple[int, torch.Tensor]]]:
        """Place the page copies in poisoned copies of their weight buffers: returns input -> the
        copy to read it from, and the (buffer, elements) staged. Fails if the instance reads a
        weight row that no page brought."""
        op = self.sim.q.entries[c.k].op
        streams = {s.input: s for s in self.streams[c.k] or []}
        buffers = {j: op.inputs[j].buffer for j in streams}
        for buf in buffers.values():
            if buf not in self.staging:  # (paged weights are floating point: matvec operands)
                self.staging[buf] = torch.full_like(self.sim.buf[buf], float("nan"))
                self.carried[buf] = torch.zeros(self.staging[buf].shape, dtype=torch.bool)
        staged = []
        for page in pages:
            buf, idx = buffers[page.tag.input], row_elements(streams[page.tag.input], page.tag)
            self.staging[buf][idx] = page.rows
            self.carried[buf][idx] = True
            staged.append((buf, idx))
        env = self.sim.coords(c.k, c.i)
        for j, buf in buffers.items():
            if not bool(self.carried[buf][self.sim.elements(op.inputs[j], op.reads[j], env)].all()):
                name = self.sim.q.program.buffers[buf].name
                raise SimulationError(f"{self.sim.where(c.k, c.i)} reads rows of weight {name!r} that its pages do not carry")
        return {j: self.staging[buf] for j, buf in buffers.items()}, staged

    # --- the scheduler ---------------------------------------------------------------
    def run(self, seed: int, adversarial: bool) -> RingStats:
        rng = random.Random(seed)
        victim = rng.randrange(len(self.sim.q.entries)) if adversarial and self.sim.q.entries else None
        while not all(sm.done for sm in self.sms):
            moves = [m for sm in self.sms for m in (*self.loader_moves(sm), *self.copy_moves(sm), *self.body_moves(sm))]
            if not moves:
                raise SimulationError("deadlock: " + "; ".join(self.stuck(sm) for sm in self.sms if not sm.done))
            preferred = [m for m in moves if m.entry is None or m.entry != victim]
            rng.choice(preferred or moves).act()
        return self.stats

    def stuck(self, sm: SM) -> str:
        """What SM ``sm``'s body and loader wait for (a deadlock report)."""
        w = sm.body
        if w is None:
            body = "body waits for a slot"
        else:
            where = self.sim.where(w.claim.k, w.claim.i)
            body = f"body's {where} waits " + ("for its barrier counters" if not w.waited else
                                                  f"for page {w.claim.page0 + len(w.read)} to land")
        if sm.to_fill:
            loader = f"loader waits for the release of page {sm.to_fill[0][0] - self.ring.pages}"
        elif sm.stopped:
            loader = "loader stopped"
        elif sm.claims - sm.finished >= self.ring.slots:
            loader = "loader waits for a free slot"
        else:
            loader = "loader waits for an idle body (the next instance's weights are not paged)"
        return f"SM {sm.index}: {body}, {loader}"


def run_with_ring(sim: Simulation, schedule: Schedule) -> RingStats:
    """Run ``sim``'s launch with the page ring of ``schedule.ring`` (see the module docstring)."""
    return RingRun(sim, schedule).run(schedule.seed, schedule.adversarial)
