"""Paged KV caches (issue 40): pools of fixed-size pages read and written through a page table, on the CPU
(reference and simulator): the same rows as a cache of slots, under adversarial schedules, and errors that
name the op and the index."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megaegg as me
from queue_edits import without_waits
from step_spies import counting_carried
from megaegg.interpreter import Interleaving, SimulationError
from megaegg.models import ModelConfig, build_step_graph, random_weights

N = me.sym("n")
HKV, D, PAGE, SLOTS, PER_SEQ, POOL = 2, 64, 4, 3, 4, 14  # sequences of up to 16 rows in pages of 4


def attention_graph(paged: bool, dt=me.f32):
    """K and V rows of a step stored, then every row attends its sequence: through a page table or not."""
    g = me.Graph("paged" if paged else "slots")
    q, k, v = (g.input(name, [N, h, D], dt) for name, h in (("q", 4), ("k", HKV), ("v", HKV)))
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    table = g.input("pages", [SLOTS, PER_SEQ], me.i32) if paged else None
    shape = [POOL, HKV, PAGE, D] if paged else [SLOTS, HKV, PAGE * PER_SEQ, D]
    kc = me.kv_store(g.input("kc", shape, dt), k, pos, slot, pages=table)
    vc = me.kv_store(g.input("vc", shape, dt), v, pos, slot, pages=table)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot, pages=table))
    return g


def scattered(table: torch.Tensor, caches: dict) -> dict:
    """Slot caches ``[SLOTS, HKV, PAGE * PER_SEQ, D]`` laid out as pools through ``table`` (other pages random)."""
    gen = torch.Generator().manual_seed(9)
    out = {}
    for name, c in caches.items():
        pool = torch.randn(POOL, HKV, PAGE, D, generator=gen, dtype=c.dtype)
        for s in range(SLOTS):
            for j in range(PER_SEQ):
                pool[table[s, j]] = c[s, :, j * PAGE : (j + 1) * PAGE]
        out[name] = pool
    return out


def step_case(seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    rows = 7  # one sequence prefills 4 tokens that attend each other; two decode
    ins = {"q": torch.randn(rows, 4, D, generator=gen), "k": torch.randn(rows, HKV, D, generator=gen),
           "v": torch.randn(rows, HKV, D, generator=gen), "pos": torch.tensor([0, 1, 2, 3, 9, 15, 0], dtype=torch.int32),
           "slot": torch.tensor([1, 1, 1, 1, 0, 2, 0], dtype=torch.int32)}
    caches = {n: torch.randn(SLOTS, HKV, PAGE * PER_SEQ, D, generator=gen) for n in ("kc", "vc")}
    table = torch.randperm(POOL, generator=gen)[: SLOTS * PER_SEQ].reshape(SLOTS, PER_SEQ).to(torch.int32)
    return rows, ins, caches, table


def test_a_paged_cache_holds_the_rows_a_cache_of_slots_does():
    """The same step through a page table (pages scattered over the pool) and through slots: the same
    attention output and the same rows stored, on the reference and on the simulator under adversarial
    interleavings; a dropped wait lets attention read a page before its rows are stored."""
    rows, ins, caches, table = step_case()
    want = me.run_reference(attention_graph(False), {**ins, **{n: c.clone() for n, c in caches.items()}}, {}, {"n": rows})
    g = attention_graph(True)
    pools = scattered(table, caches)
    fresh = lambda: {n: c.clone() for n, c in pools.items()}  # noqa: E731
    ref_pools = fresh()
    ref = me.run_reference(g, {**ins, **ref_pools, "pages": table}, {}, {"n": rows})
    assert torch.allclose(ref["o"], want["o"], atol=1e-5, rtol=1e-5)
    for i, (p, s) in enumerate(zip(ins["pos"].tolist(), ins["slot"].tolist())):  # the rows went to their pages
        page = int(table[s, p // PAGE])
        assert torch.equal(ref_pools["kc"][page, :, p % PAGE], ins["k"][i])
    kernel = me.compile(g, {}, backend="sim", max_dims={"n": 8})
    attn = [e.op for e in kernel.queue.entries if e.op.kind == "ragged_partial_merge"]
    assert attn and attn[0].params["paged"], [e.op.kind for e in kernel.queue.entries]
    for seed in range(4):
        out = kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=seed % 2 == 1), **ins, **fresh(), pages=table, n=rows)
        assert torch.allclose(out["o"], ref["o"], atol=1e-5, rtol=1e-5)
    with without_waits(kernel, "ragged_partial_merge"), pytest.raises(
            SimulationError, match=r"ragged_partial_merge .* read unwritten elements of buffer '[kv]c'"):
        for seed in range(8):
            kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=True), **ins, **fresh(), pages=table, n=rows)


def test_sequences_share_a_prefix_page():
    """Two sequences whose page tables name the same first page read the same rows there (a shared
    prompt prefix stored once), each its own pages after it."""
    gen = torch.Generator().manual_seed(4)
    g = attention_graph(True)
    table = torch.tensor([[5, 1, 2, 3], [5, 7, 8, 9], [0, 4, 6, 10]], dtype=torch.int32)
    rows = 2  # sequences 0 and 1 each add their position-5 row (page 1 / page 7) after the shared page 5
    ins = {"q": torch.randn(rows, 4, D, generator=gen), "k": torch.randn(rows, HKV, D, generator=gen),
           "v": torch.randn(rows, HKV, D, generator=gen), "pos": torch.tensor([5, 5], dtype=torch.int32),
           "slot": torch.tensor([0, 1], dtype=torch.int32)}
    pools = {n: torch.randn(POOL, HKV, PAGE, D, generator=gen) for n in ("kc", "vc")}
    kernel = me.compile(g, {}, backend="sim", max_dims={"n": 8})
    out = kernel.simulate(Interleaving(sms=3, seed=1, adversarial=True), **ins, **{n: c.clone() for n, c in pools.items()},
                          pages=table, n=rows)
    for i, own in enumerate((1, 7)):
        k = torch.cat([pools["kc"][5], pools["kc"][own]], 1)[:, :6].clone()  # [HKV, 6, D]
        v = torch.cat([pools["vc"][5], pools["vc"][own]], 1)[:, :6].clone()
        k[:, 5], v[:, 5] = ins["k"][i], ins["v"][i]
        want = me.reference.ragged_rows(ins["q"][i], k, v, D ** -0.5)
        assert torch.allclose(out["o"][i], want, atol=1e-5, rtol=1e-5)


def test_a_page_outside_the_pool_is_an_error_naming_the_op():
    rows, ins, caches, table = step_case()
    g = attention_graph(True)
    bad = table.clone()
    bad[1, 0] = POOL  # sequence 1's first page
    with pytest.raises(me.GraphError, match=rf"kv_store .*pages\[1, 0\] = {POOL} outside \[0, {POOL - 1}\]"):
        me.run_reference(g, {**ins, **scattered(table, caches), "pages": bad}, {}, {"n": rows})
    kernel = me.compile(g, {}, backend="sim", max_dims={"n": 8})
    with pytest.raises(Exception, match=rf"page {POOL} outside \[0, {POOL - 1}\]"):
        kernel.simulate(Interleaving(sms=2, seed=0), **ins, **scattered(table, caches), pages=bad, n=rows)
    with pytest.raises(me.GraphError, match=r"kv_store .*pos\[5\] = 16 outside \[0, 15\]"):
        me.run_reference(g, {**ins, "pos": torch.tensor([0, 1, 2, 3, 9, 16, 0], dtype=torch.int32),
                             **scattered(table, caches), "pages": table}, {}, {"n": rows})


@pytest.mark.parametrize("bad, message", [
    (lambda g: g.input("pages", [SLOTS, PER_SEQ], me.f32), r"kv_store: pages .* must be an i32 page table \[slots, max_pages\]"),
    (lambda g: g.input("pages", [SLOTS], me.i32), r"kv_store: pages .* must be an i32 page table"),
    (lambda g: 3, r"kv_store: pages must be a Tensor"),
])
def test_a_bad_page_table_is_one_error(bad, message):
    g = me.Graph("bad_pages")
    k = g.input("k", [N, HKV, D], me.f32)
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    with pytest.raises(me.GraphError, match=message):
        me.kv_store(g.input("kc", [POOL, HKV, PAGE, D], me.f32), k, pos, slot, pages=bad(g))


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_the_paged_step_graph_gives_the_step_graphs_logits(preset):
    """A tiny model's step graph with its caches in pages (scattered over the pool) and with slots: a prompt
    of 70 tokens (flash attention over it, q's RoPE and qwen3's norms folded in), then a decode step of all
    three sequences, the same logits on the simulator."""
    cfg = dataclasses.replace(ModelConfig.preset(preset), dtype=me.bf16)
    max_len, page = 96, 16
    plain, spec = build_step_graph(cfg, max_len=max_len, slots=SLOTS)
    paged, pspec = build_step_graph(cfg, max_len=max_len, slots=SLOTS, page_len=page, pages=20)
    weights = random_weights(spec, seed=7)
    dims = {"n": 96, "r": SLOTS, "ctx": max_len}
    kernels = [me.compile(g, weights, backend="sim", max_dims=dims, dims_hint={"n": 16, "r": SLOTS, "ctx": 80})
               for g in (plain, paged)]
    kinds = {e.op.kind for e in kernels[1].queue.entries}
    assert {"ragged_flash", "ragged_partial_merge", "kv_store"} <= kinds, kinds
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(20, generator=gen)[: SLOTS * (max_len // page)].reshape(SLOTS, -1).to(torch.int32)
    caches = [spec.new_caches(), pspec.new_caches()]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    prompts = [[5, 17, 99], list(range(1, 71)), [7, 8]]
    rows = [(s, t, i) for s, pr in enumerate(prompts) for i, t in enumerate(pr)]
    steps = [({"token": i32([t for _, t, _ in rows]), "pos": i32([p for _, _, p in rows]), "slot": i32([s for s, _, _ in rows]),
               "out": i32([2, 72, 74])}, {"n": len(rows), "r": SLOTS, "ctx": 70}),
             ({"token": i32([4, 9, 11]), "pos": i32([3, 70, 2]), "slot": i32([0, 1, 2]), "out": i32([0, 1, 2])},
              {"n": 3, "r": SLOTS, "ctx": 71})]
    for ins, d in steps:
        outs = [kernels[0](**ins, **caches[0], **d), kernels[1](**ins, **caches[1], pages=table, **d)]
        a, b = (o["logits"].float() for o in outs)
        assert (a - b).norm() / a.norm() < 1e-2
        assert torch.equal(outs[0]["next_token"], outs[1]["next_token"])


def paged_batcher_case(page: int = 4, pool: int = 24, max_tokens: int = 6):
    cfg = ModelConfig.preset("tiny")
    plain, spec = build_step_graph(cfg, max_len=32, slots=2)
    paged, pspec = build_step_graph(cfg, max_len=32, slots=2, page_len=page, pages=pool)
    weights = random_weights(spec, seed=11)
    dims = {"n": max_tokens, "r": 2, "ctx": 32}
    kernels = [me.compile(g, weights, backend="sim", max_dims=dims) for g in (plain, paged)]
    return cfg, (plain, spec, kernels[0]), (paged, pspec, kernels[1]), weights


PROMPTS = [[3, 17, 5, 9, 11, 4, 6, 8, 2], [9, 2, 44, 61, 7, 30, 8], [3, 17, 5, 9, 11, 4, 6, 8, 50, 51], [12], [21, 22]]


def test_a_paged_batcher_gives_the_slot_batchers_tokens_and_shares_prefixes():
    """Five requests through two slots, at most 6 rows a launch, on the simulator: with caches of slots and
    with a pool of pages, the same greedy tokens; the third prompt starts with the first one's 8 tokens (two
    whole pages), which it reads from the first sequence's pages instead of prefilling them again."""
    from megaegg.models.batch import Batcher, Request, kernel_batch_step
    from megaegg.models.pages import PagePool

    _, (_, spec, k_plain), (_, pspec, k_paged), _ = paged_batcher_case()
    reqs = [Request(p, 5) for p in PROMPTS]
    plain = Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=2, max_len=32, max_tokens=6)
    want = [g.tokens for g in plain.run(reqs)]
    pool = PagePool(24, 4, 8)
    paged = Batcher(kernel_batch_step(k_paged, pspec.new_caches()), slots=2, max_len=32, max_tokens=6, pages=pool)
    got = [g.tokens for g in paged.run(reqs)]
    assert got == want
    assert paged.prefix_hits == 8 and pool.shared_tokens == 8
    assert paged.launches < plain.launches  # (8 prompt tokens fewer to prefill)
    assert pool.available() == pool.count  # every page back (cached or free)


