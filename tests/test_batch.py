"""Batches of sequences: the step graph (per-row positions and cache slots, prompts prefilled in one
launch), continuous batching, and sampling on the device, on the CPU (reference and simulator)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_checkpoints import save_tiny

import megaegg as me
from queue_edits import without_waits
from step_spies import counting_carried
from megaegg.interpreter import Interleaving, SimulationError
from megaegg.models import ModelConfig, build_step_graph, load_checkpoint, random_weights, read_config
from megaegg.models.batch import Batcher, QueuedTokens, Request, Sampling, kernel_batch_step, reference_batch_step
from megaegg.sampling import draw_bits, sample_row

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 5], [9, 2, 44, 61, 7, 30, 8], [12], [50, 1, 6, 6, 90], [21, 22]]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batch_on_the_simulator_matches_transformers_prompt_by_prompt(tmp_path, arch):
    """Five prompts of 1 to 7 tokens through two cache slots, at most 6 token rows a launch: sequences
    join as others finish, long prompts prefill over two launches, and each sequence's greedy tokens
    are transformers' for its prompt alone."""
    path = save_tiny(tmp_path / arch, arch, seed=3)
    model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]).from_pretrained(path)
    cfg = read_config(path)
    graph, spec = build_step_graph(cfg, max_len=32, slots=2)
    weights = load_checkpoint(path, spec)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 6, "r": 2, "ctx": 32})
    ops = [e.op for e in kernel.queue.entries]
    # the K rows rotated (qwen3: normalised) as they go into the cache, and attention's merge in its own op
    assert sum(op.kind == "kv_store" and "inv_freq" in op.params.get("roles", ()) for op in ops) == cfg.layers
    assert sum(op.kind == "ragged_partial_merge" for op in ops) == cfg.layers
    kernel.interleaving = Interleaving(sms=5, seed=1, adversarial=True)
    batcher = Batcher(kernel_batch_step(kernel, spec.new_caches()), slots=2, max_len=32, max_tokens=6)
    outs = batcher.run([Request(p, 6) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == hf_greedy(model, prompt, 6), prompt
    assert batcher.launches < sum(len(p) + 5 for p in PROMPTS) / 2  # far fewer launches than tokens


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    graph, spec = build_step_graph(cfg, max_len=24, slots=3, sampling=True)
    return cfg, graph, spec, random_weights(spec, seed=5)


def test_sampling_is_reproducible_and_the_same_on_reference_and_simulator(tiny):
    cfg, graph, spec, weights = tiny
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    s = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=11)
    reqs = [Request(PROMPTS[0], 5, sampling=s), Request(PROMPTS[1], 4, sampling=dataclasses.replace(s, seed=12)),
            Request(PROMPTS[3], 5)]

    def run(step, requests=reqs):
        return [o.tokens for o in Batcher(step, slots=3, max_len=24).run(requests)]

    sim = run(kernel_batch_step(kernel, spec.new_caches()))
    assert sim == run(kernel_batch_step(kernel, spec.new_caches()))  # the same seeds, the same tokens
    assert sim == run(reference_batch_step(graph, weights, spec.new_caches()))
    reseeded = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=r.sampling.seed + 100)) for r in reqs[:2]]
    assert run(kernel_batch_step(kernel, spec.new_caches()), reseeded) != sim[:2]
    greedy_graph, greedy_spec = build_step_graph(cfg, max_len=24, slots=3)  # argmax, no sampling inputs
    greedy = run(reference_batch_step(greedy_graph, weights, greedy_spec.new_caches()), [reqs[2]])
    assert greedy == [sim[2]]  # temperature 0 in a sampling graph is the argmax


def chi2_limit(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.9)])
def test_sampled_tokens_follow_torchs_distribution(temperature, top_k, top_p):
    """The sample op, compiled and run on the simulator over 3000 rows of one fixed logits vector (seeds
    0..2999), against torch's softmax with Hugging Face's top-k then top-p filter: a chi-square test."""
    v, rows = 48, 3000
    logits = torch.randn(v, generator=torch.Generator().manual_seed(7)) * 1.5
    g = me.Graph("sample")
    r = me.sym("r")
    knobs = [g.input(n, [r], dt) for n, dt in
             (("temperature", me.f32), ("top_k", me.i32), ("top_p", me.f32), ("seed", me.i32), ("counter", me.i32))]
    g.output("tok", me.sample(g.input("logits", [r, v], me.f32), *knobs))
    kernel = me.compile(g, {}, backend="sim", max_dims={"r": rows})
    full = lambda x, dt: torch.full((rows,), x, dtype=dt)  # noqa: E731
    tok = kernel(logits=logits.expand(rows, v).contiguous(), temperature=full(temperature, torch.float32),
                 top_k=full(top_k, torch.int32), top_p=full(top_p, torch.float32),
                 seed=torch.arange(rows, dtype=torch.int32), counter=full(4, torch.int32), r=rows)["tok"]
    # torch: HF's warpers (temperature, top-k, top-p), then softmax
    z = logits / temperature
    if top_k:
        z = z.masked_fill(z < torch.topk(z, top_k).values[-1], -math.inf)
    p = z.softmax(0)
    s, idx = p.sort(descending=True)
    drop = (s.cumsum(0) - s) >= top_p
    p[idx[drop]] = 0
    p /= p.sum()
    counts = torch.bincount(tok.long(), minlength=v).float()
    assert (counts[p == 0] == 0).all(), "a filtered-out token was drawn"
    keep = p > 0
    expected = rows * p[keep]
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_limit(int(keep.sum()) - 1), (chi2, int(keep.sum()))


