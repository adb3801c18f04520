"""The weight page ring's protocol on the CPU simulator (interpreter/page_sim.py): per SM a loader
that claims instances and fills pages and a body that reads them, under random and adversarial
schedules and small rings whose pages are reused many times within one instance; each broken
rule of the protocol fails the run, and the barrier checks still hold with the ring on."""

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.interpreter import page_sim
from megaegg.interpreter.page_sim import Breakage, Ring
from megaegg.interpreter.render import paged_streams
from megaegg.interpreter.simulator import Schedule, SimulationError
from megaegg.models import ModelConfig, build_decode_graph, random_weights

# (preset, dtype, hidden, logits): weight rows of 512 bytes (the least paged_streams takes), one
# layer; the first pages matvec and glu_down, the second glu_down and matvec_argmax (no logits)
# next to matvecs whose 256-byte rows stay unpaged
MODELS = {"llama-f32": ("tiny", me.f32, 128, True), "qwen3-bf16": ("qwen3-tiny", me.bf16, 256, False)}
RINGS = [Ring(pages=2, page_bytes=512, slots=1), Ring(pages=3, page_bytes=1024, slots=2),
         Ring(pages=2, page_bytes=2048, slots=2)]
SCHEDULES = [Schedule(sms=1), Schedule(sms=3, seed=1, adversarial=True), Schedule(sms=8, seed=2),
             Schedule(sms=5, seed=3, adversarial=True)]


@dataclasses.dataclass
class Model:
    graph: me.Graph
    spec: object
    weights: dict
    kernel: object

    def run(self, schedule: Schedule, pos: int = 3, tok: int = 5) -> dict[str, torch.Tensor]:
        return self.kernel.simulate(schedule, token=torch.tensor([tok], dtype=torch.int32), pos=pos, **self.spec.new_caches())

    def reference(self, pos: int = 3, tok: int = 5) -> dict[str, torch.Tensor]:
        t = torch.tensor([tok], dtype=torch.int32)
        return me.run_reference(self.graph, {"token": t, **self.spec.new_caches()}, self.weights, {"pos": pos})

    def paged_kinds(self, ring: Ring) -> set[str]:
        q = self.kernel.queue
        return {e.op.kind for e in q.entries if paged_streams(q, e.op, ring.defines()) is not None}


def build(name: str) -> Model:
    preset, dt, hidden, logits = MODELS[name]
    cfg = dataclasses.replace(ModelConfig.preset(preset), dtype=dt, hidden=hidden, intermediate=2 * hidden, vocab=256,
                              heads=2, kv_heads=1, head_dim=64, layers=1)
    graph, spec = build_decode_graph(cfg, max_len=16, logits=logits)
    weights = random_weights(spec, seed=1)
    return Model(graph, spec, weights, me.compile(graph, weights, backend="sim", max_dims={"pos": 15}))


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in MODELS}


@pytest.fixture
def ring_stats(monkeypatch):
    """The RingStats of every ring run in the test, in order."""
    runs, run_with_ring = [], page_sim.run_with_ring

    def recorded(sim, schedule):
        runs.append(run_with_ring(sim, schedule))
        return runs[-1]

    monkeypatch.setattr(page_sim, "run_with_ring", recorded)
    return runs


def assert_matches(out: dict, ref: dict, why: str) -> None:
    for name, r in ref.items():
        if r.is_floating_point():
            err = ((out[name].float() - r.float()).norm() / r.float().norm()).item()
            assert err < 1e-5, f"{name}: relative error {err} {why}"
        else:
            assert torch.equal(out[name], r), f"{name} {why}"


def with_ring(schedule: Schedule, ring: Ring) -> Schedule:
    return dataclasses.replace(schedule, ring=ring)


@pytest.mark.parametrize("ring", RINGS, ids=lambda r: f"{r.pages}x{r.page_bytes}B-{r.slots}slots")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ring_matches_reference(models, name, ring, ring_stats):
    m = models[name]
    assert {"glu_down"} < m.paged_kinds(ring)  # and matvec or matvec_argmax
    ref = m.reference()
    for sch in SCHEDULES:
        assert_matches(m.run(with_ring(sch, ring)), ref, f"under {with_ring(sch, ring)}")
    assert all(s.pages > 0 and s.wrapped > 0 for s in ring_stats)  # pages reused within an instance
    if ring.slots == 1:
        assert not any(s.claimed_ahead for s in ring_stats)


@pytest.mark.parametrize("ring", [None, *RINGS, Ring(pages=3, page_bytes=1024, slots=6)],
                         ids=lambda r: "no-ring" if r is None else f"{r.pages}x{r.page_bytes}B-{r.slots}slots")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_order_matches_reference(models, name, ring, ring_stats):
    """MEGA_STATIC: SM s runs instances s, s + sms, ...; with the ring its loader streams its own
    next instances' pages as far ahead as its slots and pages allow."""
    m = models[name]
    ref = m.reference()
    for sch in SCHEDULES:
        sch = dataclasses.replace(sch, static=True, ring=ring)
        assert_matches(m.run(sch), ref, f"under {sch}")
    if ring is not None and ring.slots > 1:
        assert sum(s.claimed_ahead for s in ring_stats) > 0  # loaders ran ahead of busy bodies