def test_the_servers_warm_up_runs_its_launch_paths_and_leaves_nothing_behind():
    """`megaegg.serve.warm_up`: a lone sequence decoding, then two decoding at once with launches queued
    ahead whose rows' tokens are copied on the device; its rows land in caches nobody holds, so the requests
    after it get the tokens of fresh caches, with slots and with pages (whose pool it does not touch)."""
    from megaegg.models.batch import Batcher, Request, kernel_batch_step
    from megaegg.models.pages import PagePool
    from megaegg.serve import warm_up

    _, (_, spec, k_plain), (_, pspec, k_paged), _ = paged_batcher_case()
    reqs = [Request(p, 5) for p in PROMPTS]
    for kernel, sp, pages in ((k_plain, spec, None), (k_paged, pspec, 24)):
        def tokens(caches, pool):
            b = Batcher(kernel_batch_step(kernel, caches), slots=2, max_len=32, max_tokens=6, pages=pool)
            return [g.tokens for g in b.run(reqs)]

        pool = PagePool(pages, 4, 8) if pages else None
        warmed, carried = sp.new_caches(), []
        rows = warm_up(counting_carried(kernel_batch_step(kernel, warmed), carried), slots=2, max_len=32, max_tokens=6,
                       vocab=64, device="cpu", pool=pool)
        assert rows == [2, 1, 1, 4, 2, 2] and carried == [0, 0, 0, 0, 2, 2], (rows, carried)
        assert any(c.abs().sum() > 0 for c in warmed.values())  # (it wrote rows)
        assert pool is None or (pool.available() == pool.count and not pool.index)
        assert tokens(warmed, pool) == tokens(sp.new_caches(), PagePool(pages, 4, 8) if pages else None)


