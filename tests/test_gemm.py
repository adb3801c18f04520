"""The gemm kind (tensor-core tiles for many rows, megaegg/blockops/gemm.py) on the CPU: which linears the
rewrite gives it, per-tile barriers, the simulator under adversarial interleavings, its tensor maps and
its CUDA source. The GPU runs it in tests/gpu/test_batch_gpu.py."""

import dataclasses
import math

import pytest
import torch

import megaegg as me
from queue_edits import without_waits
from megaegg.models import ModelConfig, build_step_graph
from megaegg.interpreter import Interleaving, SimulationError
from megaegg.interpreter.tensor_maps import TensorMapError, plan
from megaegg.interpreter.render import render
from megaegg.ir.program import View

N = me.sym("n")


def mlp(dt=me.bf16, k=520, f=1000, out=600):
    """A pre-norm gated MLP with its residual, then a projection of its output: ragged in every dim."""
    g = me.Graph("gemm_mlp")
    x = g.input("x", [N, k], dt)
    h = me.rms_norm(x, g.weight("g", [k], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [f, k], dt))) * me.linear(h, g.weight("wu", [f, k], dt))
    y = x + me.linear(a, g.weight("wd", [k, f], dt))
    g.output("y", y)
    g.output("z", me.linear(y, g.weight("w", [out, k], dt)))
    return g


def weights(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn([d.value for d in t.shape], generator=gen) * 0.3).to(t.dtype.torch) for n, t in g.weights.items()}


def kinds(k):
    return [e.op.kind for e in k.queue.entries]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_simulated(k, g, w, seed: int, runs) -> None:
    """``k`` (of an ``mlp`` graph ``g``, weights ``w``) simulated at each (rows, interleaving) of ``runs`` on
    fresh x (generator ``seed``): y and z within bf16 tolerance of the reference."""
    gen = torch.Generator().manual_seed(seed)
    for rows, sch in runs:
        x = torch.randn(rows, g.inputs["x"].shape[1].value, generator=gen).to(torch.bfloat16)
        out = k.simulate(sch, x=x.clone(), n=rows)
        ref = me.run_reference(g, {"x": x}, w, {"n": rows})
        for name in ("y", "z"):
            err = rel(out[name], ref[name])
            assert err < 1e-2, (rows, name, err)


def without_gemm_waits(k) -> None:
    """``k``'s queue with every gemm entry's barrier waits dropped (a test that they are needed)."""
    k.queue = dataclasses.replace(k.queue, entries=tuple(dataclasses.replace(e, waits=()) if e.op.kind == "gemm" else e
                                                         for e in k.queue.entries))


def test_many_rows_of_bf16_take_tensor_core_tiles():
    g = mlp()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    gemms = [e.op for e in k.queue.entries if e.op.kind == "gemm"]
    # the gated pair in one tile (128 rows of each weight), the down projection with its residual, the last plain
    assert [op.params["roles"] for op in gemms] == [("x", "w", "w2"), ("x", "w", "r"), ("x", "w")]
    assert "rms_norm" in kinds(k)  # (the norm is its own op before a gemm)


@pytest.mark.parametrize("why, build", [
    ("f32", lambda: mlp(dt=me.f32)),
    ("one row", lambda: _one_row()),
])
def test_no_tensor_core_tiles_where_they_do_not_fit(why, build):
    g = build()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 512} if g.symbols() else None,
                   dims_hint={"n": 512} if g.symbols() else None)
    assert "gemm" not in kinds(k), why


def _one_row():
    g = me.Graph("one")
    g.output("y", me.linear(g.input("x", [1, 256], me.bf16), g.weight("w", [384, 256], me.bf16)))
    return g


