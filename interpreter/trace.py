"""The per-SM timeline of one launch: each instance's claim, barrier-wait end and finish, and the
stamps between them that split a hand-off into its stages.

Built from a kernel compiled with ``MEGA_TRACE`` (``Kernel.trace``). ``summary()``
gives busy %, time waiting on barriers and time between instances (queue pops) per
op; ``stages()`` the anatomy of each op's hand-off; ``chrome_json()`` opens in Perfetto
(one track per SM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..lowering.queue import WorkQueue

# u64 words a traced instance writes (common.cuh: MEGA_TRACE_WORDS): entry << 40 | sm << 32 | instance;
# claimed, waits passed, done (globaltimer ns); the SM's cycle counter at each of CLOCKS (0: none)
TRACE_WORDS = 11
CLOCKS = ("issued", "claimed", "poll", "waited", "mark", "signal", "done")


@dataclass(frozen=True)
class OpTime:
    op: int
    kind: str
    instances: int
    busy_us: float  # claim to finish, summed over instances
    wait_us: float  # claim to barrier passed, summed
    span_us: float  # first claim to last finish


@dataclass(frozen=True)
class OpStages:
    """Where an op's instances spend a hand-off, medians over its entries (a decode step: one a layer), us."""

    kind: str
    entries: int
    instances: int  # an entry's
    claim_gap: float  # an SM's last instance done -> this instance claimed (end barrier, claim atomic, table search)
    claim_to_pass: float  # claimed -> its waits passed (early loads, the poll)
    handoff: float  # the previous entry's last instance done -> this entry's first wait passed (< 0: overlapped)
    run: float  # an instance's waits passed -> done
    run_max: float  # the entry's slowest instance
    step: float  # the previous entry's last instance done -> this entry's last done
    # the hand-off's stages (NaN where no instance has the stamps)
    claim_atomic: float = float("nan")  # claim issued -> claimed (the atomic's round trip, the entry search, a barrier)
    dispatch: float = float("nan")  # claimed -> first poll (table read, wait list, pre-wait loads issued)
    poll: float = float("nan")  # first poll -> waits passed (waiting on producers, then the block barrier)
    signal_to_pass: float = float("nan")  # the previous entry's last signal -> this entry's first wait passed
    mark: float = float("nan")  # waits passed -> the body's mark (a matvec: x staged, its norm; a split: its part done)
    signal_to_done: float = float("nan")  # signal issued -> the instance's end (the trace record's own cost)