def test_a_growing_sequence_preempts_the_youngest_and_the_tokens_stay_the_same():
    """A pool of 4 pages of 4 rows: two requests of 12 rows (3 pages) both start on their prompts' page (the
    headroom, a page each for their first decode rows, is there); as they grow the pool runs out, the one
    admitted last is preempted (its pages back), waits and prefills its prompt and tokens again: both get the
    tokens of a batcher with caches of slots, and the pages all come back. A request needing more pages than
    the pool holds is refused at submit."""
    from megaegg.models.batch import Batcher, Request, reference_batch_step
    from megaegg.models.pages import PagePool

    _, (plain, spec, _), (graph, pspec, _), weights = paged_batcher_case(pool=4)
    reqs = [Request([1, 2, 3], 10), Request([9, 10, 11], 10)]
    want = [g.tokens for g in Batcher(reference_batch_step(plain, weights, spec.new_caches()), slots=2, max_len=32,
                                      max_tokens=6).run(reqs)]
    pool = PagePool(4, 4, 8, prefix_cache=False)
    b = Batcher(reference_batch_step(graph, weights, pspec.new_caches()), slots=2, max_len=32, max_tokens=6, pages=pool)
    with pytest.raises(me.GraphError, match=r"25 prompt \+ 5 new tokens need 8 pages of 4 rows, the pool holds 4"):
        b.submit(Request(list(range(1, 26)), 5))
    got = [g.tokens for g in b.run(reqs)]
    assert got == want and b.preemptions >= 1 and pool.available() == 4


