"""Serving several sequences at once: continuous batching over a step executor.

A :class:`Batcher` keeps up to ``slots`` sequences in flight, each in its own KV-cache slot of a
:func:`~megaegg.models.build_step_graph` step. Every :meth:`Batcher.step` is one launch: the
prompts that joined are prefilled (all their tokens at once, in as many launches as
``max_tokens``, the step's token budget, needs), and every other running sequence decodes one
token. A sequence that finishes (``max_new_tokens`` or a stop token) frees its slot for the next
request; nothing is recompiled when sequences join or leave. ``run(..., on_step=)`` reports each launch
(a :class:`~megaegg.models.generate.StepInfo`) and can stop early; after an exception (a failed launch,
``KeyboardInterrupt``), :meth:`Batcher.drain` returns what every request generated so far.

With a :class:`~megaegg.models.pages.PagePool` (``pages=``, for a step graph built with ``page_len`` and
``pages``) a slot is a row of the page table: a sequence holds the pages its rows need, taken as it grows.
A request is admitted once its prompt's pages are free and, besides them, the pages that every running
sequence and itself need for their next :data:`HEADROOM_ROWS` rows (so that a growing sequence does not
preempt it before its first decode; with nothing running, no headroom: a lone request that fits the pool
always starts). When a growing sequence still finds no page, the most recently admitted sequence is
preempted: its pages go back and it waits at the head of the queue, to prefill its prompt and tokens again
(emitting only new tokens). Prompts share the whole pages of a prefix that an earlier sequence wrote
(docs/serve.md, "Paged KV cache").

>>> import megaegg as me
>>> from megaegg.models import ModelConfig, build_step_graph, random_weights
>>> g, spec = build_step_graph(ModelConfig.preset("tiny"), max_len=32, slots=2)
>>> b = Batcher(reference_batch_step(g, random_weights(spec, seed=0), spec.new_caches()), slots=2, max_len=32)
>>> outs = b.run([Request([1, 2, 3], 4), Request([7, 8], 2), Request([5], 3)])
>>> [len(o.tokens) for o in outs], b.launches
([4, 2, 3], 5)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..graph import Graph, GraphError
from ..reference import run_reference
from .decoder import SAMPLING_INPUTS
from .generate import Generation, StepInfo, check_token_ids, token_ids
from .pages import PagePool, SequencePages


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens: greedy (``temperature`` 0, the default), or a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens (0: all), then
    to the fewest whose probability reaches ``top_p`` (1: all), reproducible by ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise GraphError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise GraphError(f"top_k must be an int in [0, 2**31) (0, or the vocabulary size or more: every token), "
                             f"got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise GraphError(f"top_p must be in (0, 1] (1: every token), got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**31 <= self.seed < 2**31:
            raise GraphError(f"seed must be a 32-bit int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Request:
    """One prompt to continue: ``max_new_tokens`` at most, ending early after a ``stop_tokens`` one."""

    prompt: Sequence[int]
    max_new_tokens: int
    stop_tokens: Sequence[int] = ()
    sampling: Sampling = Sampling()
    on_token: Callable[[int], None] | None = None  # called with each new token as soon as it is known


@dataclass(frozen=True)
class StepRows:
    """One launch's rows: token ``token[i]`` at position ``pos[i]`` of slot ``slot[i]``; ``out`` lists
    the rows whose next token is wanted, and the per-output-row sampling settings."""

    token: torch.Tensor  # i32[n]
    pos: torch.Tensor  # i32[n]
    slot: torch.Tensor  # i32[n]
    out: torch.Tensor  # i32[r]
    temperature: torch.Tensor  # f32[r]
    top_k: torch.Tensor  # i32[r]
    top_p: torch.Tensor  # f32[r]
    seed: torch.Tensor  # i32[r]
    counter: torch.Tensor  # i32[r]: the sequence's tokens drawn so far (each draw of a seed differs)
    host_pos: tuple[int, ...] = ()  # pos, slot and token as host ints (no device round trip to read them)
    host_slot: tuple[int, ...] = ()
    host_token: tuple[int, ...] = ()  # (-1: a token the launch reads on the device, the previous launch's)
    host_sampling: tuple[tuple, ...] = ()  # (temperature, top_k, top_p, seed, counter) of each output row
    greedy: bool = True  # every output row's sampling is greedy (a step graph without sampling inputs can run it)
    pages: torch.Tensor | None = None  # i32[slots, pages a sequence]: a paged cache's page table

    def dims(self) -> dict[str, int]:
        """The step graph's runtime dims: ``n`` rows, ``r`` outputs, ``ctx`` = the largest position + 1."""
        return {"n": len(self.host_pos), "r": self.out.numel(), "ctx": max(self.host_pos) + 1}

    def inputs(self, sampling: bool) -> dict[str, torch.Tensor]:
        """The step graph's inputs (``sampling``: with its per-row sampling inputs)."""
        if not sampling and not self.greedy:  # (its inputs would be dropped: greedy tokens, silently)
            raise GraphError("a request samples (temperature > 0) but the step graph has no sampling inputs: "
                             "build it with build_step_graph(..., sampling=True)")
        names = ["token", "pos", "slot", "out"] + ([name for name, _ in SAMPLING_INPUTS] if sampling else [])
        return {n: getattr(self, n) for n in names} | ({"pages": self.pages} if self.pages is not None else {})


