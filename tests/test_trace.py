"""The trace's hand-off stages (interpreter/trace.py: Trace.stages) on a hand-made timeline."""

import numpy as np
import pytest

import megaegg as me
from megaegg.compiler import build_artifact
from megaegg.interpreter.trace import Trace


def chain_queue():
    g = me.Graph()
    x = g.input("x", [2048], me.f32)
    g.output("y", me.silu(me.silu(x)))
    q = build_artifact(g, compile_cuda=False).queue
    assert [len(e.op.grid) and int(e.op.launch_count.eval({})) for e in q.entries] == [2, 2]  # (two ops, two tiles)
    return q


def test_stages_of_a_two_op_chain():
    base = 10**15  # (globaltimer ns)
    rows = [  # entry, sm, instance, claim, passed, done (ns)
        (0, 0, 0, 0, 0, 1000), (0, 1, 1, 0, 0, 900),
        (1, 0, 0, 1200, 1500, 2500), (1, 1, 1, 1200, 1400, 2300),
    ]
    rec = np.array([[e << 40 | s << 32 | i, base + c, base + p, base + d] for e, s, i, c, p, d in rows], dtype=np.uint64)
    trace = Trace(chain_queue(), rec)
    assert trace.summary()["pop_pct"] == pytest.approx(100 * (0.2 + 0.3) / (2.5 * 2))  # (the same gaps, summed)
    (chain,) = trace.stages()  # (one signature: both entries are 2-instance elementwise ops)
    assert (chain.kind, chain.entries, chain.instances) == ("elementwise", 2, 2)
    assert chain.claim_gap == pytest.approx(0.25)  # the second's: SM 0 1.0 -> 1.2 us, SM 1 0.9 -> 1.2
    assert chain.claim_to_pass == pytest.approx(0.125)  # entry medians 0 and 0.25 (0.3, 0.2)
    assert chain.handoff == pytest.approx(0.4)  # the first's last done 1.0, the second's first pass 1.4
    assert (chain.run, chain.run_max) == (pytest.approx(0.95), pytest.approx(1.0))
    assert chain.step == pytest.approx(1.25)  # 0 -> 1.0, then 1.0 -> 2.5