def tiny_paged(pool: int, page: int = 4, slots: int = 2, max_len: int = 32):
    """The tiny model's step graph with caches of slots and with a pool of pages, on the reference executor."""
    from megaegg.models.batch import reference_batch_step

    cfg = ModelConfig.preset("tiny")
    plain, spec = build_step_graph(cfg, max_len=max_len, slots=slots)
    graph, pspec = build_step_graph(cfg, max_len=max_len, slots=slots, page_len=page, pages=pool)
    weights = random_weights(spec, seed=11)
    return (lambda: reference_batch_step(plain, weights, spec.new_caches()),  # noqa: E731
            lambda: reference_batch_step(graph, weights, pspec.new_caches()))  # noqa: E731


def test_admission_leaves_headroom_so_a_new_request_is_not_preempted_before_it_decodes():
    """A pool of 4 pages of 4 rows. (a) Prompts of 8 and 3 tokens: admitting both leaves one page, which the
    first takes at its first decode, and the second (the youngest) was preempted two launches after its
    prefill, wasted. Now the second waits until the pages for both sequences' next rows are there (here: the
    first finishes), never preempted, its prompt prefilled once. (b) A sequence decoding into a new page, a
    request arriving then: it used to take the last pages and be preempted in that same step; now it waits.
    A request that waits for headroom starts once the others are done (no deadlock), with the slot tokens."""
    from megaegg.models.batch import Batcher, Request
    from megaegg.models.pages import PagePool

    plain, paged = tiny_paged(pool=4)
    reqs = [Request([1, 2, 3, 4, 5, 6, 7, 8], 6), Request([9, 10, 11], 3)]
    want = [g.tokens for g in Batcher(plain(), slots=2, max_len=32, max_tokens=16).run(reqs)]
    pool = PagePool(4, 4, 8, prefix_cache=False)
    b = Batcher(paged(), slots=2, max_len=32, max_tokens=16, pages=pool)
    assert [g.tokens for g in b.run(reqs)] == want
    assert b.preemptions == 0 and sum(b.prefill_rows) == 8 + 3 and pool.available() == 4

    reqs = [Request([1, 2, 3, 4, 5, 6, 7, 8], 9), Request([20, 21, 22, 23, 24, 25, 26, 27], 2)]
    want = [g.tokens for g in Batcher(plain(), slots=2, max_len=32, max_tokens=16).run(reqs)]
    pool = PagePool(4, 4, 8, prefix_cache=False)
    b = Batcher(paged(), slots=2, max_len=32, max_tokens=16, pages=pool)
    b.submit(reqs[0])
    b.step()  # the first prefilled: it holds 2 pages, its next row (8) starts a third
    b.submit(reqs[1])  # its prompt's 2 pages are free, but then the first could not grow
    info = b.step()
    assert b.preemptions == 0 and (info.running, info.waiting) == (1, 1)
    assert [g.tokens for g in b.run()] == want and b.preemptions == 0 and pool.available() == 4