def test_the_draw_is_a_uniform_hash_of_seed_and_counter():
    bits = [draw_bits(5, c) for c in range(4000)]
    assert all(0 <= b < 2**24 for b in bits) and abs(sum(bits) / len(bits) / 2**24 - 0.5) < 0.02
    assert len(set(bits)) > 3990 and len({draw_bits(s, 0) for s in range(-50, 50)}) == 100  # counter and seed both move it
    logits = torch.tensor([0.0, 5.0, 5.0, -1.0])
    assert sample_row(logits, 0.0, 0, 1.0, 1, 1) == 1  # greedy: the first of the largest
    assert {sample_row(logits, 1.0, 1, 1.0, s, 0) for s in range(50)} <= {1, 2}  # top_k 1 keeps ties of the k-th


@pytest.mark.parametrize("dtype, hkv, rows, heads", [(me.f32, 2, 7, 1), (me.bf16, 8, 7, 1), (me.bf16, 8, 64, 4),
                                                     (me.bf16, 4, 64, 2), (me.bf16, 6, 48, 2)])
def test_kv_store_and_ragged_attention_on_adversarial_interleavings(dtype, hkv, rows, heads):
    """Rows of four sequences (prompts whose tokens attend each other, at scattered positions) write their K
    and V and attend their own slot's rows; a dropped wait lets attention read the cache before the write.
    On the tensor-core body (bf16) a batch whose rows fill a wave of (row, KV head) pairs takes several KV
    heads an instance."""
    n = me.sym("n")
    g = me.Graph("ragged")
    slots, length, d, group = 4, 16, 64, 2
    q, k, v = (g.input(name, [n, h, d], dtype) for name, h in (("q", group * hkv), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [n], me.i32), g.input("slot", [n], me.i32)
    kc = me.kv_store(g.input("kc", [slots, hkv, length, d], dtype), k, pos, slot)
    vc = me.kv_store(g.input("vc", [slots, hkv, length, d], dtype), v, pos, slot)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
    kernel = me.compile(g, {}, backend="sim", max_dims={"n": 64}, dims_hint={"n": 4})  # (decode rows: not flash)
    launching = [e.op for e in kernel.queue.entries if e.op.kind == "ragged_partial_merge"
                 and e.op.launch_count.eval({"n": rows, "length": length}) > 0]
    assert [op.params.get("heads", 1) for op in launching] == [heads]
    gen = torch.Generator().manual_seed(2)
    t = dtype.torch
    cells = torch.randperm(slots * length, generator=gen)[:rows]  # distinct (slot, position)s
    ins = {"q": torch.randn(rows, group * hkv, d, generator=gen).to(t), "k": torch.randn(rows, hkv, d, generator=gen).to(t),
           "v": torch.randn(rows, hkv, d, generator=gen).to(t),
           "pos": (cells % length).to(torch.int32), "slot": (cells // length).to(torch.int32)}
    caches = {name: torch.randn(slots, hkv, length, d, generator=gen).to(t) for name in ("kc", "vc")}
    fresh = lambda: {k: c.clone() for k, c in caches.items()}  # noqa: E731
    ref = me.run_reference(g, {**ins, **fresh()}, {}, {"n": rows})
    tol = 1e-5 if dtype == me.f32 else 2e-2
    for seed in range(2):
        out = kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=seed % 2 == 1), **ins, **fresh(), n=rows)
        torch.testing.assert_close(out["o"].float(), ref["o"].float(), atol=tol, rtol=tol)
    with without_waits(kernel, "ragged_partial_merge"), pytest.raises(
            SimulationError, match=r"ragged_partial_merge .* read unwritten elements of buffer '[kv]c'"):
        for seed in range(8):
            kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=True), **ins, **fresh(), n=rows)