def test_a_consumer_tile_waits_only_for_the_producer_tiles_of_its_rows():
    """z's tile of rows [bm i, bm i + bm) waits on one counter, row tile i of the op writing y (tiles of the
    same height here), for all of that op's column tiles; not on the whole op."""
    g = mlp()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 1024}, dims_hint={"n": 1024})
    ops = [e for e in k.queue.entries if e.op.kind == "gemm"]
    down, last = ops[1], ops[2]
    bm = down.op.params["bm"]
    assert last.op.params["bm"] == bm
    (w,) = [w for w in last.waits if k.queue.barriers.sets[w.barrier_set].producer == down.op.id]
    s = k.queue.barriers.sets[w.barrier_set]
    env = {"n": 1000}
    tiles = -(-1000 // bm)
    assert s.count.eval(env) == tiles  # one counter per row tile
    assert [w.index.eval({**env, "_i0": 0, "_i1": i}) for i in range(tiles)] == list(range(tiles))
    assert w.expected.eval({**env, "_i0": 0, "_i1": 3}) == down.op.grid[0].eval(env)  # every column tile of those rows


def test_simulator_matches_the_reference_under_adversarial_interleavings():
    g = mlp()
    w = weights(g)
    k = me.compile(g, w, backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    assert_simulated(k, g, w, 3, ((300, Interleaving(sms=4, seed=1, adversarial=True)),
                                  (130, Interleaving(sms=16, seed=2, adversarial=True)), (1, Interleaving(sms=3, seed=3))))


def test_a_batch_takes_64_row_tiles_and_they_match_the_reference():
    """At ~64 rows the linears of a wide MLP are 64-row tiles (64 x 128 gated: 64 rows of each weight; 64 x 64
    with the residual), ragged in N and K; the simulator under adversarial interleavings equals the
    reference, and a dropped wait is caught."""
    g = mlp(k=2048, f=4104, out=1000)
    w = weights(g)
    k = me.compile(g, w, backend="sim", max_dims={"n": 64}, dims_hint={"n": 64})
    assert [(e.op.params["bm"], e.op.params["bn"]) for e in k.queue.entries if e.op.kind == "gemm"][:2] == [(64, 128), (64, 64)]
    assert_simulated(k, g, w, 4, ((64, Interleaving(sms=5, seed=1, adversarial=True)),
                                  (37, Interleaving(sms=16, seed=2, adversarial=True))))
    without_gemm_waits(k)
    with pytest.raises(SimulationError, match=r"gemm .* read unwritten elements"):
        for seed in range(8):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), x=torch.randn(64, 2048).to(torch.bfloat16), n=64)


def test_a_batch_splits_its_tiles_over_k():
    """At ~64 rows a projection with few weight tiles splits K (the last split to arrive sums the f32
    partials and applies the epilogue): a residual projection and a gated MLP whose gate / up and output
    projections split, ragged in N (1000 output columns). The simulator under adversarial interleavings
    equals the reference at 17-64 rows; each split tile launches S instances there, one past 64 rows;
    a reader one split short fails."""
    g = me.Graph("gemm_split")
    x = g.input("x", [N, 2048], me.bf16)
    y = x + me.linear(g.input("h", [N, 4096], me.bf16), g.weight("wo", [2048, 4096], me.bf16))
    a = me.silu(me.linear(y, g.weight("wg", [1536, 2048], me.bf16))) * me.linear(y, g.weight("wu", [1536, 2048], me.bf16))
    g.output("y", y)
    g.output("z", me.linear(a, g.weight("w", [1000, 1536], me.bf16)))
    w = weights(g, seed=5)
    k = me.compile(g, w, backend="sim", max_dims={"n": 64}, dims_hint={"n": 64})
    split = [e for e in k.queue.entries if e.op.kind == "gemm" and e.op.params.get("splits", 1) > 1]
    assert {e.op.params["roles"] for e in split} >= {("x", "w", "r"), ("x", "w", "w2")}, [e.op for e in k.queue.entries]
    gen = torch.Generator().manual_seed(6)
    for rows, sch in ((64, Interleaving(sms=5, seed=1, adversarial=True)), (17, Interleaving(sms=16, seed=2, adversarial=True)),
                      (40, Interleaving(sms=7, seed=3))):
        ins = {"x": torch.randn(rows, 2048, generator=gen).to(torch.bfloat16),
               "h": torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)}
        out = k.simulate(sch, **{n: t.clone() for n, t in ins.items()}, n=rows)
        ref = me.run_reference(g, ins, w, {"n": rows})
        for name in ("y", "z"):
            err = rel(out[name], ref[name])
            assert err < 1e-2, (rows, name, err)
        for e in split:
            assert e.op.launch_count.eval({"n": rows}) == e.op.grid[0].eval({}) * e.op.params["splits"]
    assert all(e.op.launch_count.eval({"n": 100}) == e.op.grid[0].eval({}) * 2 for e in split)  # (2 row tiles, unsplit)
    resid = next(e for e in split if e.op.params["roles"] == ("x", "w", "r"))
    readers = [e for e in k.queue.entries if any(k.queue.barriers.sets[wt.barrier_set].producer == resid.op.id for wt in e.waits)]
    assert readers
    early = {id(e): dataclasses.replace(e, waits=tuple(dataclasses.replace(wt, expected=wt.expected - 1) for wt in e.waits))
             for e in readers}
    k.queue = dataclasses.replace(k.queue, entries=tuple(early.get(id(e), e) for e in k.queue.entries))
    with pytest.raises(SimulationError, match="read unwritten elements"):
        for seed in range(10):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), x=torch.randn(40, 2048).to(torch.bfloat16),
                       h=torch.randn(40, 4096).to(torch.bfloat16), n=40)


