"""The per-SM timeline of one launch: each instance's claim, barrier-wait end and finish.

Built from a kernel compiled with ``MEGA_TRACE`` (``Kernel.trace``). ``summary()``
gives busy %, time waiting on barriers and time between instances (queue pops) per
op; ``chrome_json()`` opens in Perfetto (one track per SM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..lowering.queue import WorkQueue


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


@dataclass
class Trace:
    queue: WorkQueue
    records: np.ndarray  # [instances, 4] uint64: (entry<<40 | sm<<32 | local, claim, waited, done)

    @property
    def entry(self):
        return (self.records[:, 0] >> 40).astype(np.int64)

    @property
    def sm(self):
        return ((self.records[:, 0] >> 32) & 0xFF).astype(np.int64)

    def times_us(self):
        t = self.records[:, 1:].astype(np.float64)
        return (t - t.min()) / 1e3

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
        (docs/perf-notes.md #97)."""
        t = self.times_us()
        claim, waited, done = t[:, 0], t[:, 1], t[:, 2]
        gap = self._claim_gaps(claim, done)
        rows: dict[tuple, dict[str, list]] = {}
        prev_done = None
        for k in range(len(self.queue.entries)):
            m = self.entry == k
            if not m.any():
                continue
            key = (self.queue.entries[k].op.kind, int(m.sum()))
            d = rows.setdefault(key, {f: [] for f in ("gap", "wait", "handoff", "run", "run_max", "step")})
            d["gap"] += list(gap[m][~np.isnan(gap[m])])
            d["wait"].append(float(np.median(waited[m] - claim[m])))
            d["run"].append(float(np.median(done[m] - waited[m])))
            d["run_max"].append(float((done[m] - waited[m]).max()))
            if prev_done is not None:
                d["handoff"].append(float(waited[m].min() - prev_done))
            d["step"].append(float(done[m].max() - (prev_done if prev_done is not None else claim.min())))
            prev_done = float(done[m].max())

        def med(xs):
            return float(np.median(xs)) if len(xs) else float("nan")

        return [OpStages(kind, len(d["run"]), n, med(d["gap"]), med(d["wait"]), med(d["handoff"]), med(d["run"]),
                         med(d["run_max"]), med(d["step"])) for (kind, n), d in rows.items()]

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