def test_grouped_heads_read_a_paged_cache():
    """64 bf16 rows of 8 KV heads through a page table (the tensor-core body finds each row's page): the
    grouped op (4 heads an instance) launches, and gives the reference's output under adversarial
    interleavings; without its waits it reads the cache before the write."""
    n = me.sym("n")
    g = me.Graph("ragged_paged")
    hkv, d, page, slots, per, pool, rows = 8, 64, 8, 4, 3, 14, 64
    q, k, v = (g.input(name, [n, h, d], me.bf16) for name, h in (("q", 2 * hkv), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [n], me.i32), g.input("slot", [n], me.i32)
    table = g.input("pages", [slots, per], me.i32)
    kc = me.kv_store(g.input("kc", [pool, hkv, page, d], me.bf16), k, pos, slot, pages=table)
    vc = me.kv_store(g.input("vc", [pool, hkv, page, d], me.bf16), v, pos, slot, pages=table)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot, pages=table))
    kernel = me.compile(g, {}, backend="sim", max_dims={"n": 64}, dims_hint={"n": 4})
    launching = [e.op for e in kernel.queue.entries if e.op.kind == "ragged_partial_merge"
                 and e.op.launch_count.eval({"n": rows}) > 0]
    assert [(op.params.get("heads", 1), op.params["paged"]) for op in launching] == [(4, "rows")]
    gen = torch.Generator().manual_seed(9)
    cells = torch.randperm(slots * per * page, generator=gen)[:rows]  # distinct (slot, position)s
    ins = {"q": torch.randn(rows, 2 * hkv, d, generator=gen).bfloat16(), "k": torch.randn(rows, hkv, d, generator=gen).bfloat16(),
           "v": torch.randn(rows, hkv, d, generator=gen).bfloat16(), "pos": (cells % (per * page)).to(torch.int32),
           "slot": (cells // (per * page)).to(torch.int32),
           "pages": torch.randperm(pool, generator=gen)[: slots * per].reshape(slots, per).to(torch.int32)}
    pools = {name: torch.randn(pool, hkv, page, d, generator=gen).bfloat16() for name in ("kc", "vc")}
    fresh = lambda: {k: c.clone() for k, c in pools.items()}  # noqa: E731
    ref = me.run_reference(g, {**ins, **fresh()}, {}, {"n": rows})
    out = kernel.simulate(Interleaving(sms=4, seed=1, adversarial=True), **ins, **fresh(), n=rows)
    torch.testing.assert_close(out["o"].float(), ref["o"].float(), atol=2e-2, rtol=2e-2)
    with without_waits(kernel, "ragged_partial_merge"), pytest.raises(
            SimulationError, match=r"ragged_partial_merge .* read unwritten elements of buffer '[kv]c'"):
        for seed in range(8):
            kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=True), **ins, **fresh(), n=rows)


def test_a_position_outside_the_cache_is_an_error_naming_the_op(tiny):
    _, graph, spec, weights = tiny
    step = reference_batch_step(graph, weights, spec.new_caches())
    batcher = Batcher(step, slots=3, max_len=24)
    with pytest.raises(me.GraphError, match=r"3 prompt \+ 23 new tokens need 25 cache rows, the caches hold 24"):
        batcher.submit(Request([1, 2, 3], 23))
    rows = {"token": torch.tensor([1], dtype=torch.int32), "pos": torch.tensor([24], dtype=torch.int32),
            "slot": torch.tensor([0], dtype=torch.int32), "out": torch.tensor([0], dtype=torch.int32)}
    knobs = {"temperature": torch.zeros(1), "top_k": torch.zeros(1, dtype=torch.int32), "top_p": torch.ones(1),
             "seed": torch.zeros(1, dtype=torch.int32), "counter": torch.zeros(1, dtype=torch.int32)}
    with pytest.raises(me.GraphError, match=r"kv_store .*pos\[0\] = 24 outside \[0, 23\]"):
        me.run_reference(graph, {**rows, **knobs, **spec.new_caches()}, weights, {"n": 1, "r": 1, "ctx": 24})


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be >= 0"), ({"top_k": -2}, r"top_k must be an int in \[0, 2\*\*31\)"), ({"top_k": 2**31}, r"top_k must be an int in \[0, 2\*\*31\)"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"), ({"seed": 2**40}, "seed must be a 32-bit int"),
])
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(me.GraphError, match=message):
        Sampling(**kwargs)


def test_a_prompt_longer_than_a_launch_prefills_over_several(tiny):
    """One slot, four token rows a launch: a 7-token prompt takes two launches (the first with no output
    row), then the next request waits for the slot; the simulator and the reference agree."""
    cfg, _, _, weights = tiny
    graph, spec = build_step_graph(cfg, max_len=24, slots=1)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 4, "r": 1, "ctx": 24})
    reqs = [Request([1, 2, 3, 4, 5, 6, 7], 3), Request([5, 6], 2)]
    runs = []
    for step in (kernel_batch_step(kernel, spec.new_caches()), reference_batch_step(graph, weights, spec.new_caches())):
        b = Batcher(step, slots=1, max_len=24, max_tokens=4)
        runs.append(([o.tokens for o in b.run(reqs)], b.launches))
    assert runs[0] == runs[1] and runs[0][1] == 2 + 2 + 1 + 1  # prefill 2 + decode 2, prefill 1 + decode 1


# --- progress and stopping early: on_step, drain, Generator.current -----------------------------------------
def test_on_step_reports_each_launch_and_can_stop_keeping_the_tokens(tiny):
    cfg, graph, spec, weights = tiny
    reqs = [Request(p, 4) for p in PROMPTS[:3]]
    step = reference_batch_step(graph, weights, spec.new_caches())
    full = [o.tokens for o in Batcher(step, slots=2, max_len=24).run(reqs)]
    b = Batcher(reference_batch_step(graph, weights, spec.new_caches()), slots=2, max_len=24)
    seen = []
    outs = b.run(reqs, on_step=lambda info: seen.append(info) or info.step == 3)  # stop after the third launch
    assert [i.step for i in seen] == [1, 2, 3] and b.launches == 3 and not b.busy()
    first = seen[0]  # two prompts prefilled in one launch, the third waits for a slot
    assert (first.rows, first.prefill_rows, first.running, first.waiting, first.finished) == (10, 10, 2, 1, 0)
    assert first.tokens == ((0, full[0][0]), (1, full[1][0]))
    assert seen[1].prefill_rows == 0 and seen[1].tokens == ((0, full[0][1]), (1, full[1][1]))
    assert [o.tokens for o in outs] == [full[0][:3], full[1][:3], []]  # what came, in submission order
    assert [o.finished for o in outs] == [False, False, False] and b.prefill_rows == [10, 0, 0]
    assert [o.tokens for o in b.run([reqs[2]])] == [full[2]]  # the slots are free again: it runs on