def test_a_split_tile_past_one_row_tile_runs_unsplit(monkeypatch):
    """The program chosen at 64 rows kept for up to 131 (the bands forced to one): past 64 x rows a split
    tile's launch count drops its split axis and each instance runs all of K; equal to the reference."""
    from megaegg.rewrite import schedule

    monkeypatch.setattr(schedule, "bands", lambda programs, *a: ([programs[0]], ()))
    g = me.Graph("gemm_split_one_band")
    x = g.input("x", [N, 2048], me.bf16)
    g.output("y", x + me.linear(g.input("h", [N, 4096], me.bf16), g.weight("wo", [2048, 4096], me.bf16)))
    w = weights(g, seed=7)
    k = me.compile(g, w, backend="sim", max_dims={"n": 131}, dims_hint={"n": 64})
    (op,) = [e.op for e in k.queue.entries]
    assert op.kind == "gemm" and op.params.get("splits", 1) > 1 and op.regime is None, op
    gen = torch.Generator().manual_seed(8)
    for rows in (100, 131, 40):
        ins = {"x": torch.randn(rows, 2048, generator=gen).to(torch.bfloat16), "h": torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)}
        assert op.launch_count.eval({"n": rows}) == op.grid[0].eval({}) * (-(-rows // 64) if rows > 64 else op.params["splits"])
        out = k.simulate(Interleaving(sms=6, seed=rows, adversarial=True), **{n: t.clone() for n, t in ins.items()}, n=rows)
        ref = me.run_reference(g, ins, w, {"n": rows})
        assert rel(out["y"], ref["y"]) < 1e-2, rows


def test_a_gated_tile_takes_no_residual():
    """r + silu(x wg^T) * (x wu^T) on tensor-core tiles: a tile's epilogue gates or adds, not both
    (gemm.cuh: GemmEpi; a gated tile given the residual once dropped it on the GPU, where the simulator,
    computing the definition, still matched), so the add stays its own op; the program equals the
    reference."""
    g = me.Graph("gated_residual")
    x = g.input("x", [N, 4096], me.bf16)
    g.output("y", x + me.silu(me.linear(x, g.weight("wg", [4096, 4096], me.bf16))) * me.linear(x, g.weight("wu", [4096, 4096], me.bf16)))
    w = weights(g, seed=9)
    k = me.compile(g, w, backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    tiles = [e.op.params["roles"] for e in k.queue.entries if e.op.kind == "gemm"]
    assert tiles == [("x", "w", "w2")], [(e.op.kind, e.op.params.get("roles")) for e in k.queue.entries]
    xs = torch.randn(200, 4096, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    out, ref = k.simulate(Interleaving(sms=4, seed=1, adversarial=True), x=xs.clone(), n=200), me.run_reference(g, {"x": xs}, w, {"n": 200})
    assert rel(out["y"], ref["y"]) < 1e-2


def test_a_dropped_gemm_wait_is_caught():
    g = mlp()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    without_gemm_waits(k)
    with pytest.raises(SimulationError, match=r"gemm .* read unwritten elements"):
        for seed in range(8):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), x=torch.randn(300, 520).to(torch.bfloat16), n=300)


def test_tensor_maps_of_the_operands():
    g = mlp()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    specs, index = plan(k.queue)
    assert len(specs) == 3 + 2 + 2  # x, w, w2; x, w; x, w
    first = specs[0]
    assert (first.cols, first.row_stride, first.offset, first.itemsize) == (520, 520, 0, 2)
    assert first.rows_dim.eval({"n": 77}) == 77
    gemm = next(e for e in k.queue.entries if e.op.kind == "gemm")
    assert index[(gemm.op.id, 0)] == 0 and index[(gemm.op.id, 2)] == 2
    source = render(k.queue).source
    # one run call, compiled for the tile shapes the ops use
    shapes = sorted({(e.op.params["bm"], e.op.params["bn"]) for e in k.queue.entries if e.op.kind == "gemm"}, reverse=True)
    run = "gemm_run<" + " | ".join(f"GEMM_TILE_{m}x{n}" for m, n in shapes) + ">(gemm_job, smem)"
    assert "mega_tmap(args.tmaps, 2)" in source and source.count("gemm_run<") == 1 and run in source, run
    # each map's box: x's is the tile's rows; a weight's the tile's weight rows (a gated tile: half of each)
    ops = {e.op.id: e.op for e in k.queue.entries}
    for spec in specs:
        p = ops[spec.op].params
        role = p["roles"][spec.input]
        want = p["bm"] if role == "x" else p["bn"] // 2 if "w2" in p["roles"] else min(p["bn"], 128)
        assert spec.box_rows == want, (role, p)


def test_an_operand_a_tensor_map_cannot_describe_is_one_error():
    g = mlp()
    k = me.compile(g, weights(g), backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    q = k.queue
    e = next(e for e in q.entries if e.op.kind == "gemm")
    x = e.op.inputs[0]
    odd = dataclasses.replace(x, views=x.views + (View("slice", (1, me.dims.as_dim(1), me.dims.as_dim(133))),))
    op = dataclasses.replace(e.op, inputs=(odd, *e.op.inputs[1:]))
    q = dataclasses.replace(q, entries=(dataclasses.replace(e, op=op),))
    with pytest.raises(TensorMapError, match=r"op\d+ gemm input 0 .*16-byte aligned"):
        plan(q)


def test_one_kernel_chooses_by_row_count():
    """Compiled for 16 rows and up to 1024: the matvec program below the cost model's first crossing, the
    tensor-core one past the last, in one kernel (no rebuild); each call launches only its own band's ops,
    and every band matches the reference under adversarial interleavings."""
    g = mlp()
    w = weights(g)
    k = me.compile(g, w, backend="sim", max_dims={"n": 1024}, dims_hint={"n": 16})
    regime = k.program.regime
    assert regime is not None and regime.symbol == "n" and 16 <= regime.thresholds[0] and regime.thresholds[-1] < 1024
    by = {r: {e.op.kind for e in k.queue.entries if e.op.regime == r} for r in range(regime.bands)}
    assert "gemm" in by[regime.bands - 1] and "gemm" not in by[0] and "matvec" in by[0]
    gen = torch.Generator().manual_seed(4)
    for rows in (5, *(r for t in regime.thresholds for r in (t, t + 1)), 700):
        dims = k.program.with_derived({"n": rows})
        launched = {e.op.regime for e in k.queue.entries if e.launch.eval(dims) > 0}
        assert launched == {regime.band(rows)}, rows
        x = torch.randn(rows, 520, generator=gen).to(torch.bfloat16)
        out = k.simulate(Interleaving(sms=8, seed=rows, adversarial=True), x=x.clone(), n=rows)
        ref = me.run_reference(g, {"x": x}, w, {"n": rows})
        for name in ("y", "z"):
            err = rel(out[name], ref[name])
            assert err < 1e-2, (rows, name, err)


def prompt_attention(hq=8, hkv=2, d=64, slots=3, length=160):
    g = me.Graph("prompt_attention")
    q, k, v = (g.input(name, [N, h, d], me.bf16) for name, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    kc = me.kv_store(g.input("kc", [slots, hkv, length, d], me.bf16), k, pos, slot)
    vc = me.kv_store(g.input("vc", [slots, hkv, length, d], me.bf16), v, pos, slot)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
    return g


def prompt_rows(gen, slots=3, length=160):
    """A prompt of 100 tokens in slot 1 (positions 20..119: it continues cached rows), a second of 30 in
    slot 0, and 5 decode rows of slot 2 at scattered positions, interleaved as a mixed step has them."""
    pos = list(range(20, 120)) + list(range(30)) + [7, 150, 33, 159, 0]
    slot = [1] * 100 + [0] * 30 + [2] * 5
    return torch.tensor(pos, dtype=torch.int32), torch.tensor(slot, dtype=torch.int32)


def check_flash_on_prompts(k, g, w, seed: int) -> None:
    """Kernel ``k`` of prompt-attention graph ``g`` (prompt_attention's inputs and caches) on prompt_rows: equal
    to the reference under adversarial interleavings; with ragged_flash's waits dropped, a read of unwritten
    elements is caught."""
    gen = torch.Generator().manual_seed(seed)
    pos, slot = prompt_rows(gen)
    n = len(pos)
    ins = {"q": torch.randn(n, 8, 64, generator=gen).bfloat16(), "k": torch.randn(n, 2, 64, generator=gen).bfloat16(),
           "v": torch.randn(n, 2, 64, generator=gen).bfloat16(), "pos": pos, "slot": slot}
    caches = {"kc": torch.randn(3, 2, 160, 64, generator=gen).bfloat16(), "vc": torch.randn(3, 2, 160, 64, generator=gen).bfloat16()}
    fresh = lambda: {name: c.clone() for name, c in caches.items()}  # noqa: E731
    ref = me.run_reference(g, {**ins, **fresh()}, w, {"n": n})
    for s in range(3):
        out = k.simulate(Interleaving(sms=6, seed=s, adversarial=s > 0), **ins, **fresh(), n=n)
        err = rel(out["o"], ref["o"])
        assert err < 1e-2, err
    with without_waits(k, "ragged_flash"), pytest.raises(SimulationError, match=r"ragged_flash .* read unwritten elements"):
        for s in range(8):
            k.simulate(Interleaving(sms=8, seed=s, adversarial=True), **ins, **fresh(), n=n)


def test_flash_attention_over_prompts_on_the_simulator():
    """Prompt rows take the tensor-core flash pass (ragged_flash), matching the reference with rows of
    several sequences in one tile under adversarial interleavings; without its waits on kv_store it reads
    the cache before the writes."""
    g = prompt_attention()
    k = me.compile(g, {}, backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
    assert "ragged_flash" in kinds(k) and "ragged_partial_merge" not in kinds(k)
    check_flash_on_prompts(k, g, {}, seed=6)


def test_q_rope_folds_into_the_prompts_flash_attention():
    """q's RoPE (llama) and q norm + RoPE (qwen3) before a prompt's attention: the flash op rotates q as it
    loads it (no rope op left), matching the reference under adversarial interleavings; without its waits
    it reads q or the cache before they are written."""
    for qnorm in (False, True):
        g = me.Graph("prompt_attention_rope")
        q, k, v = (g.input(name, [N, h, 64], me.bf16) for name, h in (("q", 8), ("k", 2), ("v", 2)))
        pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
        q = me.linear(q.reshape(N, 512), g.weight("wq", [512, 512], me.bf16)).reshape(N, 8, 64)  # (q has a producer)
        if qnorm:
            q = me.rms_norm(q, g.weight("qn", [64], me.bf16), 1e-6)
        q = me.rope(q, pos)
        kc = me.kv_store(g.input("kc", [3, 2, 160, 64], me.bf16), me.rope(k, pos), pos, slot)
        vc = me.kv_store(g.input("vc", [3, 2, 160, 64], me.bf16), v, pos, slot)
        g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
        w = weights(g, seed=3)
        k_ = me.compile(g, w, backend="sim", max_dims={"n": 512}, dims_hint={"n": 512})
        flash = [e.op for e in k_.queue.entries if e.op.kind == "ragged_flash"]
        assert flash and all(op.params.get("rope") for op in flash) and "rope" not in kinds(k_), kinds(k_)
        assert ("g" in flash[0].params["rope"]) == qnorm and "rms_norm" not in kinds(k_)
        check_flash_on_prompts(k_, g, w, seed=7)


def test_decode_rows_keep_the_split_kv_path():
    """At a hint of fewer rows than cache slots (a decode batch) the split-KV path stays: a flash tile
    would run one pass per sequence."""
    g = prompt_attention(slots=64)
    k = me.compile(g, {}, backend="sim", max_dims={"n": 64}, dims_hint={"n": 16})
    assert "ragged_partial_merge" in kinds(k) and "ragged_flash" not in kinds(k)


def test_each_row_regime_compiles_into_its_own_image():
    """A program with row regimes compiles into one kernel image a band from one source: the fewest rows'
    image without the tensor-core tile (and its CuTe headers) at the decode path's 120 KB of shared memory,
    the most rows' with it and 200 KB (a 4-stage ring). NVRTC, no GPU; skipped without NVRTC or CUTLASS."""
    nvrtc = pytest.importorskip("megaegg.interpreter.nvrtc")
    try:
        nvrtc.nvrtc_version()
        nvrtc.cute_options()
    except Exception as e:
        pytest.skip(f"NVRTC or the CUTLASS headers are missing: {e}")
    from megaegg.compiler import build_artifact, kernel_images
    from megaegg.interpreter import image_defines

    art = build_artifact(mlp(), max_dims={"n": 1024}, dims_hint={"n": 16}, compile_cuda=False)
    bands = art.queue.program.regime.bands
    variants = image_defines(art.queue, art.defines)
    small, large = variants[0], variants[-1]
    assert [d["MEGA_REGIME"] for d in variants] == list(range(bands))
    assert (small["MEGA_SMEM"], large["MEGA_SMEM"]) == (120 * 1024, 200 * 1024)
    assert not nvrtc.uses_cute(art.source, small) and nvrtc.uses_cute(art.source, large)
    images, _ = kernel_images(art.source, art.defines, art.queue)
    assert len(images) == bands and all(images)


def test_a_long_queue_caps_the_dynamic_shared_memory():
    """The entry tables are static shared memory (16 bytes an entry): a queue long enough that they and the
    tile image's 200 KB would pass sm_90's 227 KB gets less dynamic memory (the bodies size their rings
    for it); a short one keeps 120 / 200 KB."""
    from megaegg.interpreter import image_defines
    from megaegg.interpreter.render import SMEM_OPTIN, static_smem

    art = me.compile(mlp(), weights(mlp()), backend="sim", max_dims={"n": 1024}, dims_hint={"n": 16})
    q = art.queue
    short = image_defines(q, {"MEGA_THREADS": 256, "MEGA_SMEM": 120 * 1024})
    assert (short[0]["MEGA_SMEM"], short[-1]["MEGA_SMEM"]) == (120 * 1024, 200 * 1024)
    # (only their count, kinds and bands matter here; each band's entries stay contiguous, as the queue's are)
    long_q = dataclasses.replace(q, entries=sorted(q.entries * 600, key=lambda e: e.op.regime))
    defs = image_defines(long_q, {"MEGA_THREADS": 256, "MEGA_SMEM": 120 * 1024})
    small, large = defs[0], defs[-1]
    assert small["MEGA_SMEM"] == 120 * 1024
    assert large["MEGA_SMEM"] < 200 * 1024 and large["MEGA_SMEM"] + static_smem(long_q, len(defs) - 1) <= SMEM_OPTIN
    assert large["MEGA_SMEM"] % 1024 == 0


def test_a_regime_launches_nothing_even_where_its_rows_do_not_vanish():
    """A linear over n + 8 rows (a concat with 8 fixed rows): its grid is not 0 at n = 0, yet outside its
    regime it must launch nothing (the other regime's ops run unsynchronised with it)."""
    g = me.Graph("rows_plus_8")
    x = g.input("x", [N, 256], me.f32)
    h = me.linear(x, g.weight("w1", [256, 256], me.f32))
    y = me.linear(me.concat([h, g.input("c", [8, 256], me.f32)], 0), g.weight("w2", [128, 256], me.f32))
    g.output("y", y)
    gen = torch.Generator().manual_seed(8)
    w = {"w1": torch.randn(256, 256, generator=gen) * 0.1, "w2": torch.randn(128, 256, generator=gen) * 0.1}
    k = me.compile(g, w, backend="sim", max_dims={"n": 4096}, dims_hint={"n": 8})
    for n in (4, 161, 300):
        if k.program.regime is not None:
            dims = k.program.with_derived({"n": n})
            assert {e.op.regime for e in k.queue.entries if e.launch.eval(dims) > 0} <= {None, k.program.regime.band(n)}
        ins = {"x": torch.randn(n, 256, generator=gen), "c": torch.randn(8, 256, generator=gen)}
        out = k.simulate(Interleaving(sms=4, seed=n, adversarial=True), **ins, n=n)
        ref = me.run_reference(g, ins, w, {"n": n})
        assert torch.allclose(out["y"], ref["y"], atol=1e-4, rtol=1e-4), n


def test_a_regime_of_three_bands_names_and_values_its_dims():
    """Three bands of rows (at most 8, 9..64, more): one derived dim a band, the row count in its band's
    and 0 in the others'; two bands keep their names (``n_rows_le80`` / ``n_rows_gt80``)."""
    from megaegg.ir.program import Regime

    r = Regime("n", (8, 64))
    assert (r.bands, r.derived) == (3, ("n_rows_le8", "n_rows_gt8_le64", "n_rows_gt64"))
    for n, band in ((0, 0), (1, 0), (8, 0), (9, 1), (64, 1), (65, 2), (4096, 2)):
        assert r.band(n) == band, n
        assert r.values({"n": n}) == {d: n if i == band else 0 for i, d in enumerate(r.derived)}, n
    two = Regime("n", (80,))
    assert two.derived == ("n_rows_le80", "n_rows_gt80")
    assert two.values({"n": 80}) == {"n_rows_le80": 80, "n_rows_gt80": 0}
    assert two.values({"n": 81}) == {"n_rows_le80": 0, "n_rows_gt80": 81}
    for bad in ((), (64, 8), (8, 8)):
        with pytest.raises(ValueError, match="strictly increasing"):
            Regime("n", bad)


def test_three_programs_merge_into_one_kernel():
    """The programs chosen at 16, 128 and 1024 rows merged into three bands: the graph's buffers once, each
    program's intermediates its own, each band's ops launching nothing outside it (even at 0 rows: no
    grid of n + c); the merged kernel matches the reference in every band under adversarial interleavings."""
    from megaegg.artifact import Artifact
    from megaegg.compiler import Kernel
    from megaegg.ir.program import Regime
    from megaegg.lowering import build_queue
    from megaegg.rewrite import rewrite
    from megaegg.rewrite.regimes import merge

    g = mlp()
    w = weights(g)
    programs = [rewrite(g, dims_hint={"n": n}) for n in (16, 128, 1024)]
    regime = Regime("n", (40, 300))
    p = merge(programs, regime)
    assert p.regime == regime and p.symbols == ("n", *regime.derived) and p.user_symbols == ("n",)
    assert [sum(op.regime == b for op in p.ops) for b in range(3)] == [len(q.ops) for q in programs]
    assert [op.id for op in p.ops] == list(range(len(p.ops)))
    graph_owned = [(b.name, b.kind, b.transposed) for b in p.buffers if b.kind not in ("scratch", "accum", "peer")]
    assert len(graph_owned) == len(set(graph_owned))  # (inputs, weights and outputs: one buffer each)
    own = [sum(b.kind in ("scratch", "accum", "peer") and b.id not in {o.buffer for o in q.outputs.values()} for b in q.buffers)
           for q in programs[1:]]  # (an output is program 0's buffer, whichever program writes it)
    assert len(p.buffers) == len(programs[0].buffers) + sum(own)
    for n in (0, 1, 40, 41, 300, 301, 700):
        dims = p.with_derived({"n": n})
        launched = {op.regime for op in p.ops if op.launch_count.eval(dims) > 0}
        assert launched <= {regime.band(n)} and (n == 0 or launched == {regime.band(n)}), n
    q = build_queue(p, {"n": 1024})
    r = render(q)
    k = Kernel(Artifact(queue=q, source=r.source, table=r.table.words(), constants={}), w, backend="sim")
    gen = torch.Generator().manual_seed(5)
    for rows in (7, 200, 333):  # one a band
        x = torch.randn(rows, 520, generator=gen).to(torch.bfloat16)
        out = k.simulate(Interleaving(sms=8, seed=rows, adversarial=True), x=x.clone(), n=rows)
        ref = me.run_reference(g, {"x": x}, w, {"n": rows})
        for name in ("y", "z"):
            err = rel(out[name], ref[name])
            assert err < 1e-2, (rows, name, err)


def test_the_bands_own_buffers_share_the_arena():
    """A scratch buffer that one band uses alone is sized for that band's most rows, and the bands' own
    buffers overlap in the arena (a launch runs one band): within a band no two buffers it touches overlap,
    each holds its largest view, and the arena is smaller than all of them side by side."""
    from megaegg.compiler import build_artifact
    from megaegg.lowering.queue import ARENA_ALIGN, upper_bound

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), hidden=2048, intermediate=8192, heads=32, kv_heads=2, layers=2)
    graph, spec = build_step_graph(cfg, max_len=512, slots=8)
    q = build_artifact(graph, max_dims={"n": 1024, "r": 8, "ctx": 512}, dims_hint={"n": 16, "r": 8, "ctx": 257},
                       compile_cuda=False).queue
    mem = q.memory
    regime = q.program.regime
    assert regime is not None and regime.bands >= 3, regime
    owned = {b for b in mem.band_rows}
    assert owned, "no band-owned buffers"
    size = {}
    for b in q.program.buffers:
        if b.id in mem.arena_offset:
            dims = {**q.max_dims, regime.symbol: mem.band_rows.get(b.id, q.max_dims[regime.symbol])}
            size[b.id] = b.dtype.itemsize * math.prod(upper_bound(d, dims) for d in b.shape)
    for band in range(regime.bands):
        used = sorted({o.buffer for op in q.program.ops if op.regime in (None, band) for o in (*op.inputs, op.output)
                       if o.buffer in mem.arena_offset}, key=mem.arena_offset.get)
        for a, b in zip(used, used[1:]):  # disjoint, in offset order
            assert mem.arena_offset[a] + size[a] <= mem.arena_offset[b], (band, a, b)
        for o in (o for op in q.program.ops if op.regime == band for o in (*op.inputs, op.output)):
            if o.buffer in mem.band_rows:  # its views at the band's most rows fit the buffer as sized
                rows = {**q.max_dims, regime.symbol: regime.most_rows(band, q.max_dims[regime.symbol])}
                assert o.dtype.itemsize * math.prod(upper_bound(d, rows) for d in o.shape) <= size[o.buffer], (band, o)
    side_by_side = sum(-(-n // ARENA_ALIGN) * ARENA_ALIGN for n in size.values())
    assert mem.arena_bytes < side_by_side


def test_bands_keep_the_programs_that_win_somewhere():
    """``bands``: the crossings of consecutive candidates, searched from the previous one up; a candidate that
    never wins in its band (its crossing not above the previous threshold) or never beats the one before
    (no crossing) is dropped; the hint's rows (16) stay in the first band, whatever a later program's price
    there. Costs here are per program: a * rows + b."""
    from megaegg.rewrite import regimes

    def run(lines, top=1000):
        programs = [object() for _ in lines]
        cost = dict(zip(map(id, programs), lines))
        seconds = lambda p, env, model: cost[id(p)][0] * env["n"] + cost[id(p)][1]  # noqa: E731
        old, regimes.program_seconds = regimes.program_seconds, seconds
        try:
            kept, cuts = regimes.bands(programs, [None] * len(lines), "n", {"n": 16}, top)
        finally:
            regimes.program_seconds = old
        return [programs.index(p) for p in kept], cuts

    assert run([(10, 0), (5, 200), (1, 1000)]) == ([0, 1, 2], (40, 200))  # (ties go to the fewer rows' program)
    assert run([(10, 0), (5, 200)]) == ([0, 1], (40,))
    assert run([(10, 0), (9, 1000), (1, 1000)]) == ([0, 2], (111,))  # 1 beats 0 only past the top
    assert run([(10, 0), (5, 200), (5, 300)]) == ([0, 1], (40,))  # 2 never beats 1
    assert run([(10, 0), (5, 200), (6, 0)]) == ([0, 2], (16,))  # 2 beats 1 all through 1's band: 1 dropped
    assert run([(1, 0), (5, 200)]) == ([0], ())  # nothing beats the hint's program
    assert run([(10, 0), (1, 0)]) == ([0, 1], (16,))  # 1 wins at the hint already: band 0 still holds the hint


def test_regime_guards_name_the_bands_that_run_the_code():
    """``#if`` around code only some bands run; nothing where every band (or any entry outside a band) runs
    it; an image compiled without MEGA_REGIME holds all; ``uses_cute`` reads the guard of a gemm include."""
    from megaegg.interpreter.nvrtc import uses_cute
    from megaegg.interpreter.render import regime_guard

    assert regime_guard({0, 1, 2}, 3) == ("", "") and regime_guard({None, 1}, 3) == ("", "") and regime_guard(set(), 3) == ("", "")
    assert regime_guard({1}, 3) == ("#if MEGA_REGIME < 0 || MEGA_REGIME == 1", "#endif")
    assert regime_guard({2, 0}, 3) == ("#if MEGA_REGIME < 0 || MEGA_REGIME == 0 || MEGA_REGIME == 2", "#endif")
    assert regime_guard({0}, 2) == ("#if MEGA_REGIME < 0 || MEGA_REGIME == 0", "#endif")
    open_, close = regime_guard({1, 2}, 3)
    src = f'{open_}\n#include "gemm.cuh"\n{close}\n'
    assert [uses_cute(src, {"MEGA_REGIME": b}) for b in range(3)] == [False, True, True]
    assert uses_cute(src) and uses_cute('#include "gemm.cuh"\n', {"MEGA_REGIME": 0})


def test_the_runner_launches_the_image_of_the_calls_band(monkeypatch):
    """CudaRunner with the driver stubbed: one image a band, loaded with its band's defines, and each call
    launches the image of its row count's band; fewer images than bands is an error."""
    import types

    from cuda.bindings import driver  # (imports without a GPU)

    from megaegg.interpreter import defines, runtime
    from megaegg.ir.program import Regime
    from megaegg.lowering import build_queue
    from megaegg.rewrite import rewrite
    from megaegg.rewrite.regimes import merge

    ok = driver.CUresult.CUDA_SUCCESS
    launched = []
    monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (ok, cubin))
    monkeypatch.setattr(driver, "cuModuleGetFunction", lambda m, name: (ok, m))  # (the function: its image's bytes)
    monkeypatch.setattr(driver, "cuFuncSetAttribute", lambda *a: (ok,))
    monkeypatch.setattr(driver, "cuFuncGetAttribute", lambda *a: (ok, 1536))  # (static shared memory)
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: launched.append(a[0]) or (ok,))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(runtime, "smem_bytes", lambda d: 1 << 20)

    g = mlp(dt=me.f32)  # (f32: no tensor-core tiles, no tensor maps)
    regime = Regime("n", (8, 64))
    p = merge([rewrite(g, dims_hint={"n": n}) for n in (4, 32, 512)], regime)
    q = build_queue(p, {"n": 1024})
    table = render(q).table.words()
    images = [b"band 0", b"band 1", b"band 2"]
    r = runtime.CudaRunner(q, images, {}, torch.device("cpu"), defines=defines(), table=table)
    for n in (1, 8, 9, 64, 65, 1024):
        dims = p.with_derived({"n": n})
        r.launch([dims[s] for s in p.symbols], {})
        assert launched[-1] == images[regime.band(n)], n
    with pytest.raises(RuntimeError, match="needs 3 kernel image"):
        runtime.CudaRunner(q, images[:2], {}, torch.device("cpu"), defines=defines(), table=table)
