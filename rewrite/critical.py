"""A decode program priced by its critical path: its instances list-scheduled over the SMs in queue order.

The extraction prices each op alone (``cost.py``), which cannot see what an op's instance count costs its
neighbours: an instance the SMs cannot take until the previous op's last instances end starts late, and an
op of many short instances holds the SMs on which the next op's instances would have claimed and started
streaming early (docs/perf-notes.md #97: llama-3.2-1b's O projection on 128 instances ends 6 us after the
attention, whose 8 merging last arrivals hold their SMs ~3 us longer; on 86 it ends ~3 us after). Here every
instance is claimed by the SM that frees first, passes its wait once its producers are done, and streams its
share of the op's bytes; the figures are the ones a traced decode step shows (perf-notes #97).

``refine_tiles`` uses it on a program without row regimes (a decode step): for the weight-streaming ops
that read a combining op's output (the O projection, every layer's alike) it tries the other tile heights
of the same block op and keeps the one that shortens the scheduled program.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from ..blockops import REGISTRY, TERMS
from ..blockops.base import Sum
from ..ir.program import BlockProgram

TILE_FIELD = "rows"  # the weight rows an instance streams: the choice refine_tiles revisits
COMBINING = ("attn_partial_merge",)  # kinds whose last arrivals combine the partials (their SMs held longer)
# kinds whose instances the model does not describe: a routed expert instance's top-k and scattered expert rows
# were never traced against it, and on qwen3-30b-a3b it predicted 2.6% off the step for a change that measured
# +1.6% (perf-notes #100); a program with one keeps the extraction's tiles (moe_experts: an instance's rows,
# possibly none, are data)
UNMODELLED = ("moe_glu_down", "moe_experts")


@dataclass(frozen=True)
class InstanceModel:
    """Seconds and bytes/s of one instance's life (H200 decode traces, perf-notes #97)."""

    sms: int = 132
    claim: float = 1.25e-6  # an SM's gap from one instance's end to its next instance's claim
    handoff: float = 0.45e-6  # the last producer instance's end to a waiting consumer passing its wait
    # an instance that waits in its body passes no sooner than this after its claim: its poll queues behind
    # the first weights it issued (a K projection claimed after its producer ended passes 2.3 us later)
    early_issue: float = 2.0e-6
    early_bytes: int = 64 * 1024  # what such an instance streams before its wait passes, at most
    poll: float = 0.9e-6  # an instance that waits first: claim to pass, its producers done
    fixed: float = 2.0e-6  # an instance's work beside streaming its bytes (x staged, epilogue, signal)
    fixed_attention: float = 3.0e-6  # a split-KV attention instance's chain of dependent loads
    combine: float = 3.0e-6  # a combining op's last arrivals: loads of the partials, the merge, the store
    sm_rate: float = 38e9  # bytes/s one SM streams at most
    chip_rate: float = 4.2e12  # bytes/s the chip streams


def scheduled_seconds(program: BlockProgram, env: dict[str, int], model: InstanceModel = InstanceModel()) -> float:
    """When the last instance of ``program`` ends, its instances claimed in queue order by the SM that frees
    first; an op's instances wait for the whole of every op that wrote what they read."""
    writer: dict[int, int] = {}
    done: list[float] = []
    sm_free = [0.0] * model.sms  # when each SM ends its last instance so far
    free = [(0.0, sm) for sm in range(model.sms)]  # (that time, the SM), the earliest first
    for k, op in enumerate(program.ops):
        n = max(1, int(op.launch_count.eval(env))) if op.grid else 1
        share = (op.estimate.bytes if op.estimate else 0) / n
        rate = min(model.sm_rate, model.chip_rate / min(n, model.sms))
        ready = max((done[writer[o.buffer]] for o in op.inputs if o.buffer in writer), default=0.0) + model.handoff
        fixed = model.fixed_attention if "attn" in op.kind or "attention" in op.kind else model.fixed
        early = REGISTRY[op.kind].waits_in_body
        ends = []
        for _ in range(n):
            t, sm = heapq.heappop(free)
            claimed = t + model.claim
            if early:
                passed = max(ready, claimed + model.early_issue)
                streamed = min(share, model.early_bytes, rate * (passed - claimed))
            else:
                passed, streamed = max(ready, claimed + model.poll), 0.0
            sm_free[sm] = passed + fixed + (share - streamed) / rate
            ends.append((sm_free[sm], sm))
            heapq.heappush(free, (sm_free[sm], sm))
        end = max(t for t, _ in ends)
        if op.kind in COMBINING:  # one last arrival an output tile (all grid axes but the split) holds its SM
            tiles = 1
            for d in op.grid[:-1]:
                tiles *= int(d.eval(env))
            last = sorted(((t, sm) for t, sm in ends if sm_free[sm] == t), reverse=True)[:tiles]  # (SMs not reused)
            for t, sm in last:
                sm_free[sm] = t + model.combine
            free = [(t, sm) for sm, t in enumerate(sm_free)]
            heapq.heapify(free)
            end += model.combine
        done.append(end)
        writer[op.output.buffer] = k
    return max(done, default=0.0)


def combine_readers(program: BlockProgram) -> set[int]:
    """The graph nodes whose block ops read a combining op's output (the O projection)."""
    combined = {o.output.buffer for o in program.ops if o.kind in COMBINING}
    return {s for o in program.ops if any(i.buffer in combined for i in o.inputs) for s in o.sources}


def refine_tiles(chosen: dict, allowed: dict, readers: set[int], build: Callable[[dict], BlockProgram],
                 env: dict[str, int], model: InstanceModel = InstanceModel(), gain: float = 0.002) -> dict:
    """``chosen`` with the tile heights of the values of ``readers`` (``combine_readers``: the O projection
    after attention; only these: the schedule's ranking of other ops' tiles was not confirmed on a GPU,
    perf-notes #98) revisited. Such values whose choices are the same block op but for their operands (the
    O projection of every layer) form a group; a group takes the tile height that all its values offer and
    that shortens the scheduled program (``build(choices)``) by more than ``gain`` of it. A program with an
    ``UNMODELLED`` kind keeps ``chosen``."""
    groups: dict[tuple, list] = {}
    for v in sorted(chosen, key=_node):
        c, term = chosen[v], TERMS[chosen[v].term]
        if _node(v) in readers and term.tile == TILE_FIELD:
            key = (c.term, *((f.name, c.named[f.name]) for f in term.fields
                             if f.kind not in ("ref", "sum", "node") and f.name != TILE_FIELD))
            groups.setdefault(key, []).append(v)
    if not groups:
        return chosen
    program = build(chosen)
    if any(op.kind in UNMODELLED for op in program.ops):
        return chosen
    best = scheduled_seconds(program, env, model)
    for group in groups.values():
        options = [{a.named[TILE_FIELD]: a for a in allowed.get(v, ()) if _same_but_tile(a, chosen[v])} for v in group]
        for tile in sorted(set.intersection(*(set(o) for o in options)) - {chosen[group[0]].named[TILE_FIELD]}):
            trial = {**chosen, **{v: o[tile] for v, o in zip(group, options)}}
            t = scheduled_seconds(build(trial), env, model)
            if t < best * (1 - gain):
                best, chosen = t, trial
    return chosen


def _node(v) -> int:
    return v.node if isinstance(v, Sum) else v


def _same_but_tile(a, b) -> bool:
    return a.term == b.term and {k: x for k, x in a.args if k != TILE_FIELD} == {k: x for k, x in b.args if k != TILE_FIELD}