def test_drain_after_an_interrupted_launch_keeps_what_came(tiny):
    cfg, graph, spec, weights = tiny
    step = reference_batch_step(graph, weights, spec.new_caches())
    reqs = [Request(PROMPTS[0], 2), Request(PROMPTS[2], 5)]
    full = [o.tokens for o in Batcher(step, slots=2, max_len=24).run(reqs)]
    launches = []

    def interrupted_at_the_fourth(rows):
        launches.append(1)
        if len(launches) == 4:
            raise KeyboardInterrupt
        return step(rows)

    b = Batcher(interrupted_at_the_fourth, slots=2, max_len=24)
    with pytest.raises(KeyboardInterrupt):
        b.run(reqs)
    outs = b.drain()
    assert [o.tokens for o in outs] == [full[0], full[1][:3]] and [o.finished for o in outs] == [True, False]
    assert b.launches == 3 and not b.busy() and b.drain() == []


def test_generator_on_step_can_stop_and_current_keeps_an_interrupted_generation():
    from megaegg.models import Generator, build_decode_graph, reference_step

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    graph, spec = build_decode_graph(cfg, max_len=16)
    step = reference_step(graph, random_weights(spec, seed=5), spec.new_caches())
    gen = Generator(step, max_len=16)
    full = gen.generate([3, 4], 5)
    assert full.finished and gen.current is full
    seen = []
    cut = gen.generate([3, 4], 5, on_step=lambda info: seen.append(info) or info.step == 3)
    assert cut.tokens == full.tokens[:2] and not cut.finished
    assert [(i.step, i.prefill_rows, i.tokens) for i in seen] == [
        (1, 1, ()), (2, 1, ((0, full.tokens[0]),)), (3, 0, ((0, full.tokens[1]),))]
    calls = []

    def interrupted_at_the_fourth(token, pos):
        calls.append(pos)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(token, pos)

    gen = Generator(interrupted_at_the_fourth, max_len=16)
    with pytest.raises(KeyboardInterrupt):
        gen.generate([3, 4], 5)
    assert gen.current.tokens == full.tokens[:2] and not gen.current.finished


def test_prefix_cache_reuses_a_free_slots_rows():
    """A request sharing a prompt prefix with a finished sequence goes to its slot and prefills only the
    rest; its tokens are the ones a fresh prefill gives."""
    from megaegg.models.batch import Batcher, Request, reference_batch_step

    cfg = ModelConfig.preset("tiny")
    graph, spec = build_step_graph(cfg, max_len=32, slots=2)
    w = random_weights(spec, seed=4)
    system = [5, 9, 2, 7, 7, 1, 3, 8]
    prompts = [system + [11, 12], system + [40], [6, 6, 6], system + [11, 12, 13]]

    def run(prefix_cache):
        b = Batcher(reference_batch_step(graph, w, spec.new_caches()), slots=2, max_len=32, prefix_cache=prefix_cache)
        outs = [b.run([Request(p, 3)])[0].tokens for p in prompts]  # one after another: slots free up
        return outs, b

    fresh, plain = run(False)
    cached, b = run(True)
    assert cached == fresh
    # the 2nd reuses the 1st's 8 system tokens (slot 0); the 3rd shares nothing and takes the empty slot 1,
    # so the 4th finds the system prompt in slot 0 again
    assert b.prefix_hits == 8 + 0 + 8
    assert sum(b.prefill_rows) == sum(plain.prefill_rows) - b.prefix_hits


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_bf16_decode_rows_store_k_rotated_and_attend_in_one_op(preset):
    """bf16 decode rows of several sequences at different lengths: K's RoPE (qwen3: its RMSNorm too) runs
    inside the cache store, attention is one split-KV op whose splits merge themselves, and the step
    matches the reference executor under adversarial interleavings."""
    cfg = dataclasses.replace(ModelConfig.preset(preset), dtype=me.bf16)
    graph, spec = build_step_graph(cfg, max_len=40, slots=8)
    weights = random_weights(spec, seed=7)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 8, "r": 8, "ctx": 40},
                        dims_hint={"n": 4, "r": 4, "ctx": 33})
    ops = [e.op for e in kernel.queue.entries]
    assert sum(op.kind == "kv_store" and "inv_freq" in op.params.get("roles", ()) for op in ops) == cfg.layers
    assert sum(op.kind == "ragged_partial_merge" for op in ops) == cfg.layers
    gen = torch.Generator().manual_seed(11)
    caches = {n: (torch.randn(s, generator=gen) * 0.5).to(torch.bfloat16) for n, s in spec.caches.items()}
    rows = 5
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ins = {"token": torch.randint(0, cfg.vocab, (rows,), generator=gen, dtype=torch.int32),
           "pos": i32([32, 7, 19, 0, 31]), "slot": i32([0, 3, 5, 6, 1]), "out": i32([0, 1, 2, 3, 4])}
    dims = {"n": rows, "r": rows, "ctx": 33}
    ref = me.run_reference(graph, {**ins, **{n: c.clone() for n, c in caches.items()}}, weights, dims)
    for seed in range(2):
        out = kernel.simulate(Interleaving(sms=6, seed=seed, adversarial=seed == 1), **ins,
                              **{n: c.clone() for n, c in caches.items()}, **dims)
        err = ((out["logits"].float() - ref["logits"].float()).norm() / ref["logits"].float().norm()).item()
        assert err < 1e-2, err


