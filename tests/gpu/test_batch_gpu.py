"""GPU: batches (a runtime row count, per-row positions and cache slots) and sampling on the device,
against the reference executor on fresh random data."""

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_step_graph, random_weights
from megaegg.sampling import kept, sample_row, weights

pytestmark = pytest.mark.gpu
N = me.sym("n")


def rand(shape, dt, gen):
    return torch.randn(shape, device="cuda", generator=gen).to(dt.torch)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-5), (me.bf16, 1e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_projections_of_a_batch(dt, tol, rows):
    """A pre-norm gated MLP with its residual, and a plain projection, over `rows` rows (x tiles of
    several rows per instance, the last one ragged)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    g = me.Graph("batch_mlp")
    x = g.input("x", [N, 256], dt)
    h = me.rms_norm(x, g.weight("g", [256], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [200, 256], dt))) * me.linear(h, g.weight("wu", [200, 256], dt))
    g.output("y", x + me.linear(a, g.weight("wd", [256, 200], dt)))
    g.output("z", me.linear(x, g.weight("w", [300, 256], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 64})
    assert any(e.op.params.get("mrows", 1) > 1 for e in k.queue.entries)
    xs = rand([rows, 256], dt, gen)
    out, ref = k(x=xs, n=rows), me.run_reference(g, {"x": xs}, w, {"n": rows})
    for name in ("y", "z"):
        assert rel(out[name], ref[name]) < tol, name


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-4), (me.bf16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("hq, hkv, d, rows", [(4, 2, 64, 0), (8, 2, 128, 0), (32, 8, 64, 8), (32, 8, 64, 64),
                                             (16, 4, 128, 64), (32, 8, 64, 40)])
def test_kv_store_and_ragged_attention(dt, tol, hq, hkv, d, rows):
    """rows 0: a prompt of four tokens beside decoding rows, the extractor's choice of op; else `rows` rows at
    scattered (slot, position)s, the extractor told to expect decode batches (the split-KV op, not flash):
    where they fill a wave of (row, KV head) pairs, bf16 instances take several KV heads (4 of 8 at 64 rows,
    2 of 4, 2 of 8 at 40)."""
    gen = torch.Generator(device="cuda").manual_seed(hq * d + rows)
    slots, length = 3, 96
    g = me.Graph("ragged")
    q, k, v = (g.input(name, [N, h, d], dt) for name, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    kc = me.kv_store(g.input("kc", [slots, hkv, length, d], dt), k, pos, slot)
    vc = me.kv_store(g.input("vc", [slots, hkv, length, d], dt), v, pos, slot)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
    kern = me.compile(g, {}, backend="cuda", max_dims={"n": 64}, dims_hint={"n": 8} if rows else None)
    if rows:
        cells = torch.randperm(slots * length, device="cuda", generator=gen)[:rows]  # distinct (slot, position)s
        p, s = (cells % length).tolist(), (cells // length).tolist()
    else:
        p = [0, 1, 2, 3, 70, 95, 0, 40]  # a prompt of four tokens in slot 1, decoding rows elsewhere
        s = [1, 1, 1, 1, 0, 2, 0, 2]
    n = len(p)
    ins = {"q": rand([n, hq, d], dt, gen), "k": rand([n, hkv, d], dt, gen), "v": rand([n, hkv, d], dt, gen),
           "pos": torch.tensor(p, dtype=torch.int32, device="cuda"), "slot": torch.tensor(s, dtype=torch.int32, device="cuda")}
    caches = {"kc": rand([slots, hkv, length, d], dt, gen), "vc": rand([slots, hkv, length, d], dt, gen)}
    mine = {n: c.clone() for n, c in caches.items()}
    out = kern(**ins, **mine, n=n)
    ref_caches = {n: c.clone() for n, c in caches.items()}
    ref = me.run_reference(g, {**ins, **ref_caches}, {}, {"n": n})
    assert rel(out["o"], ref["o"]) < tol
    assert all(torch.equal(mine[n], ref_caches[n]) for n in caches)  # the K and V rows written where they belong


def test_sampling_on_the_device_follows_the_definition():
    """Rows of one logits matrix under greedy, temperature, top-k and top-p settings: greedy rows give the
    argmax exactly; a sampled token is always one the definition keeps, and the same as the CPU's draw for
    nearly all rows (exp on the GPU may differ from torch's in the last bit, which moves a boundary)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 5003
    g = me.Graph("sample")
    r = me.sym("r")
    knobs = [g.input(n, [r], dt) for n, dt in
             (("temperature", me.f32), ("top_k", me.i32), ("top_p", me.f32), ("seed", me.i32), ("counter", me.i32))]
    g.output("tok", me.sample(g.input("logits", [r, vocab], me.bf16), *knobs))
    kern = me.compile(g, {}, backend="cuda", max_dims={"r": rows})
    logits = (rand([rows, vocab], me.f32, gen) * 3).to(torch.bfloat16)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0), (1.2, 0, 0.9), (0.8, 20, 0.7), (1.0, 1, 1.0), (2.0, 0, 0.5),
                (0.5, 5000, 0.99)]
    t, k, p = zip(*[settings[i % len(settings)] for i in range(rows)])
    ins = {"logits": logits, "temperature": torch.tensor(t, device="cuda"), "top_k": torch.tensor(k, dtype=torch.int32, device="cuda"),
           "top_p": torch.tensor(p, device="cuda"), "seed": torch.arange(rows, dtype=torch.int32, device="cuda"),
           "counter": torch.full((rows,), 9, dtype=torch.int32, device="cuda")}
    tok = kern(**ins, r=rows)["tok"].cpu().tolist()
    cpu = logits.cpu()
    same = 0
    for i in range(rows):
        want = sample_row(cpu[i], t[i], k[i], p[i], i, 9)
        same += tok[i] == want
        if t[i] == 0:
            assert tok[i] == want == int(cpu[i].float().argmax())
        else:
            z = cpu[i].float() / torch.tensor(t[i])
            assert kept(z, weights(z), k[i], p[i])[tok[i]], f"row {i}: token {tok[i]} is filtered out"
    assert same >= rows - 2, f"{rows - same} rows drew another token than the CPU definition"


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "llama-3.2-1b"])
def test_step_graph_prefills_and_decodes_a_batch(preset):
    """Three prompts prefilled in one launch into three cache slots, then four decode steps of all three
    (each fed the reference's token): logits within bf16 tolerance of the reference at every step."""
    cfg = ModelConfig.preset(preset)
    if cfg.layers > 2:
        cfg = dataclasses.replace(cfg, layers=2)
    graph, spec = build_step_graph(cfg, max_len=64, slots=3)
    w = random_weights(spec, seed=2, device="cuda")
    kern = me.compile(graph, w, backend="cuda", max_dims={"n": 64, "r": 3, "ctx": 64})
    mine, theirs = spec.new_caches("cuda"), spec.new_caches("cuda")
    prompts = [[5, 17, 99, 3], [42], [7, 7, 8, 1, 2, 9, 11]]
    fed = [0, 0, 0]
    rows = [(s, t, i) for s, pr in enumerate(prompts) for i, t in enumerate(pr)]
    for step in range(5):
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
        ins = {"token": i32([t for _, t, _ in rows]), "pos": i32([p for _, _, p in rows]),
               "slot": i32([s for s, _, _ in rows]),
               "out": i32([max(i for i, (s, _, _) in enumerate(rows) if s == q) for q in range(3)])}
        dims = {"n": len(rows), "r": 3, "ctx": max(p for _, _, p in rows) + 1}
        out = kern(**ins, **mine, **dims)
        ref = me.run_reference(graph, {**ins, **theirs}, w, dims)
        assert rel(out["logits"], ref["logits"]) < 2e-2, f"step {step}"
        top2 = ref["logits"].float().topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2e-2 * top2[:, 0].abs()
        assert torch.equal(out["next_token"][sure], ref["next_token"][sure]), f"step {step}"
        fed = [max(p for s, _, p in rows if s == q) + 1 for q in range(3)]
        rows = [(q, int(ref["next_token"][q]), fed[q]) for q in range(3)]