def fake_step(rows):
    """A step function with no model: each output row's next token from its token and position."""
    tok, pos = rows.token.tolist(), rows.host_pos
    return torch.tensor([(tok[i] * 31 + pos[i] * 7 + 3) % 97 for i in rows.out.tolist()], dtype=torch.int32)


def test_a_preempted_request_streams_each_token_once_and_drain_keeps_its_tokens():
    """Two requests of 12 rows through a pool of 4 pages of 4: the second is preempted after 6 tokens and
    resumes after the first finishes. on_token gets each token once, in order (the re-prefill of its prompt
    and tokens emits none), the same as the slot batcher's; stopped right after the preemption, drain gives
    the preempted request the tokens it had (streamed, not again), its pages are all back, and it counts as
    no request waiting to start."""
    from megaegg.models.batch import Batcher, Request
    from megaegg.models.pages import PagePool

    plain, paged = tiny_paged(pool=4)
    prompts = [[1, 2, 3], [9, 10, 11]]
    want = [g.tokens for g in Batcher(plain(), slots=2, max_len=32, max_tokens=16).run([Request(p, 10) for p in prompts])]
    for stop_after_preemption in (False, True):
        streamed = [[], []]
        reqs = [Request(p, 10, on_token=out.append) for p, out in zip(prompts, streamed)]
        pool = PagePool(4, 4, 8, prefix_cache=False)
        b = Batcher(paged(), slots=2, max_len=32, max_tokens=16, pages=pool)
        outs = b.run(reqs, on_step=lambda info: stop_after_preemption and b.preemptions > 0)
        assert b.preemptions == 1 and pool.available() == 4 and not b.busy() and b.queued == 0
        assert [g.tokens for g in outs] == streamed
        if not stop_after_preemption:
            assert streamed == want and all(g.finished for g in outs)
            continue
        assert [len(t) for t in streamed] == [7, 6] and [g.finished for g in outs] == [False, False]
        assert all(t == w[:len(t)] for t, w in zip(streamed, want))
    # (the same with no model, checked step by step: the preempted one waits, not counted as queued)
    b = Batcher(fake_step, slots=2, max_len=32, max_tokens=16, pages=PagePool(4, 4, 8, prefix_cache=False))
    for p in prompts:
        b.submit(Request(p, 10))
    assert b.queued == 2
    while not b.preemptions:
        b.step()
    assert (len(b.running), len(b.waiting), b.queued) == (1, 1, 0)
    b.submit(Request([5], 2))
    assert b.queued == 1
    outs = b.drain()
    assert [len(g.tokens) for g in outs] == [7, 6, 0] and b.queued == 0 and b.pages.available() == 4