def test_a_batch_of_64_rows_takes_the_grouped_attention_op_and_matches_the_reference():
    """8 KV heads (bf16): the step graph's 17-65-row band holds both attention ops, the per-head one and the
    grouped one (4 heads an instance), and at 64 decoding rows the grouped one runs and gives the
    reference's logits; the band below 17 rows holds only the per-head op (the grouped one could never run
    there: no queue entry, no wait on it)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.bf16, kv_heads=8, heads=16)
    graph, spec = build_step_graph(cfg, max_len=40, slots=64)
    weights = random_weights(spec, seed=4)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 600, "r": 64, "ctx": 40},
                        dims_hint={"n": 16, "r": 16, "ctx": 33})
    regime = kernel.queue.program.regime
    attn = [e.op for e in kernel.queue.entries if e.op.kind == "ragged_partial_merge"]
    by_band = {b: sorted(op.params.get("heads", 1) for op in attn if op.regime == b) for b in range(regime.bands)}
    assert by_band[0] == [1] * cfg.layers and by_band[1] == [1] * cfg.layers + [4] * cfg.layers, by_band
    gen = torch.Generator().manual_seed(12)
    caches = {n: (torch.randn(s, generator=gen) * 0.5).to(torch.bfloat16) for n, s in spec.caches.items()}
    rows = 64
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ins = {"token": torch.randint(0, cfg.vocab, (rows,), generator=gen, dtype=torch.int32),
           "pos": torch.randint(0, 39, (rows,), generator=gen, dtype=torch.int32), "slot": i32(list(range(rows))),
           "out": i32(list(range(rows)))}
    dims = {"n": rows, "r": rows, "ctx": 40}
    env = kernel.queue.program.with_derived(dims)
    assert [op.params.get("heads", 1) for op in attn if op.launch_count.eval(env) > 0] == [4] * cfg.layers
    ref = me.run_reference(graph, {**ins, **{n: c.clone() for n, c in caches.items()}}, weights, dims)
    out = kernel.simulate(Interleaving(sms=6, seed=3, adversarial=True), **ins, **{n: c.clone() for n, c in caches.items()},
                          **dims)
    err = ((out["logits"].float() - ref["logits"].float()).norm() / ref["logits"].float().norm()).item()
    assert err < 1e-2, err


def test_runtime_row_tiles_by_operand_layout():
    """A runtime M's linears take wide 64-row tiles (bf16, K a multiple of 64); a matmul's transposed
    weight has no 16-byte rows for the tensor-core bodies, so its tiles stay below 8 rows (the generic
    body); f16 gets no norm prologue on a wide tile (its unnormalised x * g could overflow)."""
    from megaegg.compiler import build_artifact

    n = me.sym("n")
    for dt, fused in ((me.bf16, True), (me.f16, False)):
        g = me.Graph("rows")
        x = g.input("x", [n, 512], dt)
        h = me.rms_norm(x, g.weight("g", [512], dt), 1e-5)
        g.output("y", me.linear(h, g.weight("w", [256, 512], dt)))
        g.output("z", me.matmul(x, g.weight("b", [512, 96], dt)))
        ops = build_artifact(g, max_dims={"n": 64}, dims_hint={"n": 16}, compile_cuda=False).queue.program.ops
        mv = [op for op in ops if op.kind == "matvec"]
        linear = [op for op in mv if op.params["roles"][:2] == ("x", "w") and op.output.shape[1].value == 256]
        matmul = [op for op in mv if op.output.shape[1].value == 96]
        assert linear and all(op.params["mrows"] == 64 for op in linear), [op.params for op in mv]
        assert ("g" in linear[0].params["roles"]) == fused, (dt, linear[0].params)
        assert matmul and all(op.params["mrows"] <= 4 for op in matmul), [op.params for op in matmul]


def test_a_batch_splits_its_residual_projections_over_k():
    """At llama-3.2-1b's widths the step graph's hint program runs O and the down projection as
    ``matvec_split``: priced at the 16-row hint it ties with a matvec of half its tile height (what it runs up
    to 16 rows), and the tie goes to the split (rewrite/schedule.py: TIE_ROWS). Past the hint the band of
    17-65 rows takes 64-row tensor-core tiles, the down projections split over K (gemm ``splits``)."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), hidden=2048, intermediate=8192, heads=32, kv_heads=2)
    graph, spec = build_step_graph(cfg, max_len=64, slots=4)
    k = me.compile(graph, random_weights(spec, seed=1), backend="sim", max_dims={"n": 256, "r": 4, "ctx": 64},
                   dims_hint={"n": 16, "r": 4, "ctx": 33})
    small = [e.op for e in k.queue.entries if e.op.regime == 0]
    splits = [op for op in small if op.kind == "matvec_split"]
    assert len(splits) == 2 * cfg.layers and all(op.params["roles"] == ("x", "w", "r") for op in splits)
    env = k.queue.program.with_derived
    for op in splits:  # two halves a tile up to 16 rows (the band's last); none past it
        tiles = op.output.shape[1].value // op.params["rows"]
        assert op.launch_count.eval(env({"n": 16, "r": 1, "ctx": 33})) == 2 * tiles
        assert op.launch_count.eval(env({"n": 40, "r": 1, "ctx": 33})) == 0
    batch = [e.op for e in k.queue.entries if e.op.regime == 1]
    down = [op for op in batch if op.kind == "gemm" and op.inputs[0].shape[1].value == cfg.intermediate]
    split_tiles = [op for op in down if op.params.get("splits", 1) > 1 and "r" in op.params["roles"]]
    assert len(split_tiles) == cfg.layers, [(op.kind, op.params) for op in batch]
    for op in split_tiles:
        assert op.launch_count.eval(env({"n": 40, "r": 1, "ctx": 33})) == op.grid[0].eval(env({"n": 40})) * op.params["splits"]