@pytest.mark.parametrize("rows", [1, 130, 300])
def test_tensor_core_tiles_of_a_prompt(rows):
    """The gemm kind (TMA + wgmma tiles) on a pre-norm gated MLP with its residual and a plain projection,
    ragged in every dim (M past a 128-row tile, N = 600 and 1000 past 256- and 128-column tiles, K = 520
    and 1000 past 64-column k-tiles), chained so one gemm reads another's tiles: within bf16 tolerance of
    the reference."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    dt = me.bf16
    g = me.Graph("gemm_mlp")
    x = g.input("x", [N, 520], dt)
    h = me.rms_norm(x, g.weight("g", [520], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [1000, 520], dt))) * me.linear(h, g.weight("wu", [1000, 520], dt))
    y = x + me.linear(a, g.weight("wd", [520, 1000], dt))
    g.output("y", y)
    g.output("z", me.linear(y, g.weight("w", [600, 520], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) * 0.3 for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 512}, dims_hint={"n": 512})
    assert sum(e.op.kind == "gemm" for e in k.queue.entries) == 3, [e.op.kind for e in k.queue.entries]
    for n in (rows, 7):  # and a later call with fewer rows: the same kernel, the same tensor maps
        xs = rand([n, 520], dt, gen)
        out, ref = k(x=xs, n=n), me.run_reference(g, {"x": xs}, w, {"n": n})
        for name in ("y", "z"):
            assert rel(out[name], ref[name]) < 1e-2, (n, name)


def test_tensor_core_tiles_of_a_batch():
    """The 64-row tiles (64 x 128 gated, 64 x 64 with the residual) that a batch of ~64 rows takes:
    ragged N (4104 gate / up rows, 1000 output columns) and K (4104), 64 rows and fewer, within bf16
    tolerance of the reference."""
    gen = torch.Generator(device="cuda").manual_seed(64)
    dt = me.bf16
    g = me.Graph("gemm_batch")
    x = g.input("x", [N, 2048], dt)
    h = me.rms_norm(x, g.weight("g", [2048], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [4104, 2048], dt))) * me.linear(h, g.weight("wu", [4104, 2048], dt))
    y = x + me.linear(a, g.weight("wd", [2048, 4104], dt))
    g.output("y", y)
    g.output("z", me.linear(y, g.weight("w", [1000, 2048], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) * 0.3 for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 64}, dims_hint={"n": 64})
    shapes = [(e.op.params["bm"], e.op.params["bn"]) for e in k.queue.entries if e.op.kind == "gemm"]
    assert shapes[:2] == [(64, 128), (64, 64)], [e.op.kind for e in k.queue.entries]
    for n in (64, 37, 1, 50):
        xs = rand([n, 2048], dt, gen)
        out, ref = k(x=xs, n=n), me.run_reference(g, {"x": xs}, w, {"n": n})
        for name in ("y", "z"):
            assert rel(out[name], ref[name]) < 1e-2, (n, name)


def test_tensor_core_tiles_of_128_by_128():
    """The 128 x 128 tile that a prompt of ~512 rows takes where 128 x 256 tiles would leave SMs idle (a
    4000-wide residual projection: 16 x 4 tiles of 128 x 256 against 32 x 4 of 128 x 128), ragged in N
    (4000) and K (1000) and M (past and within a row tile), chained into a plain projection: within bf16
    tolerance of the reference."""
    gen = torch.Generator(device="cuda").manual_seed(128)
    dt = me.bf16
    g = me.Graph("gemm_128x128")
    x = g.input("x", [N, 4000], dt)
    y = x + me.linear(g.input("h", [N, 1000], dt), g.weight("wo", [4000, 1000], dt))
    g.output("y", y)
    g.output("z", me.linear(y, g.weight("w", [600, 4000], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) * 0.3 for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 512}, dims_hint={"n": 512})
    shapes = [(e.op.params["bm"], e.op.params["bn"]) for e in k.queue.entries if e.op.kind == "gemm"]
    assert shapes[0] == (128, 128), shapes
    for n in (512, 300, 129, 5):
        ins = {"x": rand([n, 4000], dt, gen), "h": rand([n, 1000], dt, gen)}
        out, ref = k(**ins, n=n), me.run_reference(g, ins, w, {"n": n})
        for name in ("y", "z"):
            assert rel(out[name], ref[name]) < 1e-2, (n, name)


@pytest.mark.parametrize("one_band", [False, True])
def test_tensor_core_tiles_split_over_k(one_band, monkeypatch):
    """The 64-row tiles split over K (f32 partials, the last split to arrive sums them and applies the
    epilogue): a residual projection, a gated MLP and a plain projection with ragged N (1000), at 64 rows
    and fewer, and (``one_band``: the program chosen at 64 rows kept for every row count) past one row
    tile, where the split tiles run unsplit; within bf16 tolerance of the reference."""
    if one_band:
        from megaegg.rewrite import schedule

        monkeypatch.setattr(schedule, "bands", lambda programs, *a: ([programs[0]], ()))
    gen = torch.Generator(device="cuda").manual_seed(65)
    dt = me.bf16
    g = me.Graph("gemm_split_one_band" if one_band else "gemm_split")  # (apart in the artifact cache)
    x = g.input("x", [N, 2048], dt)
    y = x + me.linear(g.input("h", [N, 4096], dt), g.weight("wo", [2048, 4096], dt))
    a = me.silu(me.linear(y, g.weight("wg", [1536, 2048], dt))) * me.linear(y, g.weight("wu", [1536, 2048], dt))
    g.output("y", y)
    g.output("z", me.linear(a, g.weight("w", [1000, 1536], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) * 0.3 for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 130}, dims_hint={"n": 64})
    split = {e.op.params["roles"] for e in k.queue.entries if e.op.kind == "gemm" and e.op.params.get("splits", 1) > 1}
    assert split >= {("x", "w", "r"), ("x", "w", "w2")}, [e.op for e in k.queue.entries]
    for n in (64, 17, 40, 100, 130, 64):
        ins = {"x": rand([n, 2048], dt, gen), "h": rand([n, 4096], dt, gen)}
        out, ref = k(**ins, n=n), me.run_reference(g, ins, w, {"n": n})
        for name in ("y", "z"):
            assert rel(out[name], ref[name]) < 1e-2, (n, name)


def test_tensor_core_tiles_read_a_callers_tensor():
    """x is the caller's tensor (its tensor map is encoded at each call whose pointer or row count
    changed): three calls with different tensors and row counts."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    g = me.Graph("gemm_input")
    # (a shape the cost model gives to gemm tiles at 1024 rows; smaller ones go to wide matvec tiles)
    g.output("y", me.linear(g.input("x", [N, 1024], me.bf16), g.weight("w", [2048, 1024], me.bf16)))
    w = {"w": rand([2048, 1024], me.bf16, gen)}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 1024}, dims_hint={"n": 1024})
    assert [e.op.kind for e in k.queue.entries] == ["gemm"]
    for n in (1000, 129, 1000):
        xs = rand([n, 1024], me.bf16, gen)
        assert rel(k(x=xs, n=n)["y"], xs.float() @ w["w"].float().T) < 1e-2, n