def test_a_page_pool_shares_whole_pages_only_and_evicts_the_least_recent():
    from megaegg.models.pages import PagePool

    pool = PagePool(6, 4, 4)
    a, shared = pool.admit([1, 2, 3, 4, 5, 6, 7, 8, 9], 12)
    assert shared == 0 and len(a.pages) == 3
    pool.written(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)  # two whole pages indexed, the third not
    b, shared = pool.admit([1, 2, 3, 4, 5, 6, 7, 8, 40], 9)
    assert shared == 8 and b.pages[:2] == a.pages[:2]
    c, shared = pool.admit([1, 2, 3, 4, 5, 6, 7, 8], 8)  # (its last token's logits: the second page not shared)
    assert shared == 4 and c.pages[0] == a.pages[0] and c.pages[1] not in a.pages
    assert pool.admit([7] * 9, 9) is None  # 3 pages, 1 free
    for s in (a, b, c):
        pool.release(s)
    assert pool.available() == 6
    d, shared = pool.admit([1, 2, 3, 4, 5, 6, 7, 8, 1], 24)  # 6 pages: takes every page, evicting the cached ones
    assert shared == 8 and len(d.pages) == 6
    pool.release(d)
    e, shared = pool.admit([9, 9, 9, 9, 1], 24)  # every page again: the two cached ones evicted
    assert shared == 0 and sorted(e.pages) == list(range(6))
    pool.release(e)
    f, shared = pool.admit([1, 2, 3, 4, 5, 6, 7, 8, 1], 9)
    assert shared == 0  # (the evicted pages' rows are gone)


def test_eviction_takes_a_prefixs_last_page_first():
    """A released three-page prefix, then one page needed: the evicted page is the prefix's last, so a
    later prompt still shares its first two pages (evicting the first would strand both others)."""
    from megaegg.models.pages import PagePool

    pool = PagePool(4, 4, 4)
    prompt = list(range(1, 14))  # 13 tokens: three whole pages and a last token
    a, _ = pool.admit(prompt, 13)
    pool.written(a, prompt, 13)
    a_pages = list(a.pages)
    pool.release(a)  # three indexed pages cached, one page free
    b, shared = pool.admit([50, 51], 8)  # two pages: the free one and one evicted
    assert shared == 0
    pool.release(b)
    c, shared = pool.admit(prompt, 13)
    assert shared == 8 and c.pages[:2] == a_pages[:2]


def test_a_duplicate_page_never_becomes_a_parent_of_stale_pages():
    """Two sequences admitted together write the same first page: the second's copy stays unindexed and its
    next page is keyed on the first's. Once that copy is freed and reused for other tokens, a prompt of those
    tokens followed by the second's next tokens shares only the page that holds them (a stale child keyed
    on the reused page matched before)."""
    from megaegg.models.pages import PagePool

    pool = PagePool(8, 2, 3)
    a, _ = pool.admit([1, 1, 5], 3)
    b, _ = pool.admit([1, 1, 2, 2, 5], 5)
    pool.written(a, [1, 1, 5], 2)
    pool.written(b, [1, 1, 2, 2, 5], 4)  # b's first page duplicates a's; its second holds [2, 2]
    copy = b.pages[0]
    pool.release(b)
    pool.release(a)
    while pool.free[-1] != copy:  # (others take pages until b's copy is the next free one)
        pool.admit([3], 1)
    c, _ = pool.admit([9, 9, 7], 3)
    assert c.pages[0] == copy
    pool.written(c, [9, 9, 7], 2)
    d, shared = pool.admit([9, 9, 2, 2, 8], 5)
    assert shared == 2 and d.pages[0] == copy  # [9, 9] only: no page holds [2, 2] after [9, 9]