class QueuedTokens:
    """A launch queued on the device whose next tokens :meth:`get` waits for (checking the launch's errors):
    what a step function may return instead of the tokens, so that the batcher's ``launched`` hook runs
    while the launch does (:meth:`Batcher.step`); ``device``: the tokens as the launch writes them (a launch
    queued behind it reads them there: ``Batcher(run_ahead=True)``)."""

    def __init__(self, get: Callable[[], torch.Tensor], device: torch.Tensor | None = None) -> None:
        self.get, self.device = get, device


@dataclass
class _Launch:
    """A launch the batcher queued: the sequences it draws tokens for (and at which row), the rows it fed
    each, and its tokens (``queued``: the step function's result)."""

    outs: list[tuple["_Running", int]]
    fed: dict[int, int]
    rows: int
    prefill_rows: int
    queued: "torch.Tensor | QueuedTokens"
    started: float

    @property
    def tokens(self) -> torch.Tensor | None:
        """Its tokens on the device (or already computed), for a launch queued behind it; None if unknown."""
        return self.queued.device if isinstance(self.queued, QueuedTokens) else self.queued


BatchStepFn = Callable[[StepRows], "torch.Tensor | QueuedTokens"]  # -> next tokens i32[r]


@dataclass
class _Running:
    request: Request
    index: int  # in the order of submission
    generation: Generation
    slot: int = -1  # its cache slot, once admitted
    fed: int = 0  # tokens whose K and V are in the cache
    pages: SequencePages | None = None  # a paged cache's pages
    context: list[int] | None = None  # what it prefills: its prompt, or after a preemption its prompt and tokens
    admitted: int = 0  # when it was admitted (a count): the most recent is preempted first

    def __post_init__(self) -> None:
        if self.context is None:
            self.context = self.generation.prompt

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.context)

    @property
    def pending(self) -> list[int]:
        """Tokens still to feed: the rest of the prompt (context), or the last generated token."""
        return self.context[self.fed:] if self.prefilling else [self.generation.tokens[-1]]


PREFIX_MIN = 4  # tokens a cached prefix must share before a request takes its slot over an empty one
# A paged cache admits a request only if, its prompt's pages taken, the pool keeps the pages each running
# sequence (and the request) needs for its next HEADROOM_ROWS rows: the row this launch writes and the next
# launch's, for a decoding sequence; its first two decode rows, for a prefilling one.
HEADROOM_ROWS = 2


