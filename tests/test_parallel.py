"""Tensor parallelism on the CPU: the reference over ranks, the peer barrier families, and every rank's
queue run together on the simulator (random and adversarial interleavings of the ranks), where a
dropped cross-rank wait must fail."""

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.compiler import build_artifact
from megaegg.graph import GraphError
from megaegg.interpreter.render import render
from megaegg.interpreter import Interleaving, SimulationError
from megaegg.models import ModelConfig, UnsupportedConfig, build_decode_graph, random_weights
from megaegg.models.decoder import shard_caches, shard_weights
from megaegg.parallel import ParallelKernel

TP = 2


def tiny(tp: int):
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    return cfg, build_decode_graph(cfg, max_len=32), build_decode_graph(cfg, max_len=32, tp=tp)


def rank_inputs(caches, spec, tok):
    return [{"token": tok, **shard_caches(spec, caches, r)} for r in range(spec.tp)]


@pytest.fixture(scope="module")
def model():
    cfg, (g1, s1), (g, s) = tiny(TP)
    W = random_weights(s1, seed=21)
    caches = {n: torch.randn(shape, generator=torch.Generator().manual_seed(3)) for n, shape in s1.caches.items()}
    return g1, s1, g, s, W, caches, build_artifact(g, compile_cuda=False, max_dims={"pos": 31})


def test_reference_over_ranks_equals_one_gpu_model(model):
    g1, s1, g, s, W, caches, _ = model
    tok = torch.tensor([9], dtype=torch.int32)
    one = me.run_reference(g1, {"token": tok, **{n: c.clone() for n, c in caches.items()}}, W, {"pos": 6})
    ranks = me.run_reference_ranks(g, rank_inputs(caches, s, tok), [shard_weights(s, W, r) for r in range(TP)], {"pos": 6})
    for out in ranks:
        torch.testing.assert_close(out["logits"], one["logits"], atol=2e-5, rtol=1e-4)
        assert torch.equal(out["next_token"], one["next_token"])


@pytest.mark.parametrize("seed,adversarial", [(0, False), (1, False), (2, True), (3, True), (4, True)])
def test_simulated_ranks_match_reference(model, seed, adversarial):
    _, _, g, s, W, caches, art = model
    shards = [shard_weights(s, W, r) for r in range(TP)]
    kernel = ParallelKernel(art, shards, backend="sim")
    tok = torch.tensor([4], dtype=torch.int32)
    ours = kernel.simulate(Interleaving(sms=3, seed=seed, adversarial=adversarial), rank_inputs(caches, s, tok), pos=11)
    ref = me.run_reference_ranks(g, rank_inputs(caches, s, tok), shards, {"pos": 11})
    for r in range(TP):
        torch.testing.assert_close(ours[r]["logits"], ref[r]["logits"], atol=1e-5, rtol=1e-5)


def test_simulated_launches_carry_peer_counters_and_halves(model):
    """Three decode steps in a row: a delayed rank lets the others run into their next launches, whose
    sends land in the other half; every launch matches the reference run step by step."""
    _, _, g, s, W, caches, art = model
    shards = [shard_weights(s, W, r) for r in range(TP)]
    kernel = ParallelKernel(art, shards, backend="sim")
    steps = [(4, 11), (9, 12), (2, 13)]  # (token, pos)
    for seed, adversarial in ((0, False), (1, True), (2, True)):
        ours_c, ref_c = rank_inputs(caches, s, None), rank_inputs(caches, s, None)
        feeds = [([{**{n: c for n, c in ours_c[r].items() if n != "token"}, "token": torch.tensor([t], dtype=torch.int32)}
                   for r in range(TP)], {"pos": p}) for t, p in steps]
        outs = kernel.simulate_launches(Interleaving(sms=2, seed=seed, adversarial=adversarial), feeds)
        for (t, p), ours in zip(steps, outs):
            ref = me.run_reference_ranks(g, [{**{n: c for n, c in ref_c[r].items() if n != "token"},
                                              "token": torch.tensor([t], dtype=torch.int32)} for r in range(TP)],
                                         shards, {"pos": p})
            for r in range(TP):
                torch.testing.assert_close(ours[r]["logits"], ref[r]["logits"], atol=1e-5, rtol=1e-5)


