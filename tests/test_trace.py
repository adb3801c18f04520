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


def record(entry, sm, instance, claim, passed, done, issued, poll, mark, signal, cycles_per_ns=2):
    """A traced instance's words (ns; None: no stamp): the global clock's three, the SM's cycles for the rest."""
    base, c0 = 10**15, 10**6  # (globaltimer ns, the SM's cycle counter)
    clock = [0 if v is None else c0 + cycles_per_ns * v for v in (issued, claim, poll, passed, mark, signal, done)]
    return [entry << 40 | sm << 32 | instance, base + claim, base + passed, base + done, *clock]


def test_stages_of_a_two_op_chain():
    rows = [  # entry, sm, instance, claim, passed, done, claim issued, first poll, mark, signal (ns; None: no stamp)
        (0, 0, 0, 0, 0, 1000, 0, None, None, 950), (0, 1, 1, 0, 0, 900, 0, None, None, 800),
        (1, 0, 0, 1200, 1500, 2500, 1050, 1300, 1700, 2400), (1, 1, 1, 1200, 1400, 2300, 950, 1250, None, 2250),
    ]
    trace = Trace(chain_queue(), np.array([record(*r) for r in rows], dtype=np.uint64))
    assert trace.cycles_per_us() == pytest.approx(2000)
    assert trace.summary()["pop_pct"] == pytest.approx(100 * (0.2 + 0.3) / (2.5 * 2))  # (the same gaps, summed)
    (chain,) = trace.stages()  # (one signature: both entries are 2-instance elementwise ops)
    assert (chain.kind, chain.entries, chain.instances) == ("elementwise", 2, 2)
    assert chain.claim_gap == pytest.approx(0.25)  # the second's: SM 0 1.0 -> 1.2 us, SM 1 0.9 -> 1.2
    assert chain.claim_to_pass == pytest.approx(0.125)  # entry medians 0 and 0.25 (0.3, 0.2)
    assert chain.handoff == pytest.approx(0.4)  # the first's last done 1.0, the second's first pass 1.4
    assert (chain.run, chain.run_max) == (pytest.approx(0.95), pytest.approx(1.0))
    assert chain.step == pytest.approx(1.25)  # 0 -> 1.0, then 1.0 -> 2.5
    assert chain.claim_atomic == pytest.approx(0.1)  # entry medians 0 and 0.2 (0.15, 0.25)
    assert chain.dispatch == pytest.approx(0.075)  # the second entry's alone: 0.1, 0.05
    assert chain.poll == pytest.approx(0.175)  # 0.2, 0.15
    assert chain.mark == pytest.approx(0.2)  # one instance marked: 1.5 -> 1.7
    assert chain.signal_to_pass == pytest.approx(0.45)  # the first's last signal 0.95, the second's first pass 1.4
    assert chain.signal_to_done == pytest.approx(0.075)  # entry medians 0.075 (0.05, 0.1) and 0.075 (0.1, 0.05)


def test_stages_within_an_instance_use_the_sms_cycles():
    # the global clock in 256 ns steps (as on an H200) puts the second instance's claim, pass and end at
    # 256, 256 and 512 ns; its SM's cycles (1.5 a ns, as the first instance's 100 us show) say 256, 356, 436
    c0 = 10**6
    rows = [(0, 0, 0, 0, 0, 100_000, 0, None, None, None), (1, 0, 0, 256, 256, 512, 200, 220, None, None)]
    rec = np.array([record(*r) for r in rows], dtype=np.uint64)
    rec[0, 4:11] = [c0, c0, 0, c0, 0, 0, c0 + 150_000]
    rec[1, 4:11] = [0 if v is None else c0 + int(1.5 * v) for v in (200, 256, 230, 356, None, None, 436)]
    trace = Trace(chain_queue(), rec)
    assert trace.cycles_per_us() == pytest.approx(1500, rel=2e-3)
    (chain,) = trace.stages()
    assert chain.poll == pytest.approx(0.126, abs=1e-3)  # first poll 230 -> passed 356 ns, by cycles
    assert chain.claim_atomic == pytest.approx(0.028, abs=1e-3)  # entry medians 0 and 0.056 (issued 200 -> claimed 256)
    assert chain.run == pytest.approx((100 + 0.08) / 2, abs=0.1)  # entry medians 100 us and 0.08 (the global clock: 0.256)


def test_stamps_absent_from_a_short_record():
    rec = np.array([[0 << 40, 10**15, 10**15 + 10, 10**15 + 20], [1 << 40, 10**15, 10**15 + 30, 10**15 + 40]],
                   dtype=np.uint64)
    trace = Trace(chain_queue(), rec)
    assert all(np.isnan(v).all() for v in trace.stamps_us().values())
    assert trace.times_us()[1, 2] == pytest.approx(0.04)
    (chain,) = trace.stages()
    assert np.isnan(chain.claim_atomic) and chain.run == pytest.approx(0.01)