class Batcher:
    """Continuous batching of :class:`Request` s over a step function (see the module docstring).

    ``max_tokens`` bounds the rows of one launch (the step graph's ``n``); ``vocab`` refuses
    out-of-range prompt ids up front; ``pages``: a paged cache's pool (prefix sharing as it says).

    ``run_ahead``: each launch queues the next one before its tokens are read, its decoding rows' tokens
    copied on the device from this launch's, so the host's work for a launch (the batcher's, the server's)
    overlaps the one before it. A sequence that this launch ends (a stop token) or that is cancelled
    meanwhile has rows in the next launch that nothing reads: they write the slot's rows after the
    sequence's last, which no later sequence reads before writing them. With a paged cache they write pages
    the sequence held past its whole, indexed ones: back in the pool, such a page is written by its next
    holder only in a launch queued after them, and read only after that (no other sequence shares a page
    that is not whole); pages are indexed for sharing only with the rows of launches whose tokens came back.
    """

    def __init__(self, step: BatchStepFn, *, slots: int, max_len: int, max_tokens: int | None = None,
                 device="cpu", vocab: int | None = None, prefix_cache: bool = False, pages: PagePool | None = None,
                 run_ahead: bool = False) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise GraphError(f"slots must be an int >= 1, got {slots!r}")
        self.step_fn, self.slots, self.max_len = step, slots, max_len
        self.max_tokens = max_tokens or slots * max_len
        if self.max_tokens < slots:
            raise GraphError(f"max_tokens {self.max_tokens} must be at least the {slots} slots (one token each)")
        self.device, self.vocab = torch.device(device), vocab
        self.waiting: deque[_Running] = deque()
        # requests waiting that were never admitted (a preempted sequence back in the queue is not one):
        # what a server's queue limit counts (a single int, read from other threads)
        self.queued = 0
        self.running: list[_Running] = []
        self.free = list(range(slots))
        self.done: list[_Running] = []
        self.launches = 0
        self.step_seconds: list[float] = []  # wall time of each launch (run ahead: from the previous one's tokens)
        self.step_started: list[float] = []  # when each launch began (time.perf_counter; run ahead: as above)
        self._last_read = 0.0  # when the last launch's tokens were read
        self.prefill_rows: list[int] = []  # prompt tokens each launch fed (0: a pure decode step)
        self.launch_rows: list[int] = []  # rows each launch fed (decoding tokens and prompt tokens)
        self._count = 0
        # Prefix caching by slot: the tokens whose K and V rows a free slot still holds (a finished sequence's).
        # A request admitted to the free slot sharing the longest prefix with its prompt starts past it.
        self.prefix_cache = prefix_cache
        self.cached: list[list[int]] = [[] for _ in range(slots)]
        self.released = [0] * slots  # when each slot was last released (a count)
        self._releases = 0
        self.prefix_hits = 0  # prompt tokens not prefilled: their rows were in the slot (or in shared pages)
        self.pages = pages
        self.preemptions = 0  # sequences whose pages were taken back to let others grow
        self.run_ahead = run_ahead
        self._ahead: _Launch | None = None  # the launch queued ahead (run_ahead), taken by the next step
        self.ahead_failures = 0  # launches that failed to queue ahead (stepped again as usual)
        self._admissions = 0
        if pages is not None and prefix_cache:
            raise GraphError("prefix_cache keeps a finished sequence's rows in its slot; a paged cache shares "
                             "prefixes through its PagePool (prefix_cache=True there) instead: pass one of them")
        if pages is not None and pages.per_seq * pages.page_len < max_len:
            raise GraphError(f"the page table's {pages.per_seq} pages of {pages.page_len} rows a sequence hold fewer "
                             f"than max_len {max_len} rows")

    def submit(self, request: Request) -> int:
        """Queue a request; returns its index (the order of :meth:`run`'s results)."""
        prompt = token_ids(request.prompt, "a request's prompt")
        token_ids(request.stop_tokens, "a request's stop_tokens")
        if not prompt:
            raise GraphError("a request's prompt must hold at least one token")
        if self.vocab is not None:
            check_token_ids(prompt, self.vocab, "prompt")
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GraphError(f"max_new_tokens must be an int >= 1, got {n!r}")
        if len(prompt) + n - 1 > self.max_len:
            raise GraphError(f"{len(prompt)} prompt + {n} new tokens need {len(prompt) + n - 1} cache rows, "
                             f"the caches hold {self.max_len}")
        if self.pages is not None and not self.pages.fits_ever(len(prompt) + n - 1):
            raise GraphError(f"{len(prompt)} prompt + {n} new tokens need {self.pages.pages_for(len(prompt) + n - 1)} "
                             f"pages of {self.pages.page_len} rows, the pool holds {self.pages.count}")
        run = _Running(request, self._count, Generation(prompt=prompt, tokens=[]))
        self._count += 1
        self.waiting.append(run)
        self.queued += 1
        return run.index

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._ahead)

    def cancel(self, index: int) -> Generation | None:
        """Stop request ``index`` (its client went away): it leaves the queue or frees its slot before the
        next launch; its generation so far (``finished`` False), or None if it is not waiting or running."""
        for run in list(self.waiting):
            if run.index == index:
                self.waiting.remove(run)
                if not run.admitted:
                    self.queued -= 1
                return run.generation
        for run in self.running:
            if run.index == index:
                self.running.remove(run)
                self._release(run)
                return run.generation
        return None

    def step(self, launched: Callable[[], None] | None = None) -> StepInfo:
        """One launch: admit waiting requests into free slots, then feed every running sequence
        (decoding ones first, one token each; prompts with what is left of the token budget).
        Returns what it did. ``launched`` is called once the launch is queued, before waiting for its
        tokens (while it runs, when the step function returns :class:`QueuedTokens`): a server hands the
        previous launch's tokens to its clients there, so that work overlaps this launch instead of
        delaying the next one. With ``run_ahead``, the launch may be the one the previous step queued, and
        the next one is queued before this one's tokens are waited for."""
        launch, self._ahead = self._ahead, None
        if launch is None:
            self._admit_waiting()
            plan = self._plan()
            while self.pages is not None and not self._grow(plan):
                plan = self._plan()  # (a sequence was preempted: its rows and budget go to the others)
            launch = self._launch([(run, take, None) for run, take in plan], None)
        if self.run_ahead:
            try:  # (failing to queue it, or on the simulator failing to run it, is not this launch's error:
                self._ahead = self._launch_ahead(launch)  # the next step launches those rows again, as usual)
            except Exception:
                self._ahead = None
                self.ahead_failures += 1
        try:  # (a hook that raises fails the launch as a device error would: nothing of it is read)
            if launched is not None:
                launched()
            tokens = launch.queued.get() if isinstance(launch.queued, QueuedTokens) else launch.queued
            new = [int(t) for t in tokens.reshape(-1).tolist()]  # (syncs with the device)
        except BaseException:
            for failed in (launch, self._ahead):  # (their rows were not written: fed again if stepped again)
                if failed is not None:
                    for run in self.running:
                        run.fed -= failed.fed.get(run.index, 0)
            self._settle_ahead()
            raise
        # (a launch queued ahead counts from the previous launch's tokens: its seconds are the pace of tokens)
        started = max(launch.started, self._last_read)
        self._last_read = time.perf_counter()
        seconds = self._last_read - started
        self.step_seconds.append(seconds)
        self.step_started.append(started)
        self.prefill_rows.append(launch.prefill_rows)
        self.launch_rows.append(launch.rows)
        self.launches += 1
        if self.pages is not None:  # (the rows through this launch: not those of the launch queued behind it)
            behind = self._ahead.fed if self._ahead is not None else {}
            for run in self.running:
                if run.pages is not None:
                    self.pages.written(run.pages, run.generation.prompt + run.generation.tokens,
                                       run.fed - behind.get(run.index, 0))
        live = {id(run) for run in self.running}  # (a sequence cancelled, or ended by the launch before: not fed)
        emitted = [(run, tok) for (run, _), tok in zip(launch.outs, new) if id(run) in live]
        for run, tok in emitted:
            self._emit(run, tok)
        return StepInfo(step=self.launches, seconds=seconds, rows=launch.rows, prefill_rows=launch.prefill_rows,
                        tokens=tuple((run.index, tok) for run, tok in emitted),
                        running=len(self.running), waiting=len(self.waiting), finished=len(self.done))

    def _admit_waiting(self) -> None:
        """Waiting requests into free slots (a paged cache: while their pages and the headroom are free)."""
        while self.waiting and self.free:
            run = self.waiting[0]
            if self.pages is not None:  # its prompt's pages and the headroom: a request waits (in order) until free
                keep = sum(self._headroom(r) for r in self.running + [run]) if self.running else 0
                held = self.pages.admit(run.context, len(run.context), keep=keep)
                if held is None:
                    break
                run.pages, shared = held
                self.free.remove(slot := self.free[0])
                run.slot, run.fed = slot, shared
            else:
                run.slot, run.fed = self._admit(run.generation.prompt)
            self.waiting.popleft()
            if not run.admitted:  # (a preempted sequence's re-read rows are no prompt tokens saved)
                self.prefix_hits += run.fed
                self.queued -= 1
            self._admissions += 1
            run.admitted = self._admissions
            self.running.append(run)

    def _launch(self, plan: list[tuple[_Running, list[int], int | None]], before: "_Launch | None") -> "_Launch":
        """Queue a launch of ``plan`` (sequence, its tokens, or None: the one token ``before`` draws for it, at
        that output row); the sequences' fed counts move past its rows at once."""
        rows: list[tuple[_Running, int, int]] = []  # (sequence, token (-1: from before), position)
        outs: list[tuple[_Running, int]] = []  # (sequence, its row whose next token it gets)
        fed: dict[int, int] = {}  # sequence index -> tokens fed this launch
        carried: list[tuple[int, int]] = []  # (row, before's output row): tokens read on the device
        drawn: dict[int, int] = {}  # sequence index -> tokens it has drawn when this launch draws (counters)
        prefill_rows = 0
        for run, take, out in plan:
            if out is not None:
                carried.append((len(rows), out))
                take = [-1]
            rows += [(run, t, run.fed + j) for j, t in enumerate(take)]
            fed[run.index] = len(take)
            drawn[run.index] = len(run.generation.tokens) + (out is not None)
            if run.prefilling:
                prefill_rows += len(take)
            if run.fed + len(take) >= len(run.context) or out is not None:
                outs.append((run, len(rows) - 1))
        started = time.perf_counter()
        step_rows = self._rows(rows, outs, drawn, carried, None if before is None else before.tokens)
        queued = self.step_fn(step_rows)
        for run, take, _ in plan:
            run.fed += fed[run.index]
        return _Launch(outs=outs, fed=fed, rows=len(rows), prefill_rows=prefill_rows, queued=queued, started=started)

    def _launch_ahead(self, launch: "_Launch") -> "_Launch | None":
        """The next launch queued behind ``launch`` before its tokens are known: every sequence it draws a
        token for decodes that token (read on the device), unless it is the sequence's last; prompts go on
        and waiting requests join as a step would feed them. None (stepped as usual) when the next launch
        would have fewer than two rows (a lone row is single_sequence_decode's), when the
        launch's tokens are not on the device, or when a paged cache has too few pages for its rows (the next
        step then preempts, with nothing in flight)."""
        if launch.tokens is None:
            return None
        self._admit_waiting()
        drawing = {id(run): i for i, (run, _) in enumerate(launch.outs)}
        plan, budget = [], self.max_tokens
        for run in self.running:  # decoding ones first (one row each: max_tokens >= slots)
            if id(run) in drawing and len(run.generation.tokens) + 1 < run.request.max_new_tokens:
                plan.append((run, None, drawing[id(run)]))
                budget -= 1
        for run in self.running:
            if id(run) in drawing:
                continue
            if not run.prefilling:  # (decoding without a token in flight: a step plans it from the host)
                return None
            if budget > 0:
                take = run.pending[:budget]
                plan.append((run, take, None))
                budget -= len(take)
        if sum(1 if out is not None else len(take) for _, take, out in plan) < 2:
            return None
        if self.pages is not None and not all(self.pages.grow(run.pages, run.fed + (1 if out is not None else len(take)))
                                              for run, take, out in plan):
            return None  # (pages grown for some: their rows come next step)
        return self._launch(plan, launch)

    def _settle_ahead(self) -> None:
        """Wait for the launch queued ahead, if any, and forget it (a launch before it failed: nothing reads
        its tokens; its error, if any, is read here, not by the next launch)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and isinstance(ahead.queued, QueuedTokens):
            try:
                ahead.queued.get()
            except Exception:
                pass

    def _plan(self) -> list[tuple[_Running, list[int]]]:
        """What each running sequence feeds this launch: decoding ones first, one token each (they always
        fit: max_tokens >= slots), then prompts, what is left of the token budget."""
        plan, budget = [], self.max_tokens
        for run in [r for r in self.running if not r.prefilling] + [r for r in self.running if r.prefilling]:
            take = run.pending[:budget]
            if not take:
                break
            plan.append((run, take))
            budget -= len(take)
        return plan

    def _headroom(self, run: _Running) -> int:
        """Pages the sequence needs beyond those it holds (a waiting one: its context's) for its next
        HEADROOM_ROWS rows past what it has fed and will prefill, never past its last row (prompt +
        max_new_tokens - 1: the last token is not fed)."""
        held = len(run.pages.pages) if run.pages is not None else self.pages.pages_for(len(run.context))
        last = len(run.generation.prompt) + run.request.max_new_tokens - 1
        rows = min(max(run.fed, len(run.context)) + HEADROOM_ROWS, last)
        return max(0, self.pages.pages_for(rows) - held)

    def _grow(self, plan) -> bool:
        """Pages for every row the plan writes; when none is left, the most recently admitted running sequence
        (perhaps the one growing) is preempted (False: plan again). A lone sequence always fits: submit checked
        that its rows fit the pool."""
        for run, take in plan:
            if not self.pages.grow(run.pages, run.fed + len(take)):
                if len(self.running) == 1:
                    raise GraphError(f"the page pool cannot hold request {run.index}'s {run.fed + len(take)} rows")
                self._preempt(max(self.running, key=lambda r: r.admitted))
                return False
        return True

    def _preempt(self, run: _Running) -> None:
        """Take a running sequence's pages back: it waits at the head of the queue to prefill its prompt and
        the tokens it generated so far again (their pages may still be cached: then it shares them)."""
        self.running.remove(run)
        self._release(run)
        run.context = run.generation.prompt + run.generation.tokens
        run.fed, run.pages, run.slot = 0, None, -1
        self.waiting.appendleft(run)
        self.preemptions += 1

    def _admit(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for ``prompt`` and the tokens of it whose rows that slot holds (at most all but the
        last: its logits are what the first launch computes): the longest such prefix; sharing none, the
        slot whose rows are least worth keeping (empty, else released longest ago)."""
        if not self.prefix_cache:
            self.free.remove(best := self.free[0])
            return best, 0
        best = min(self.free, key=lambda s: (len(self.cached[s]) > 0, self.released[s], s))
        shared = 0
        for slot in self.free:
            cached, n = self.cached[slot], 0
            top = min(len(cached), len(prompt) - 1)
            while n < top and cached[n] == prompt[n]:
                n += 1
            if n > shared:
                best, shared = slot, n
        # (a BOS in common is no prefix worth evicting a cached one for: an empty slot first)
        if shared < PREFIX_MIN and any(not self.cached[s] for s in self.free):
            best, shared = min((s for s in self.free if not self.cached[s]), key=lambda s: (self.released[s], s)), 0
        self.free.remove(best)
        self.cached[best] = []  # (rewritten from `shared` on: known again when the slot is released)
        return best, shared

    def _release(self, run: _Running) -> None:
        """Free the run's slot, remembering the tokens whose rows it holds (or its pages, to the pool)."""
        if run.pages is not None:
            self.pages.release(run.pages)
        gen = run.generation
        self.cached[run.slot] = (gen.prompt + gen.tokens)[:run.fed] if self.prefix_cache else []
        self._releases += 1
        self.released[run.slot] = self._releases
        self.free.append(run.slot)
        self.free.sort()

    def _emit(self, run: _Running, tok: int) -> None:
        gen, req = run.generation, run.request
        gen.tokens.append(tok)
        if tok in req.stop_tokens:
            gen.stop_token = tok
        if gen.stop_token is not None or len(gen.tokens) >= req.max_new_tokens:
            gen.finished = True
            self.running.remove(run)
            self._release(run)
            self.done.append(run)
        if req.on_token is not None:  # last: the state is whole if it raises (a KeyboardInterrupt)
            req.on_token(tok)

    def _rows(self, rows: list[tuple[_Running, int, int]], outs: list[tuple[_Running, int]], drawn: dict[int, int],
              carried: list[tuple[int, int]] = (), before: torch.Tensor | None = None) -> StepRows:
        """The launch's rows on the device: one copy of every value (a copy a field cost ~10 us each on an
        H200's host), the fields views of it; the ``carried`` rows' tokens then copied on the device from
        ``before`` (the previous launch's tokens, at those output rows)."""
        s = [r.request.sampling for r, _ in outs]
        ints = [t for _, t, _ in rows] + [p for _, _, p in rows] + [r.slot for r, _, _ in rows] + [i for _, i in outs] \
            + [x.top_k for x in s] + [x.seed for x in s] + [drawn[r.index] for r, _ in outs] \
            + [i for i, _ in carried] + [o for _, o in carried]
        floats = [x.temperature for x in s] + [x.top_p for x in s]
        packed = self._to_device(torch.cat([torch.tensor(ints, dtype=torch.int32),
                                            torch.tensor(floats, dtype=torch.float32).view(torch.int32)]))
        n, r, c = len(rows), len(outs), len(carried)
        token, pos, slot, out, top_k, seed, counter, at, src, temperature, top_p = packed.split([n, n, n, r, r, r, r, c, c, r, r])
        if carried:
            token.index_copy_(0, at.long(), before.reshape(-1).to(token.device).index_select(0, src.long()))
        return StepRows(
            token=token, pos=pos, slot=slot, out=out, temperature=temperature.view(torch.float32), top_k=top_k,
            top_p=top_p.view(torch.float32), seed=seed, counter=counter,
            host_pos=tuple(p for _, _, p in rows), host_slot=tuple(r.slot for r, _, _ in rows),
            host_token=tuple(t for _, t, _ in rows),
            host_sampling=tuple((x.temperature, x.top_k, x.top_p, x.seed, drawn[r.index]) for x, (r, _) in zip(s, outs)),
            greedy=all(x.greedy for x in s), pages=self._table())

    def _table(self) -> torch.Tensor | None:
        """The page table of the running sequences (rows of free slots: zeros, never read)."""
        if self.pages is None:
            return None
        table = [[-1] * self.pages.per_seq for _ in range(self.slots)]
        for run in self.running:
            table[run.slot] = self.pages.table_row(run.pages)
        return self._to_device(torch.tensor(table, dtype=torch.int32))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device, its copy queued on the stream (from pinned memory) without waiting: a copy
        from pageable memory waits for the stream, so a launch queued ahead (single_sequence_decode) would
        finish before the host could queue the next one."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def run(self, requests: Sequence[Request] = (), *,
            on_step: Callable[[StepInfo], bool | None] | None = None) -> list[Generation]:
        """Submit ``requests``, step until every submitted request is done; their generations in submission order.

        ``on_step`` is called with a :class:`~megaegg.models.generate.StepInfo` after each launch; if it returns
        True, the run stops there: every request's generation so far is returned (:meth:`drain`; those cut short,
        running or preempted, have ``finished`` False, those not started no tokens)."""
        for r in requests:
            self.submit(r)
        while self.busy():
            info = self.step()
            if on_step is not None and on_step(info):
                return self.drain()
        done = sorted(self.done, key=lambda r: r.index)
        self.done = []
        return [r.generation for r in done]

    def drain(self) -> list[Generation]:
        """Stop every request now: the generations so far of all requests not yet returned (finished ones whole,
        running ones cut short, waiting ones as far as they got: none for a request never started, the tokens
        already generated (and given to ``on_token``) for a preempted one), in submission order; their slots
        are free again. Nothing is given to ``on_token`` here.
        Call it after :meth:`run` or :meth:`step` raised (``KeyboardInterrupt``, a failed launch) to keep what was
        generated; a cut-short sequence's slot is reused from position 0, so the batcher can run again."""
        self._settle_ahead()
        runs = sorted(self.done + self.running + list(self.waiting), key=lambda r: r.index)
        for run in self.running:  # (their pages: the rows a failed launch half wrote are in unindexed ones)
            if run.pages is not None:
                self.pages.release(run.pages)
        self.done, self.running, self.waiting, self.queued = [], [], deque(), 0
        self.free = list(range(self.slots))
        self.cached = [[] for _ in range(self.slots)]  # (a failed launch may have left any row half written)
        return [r.generation for r in runs]