def test_a_small_pool_with_shared_prefixes_and_preemptions_gives_the_slot_tokens():
    """Eight requests, several sharing prefixes, through three slots and a pool of 7 pages of 4 rows (too
    few for three sequences at once): preemptions, re-prefills that read their own cached pages (more tokens
    shared than prompt tokens saved) and pages shared between running sequences, and still the tokens of
    caches of slots; every page comes back."""
    from megaegg.models.batch import Batcher, Request, reference_batch_step
    from megaegg.models.pages import PagePool

    cfg = ModelConfig.preset("tiny")
    plain, spec = build_step_graph(cfg, max_len=32, slots=3)
    graph, pspec = build_step_graph(cfg, max_len=32, slots=3, page_len=4, pages=7)
    weights = random_weights(spec, seed=12)
    base = [3, 17, 5, 9, 11, 4, 6, 8]
    prompts = [base + [1], [40, 41], base + [2, 7], base[:4] + [9], base + [1], [50] * 9, base[:6], [60, 61, 62]]
    reqs = [Request(p, 4 + i % 3) for i, p in enumerate(prompts)]
    want = [g.tokens for g in Batcher(reference_batch_step(plain, weights, spec.new_caches()), slots=3, max_len=32,
                                      max_tokens=8).run(reqs)]
    pool = PagePool(7, 4, 8)
    b = Batcher(reference_batch_step(graph, weights, pspec.new_caches()), slots=3, max_len=32, max_tokens=8, pages=pool)
    assert [g.tokens for g in b.run(reqs)] == want
    assert b.preemptions >= 1 and b.prefix_hits >= 8 and pool.shared_tokens > b.prefix_hits and pool.available() == 7


def test_a_page_keyed_on_a_twin_that_was_taken_meanwhile_is_not_shared():
    """A duplicate page's successor is keyed on its indexed twin as the twin was when the chain reached it:
    if another sequence takes the twin before the successor is written, a prompt along the new owner's pages
    must not share the successor (review repro: 12 tokens shared, 8 of them computed after another prefix)."""
    from megaegg.models.pages import PagePool

    pool = PagePool(5, 4, 8)
    s1, _ = pool.admit(list(range(1, 10)), 9)
    pool.written(s1, list(range(1, 10)), 9)
    pool.release(s1)
    s2, _ = pool.admit(list(range(1, 9)), 8)  # (its last token unshared: page 1 duplicates s1's cached twin)
    pool.written(s2, list(range(1, 9)), 8)
    assert pool.grow(s2, 9)
    x, _ = pool.admit([20, 21, 22, 23, 30, 31, 32, 33], 8)  # takes the twin
    pool.written(x, [20, 21, 22, 23, 30, 31, 32, 33], 8)
    pool.written(s2, list(range(1, 13)), 12)
    pool.release(x)
    pool.release(s2)
    _, shared = pool.admit([20, 21, 22, 23, 30, 31, 32, 33, 9, 10, 11, 12, 99], 13)
    assert shared == 8


def _paged_ahead_requests(stop: int | None = None):
    from megaegg.models.batch import Request, Sampling

    base = [3, 17, 5, 9, 11, 4, 6, 8]
    prompts = [base + [1], [40, 41], base + [2, 7], base[:4] + [9], base + [1], [50] * 9, base[:6], [60, 61, 62]]
    return [Request(p, 4 + i % 3, sampling=Sampling(temperature=0.9, top_k=9, seed=i) if i % 2 else Sampling(),
                    stop_tokens=(stop,) if stop is not None and i == 2 else ()) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("interleave", [False, True])
def test_run_ahead_on_a_paged_cache_gives_the_tokens_of_one_launch_at_a_time(interleave):
    """Eight requests through three slots and a pool of 7 pages of 4 rows (too few for three sequences: they
    are preempted), prompts sharing prefixes, sampling, a stop token that ends one early: queuing each launch
    before the previous one's tokens are read gives every request the tokens, stop and finish of the slot
    caches stepped one launch at a time; most launches were queued ahead, and every page comes back."""
    from megaegg.models.batch import Batcher, kernel_batch_step
    from megaegg.models.pages import PagePool

    cfg = ModelConfig.preset("tiny")
    plain, spec = build_step_graph(cfg, max_len=32, slots=3, sampling=True)
    graph, pspec = build_step_graph(cfg, max_len=32, slots=3, page_len=4, pages=7, sampling=True)
    weights = random_weights(spec, seed=12)
    dims = {"n": 8, "r": 3, "ctx": 32}
    k_plain, k_paged = (me.compile(g, weights, backend="sim", max_dims=dims) for g in (plain, graph))
    if interleave:
        k_paged.interleaving = Interleaving(sms=4, seed=2, adversarial=True)
    stop = Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=3, max_len=32,
                   max_tokens=8).run(_paged_ahead_requests())[2].tokens[2]
    want = [(g.tokens, g.stop_token, g.finished) for g in Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=3,
                                                                   max_len=32, max_tokens=8).run(_paged_ahead_requests(stop))]
    carried = []

    pool = PagePool(7, 4, 8)
    b = Batcher(counting_carried(kernel_batch_step(k_paged, pspec.new_caches()), carried), slots=3, max_len=32, max_tokens=8, pages=pool,
                run_ahead=True)
    got = [(g.tokens, g.stop_token, g.finished) for g in b.run(_paged_ahead_requests(stop))]
    assert got == want
    assert want[2][1] == stop and len(want[2][0]) == 3
    assert b.preemptions >= 1 and b.prefix_hits >= 8 and pool.available() == pool.count
    assert sum(1 for c in carried if c) >= b.launches // 3 and b.ahead_failures == 0