def test_one_kernel_runs_both_row_regimes():
    """Compiled for 16 rows and up to 1024 rows: a few rows take the matvec program, many the tensor-core
    one, alternating in one kernel."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    dt = me.bf16
    g = me.Graph("regimes")
    x = g.input("x", [N, 512], dt)
    h = me.rms_norm(x, g.weight("g", [512], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [1024, 512], dt))) * me.linear(h, g.weight("wu", [1024, 512], dt))
    g.output("y", x + me.linear(a, g.weight("wd", [512, 1024], dt)))
    w = {n: rand([d.value for d in t.shape], dt, gen) * 0.3 for n, t in g.weights.items()}
    k = me.compile(g, w, backend="cuda", max_dims={"n": 1024}, dims_hint={"n": 16})
    assert k.program.regime is not None
    for n in (3, 1000, 16, 700, 1):
        xs = rand([n, 512], dt, gen)
        out, ref = k(x=xs, n=n), me.run_reference(g, {"x": xs}, w, {"n": n})
        assert rel(out["y"], ref["y"]) < 1e-2, n


def prompt_rows(hq, hkv, d, gen):
    """A prompt of 100 tokens continuing cached rows of slot 1, one of 30 in slot 0 and 5 decode rows of slot
    2 (scattered positions): n, the inputs q / k / v / pos / slot and the caches kc / vc (3 slots of 160)."""
    p = list(range(20, 120)) + list(range(30)) + [7, 150, 33, 159, 0]
    s = [1] * 100 + [0] * 30 + [2] * 5
    n = len(p)
    ins = {"q": rand([n, hq, d], me.bf16, gen), "k": rand([n, hkv, d], me.bf16, gen), "v": rand([n, hkv, d], me.bf16, gen),
           "pos": torch.tensor(p, dtype=torch.int32, device="cuda"), "slot": torch.tensor(s, dtype=torch.int32, device="cuda")}
    return n, ins, {"kc": rand([3, hkv, 160, d], me.bf16, gen), "vc": rand([3, hkv, 160, d], me.bf16, gen)}


def test_flash_attention_over_prompts():
    """ragged_flash in a kernel: two prompts (one continuing cached rows) and decode rows of a third
    sequence in one step, D 64 and 128."""
    for hq, hkv, d in ((8, 2, 64), (16, 2, 128)):
        gen = torch.Generator(device="cuda").manual_seed(d)
        g = me.Graph("prompt_attention")
        q, k, v = (g.input(name, [N, h, d], me.bf16) for name, h in (("q", hq), ("k", hkv), ("v", hkv)))
        pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
        kc = me.kv_store(g.input("kc", [3, hkv, 160, d], me.bf16), k, pos, slot)
        vc = me.kv_store(g.input("vc", [3, hkv, 160, d], me.bf16), v, pos, slot)
        g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
        kern = me.compile(g, {}, backend="cuda", max_dims={"n": 512}, dims_hint={"n": 512})
        assert any(e.op.kind == "ragged_flash" for e in kern.queue.entries)
        n, ins, caches = prompt_rows(hq, hkv, d, gen)
        mine = {name: c.clone() for name, c in caches.items()}
        out = kern(**ins, **mine, n=n)
        ref = me.run_reference(g, {**ins, **{name: c.clone() for name, c in caches.items()}}, {}, {"n": n})
        assert rel(out["o"], ref["o"]) < 2e-2, d


def test_flash_attention_rotates_q_as_it_loads_it():
    """q's RoPE (and qwen3's q norm before it) folded into ragged_flash, in a kernel: a prompt continuing
    cached rows, a second prompt and decode rows of a third sequence, D 64 and 128."""
    for hq, hkv, d, qnorm in ((8, 2, 64, False), (16, 2, 128, True)):
        gen = torch.Generator(device="cuda").manual_seed(d + 1)
        g = me.Graph("prompt_attention_rope")
        q, k, v = (g.input(name, [N, h, d], me.bf16) for name, h in (("q", hq), ("k", hkv), ("v", hkv)))
        pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
        if qnorm:
            q = me.rms_norm(q, g.weight("qn", [d], me.bf16), 1e-6)
        q = me.rope(q, pos, theta=1e6)
        kc = me.kv_store(g.input("kc", [3, hkv, 160, d], me.bf16), me.rope(k, pos, theta=1e6), pos, slot)
        vc = me.kv_store(g.input("vc", [3, hkv, 160, d], me.bf16), v, pos, slot)
        g.output("o", me.ragged_attention(q, kc, vc, pos, slot))
        w = {"qn": (torch.rand(d, generator=gen, device="cuda") + 0.5).bfloat16()} if qnorm else {}
        kern = me.compile(g, w, backend="cuda", max_dims={"n": 512}, dims_hint={"n": 512})
        flash = [e.op for e in kern.queue.entries if e.op.kind == "ragged_flash"]
        assert flash and flash[0].params.get("rope") and not any(e.op.kind == "rope" for e in kern.queue.entries)
        n, ins, caches = prompt_rows(hq, hkv, d, gen)
        out = kern(**ins, **{name: c.clone() for name, c in caches.items()}, n=n)
        ref = me.run_reference(g, {**ins, **{name: c.clone() for name, c in caches.items()}}, w, {"n": n})
        assert rel(out["o"], ref["o"]) < 2e-2, (d, qnorm)


def test_flash_spreads_a_mixed_tiles_passes_over_instances():
    """A mixed step's rows in ragged_flash, in a kernel: 30 decode rows of other sequences before a 100-token
    prompt, so the first token tiles run one pass a sequence, spread over 8 instances a tile (``sequences=``)."""
    hq, hkv, d, slots = 8, 2, 64, 40
    gen = torch.Generator(device="cuda").manual_seed(91)
    g = me.Graph("mixed_attention")
    q, k, v = (g.input(name, [N, h, d], me.bf16) for name, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    kc = me.kv_store(g.input("kc", [slots, hkv, 160, d], me.bf16), k, pos, slot)
    vc = me.kv_store(g.input("vc", [slots, hkv, 160, d], me.bf16), v, pos, slot)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot, sequences=me.sym("s")))
    kern = me.compile(g, {}, backend="cuda", max_dims={"n": 256, "s": 64}, dims_hint={"n": 256, "s": 31})
    decode, prompt = 30, 100
    n = decode + prompt
    flash = [e.op for e in kern.queue.entries if e.op.kind == "ragged_flash"]
    assert flash and flash[0].grid[2].eval({"n": n, "s": decode + 1}) == 8
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    ins = {"q": rand((n, hq, d), me.bf16, gen), "k": rand((n, hkv, d), me.bf16, gen), "v": rand((n, hkv, d), me.bf16, gen),
           "pos": i32([int(p) for p in torch.randint(0, 150, (decode,), generator=torch.Generator().manual_seed(3))]
                      + list(range(prompt))),
           "slot": i32(list(range(1, decode + 1)) + [0] * prompt)}
    caches = {name: rand((slots, hkv, 160, d), me.bf16, gen) for name in ("kc", "vc")}
    out = kern(**ins, **{name: c.clone() for name, c in caches.items()}, n=n, s=decode + 1)
    ref = me.run_reference(g, {**ins, **{name: c.clone() for name, c in caches.items()}}, {}, {"n": n, "s": decode + 1})
    assert rel(out["o"], ref["o"]) < 2e-2


@pytest.mark.parametrize("dt", [me.bf16, me.f32])
def test_paged_kv_cache_ops_on_gpu(dt):
    """kv_store and ragged_attention through a page table (pages of 16 rows scattered over the pool; the
    split-KV path: one page an instance, the tensor-core body for bf16, the generic one for f32): the
    same outputs and stored rows as the reference; a page outside the pool is an error naming the op."""
    gen = torch.Generator(device="cuda").manual_seed(40)
    hkv, d, page, slots, per, pool = 2, 64, 16, 3, 4, 14
    g = me.Graph(f"paged_ops_{dt.name}")
    q, k, v = (g.input(name, [N, h, d], dt) for name, h in (("q", 4), ("k", hkv), ("v", hkv)))
    pos, slot = g.input("pos", [N], me.i32), g.input("slot", [N], me.i32)
    table = g.input("pages", [slots, per], me.i32)
    kc = me.kv_store(g.input("kc", [pool, hkv, page, d], dt), k, pos, slot, pages=table)
    vc = me.kv_store(g.input("vc", [pool, hkv, page, d], dt), v, pos, slot, pages=table)
    g.output("o", me.ragged_attention(q, kc, vc, pos, slot, pages=table))
    kern = me.compile(g, {}, backend="cuda", max_dims={"n": 16})
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    rows = 7
    ins = {"q": rand([rows, 4, d], dt, gen), "k": rand([rows, hkv, d], dt, gen), "v": rand([rows, hkv, d], dt, gen),
           "pos": i32([0, 1, 2, 3, 40, 63, 17]), "slot": i32([1, 1, 1, 1, 0, 2, 0]),
           "pages": torch.randperm(pool, device="cuda", generator=gen)[: slots * per].reshape(slots, per).to(torch.int32)}
    pools = {name: rand([pool, hkv, page, d], dt, gen) for name in ("kc", "vc")}
    mine, theirs = ({n: c.clone() for n, c in pools.items()} for _ in range(2))
    out = kern(**ins, **mine, n=rows)
    ref = me.run_reference(g, {**ins, **theirs}, {}, {"n": rows})
    assert rel(out["o"], ref["o"]) < 1e-2
    assert torch.equal(mine["kc"], theirs["kc"]) and torch.equal(mine["vc"], theirs["vc"])
    bad = ins["pages"].clone()
    bad[0, 2] = pool
    with pytest.raises(RuntimeError, match=rf"index out of range in op\d+ (kv_store|ragged_partial_merge) .*value {pool}"):
        kern(**{**ins, "pages": bad}, **{n: c.clone() for n, c in pools.items()}, n=rows)


def test_paged_step_graph_gives_the_step_graphs_logits_on_gpu():
    """llama-3.2-1b (2 layers) with its caches in pages of 64 rows scattered over the pool and with slots: a
    300-token prompt beside two short ones (flash through the page table), then decode steps of all three
    (split-KV a page an instance): logits within bf16 tolerance, the same tokens where the top two differ."""
    cfg = dataclasses.replace(ModelConfig.preset("llama-3.2-1b"), layers=2)
    max_len, page = 512, 64
    plain, spec = build_step_graph(cfg, max_len=max_len, slots=3)
    paged, pspec = build_step_graph(cfg, max_len=max_len, slots=3, page_len=page, pages=30)
    w = random_weights(spec, seed=8, device="cuda")
    dims = {"n": 320, "r": 3, "ctx": max_len}
    kerns = [me.compile(gr, w, backend="cuda", max_dims=dims) for gr in (plain, paged)]
    gen = torch.Generator(device="cuda").manual_seed(41)
    table = torch.randperm(30, device="cuda", generator=gen)[:24].reshape(3, 8).to(torch.int32)
    caches = [spec.new_caches("cuda"), pspec.new_caches("cuda")]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    prompts = [[5, 17, 99], [(7 * i) % cfg.vocab for i in range(300)], [7, 8]]
    rows = [(s, t, i) for s, pr in enumerate(prompts) for i, t in enumerate(pr)]
    ins = {"token": i32([t for _, t, _ in rows]), "pos": i32([p for _, _, p in rows]), "slot": i32([s for s, _, _ in rows]),
           "out": i32([2, 302, 304])}
    d = {"n": len(rows), "r": 3, "ctx": 300}
    fed = [3, 300, 2]
    for step in range(4):
        outs = [kerns[0](**ins, **caches[0], **d), kerns[1](**ins, **caches[1], pages=table, **d)]
        assert rel(outs[1]["logits"], outs[0]["logits"]) < 2e-2, f"step {step}"
        top2 = outs[0]["logits"].float().topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2e-2 * top2[:, 0].abs()
        assert torch.equal(outs[0]["next_token"][sure], outs[1]["next_token"][sure]), f"step {step}"
        ins = {"token": outs[0]["next_token"], "pos": i32(fed), "slot": i32([0, 1, 2]), "out": i32([0, 1, 2])}
        d = {"n": 3, "r": 3, "ctx": max(fed) + 1}
        fed = [f + 1 for f in fed]