@dataclass
class Trace:
    queue: WorkQueue
    records: np.ndarray  # [instances, TRACE_WORDS] uint64 (entry<<40 | sm<<32 | local, claim, waited, done, ...)

    @property
    def entry(self):
        return (self.records[:, 0] >> 40).astype(np.int64)

    @property
    def sm(self):
        return ((self.records[:, 0] >> 32) & 0xFF).astype(np.int64)

    def _base(self) -> float:
        return float(self.records[:, 1:4].min())

    def times_us(self):
        """[instances, 3]: claimed, waits passed, done, us from the launch's first claim (the global clock)."""
        return (self.records[:, 1:4].astype(np.float64) - self._base()) / 1e3

    def clocks(self) -> dict[str, np.ndarray]:
        """Each of CLOCKS: the SM's cycle counter (float; NaN: no such stamp, or a record without them)."""
        raw = self.records[:, 4:4 + len(CLOCKS)]
        if raw.shape[1] < len(CLOCKS):
            return {k: np.full(len(self.records), np.nan) for k in CLOCKS}
        c = np.where(raw > 0, raw.astype(np.float64), np.nan)
        return dict(zip(CLOCKS, c.T))

    def cycles_per_us(self) -> float:
        """The SMs' clock rate, from every instance's claimed -> done span on both clocks."""
        c, t = self.clocks(), self.times_us()
        cyc, us = c["done"] - c["claimed"], t[:, 2] - t[:, 0]
        ok = ~np.isnan(cyc)
        return float(cyc[ok].sum() / us[ok].sum()) if ok.any() and us[ok].sum() > 0 else float("nan")

    def stamps_us(self) -> dict[str, np.ndarray]:
        """Each of CLOCKS on times_us' clock: the instance's claim there plus its cycles since, at cycles_per_us."""
        c, claimed = self.clocks(), self.times_us()[:, 0]
        rate = self.cycles_per_us()
        return {k: claimed + (v - c["claimed"]) / rate for k, v in c.items()}

    def summary(self) -> dict:
        t = self.times_us()
        claim, waited, done = t[:, 0], t[:, 1], t[:, 2]
        sms = np.unique(self.sm)
        wall = done.max() - claim.min()
        busy = (done - claim).sum()
        pops = float(np.nansum(np.clip(self._claim_gaps(claim, done), 0, None)))
        per_op = []
        for k, e in enumerate(self.queue.entries):
            m = self.entry == k
            if m.any():
                per_op.append(OpTime(e.op.id, e.op.kind, int(m.sum()), float((done[m] - claim[m]).sum()),
                                     float((waited[m] - claim[m]).sum()), float(done[m].max() - claim[m].min())))
        return {
            "wall_us": float(wall), "sms": int(len(sms)), "instances": int(len(t)),
            "busy_pct": float(100 * busy / (wall * len(sms))),
            "waiting_pct": float(100 * (waited - claim).sum() / (wall * len(sms))),
            "pop_pct": float(100 * pops / (wall * len(sms))),
            "ops": per_op,
        }

    def _claim_gaps(self, claim, done) -> np.ndarray:
        """Each instance's gap on its SM from the previous instance's finish to its claim (NaN: the SM's first)."""
        gap = np.full(len(claim), np.nan)
        for s in np.unique(self.sm):
            idx = np.where(self.sm == s)[0]
            order = idx[np.argsort(claim[idx])]
            gap[order[1:]] = claim[order[1:]] - done[order[:-1]]
        return gap

    def stages(self) -> list[OpStages]:
        """Per op signature (kind, instances) in queue order of first appearance: the stages of a hand-off
        (docs/perf-notes.md #97, #108). Within an instance they are the SM's cycles (stamps_us); across SMs
        (hand-off, sig->pass) the global clock, which moves in 256 ns steps on an H200."""
        t, st = self.times_us(), self.stamps_us()
        claim, waited, done = t[:, 0], t[:, 1], t[:, 2]
        cycles = not np.isnan(st["claimed"]).all()  # (an SM's own cycles: finer than the global clock)
        gap = self._claim_gaps(st["claimed"], st["done"]) if cycles else self._claim_gaps(claim, done)
        spans = {"claim_atomic": ("issued", "claimed"), "dispatch": ("claimed", "poll"), "poll": ("poll", "waited"),
                 "mark": ("waited", "mark"), "signal_to_done": ("signal", "done")}
        rows: dict[tuple, dict[str, list]] = {}
        prev_done = prev_signal = None
        for k in range(len(self.queue.entries)):
            m = self.entry == k
            if not m.any():
                continue
            key = (self.queue.entries[k].op.kind, int(m.sum()))
            d = rows.setdefault(key, {f: [] for f in ("gap", "wait", "handoff", "run", "run_max", "step",
                                                      "signal_to_pass", *spans)})
            d["gap"] += list(gap[m][~np.isnan(gap[m])])
            d["wait"].append(float(np.median(waited[m] - claim[m])))
            run = st["done"][m] - st["waited"][m]
            run = run if not np.isnan(run).any() else done[m] - waited[m]
            d["run"].append(float(np.median(run)))
            d["run_max"].append(float(run.max()))
            if prev_done is not None:
                d["handoff"].append(float(waited[m].min() - prev_done))
                d["signal_to_pass"].append(float(waited[m].min() - prev_signal))
            d["step"].append(float(done[m].max() - (prev_done if prev_done is not None else claim.min())))
            for name, (a, b) in spans.items():
                span = (st[b][m] - st[a][m])[~np.isnan(st[b][m] - st[a][m])]
                if len(span):
                    d[name].append(float(np.median(span)))
            prev_done = float(done[m].max())
            # (a body that signals by itself, or none: its instances' ends stand in for the signal)
            sig = st["signal"][m]
            prev_signal = float(np.nanmax(np.where(np.isnan(sig), done[m], sig)))

        def med(xs):
            return float(np.median(xs)) if len(xs) else float("nan")

        extra = ("claim_atomic", "dispatch", "poll", "signal_to_pass", "mark", "signal_to_done")
        return [OpStages(kind, len(d["run"]), n, med(d["gap"]), med(d["wait"]), med(d["handoff"]), med(d["run"]),
                         med(d["run_max"]), med(d["step"]), *(med(d[f]) for f in extra))
                for (kind, n), d in rows.items()]

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for o in self.summary()["ops"]:
            d = out.setdefault(o.kind, {"busy_us": 0.0, "wait_us": 0.0, "instances": 0})
            d["busy_us"] += o.busy_us
            d["wait_us"] += o.wait_us
            d["instances"] += o.instances
        return out

    def chrome_json(self) -> str:
        t = self.times_us()
        events = []
        for r, (claim, waited, done) in enumerate(t):
            op = self.queue.entries[int(self.entry[r])].op
            sm = int(self.sm[r])
            if waited > claim:
                events.append({"name": f"wait op{op.id}", "ph": "X", "pid": 0, "tid": sm, "ts": claim, "dur": waited - claim})
            events.append({"name": f"op{op.id} {op.kind}", "ph": "X", "pid": 0, "tid": sm, "ts": waited,
                           "dur": max(done - waited, 0.001), "args": {"instance": int(self.records[r, 0] & 0xFFFFFFFF)}})
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ns"})