def reference_batch_step(graph: Graph, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> BatchStepFn:
    """A batch step over :func:`megaegg.run_reference` of a step graph; ``caches`` are updated in place."""
    sampling = "temperature" in graph.inputs

    def step(rows: StepRows) -> torch.Tensor:
        return run_reference(graph, {**rows.inputs(sampling), **caches}, weights, rows.dims())["next_token"]

    return step


def kernel_batch_step(kernel, caches: Mapping[str, torch.Tensor], *, check: bool = True) -> BatchStepFn:
    """A batch step over a compiled step graph (one launch per step); ``caches`` updated in place. It returns
    the launch queued (:class:`QueuedTokens`: the batcher waits for its tokens, and with ``check`` for its
    errors, after its ``launched`` hook; the tokens' host copy and the error record are queued behind the
    launch, so a launch queued after it, run ahead, does not delay them)."""
    sampling = _samples(kernel)

    def step(rows: StepRows) -> QueuedTokens:
        tokens = kernel(**rows.inputs(sampling), **caches, **rows.dims(), check=False)["next_token"]
        result = kernel.result_of(tokens)
        return QueuedTokens(lambda: result.get(check), tokens)

    return step


def lone_decode_kernel(cfg, weights: Mapping[str, torch.Tensor], *, backend: str, max_len: int, sampling: bool):
    """The batch-1 decode graph a lone sequence runs (:func:`single_sequence_decode`), tokens only (its LM head
    and argmax fuse; ``sampling``: drawn on the device), compiled for every position below ``max_len``."""
    import megaegg as me
    from .decoder import build_decode_graph

    graph, _ = build_decode_graph(cfg, max_len=max_len, logits=False, sampling=sampling)
    return me.compile(graph, weights, backend=backend, max_dims={"pos": max_len - 1}, dims_hint={"pos": min(512, max_len - 1)})


def _samples(kernel) -> bool:
    """Whether a compiled step or decode graph draws its tokens (has the sampling inputs)."""
    return "temperature" in {b.name for b in kernel.program.buffers}


def single_sequence_decode(step: BatchStepFn, decode_kernel, caches: Mapping[str, torch.Tensor], *,
                           run_ahead: bool = True) -> BatchStepFn:
    """``step``, except that a launch of one decoding row runs ``decode_kernel`` (a batch-1 decode graph,
    :func:`~megaegg.models.build_decode_graph`: its fused kernel is faster) on that row's cache slot. A
    decode graph built with ``sampling`` takes every row; a greedy one only rows that are greedy.

    ``run_ahead``: each such launch queues the sequence's next one behind it (its token the one this launch
    writes on the device, its counter one more) before waiting for its token, so the host's work between
    tokens (the batcher, the server) overlaps that launch instead of adding to it. The next call takes it
    if its row is that one (same slot, position, token and sampling); otherwise it is dropped: it wrote the
    slot's next cache row for the token that row holds, which a later launch of the row writes again."""
    return _LoneDecode(step, decode_kernel, caches, run_ahead)


class _LoneDecode:
    """:func:`single_sequence_decode`'s step function: a launcher a slot, and the launch queued ahead."""

    def __init__(self, step: BatchStepFn, kernel, caches: Mapping[str, torch.Tensor], run_ahead: bool) -> None:
        self.step, self.kernel, self.caches, self.run_ahead = step, kernel, caches, run_ahead
        self.knobs = [name for name, _ in SAMPLING_INPUTS] if _samples(kernel) else []
        self.launchers = {}
        self.ahead = None  # (the row it runs: slot, pos, token, sampling; its LaunchResult)
        self.dropped = []  # launches run ahead and not taken: their errors are nobody's (settled before the next)
        self.last_pos = kernel.queue.max_dims["pos"]

    def __call__(self, rows: StepRows) -> torch.Tensor | QueuedTokens:
        if rows.pages is not None:
            raise GraphError("single_sequence_decode takes caches of slots; a paged cache's rows are in pages")
        ahead, self.ahead = self.ahead, None
        if len(rows.host_pos) != 1 or rows.out.numel() != 1 or not (self.knobs or rows.greedy):
            self.dropped += [ahead[1]] if ahead else []
            return self.step(rows)
        if not (rows.host_token and rows.host_sampling):
            raise GraphError("single_sequence_decode needs the rows' host_token and host_sampling (as Batcher fills them)")
        slot, pos, sampling = rows.host_slot[0], rows.host_pos[0], rows.host_sampling[0]
        knobs = {k: getattr(rows, k) for k in self.knobs}
        if ahead is not None and ahead[0] == (slot, pos, rows.host_token[0], sampling):
            result = ahead[1]
        else:
            self.dropped += [ahead[1]] if ahead else []
            result = self._launch(slot, pos, {"token": rows.token, **knobs})
        nxt = None
        if self.run_ahead and pos < self.last_pos:
            if "counter" in knobs:
                knobs["counter"] = knobs["counter"] + 1
            try:  # (a failure queuing it, or on the simulator running it, is not this launch's: it is not run ahead)
                nxt = self._launch(slot, pos + 1, {"token": result.device, **knobs})
            except Exception:
                nxt = None

        def get() -> torch.Tensor:
            try:
                tokens = result.get()
            except Exception:
                self.dropped += [nxt] if nxt is not None else []
                self._settle()
                raise
            if nxt is not None:
                self.ahead = ((slot, pos + 1, int(tokens[0]), (*sampling[:4], sampling[4] + 1)), nxt)
            return tokens

        return QueuedTokens(get, result.device)

    def _settle(self) -> None:
        """Wait for the launches dropped so far and clear what they recorded (a kernel's error record stays set
        until read: the next launch would run nothing and report their error as its own)."""
        for r in self.dropped:
            try:
                r.get()
            except Exception:
                pass
        self.dropped = []

    def _launch(self, slot: int, pos: int, inputs: dict):
        if self.dropped:
            self._settle()
        launch = self.launchers.get(slot)
        if launch is None:
            views = {name: c[slot] for name, c in self.caches.items()}  # [kv_heads, max_len, head_dim], in place
            launch = self.launchers[slot] = self.kernel.launcher(pos=pos, **inputs, **views)
        launch(pos=pos, **inputs)
        return launch.result("next_token")