def test_a_short_prompt_takes_tiles_that_fill_the_sms():
    """A 512-row prompt makes 32 tiles of 128 x 256 for a 2048-wide projection, a quarter of the SMs: the
    extractor also chooses at 4x the tallest tile's rows, and that program, in a band of its own, runs the
    O projection on 64 x 128 tiles (128 of them at 512 rows); a 2048-row prompt keeps the 128 x 256 tiles
    (rewrite/schedule.py: row_points, docs/perf-notes.md #89)."""
    from megaegg.rewrite import rewrite

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                              dtype=me.bf16, max_positions=4096)
    graph, _ = build_step_graph(cfg, max_len=2049, slots=4)
    program = rewrite(graph, dims_hint={"n": 16, "r": 4, "ctx": 513}, max_dims={"n": 2112, "r": 4, "ctx": 2049})

    def o_projection(rows: int):
        env = program.with_derived({"n": rows, "r": 1, "ctx": rows})
        ops = [op for op in program.ops if op.kind == "gemm" and "r" in op.params["roles"]
               and op.inputs[0].shape[1].value == cfg.hidden and op.launch_count.eval(env) > 0]
        assert len(ops) == cfg.layers, [(op.kind, op.params) for op in ops]
        return ops[0], ops[0].launch_count.eval(env)

    op, instances = o_projection(512)
    assert (op.params["bm"], op.params["bn"]) == (64, 128) and instances == 128
    op, instances = o_projection(2048)
    assert (op.params["bm"], op.params["bn"]) == (128, 256) and instances == 16 * 8