def test_a_paged_sequence_cancelled_while_its_next_launch_is_queued_frees_its_pages_for_the_next():
    """Run ahead on a paged cache: a request cancelled between two steps still has rows in the launch queued
    ahead (they write its pages, back in the pool); a request that then takes those pages, and the one that
    runs on, get the tokens they get without it."""
    from megaegg.models.batch import Batcher, Request, kernel_batch_step
    from megaegg.models.pages import PagePool

    _, (_, spec, k_plain), (_, pspec, k_paged), _ = paged_batcher_case(pool=6, max_tokens=8)
    keep = [Request([3, 17, 5, 9, 11], 8), Request([9, 2, 44, 61, 7, 30, 8], 6)]
    alone = [g.tokens for g in Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=2, max_len=32,
                                       max_tokens=8).run(keep)]
    given = []
    victim = Request([12, 40, 41, 42, 43, 44, 45], 9, on_token=given.append)
    pool = PagePool(6, 4, 8, prefix_cache=False)
    b = Batcher(kernel_batch_step(k_paged, pspec.new_caches()), slots=2, max_len=32, max_tokens=8, pages=pool,
                run_ahead=True)
    first = b.submit(keep[0])
    gone = b.submit(victim)
    while len(given) < 2:
        b.step()
    assert b._ahead is not None
    held = list(next(r for r in b.running if r.index == gone).pages.pages)
    cut = b.cancel(gone)
    assert cut.tokens == given and not cut.finished
    b.submit(keep[1])  # (it needs pages the victim held: 6 pages, the first request holds 3 at most)
    while b.busy():
        b.step()
    done = {r.index: r.generation.tokens for r in b.done}
    assert done[first] == alone[0] and done[first + 2] == alone[1] and given == cut.tokens
    assert held and pool.available() == pool.count and b.ahead_failures == 0


def test_run_ahead_indexes_a_page_only_once_its_rows_came_back_so_the_next_turn_shares_it():
    """A conversation's next turn (the prompt, the answer's first tokens, a new one) reads the pages the
    answer wrote, with launches queued ahead as with none: a page whose last row is in a launch queued ahead
    is indexed when that launch's tokens come back, with its tokens (indexed earlier, its key would hold the
    tokens known then, and no prompt would match it)."""
    from megaegg.models.batch import Batcher, Request, kernel_batch_step
    from megaegg.models.pages import PagePool

    _, (_, spec, k_plain), (_, pspec, k_paged), _ = paged_batcher_case(pool=24, max_tokens=8)
    first = [Request([3, 17, 5], 9), Request([40, 41, 42, 43, 44], 9)]
    answer = Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=2, max_len=32, max_tokens=8).run(first)[0].tokens
    turn = [Request([3, 17, 5] + answer[:6] + [7], 4), Request([60, 61], 4)]
    want = [g.tokens for g in Batcher(kernel_batch_step(k_plain, spec.new_caches()), slots=2, max_len=32,
                                      max_tokens=8).run(turn)]
    for ahead in (False, True):
        pool = PagePool(24, 4, 8)
        b = Batcher(kernel_batch_step(k_paged, pspec.new_caches()), slots=2, max_len=32, max_tokens=8, pages=pool,
                    run_ahead=ahead)
        assert b.run(first)[0].tokens == answer
        hits = b.prefix_hits
        assert [g.tokens for g in b.run(turn)] == want
        assert b.prefix_hits - hits == 8, ahead  # (two whole pages: the prompt and the answer's first 5 tokens)
        assert b.ahead_failures == 0