def test_one_half_of_peer_buffers_is_caught(model):
    """With one copy of the peer buffers instead of two, a rank running ahead into its next launch
    writes where a slower rank's launch still reads: the simulator must catch it."""
    _, _, g, s, W, caches, art = model
    kernel = ParallelKernel(art, [shard_weights(s, W, r) for r in range(TP)], backend="sim")
    c = rank_inputs(caches, s, None)
    feeds = [([{**{n: x for n, x in c[r].items() if n != "token"}, "token": torch.tensor([3], dtype=torch.int32)}
               for r in range(TP)], {"pos": p}) for p in (5, 6, 7)]
    with pytest.raises(SimulationError, match="still reads"):
        for seed in range(8):
            kernel.simulate_launches(Interleaving(sms=2, seed=seed, adversarial=True), feeds, halves=1)


def test_peer_barriers_are_per_source_and_static(model):
    art = model[-1]
    q = art.queue
    peer_sets = [s for s in q.barriers.sets if s.peer]
    sends = [e.op.id for e in q.entries if e.op.kind == "allreduce_send"]
    assert peer_sets and {s.producer for s in peer_sets} == set(sends)  # the sends, and only they, signal across ranks
    plan = q.memory.peer
    words = [plan.word(plan.counter_base[s.id] + k, r) for s in peer_sets for k in range(s.count.value) for r in range(TP)]
    assert sorted(words) == list(range(plan.counters * TP))  # every (counter, source) its own word, none shared
    assert 4 * len(words) <= plan.data_at  # the counters end before the buffers begin
    sums = [e for e in q.entries if e.op.kind in ("allreduce_sum", "allgather_copy")]
    assert {e.op.kind for e in sums} == {"allreduce_sum", "allgather_copy"}  # tiny's LM head is vocabulary-parallel
    for e in sums:
        (w,) = [w for w in e.waits if q.barriers.sets[w.barrier_set].peer]
        assert w.expected.is_const  # counted across launches: the same count every launch
    src = render(q).source
    assert "mega_red_release_sys" in src and "seq * (unsigned)" in src


def test_tp_kernel_compiles(model):
    """The whole tensor-parallel kernel (peer waits, system-scope signals, the all-reduce bodies) through NVRTC."""
    nvrtc = pytest.importorskip("megaegg.interpreter.nvrtc")
    art = model[-1]
    try:
        out = nvrtc.compile_cubin(art.source, defines=art.defines)
    except ImportError as e:  # (no NVRTC on this machine)
        pytest.skip(str(e))
    assert out.cubin


@pytest.mark.parametrize("kind", ["allreduce_sum", "allgather_copy"])
def test_dropped_cross_rank_wait_fails(model, kind):
    _, _, g, s, W, caches, art = model
    q = art.queue
    peer = {b.id for b in q.barriers.sets if b.peer}
    entries = tuple(dataclasses.replace(e, waits=tuple(w for w in e.waits if w.barrier_set not in peer))
                    if e.op.kind == kind else e for e in q.entries)
    broken = dataclasses.replace(art, queue=dataclasses.replace(q, entries=entries))
    kernel = ParallelKernel(broken, [shard_weights(s, W, r) for r in range(TP)], backend="sim")
    tok = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(SimulationError, match=f"rank .*{kind}.*early"):
        for seed in range(6):  # (some interleaving lets a sum in before the other rank's send)
            kernel.simulate(Interleaving(sms=2, seed=seed, adversarial=True), rank_inputs(caches, s, tok), pos=3)


def test_user_errors():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(UnsupportedConfig, match="tp=3 does not divide"):
        build_decode_graph(cfg, max_len=32, tp=3)
    with pytest.raises(GraphError, match="tp must be an int in"):
        build_decode_graph(cfg, max_len=32, tp=0)
    with pytest.raises(UnsupportedConfig, match="routed experts"):
        build_decode_graph(ModelConfig.preset("qwen3-moe-tiny"), max_len=32, tp=2)
    g = me.Graph()
    x = g.input("x", [1, 8], me.f32)
    with pytest.raises(me.ShapeError, match="ranks must be an int"):
        me.all_reduce(x, ranks=9)
    with pytest.raises(me.ShapeError, match="all_gather: .* must be one row"):
        me.all_gather(g.input("rows", [2, 8], me.f32), ranks=2)
    with pytest.raises(me.ShapeError, match="all_gather: .* must be a float tensor"):
        me.all_gather(g.input("ids", [1, 8], me.i32), ranks=2)
    _ = g.output("y", me.all_reduce(x, ranks=2))
    with pytest.raises(GraphError, match="run_reference_ranks"):
        me.run_reference(g, {"x": torch.ones(1, 8)})
    art = build_artifact(g, compile_cuda=False)
    with pytest.raises(GraphError, match="one weights dict per rank"):
        ParallelKernel(art, [{}], backend="sim")
    with pytest.raises(GraphError, match="ParallelKernel"):
        me.Kernel(art, {}, backend="sim")(x=torch.ones(1, 8))
    with pytest.raises(GraphError, match="ParallelKernel"):
        me.Kernel(art, {}, backend="sim").simulate(Interleaving(), x=torch.ones(1, 8))
    _, (_, s1), (_, s) = tiny(2)
    W = random_weights(s1, seed=1)
    with pytest.raises(GraphError, match="missing weight"):
        shard_weights(s, {k: v for k, v in W.items() if "q_proj" not in k}, 0)