def test_a_mixed_steps_flash_tile_spreads_its_passes_over_instances():
    """A prompt's flash tile that also holds decode rows of other sequences runs one pass a sequence; with the
    step's sequence count (``sequences=r``) those passes spread over up to 8 instances of the tile, which
    share its rows: the step matches the reference executor under adversarial interleavings."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.bf16)
    graph, spec = build_step_graph(cfg, max_len=96, slots=8)
    weights = random_weights(spec, seed=3)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 80, "r": 8, "ctx": 96},
                        dims_hint={"n": 4, "r": 4, "ctx": 33})
    decode, prompt = 6, 70  # decode rows first: the first token tile holds 6 slots and the prompt's start
    rows = decode + prompt
    dims = {"n": rows, "r": decode + 1, "ctx": prompt}
    env = kernel.queue.program.with_derived(dims)
    flash = [e.op for e in kernel.queue.entries if e.op.kind == "ragged_flash" and e.op.launch_count.eval(env) > 0]
    assert len(flash) == cfg.layers and all(op.grid[2].eval(env) == decode + 1 for op in flash), \
        [(op.params, op.grid) for op in flash]
    gen = torch.Generator().manual_seed(5)
    caches = {n: (torch.randn(s, generator=gen) * 0.5).to(torch.bfloat16) for n, s in spec.caches.items()}
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ins = {"token": torch.randint(0, cfg.vocab, (rows,), generator=gen, dtype=torch.int32),
           "pos": i32([40, 7, 19, 3, 31, 60] + list(range(prompt))), "slot": i32([1, 2, 3, 4, 5, 6] + [0] * prompt),
           "out": i32(list(range(decode)) + [rows - 1])}
    ref = me.run_reference(graph, {**ins, **{n: c.clone() for n, c in caches.items()}}, weights, dims)
    for seed in range(2):
        out = kernel.simulate(Interleaving(sms=5, seed=seed, adversarial=seed == 1), **ins,
                              **{n: c.clone() for n, c in caches.items()}, **dims)
        err = ((out["logits"].float() - ref["logits"].float()).norm() / ref["logits"].float().norm()).item()
        assert err < 1e-2, err


@pytest.mark.parametrize("decode_sampling, run_ahead", [(True, True), (False, True), (True, False)])
def test_a_lone_sequence_decodes_through_the_batch_1_graph_with_the_same_tokens(tiny, decode_sampling, run_ahead):
    """single_sequence_decode: once one sequence is left decoding, its launches run the batch-1 decode graph on
    its slot (a decode graph with sampling takes sampled rows too; a greedy one leaves them to the step graph),
    and every sequence's tokens, greedy and sampled, are those of the step graph alone; run ahead, each lone
    launch is queued one token early and taken, but for the last of each run (dropped)."""
    from megaegg.models import build_decode_graph
    from megaegg.models.batch import single_sequence_decode

    cfg, graph, spec, weights = tiny
    step_kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    decode_graph, _ = build_decode_graph(cfg, max_len=24, logits=False, sampling=decode_sampling)
    decode = me.compile(decode_graph, weights, backend="sim", max_dims={"pos": 23})
    requests = lambda: [Request([3, 17, 5], 7), Request([9, 2], 4, sampling=Sampling(temperature=0.9, seed=11)),  # noqa: E731
                        Request([12, 40, 41, 42], 9, sampling=Sampling(temperature=1.3, top_k=9, seed=2))]
    outs, lone_rows = {}, []

    def seen(run):  # the launches of one output row that the decode graph may take
        def wrapped(rows):
            if len(rows.host_pos) == rows.out.numel() == 1 and (decode_sampling or rows.greedy):
                lone_rows.append(rows.greedy)
            return run(rows)
        return wrapped

    for lone in (False, True):
        caches = spec.new_caches()
        step = kernel_batch_step(step_kernel, caches)
        lone_step = single_sequence_decode(step, decode, caches, run_ahead=run_ahead)
        batch = Batcher(seen(lone_step) if lone else step, slots=3, max_len=24)
        outs[lone] = [[g.tokens for g in batch.run(requests()[:k])] for k in (1, 2, 3)]
    assert outs[True] == outs[False]
    assert all(len(t) == n for runs in outs[True] for t, n in zip(runs, (7, 4, 9)))
    assert len(lone_rows) >= 6 and (not all(lone_rows)) == decode_sampling
    # (run ahead: a run ending on a lone launch queued one more, dropped)
    assert len(lone_rows) + (1 if run_ahead else 0) <= decode.launches <= len(lone_rows) + (3 if run_ahead else 0)


def test_a_request_joining_a_lone_sequence_drops_the_launch_run_ahead(tiny):
    """A lone sequence decodes run ahead; a request submitted after its third launch makes the next launch a
    batch of two (the launch queued ahead is dropped, its cache row written again): both get the tokens of the
    step graph alone, and the lone launches resume run ahead once the newcomer ends."""
    from megaegg.models import build_decode_graph
    from megaegg.models.batch import single_sequence_decode

    cfg, graph, spec, weights = tiny
    step_kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    decode = me.compile(build_decode_graph(cfg, max_len=24, logits=False, sampling=True)[0], weights, backend="sim",
                        max_dims={"pos": 23})
    first, joiner = Request([3, 17, 5], 12, sampling=Sampling(temperature=0.7, seed=4)), Request([9, 2, 8], 3)
    outs = {}
    for lone in (False, True):
        caches = spec.new_caches()
        step = kernel_batch_step(step_kernel, caches)
        batch = Batcher(single_sequence_decode(step, decode, caches) if lone else step, slots=3, max_len=24)
        batch.submit(first)
        infos = []
        while batch.busy():
            infos.append(batch.step())
            if len(infos) == 3:
                batch.submit(joiner)
        outs[lone] = [i.tokens for i in infos], [i.rows for i in infos]
    assert outs[True] == outs[False]
    rows = outs[True][1]
    assert rows[:3] == [3, 1, 1] and rows[3] == 1 + 3 and 1 in rows[5:]  # lone, joined (prompt prefill), lone again
    assert decode.launches == rows.count(1) + 2  # every lone launch, and the two run ahead and dropped (join, end)


def test_a_launch_run_ahead_that_fails_is_not_the_requests_error(tiny):
    """The token after the prompt has NaN embeddings: the launch run ahead on it fails (NaN logits), which is no
    error of the request that ends at that token (it gets the token, as without running ahead); the next
    request then runs as usual."""
    from megaegg.models import build_decode_graph
    from megaegg.models.batch import single_sequence_decode

    cfg, graph, spec, weights = tiny
    step_kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    after = Batcher(kernel_batch_step(step_kernel, spec.new_caches()), slots=3, max_len=24).run([Request([5], 1)])[0].tokens[0]
    poisoned = dict(weights)
    embed = poisoned["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    embed[after] = float("nan")
    step_kernel = me.compile(graph, poisoned, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    decode = me.compile(build_decode_graph(cfg, max_len=24, logits=False, sampling=True)[0], poisoned, backend="sim",
                        max_dims={"pos": 23})
    caches = spec.new_caches()
    batch = Batcher(single_sequence_decode(kernel_batch_step(step_kernel, caches), decode, caches), slots=3, max_len=24)
    assert batch.run([Request([5], 1)])[0].tokens == [after]
    other = 1 if after != 1 else 2
    assert len(batch.run([Request([other, other], 3)])[0].tokens) == 3


def _ahead_requests(stop: int | None = None) -> list[Request]:
    system = [5, 9, 2, 7, 7, 1]
    return [Request(system + [11, 12], 6, sampling=Sampling(temperature=0.9, top_k=9, seed=3)),
            Request([9, 2, 44, 61, 7, 30, 8, 4, 4, 19], 5), Request([12], 7, stop_tokens=(stop,) if stop is not None else ()),
            Request(system + [40], 4, sampling=Sampling(temperature=1.2, top_p=0.8, seed=8)), Request([21, 22], 3),
            Request(system + [11, 12, 13], 5)]


@pytest.mark.parametrize("interleave", [False, True])
def test_run_ahead_gets_the_tokens_of_one_launch_at_a_time(tiny, interleave):
    """Six requests through three slots, at most 6 rows a launch, with prefix caching, sampling, a stop token
    that ends a sequence early and sequences joining as others end: queuing each launch before the previous
    one's tokens are read (its decoding rows' tokens copied on the device) gives every request the tokens,
    stop and finish of stepping one launch at a time; most launches were queued ahead."""
    cfg, graph, spec, weights = tiny
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 6, "r": 3, "ctx": 24})
    if interleave:
        kernel.interleaving = Interleaving(sms=4, seed=2, adversarial=True)
    stop = Batcher(kernel_batch_step(kernel, spec.new_caches()), slots=3, max_len=24, max_tokens=6).run(_ahead_requests())[2].tokens[3]
    carried = []

    outs = {}
    for ahead in (False, True):
        b = Batcher(counting_carried(kernel_batch_step(kernel, spec.new_caches()), carried), slots=3, max_len=24, max_tokens=6,
                    prefix_cache=True, run_ahead=ahead)
        gens = b.run(_ahead_requests(stop))
        outs[ahead] = [(g.tokens, g.stop_token, g.finished) for g in gens], b.prefix_hits
    assert outs[True] == outs[False]
    assert outs[True][0][2][1] == stop and len(outs[True][0][2][0]) < 7 and outs[True][1] > 0
    ahead_launches = sum(1 for c in carried[-b.launches:] if c)
    assert not any(carried[:-b.launches]) and ahead_launches >= b.launches // 2 and b.ahead_failures == 0


def test_a_sequence_cancelled_while_its_next_launch_is_queued_gets_no_more_tokens(tiny):
    """With run ahead, a request cancelled between two steps still has a row in the launch queued ahead: its
    token is not given to it (nor to on_token), its slot is free for the next request, and the others get the
    tokens they get without it."""
    cfg, graph, spec, weights = tiny
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24})
    keep = [Request([3, 17, 5], 8), Request([9, 2], 6, sampling=Sampling(temperature=0.8, seed=1))]
    alone = [g.tokens for g in Batcher(kernel_batch_step(kernel, spec.new_caches()), slots=3, max_len=24).run(keep)]
    given = []
    victim = Request([12, 40, 41], 9, on_token=given.append)
    b = Batcher(kernel_batch_step(kernel, spec.new_caches()), slots=2, max_len=24, run_ahead=True)
    first = b.submit(keep[0])
    gone = b.submit(victim)
    for _ in range(3):
        b.step()
    assert b._ahead is not None and len(given) == 3  # (a token a launch; the fourth launch queued)
    cut = b.cancel(gone)
    assert cut.tokens == given and not cut.finished
    b.submit(keep[1])  # takes the freed slot
    while b.busy():
        b.step()
    done = {r.index: r.generation.tokens for r in b.done}
    assert done[first] == alone[0] and done[first + 2] == alone[1] and given == cut.tokens


def test_a_failed_launch_with_one_queued_ahead_is_drained(tiny):
    """The launch after the fourth fails when its tokens are read, with the next one queued behind it: the
    step raises, drain keeps what every request got (the fed rows of both launches are not counted), and the
    batcher runs again from there."""
    cfg, graph, spec, weights = tiny
    step = kernel_batch_step(me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24}),
                             spec.new_caches())
    reqs = [Request(PROMPTS[0], 6), Request(PROMPTS[2], 6)]
    full = [o.tokens for o in Batcher(step, slots=2, max_len=24).run(reqs)]
    calls = []

    def failing_on_the_fifth(rows):
        calls.append(1)
        queued = step(rows)
        if len(calls) != 5:
            return queued

        def get():
            raise RuntimeError("the launch failed")
        return QueuedTokens(get, queued.device)

    b = Batcher(failing_on_the_fifth, slots=2, max_len=24, run_ahead=True)
    with pytest.raises(RuntimeError, match="the launch failed"):
        b.run(reqs)
    outs = b.drain()
    assert [o.tokens for o in outs] == [full[0][:4], full[1][:4]] and not b.busy()
    assert [o.tokens for o in b.run(reqs)] == full



def test_a_launched_hook_that_raises_fails_its_launch_as_a_device_error_would(tiny):
    """Batcher.step(launched=...) whose hook raises (a server's hand-over failing) with a launch queued ahead:
    the step raises, nothing of that launch is emitted, both launches' rows are not counted, and the
    requests then run again from there to the tokens of an undisturbed run."""
    cfg, graph, spec, weights = tiny
    step = kernel_batch_step(me.compile(graph, weights, backend="sim", max_dims={"n": 24, "r": 3, "ctx": 24}),
                             spec.new_caches())
    reqs = [Request(PROMPTS[0], 6), Request(PROMPTS[2], 6)]
    full = [o.tokens for o in Batcher(step, slots=2, max_len=24).run(reqs)]
    b = Batcher(step, slots=2, max_len=24, run_ahead=True)
    idx = [b.submit(r) for r in reqs]
    for _ in range(3):
        b.step()
    assert b._ahead is not None
    fed = {r.index: r.fed for r in b.running}

    def hand_over():
        raise OSError("the pipe broke")

    with pytest.raises(OSError, match="the pipe broke"):
        b.step(launched=hand_over)
    assert b._ahead is None and {r.index: r.fed for r in b.running} == {i: fed[i] - 1 for i in fed}
    assert [len(r.generation.tokens) for r in b.running] == [3, 3]
    while b.busy():
        b.step()
    assert [next(r for r in b.done if r.index == i).generation.tokens for i in idx] == full