def test_the_models_page_matvec_glu_down_and_matvec_argmax(models):
    ring = RINGS[0]
    assert models["llama-f32"].paged_kinds(ring) >= {"matvec", "glu_down"}
    assert models["qwen3-bf16"].paged_kinds(ring) >= {"matvec", "glu_down", "matvec_argmax"}
    q = models["qwen3-bf16"].kernel.queue
    unpaged = [e for e in q.entries if e.op.kind == "matvec" and paged_streams(q, e.op, ring.defines()) is None]
    assert unpaged  # the loader also meets instances it may not claim ahead


@pytest.mark.parametrize("breakage, why", [
    (Breakage(refill_before_release=True), "its ring slot was refilled before the body released it"),
    (Breakage(read_before_fill=True), "read before its fill landed"),
    (Breakage(loader_streams_reversed=True), "the loader streamed other rows than the body reads"),
], ids=["refill_before_release", "read_before_fill", "loader_streams_reversed"])
@pytest.mark.parametrize("static", [False, True], ids=["claimed", "static"])
def test_a_broken_protocol_fails(models, breakage, why, static):
    m = models["llama-f32"]
    ring = Ring(pages=2, page_bytes=512, slots=2, breakage=breakage)
    pattern = rf"op\d+ (matvec|glu_down) \(entry \d+\) instance \d+ on SM \d+: page \d+ \(ring slot [01]\) should hold .*: {why}"
    with pytest.raises(SimulationError, match=pattern):
        for seed in range(10):
            m.run(Schedule(sms=4, seed=seed, adversarial=seed % 2 == 1, ring=ring, static=static))


def test_bodies_compute_from_the_page_copies(models, monkeypatch):
    """Pages whose rows are wrong (tags right) give wrong results: the bodies read the copies."""
    m = models["llama-f32"]
    copy_rows = page_sim.copy_rows
    monkeypatch.setattr(page_sim, "copy_rows", lambda weight, s, tag: 2 * copy_rows(weight, s, tag))
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches(m.run(Schedule(sms=4, ring=RINGS[1])), m.reference(), "with doubled page copies")


def test_pages_must_carry_every_row_the_op_reads(models, monkeypatch):
    """A stream geometry that misses rows the op reads fails, though loader and body agree on it."""
    m = models["llama-f32"]
    streams = page_sim.paged_streams

    def short(q, op, defs):
        got = streams(q, op, defs)
        return got and [dataclasses.replace(s, tile=s.tile - 1) for s in got]

    monkeypatch.setattr(page_sim, "paged_streams", short)
    with pytest.raises(SimulationError, match=r"op\d+ (matvec|glu_down) .* reads rows of weight '.*' that its pages do not"):
        m.run(Schedule(sms=4, ring=RINGS[1]))


@pytest.mark.parametrize("ring, static", [(RINGS[0], False), (RINGS[0], True), (None, True)],
                         ids=["ring-claimed", "ring-static", "static"])
def test_a_dropped_wait_is_caught(models, ring, static):
    m = models["llama-f32"]
    q = m.kernel.queue
    entries = tuple(dataclasses.replace(e, waits=()) if paged_streams(q, e.op, RINGS[0].defines()) else e for e in q.entries)
    m.kernel.queue = dataclasses.replace(q, entries=entries)  # the paged ops no longer wait for their inputs
    try:
        with pytest.raises(SimulationError, match=r"op\d+ (matvec|glu_down) .* read unwritten elements"):
            for seed in range(10):
                m.run(Schedule(sms=8, seed=seed, adversarial=True, ring=ring, static=static))
    finally:
        m.kernel.queue = q


def test_a_never_met_wait_is_a_deadlock_naming_the_op(models):
    m = models["llama-f32"]
    q = m.kernel.queue
    k = max(k for k, e in enumerate(q.entries) if e.waits and paged_streams(q, e.op, RINGS[1].defines()))
    e = q.entries[k]
    bad = tuple(dataclasses.replace(w, expected=w.expected + 1) for w in e.waits)
    m.kernel.queue = dataclasses.replace(q, entries=q.entries[:k] + (dataclasses.replace(e, waits=bad),) + q.entries[k + 1:])
    try:
        stuck = rf"deadlock: .*op{e.op.id} {e.op.kind} \(entry {k}\) instance \d+ waits for its barrier counters"
        with pytest.raises(SimulationError, match=stuck):
            m.run(Schedule(sms=3, ring=RINGS[1]))
        with pytest.raises(SimulationError, match=rf"deadlock: op{e.op.id} {e.op.kind} instance \d+ waits forever \(static"):
            m.run(Schedule(sms=3, static=True))
    finally:
        m.kernel.queue = q


@pytest.mark.parametrize("slots", [1, 2])
def test_no_deadlock_across_seeds(models, slots, ring_stats):
    ring = Ring(pages=2, page_bytes=1024, slots=slots)
    for m in models.values():
        refs = {pos: m.reference(pos) for pos in (0, 7)}
        for seed in range(12):
            sch = Schedule(sms=1 + seed % 8, seed=seed, adversarial=seed % 3 == 0, ring=ring)
            pos = 7 * (seed % 2)
            assert_matches(m.run(sch, pos=pos), refs[pos], f"under {sch}")
    ahead = sum(s.claimed_ahead for s in ring_stats)
    assert ahead > 0 if slots > 1 else ahead == 0  # two slots: loaders claimed paged instances ahead