def test_all_gather_concatenates_in_rank_order():
    g = me.Graph()
    x = g.input("x", [1, 3], me.f32)
    _ = g.output("y", me.all_gather(me.silu(x), ranks=2))
    xs = [torch.randn(1, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    want = torch.cat([torch.nn.functional.silu(t) for t in xs], -1)
    for out in me.run_reference_ranks(g, [{"x": t} for t in xs], [{}, {}]):
        torch.testing.assert_close(out["y"], want)
    with pytest.raises(GraphError, match="run_reference_ranks"):
        me.run_reference(g, {"x": xs[0]})
    art = build_artifact(g, compile_cuda=False)
    ours = ParallelKernel(art, [{}, {}], backend="sim").simulate(Interleaving(sms=2, seed=5, adversarial=True),
                                                                 [{"x": t} for t in xs])
    for out in ours:
        torch.testing.assert_close(out["y"], want)


def test_lm_head_is_vocabulary_parallel_only_when_untied_and_divisible():
    cfg = ModelConfig.preset("tiny")  # untied, vocab 1024
    for c, tp, split in ((cfg, 2, True), (dataclasses.replace(cfg, tie_embeddings=True), 2, False),
                         (dataclasses.replace(cfg, vocab=1023), 2, False)):
        g, s = build_decode_graph(c, max_len=32, tp=tp)
        assert any(n.op == "all_gather" for n in g.nodes) == split
        rows = s.weights.get("lm_head.weight", s.weights["model.embed_tokens.weight"])[0]
        assert rows == (c.vocab // tp if split else c.vocab)


def test_ragged_vocabulary_parallel_lm_head_on_simulated_ranks():
    """vocab / tp = 1250 logit rows a rank, whose last tiles are short: every rank's logits match the
    reference over ranks and the one-GPU model, over two launches."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32, vocab=2500)
    (g1, s1), (g, s) = build_decode_graph(cfg, max_len=16), build_decode_graph(cfg, max_len=16, tp=TP)
    art = build_artifact(g, compile_cuda=False, max_dims={"pos": 15})
    W = random_weights(s1, seed=4)
    caches = {n: torch.randn(shape, generator=torch.Generator().manual_seed(5)) for n, shape in s1.caches.items()}
    shards = [shard_weights(s, W, r) for r in range(TP)]
    kernel = ParallelKernel(art, shards, backend="sim")
    c = rank_inputs(caches, s, None)
    feeds = [([{**{n: x for n, x in c[r].items() if n != "token"}, "token": torch.tensor([t], dtype=torch.int32)}
               for r in range(TP)], {"pos": p}) for t, p in ((5, 3), (77, 4))]
    ref_c = rank_inputs(caches, s, None)
    for (t, p), ours in zip(((5, 3), (77, 4)), kernel.simulate_launches(Interleaving(sms=3, seed=1, adversarial=True), feeds)):
        one = me.run_reference(g1, {"token": torch.tensor([t], dtype=torch.int32), **{n: x for n, x in caches.items()}}, W, {"pos": p})
        ref = me.run_reference_ranks(g, [{**{n: x for n, x in ref_c[r].items() if n != "token"},
                                          "token": torch.tensor([t], dtype=torch.int32)} for r in range(TP)], shards, {"pos": p})
        for r in range(TP):
            torch.testing.assert_close(ours[r]["logits"], ref[r]["logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours[r]["logits"], one["logits"], atol=2e-5, rtol=1e-4)
