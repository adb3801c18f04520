"""The compiled queue on the CPU simulator: random and adversarial interleavings, poisoned buffers."""

import dataclasses
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_cases import CASES, P, mlp_sum_readers, qk_norm_rope_append
from test_reference import WEIGHTS, build_layer

import megaegg as me
from megaegg.dims import as_dim
from megaegg.interpreter import Interleaving, SimulationError


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def compare(kernel, graph, inputs, weights, dims, tol, interleavings=(Interleaving(),)):
    ref = me.run_reference(graph, {n: t.clone() for n, t in inputs.items()}, weights, dims)
    for sch in interleavings:
        out = kernel.simulate(sch, **{n: t.clone() for n, t in inputs.items()}, **dims)
        for name, r in ref.items():
            if r.is_floating_point():
                assert rel(out[name], r) < tol, f"{name} under {sch}"
            else:
                assert torch.equal(out[name], r), f"{name} under {sch}"


INTERLEAVINGS = [Interleaving(sms=1), Interleaving(sms=4, seed=1), Interleaving(sms=16, seed=2, adversarial=True),
                 Interleaving(sms=3, seed=3, adversarial=True)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_on_simulator(case):
    torch.manual_seed(zlib.crc32(case.encode()) % 1000)  # hash() varies per process (PYTHONHASHSEED)
    build, ins, ws = CASES[case](me.f32)
    g = me.Graph(case)
    build(g)
    dims = {"pos": 9} if g.symbols() else {}
    k = me.compile(g, {n: torch.randn(s) for n, s in ws.items()}, backend="sim", max_dims={s: 64 for s in g.symbols()})
    compare(k, g, {n: torch.randn(s) for n, s in ins.items()}, k.weights, dims, 1e-5, INTERLEAVINGS)


def test_layer_20_decode_steps_one_compile():
    torch.manual_seed(11)
    g = build_layer(me.f32)
    W = {n: torch.randn(s) * 0.3 for n, s in WEIGHTS.items()}
    k = me.compile(g, W, backend="sim", max_dims={"pos": 31})
    queue = k.queue
    kc, vc = torch.randn(2, 32, 16), torch.randn(2, 32, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    for pos in range(20):
        x = torch.randn(1, 64)
        out = k.simulate(INTERLEAVINGS[pos % len(INTERLEAVINGS)], x=x, k_cache=kc, v_cache=vc, pos=pos)["y"]
        ref = me.run_reference(g, {"x": x, "k_cache": kc2, "v_cache": vc2}, W, {"pos": pos})["y"]
        assert rel(out, ref) < 1e-5
        assert torch.allclose(kc, kc2, atol=1e-6) and torch.allclose(vc, vc2, atol=1e-6)
    assert k.queue is queue  # the dims changed; nothing was rebuilt


def test_simulator_catches_a_missing_barrier():
    g = build_layer(me.f32)
    k = me.compile(g, {n: torch.randn(s) for n, s in WEIGHTS.items()}, backend="sim", max_dims={"pos": 31})
    entries = tuple(dataclasses.replace(e, waits=()) for e in k.queue.entries)  # drop every wait
    k.queue = dataclasses.replace(k.queue, entries=entries)
    with pytest.raises(SimulationError, match="read unwritten elements"):
        for seed in range(10):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), x=torch.randn(1, 64),
                       k_cache=torch.randn(2, 32, 16), v_cache=torch.randn(2, 32, 16), pos=3)


def test_simulator_reports_deadlock():
    g = build_layer(me.f32)
    k = me.compile(g, {n: torch.randn(s) for n, s in WEIGHTS.items()}, backend="sim", max_dims={"pos": 31})
    e = k.queue.entries[-1]
    bad = tuple(dataclasses.replace(w, expected=w.expected + 1) for w in e.waits)  # a count no one reaches
    k.queue = dataclasses.replace(k.queue, entries=k.queue.entries[:-1] + (dataclasses.replace(e, waits=bad),))
    with pytest.raises(SimulationError, match="deadlock"):
        k.simulate(Interleaving(), x=torch.randn(1, 64), k_cache=torch.randn(2, 32, 16), v_cache=torch.randn(2, 32, 16), pos=3)


def test_attention_output_waits_for_every_split():
    """``attn_partial_merge``: the last split of a KV head writes its output, so a reader must wait
    for every split of the heads it reads; one split short, it must fail."""
    g = me.Graph("attn")
    pos = me.sym("pos")
    q = g.input("q", [8, 16], me.f32)
    kc, vc = g.input("k_cache", [2, 1024, 16], me.f32), g.input("v_cache", [2, 1024, 16], me.f32)
    attn = me.attention(q, kc, vc, pos + 1)
    g.output("y", me.linear(attn.reshape(1, 128), g.weight("wo", [64, 128], me.f32)))
    k = me.compile(g, {"wo": torch.randn(64, 128)}, backend="sim", max_dims={"pos": 1023})
    kinds = [e.op.kind for e in k.queue.entries]
    assert kinds == ["attn_partial_merge", "matvec"]
    chunk = k.queue.entries[0].op.params["chunk"]
    args = dict(q=torch.randn(8, 16), k_cache=torch.randn(2, 1024, 16), v_cache=torch.randn(2, 1024, 16))
    dims = {"pos": 3 * chunk + 5}  # 4 splits a KV head: which one writes depends on the interleaving
    compare(k, g, args, k.weights, dims, 1e-5, INTERLEAVINGS)
    reader = k.queue.entries[1]
    assert [w.expected.eval(dims) for w in reader.waits] == [8]  # 2 KV heads x 4 splits
    early = tuple(dataclasses.replace(w, expected=w.expected - 1) for w in reader.waits)
    k.queue = dataclasses.replace(k.queue, entries=(k.queue.entries[0], dataclasses.replace(reader, waits=early)))
    name = k.queue.program.buffers[k.queue.entries[0].op.output.buffer].name
    with pytest.raises(SimulationError, match=f"read unwritten elements of buffer '{name}'"):
        for seed in range(10):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), **args, **dims)


# --- random graphs ------------------------------------------------------------------------
S = me.sym("S")


@st.composite
def random_graph(draw):
    """A random chain of ops over an [R, C] input; returns (graph, input shapes, weight shapes, dims)."""
    g = me.Graph("random")
    symbolic = draw(st.booleans())
    rows = draw(st.integers(1, 3))
    cols = draw(st.sampled_from([2, 8, 30, 64, 200, 320]))
    x = g.input("x", [S if symbolic else rows, cols], me.f32)
    ins, ws = {"x": ("x", cols)}, {}
    outs = []
    for step in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(["linear", "norm", "silu", "add_in", "mul_self", "softmax", "rope", "view", "concat"]))
        c = x.shape[-1].value
        if op == "linear":
            n = draw(st.sampled_from([1, 16, 50, 130]))
            x = me.linear(x, g.weight(f"w{step}", [n, c], me.f32))
            ws[f"w{step}"] = [n, c]
        elif op == "norm":
            x = me.rms_norm(x, g.weight(f"g{step}", [c], me.f32), 1e-5)
            ws[f"g{step}"] = [c]
        elif op == "silu":
            x = me.silu(x)
        elif op == "add_in":
            x = x + g.input(f"b{step}", [c], me.f32)
            ins[f"b{step}"] = (None, c)
        elif op == "mul_self":
            x = me.silu(x) * x
        elif op == "softmax":
            x = me.softmax(x)
        elif op == "rope" and c % 2 == 0:
            x = me.rope(x, me.sym("pos"))
        elif op == "view" and not symbolic:
            x = me.transpose(me.transpose(x, 0, 1), 0, 1) if c % 2 else me.reshape(me.reshape(x, [-1, 2]), [x.shape[0], c])
        elif op == "concat":
            x = me.concat([x, me.slice(x, 1, 0, max(1, c // 2))], 1)
        if draw(st.booleans()):
            outs.append(x)
    outs.append(x)
    for k, t in enumerate(outs):
        g.output(f"out{k}", t)
    return g, ins, ws, rows


def case_data(case, seed: int, device: str = "cpu"):
    """Runtime dims, random inputs and weights (on ``device``) for a ``random_graph`` case."""
    g, ins, ws, rows = case
    torch.manual_seed(seed)
    dims = {s: {"S": rows, "pos": seed % 50}[s] for s in g.symbols()}
    n_rows = dims.get("S", rows)
    inputs = {n: (torch.randn(n_rows, c) if base else torch.randn(c)).to(device) for n, (base, c) in ins.items()}
    weights = {n: (torch.randn(s) * 0.2).to(device) for n, s in ws.items()}
    return dims, inputs, weights


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graph(), st.integers(0, 2**16))
def test_random_graphs_on_simulator(case, seed):
    g = case[0]
    dims, inputs, weights = case_data(case, seed)
    k = me.compile(g, weights, backend="sim", max_dims={s: 64 for s in g.symbols()})
    compare(k, g, inputs, k.weights, dims, 1e-4, (Interleaving(sms=5, seed=seed, adversarial=seed % 2 == 0),))


def test_token_only_graph_fuses_lm_head_with_argmax_partials():
    from megaegg.models import ModelConfig, build_decode_graph, random_weights

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    g, spec = build_decode_graph(cfg, max_len=16, logits=False)
    weights = random_weights(spec, seed=4)
    k = me.compile(g, weights, backend="sim", max_dims={"pos": 15})
    kinds = [e.op.kind for e in k.queue.entries]
    assert "matvec_argmax" in kinds and "argmax_partial" not in kinds
    caches, ref_caches = spec.new_caches(), spec.new_caches()
    for pos, tok in enumerate([5, 9, 11, 200, 7]):
        t = torch.tensor([tok], dtype=torch.int32)
        out = k.simulate(INTERLEAVINGS[pos % len(INTERLEAVINGS)], token=t, pos=pos, **caches)["next_token"]
        assert torch.equal(out, me.run_reference(g, {"token": t, **ref_caches}, weights, {"pos": pos})["next_token"])
    # with logits also an output, fusing would compute the LM head twice: the extractor keeps it unfused
    g2, _ = build_decode_graph(cfg, max_len=16)
    assert "matvec_argmax" not in [e.op.kind for e in me.compile(g2, weights, backend="sim", max_dims={"pos": 15}).queue.entries]


def _compiled_case(name: str, seed: int):
    """Op case ``name`` in f32 with fresh random weights, compiled for the simulator."""
    torch.manual_seed(seed)
    build, _ins, ws = CASES[name](me.f32)
    g = me.Graph(name)
    build(g)
    W = {n: torch.randn(s) for n, s in ws.items()}
    return g, W, me.compile(g, W, backend="sim")


def test_gated_mlp_sums_wait_for_every_adder():
    """glu_down instances add into one f32 accumulator: its reader must wait for all of them.
    The down weight is bound transposed; ``kernel.weights`` still shows the user's layout."""
    g, W, k = _compiled_case("gated_mlp_residual", seed=5)
    assert [e.op.kind for e in k.queue.entries] == ["glu_down", "acc_residual"]
    assert torch.equal(k.weights["wd"], W["wd"])
    x = torch.randn(1, 128)
    compare(k, g, {"x": x}, k.weights, {}, 1e-5, INTERLEAVINGS)
    # one adder's wait is not enough: with the reader's expected count cut to 1 it must fail
    reader = k.queue.entries[1]
    early = tuple(dataclasses.replace(w, expected=as_dim(1)) for w in reader.waits)
    k.queue = dataclasses.replace(k.queue, entries=(k.queue.entries[0], dataclasses.replace(reader, waits=early)))
    with pytest.raises(SimulationError, match="read unwritten elements of buffer 'mlp_acc"):
        for seed in range(10):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), x=x)


def test_mlp_sum_is_read_by_its_matvecs_without_acc_residual():
    """Where every reader of the MLP's sum is a matvec (x or residual), no acc_residual op is
    emitted: the readers stage r + T(acc) and wait for every adder. Where the sum is also a
    graph output it is materialised as before."""
    g, W, k = _compiled_case("mlp_sum_readers", seed=7)
    entries = k.queue.entries
    assert [e.op.kind for e in entries] == ["glu_down", "matvec", "matvec"]
    assert [e.op.params["roles"] for e in entries[1:]] == [("x", "w", "g", "xa"), ("x", "w", "r", "ra")]
    adders = entries[0].launch.eval({})
    assert adders > 1 and [w.expected.eval({}) for w in entries[1].waits] == [adders]  # the second reader's is implied
    compare(k, g, {"x": torch.randn(1, 128)}, k.weights, {}, 1e-5, INTERLEAVINGS)
    # a second reader that is not a matvec (the sum as an output) keeps acc_residual
    g2 = me.Graph("sum_output")
    mlp_sum_readers(g2, me.f32, sum_output=True)
    k2 = me.compile(g2, W, backend="sim")
    assert "acc_residual" in [e.op.kind for e in k2.queue.entries]
    compare(k2, g2, {"x": torch.randn(1, 128)}, k2.weights, {}, 1e-5, INTERLEAVINGS)


def test_rope_takes_the_head_norm_and_writes_the_cache_row():
    """qwen3's q/k path: the per-head RMSNorm runs inside the rope op, and k's rope writes the
    cache row itself, so no rms_norm op and no kv_append for k remain."""
    g = me.Graph("qk")
    qk_norm_rope_append(g, me.f32)
    k = me.compile(g, {"gq": torch.randn(64), "gk": torch.randn(64)}, backend="sim", max_dims={"pos": 15})
    kinds = [e.op.kind for e in k.queue.entries]
    assert kinds.count("rms_norm") == 0 and kinds.count("kv_append") == 1 and kinds.count("rope") == 2
    cache_rope = next(e.op for e in k.queue.entries if e.op.kind == "rope" and k.queue.program.buffers[e.op.output.buffer].name == "kc")
    assert cache_rope.params["roles"] == ("x", "inv_freq", "g")


def test_hf_rounding_rope_in_each_fused_form_gives_the_references_bits():
    """ops.rope(rounding="hf") rounds as transformers' apply_rotary_pos_emb computes in bf16 (cos / sin, each
    product and each sum): the rope op at a runtime position after qwen3's norm, k's writing its cache row
    (rope_rows), at positions from a tensor (rope_ids) and rotating a batch's K rows as they are stored
    (kv_store_rope) give the reference's bits; the f32 rounding does not, on the same data."""
    dt, outs = me.bf16, {}
    for rounding in ("hf", "f32"):
        g = me.Graph(f"rope_{rounding}")
        r = dict(theta=10000.0, rounding=rounding)
        ids, at, slot = (g.input(n, [3], me.i32) for n in ("ids", "at", "slot"))
        g.output("q", me.rope(me.rms_norm(g.input("q", [4, 64], dt), g.weight("gq", [64], dt), 1e-6), P, **r))
        k = me.rope(me.rms_norm(g.input("k", [2, 64], dt), g.weight("gk", [64], dt), 1e-6), P, **r)
        g.output("kc", me.kv_append(g.input("kc", [2, 16, 64], dt), k, P))
        g.output("x", me.rope(g.input("x", [3, 2, 64], dt), ids, **r))
        g.output("kc2", me.kv_store(g.input("kc2", [2, 2, 16, 64], dt), me.rope(g.input("kn", [3, 2, 64], dt), ids, **r),
                                    at, slot))
        torch.manual_seed(8)
        w = {"gq": torch.randn(64).to(dt.torch), "gk": torch.randn(64).to(dt.torch)}
        k_ = me.compile(g, w, backend="sim", max_dims={"pos": 15})
        ops = [e.op for e in k_.queue.entries]
        assert sorted(op.kind for op in ops) == ["kv_store", "rope", "rope", "rope"], [op.kind for op in ops]
        assert all(op.params.get("hf", False) == (rounding == "hf") for op in ops)
        ins = {"ids": torch.tensor([3, 900, 15], dtype=torch.int32), "at": torch.tensor([3, 9, 15], dtype=torch.int32),
               "slot": torch.tensor([1, 0, 1], dtype=torch.int32),
               **{n: torch.randn(s).to(dt.torch) * 2 for n, s in (("q", [4, 64]), ("k", [2, 64]), ("x", [3, 2, 64]),
                                                                    ("kn", [3, 2, 64]))},
               "kc": torch.zeros(2, 16, 64, dtype=dt.torch), "kc2": torch.zeros(2, 2, 16, 64, dtype=dt.torch)}
        ref = me.run_reference(g, {n: t.clone() for n, t in ins.items()}, w, {"pos": 11})
        for sch in INTERLEAVINGS[:2]:
            out = k_.simulate(sch, **{n: t.clone() for n, t in ins.items()}, pos=11)
            for name in ref:
                assert torch.equal(out[name], ref[name]), (rounding, name)
        outs[rounding] = ref
    assert not any(torch.equal(outs["hf"][n], outs["f32"][n]) for n in outs["hf"])


def test_a_written_out_rope_broadcast_over_a_runtime_dim_stays_elementwise():
    """RoPE written out as transformers writes it, one position for x [1, S, D]'s S rows with S a runtime
    dim: the fused rope_ids needs its rows' groups at compile time, so the ops stay elementwise (a review
    found the compile raising) and give the reference's bits."""
    from megaegg import ops as O

    D = 16
    g = me.Graph("rope_runtime_mid")
    x = g.input("x", [1, me.sym("S"), D], me.bf16)
    p = g.input("p", [1, 1], me.i32)
    inv = g.constant("inv", 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D)))
    a = O.concat([O.mul(O.cast(p, me.f32), inv)] * 2, -1)
    c, s = (O.reshape(O.cast(f(a), me.bf16), [1, 1, D]) for f in (O.cos, O.sin))
    rot = O.concat([O.neg(O.slice(x, 2, D // 2, D)), O.slice(x, 2, 0, D // 2)], -1)
    g.output("y", O.add(O.mul(x, c), O.mul(rot, s)))
    k = me.compile(g, {}, backend="sim", max_dims={"S": 64})
    assert "rope" not in {e.op.kind for e in k.queue.entries}
    torch.manual_seed(3)
    ins = {"x": torch.randn(1, 5, D).to(torch.bfloat16), "p": torch.tensor([[37]], dtype=torch.int32)}
    ref = me.run_reference(g, ins, {}, {"S": 5})
    assert torch.equal(k(**ins, S=5)["y"], ref["y"])


def test_gated_mlp_through_a_weight_view_stays_unfused():
    """glu_down reads its weights' rows directly: a gate weight seen through a transpose is
    left to the matvec path (which handles strides), and the result stays right."""
    torch.manual_seed(6)
    g = me.Graph("mlp_view")
    x = g.input("x", [1, 64], me.f32)
    gate = me.transpose(g.weight("wg_t", [64, 96], me.f32), 0, 1)
    a = me.silu(me.linear(x, gate)) * me.linear(x, g.weight("wu", [96, 64], me.f32))
    g.output("y", x + me.linear(a, g.weight("wd", [64, 96], me.f32)))
    W = {"wg_t": torch.randn(64, 96), "wu": torch.randn(96, 64), "wd": torch.randn(64, 96)}
    k = me.compile(g, W, backend="sim")
    assert "glu_down" not in {e.op.kind for e in k.queue.entries}
    compare(k, g, {"x": torch.randn(1, 64)}, k.weights, {}, 1e-5, INTERLEAVINGS)


def test_a_view_with_no_strides_is_copied_once_through_its_layout_part():
    """Embedding ids seen through a transpose then flattened: the flatten has no strided layout,
    so the transposed ids are copied first (copying the whole view chain recursed forever)."""
    g = me.Graph("ids_view")
    ids = me.transpose(g.input("ids", [4, 3], me.i32), 0, 1)
    g.output("y", me.embedding(g.weight("t", [50, 16], me.f32), ids))
    W = {"t": torch.randn(50, 16)}
    k = me.compile(g, W, backend="sim")
    assert [e.op.kind for e in k.queue.entries] == ["elementwise", "embedding"]
    compare(k, g, {"ids": torch.randint(0, 50, (4, 3), dtype=torch.int32)}, W, {}, 1e-6, INTERLEAVINGS)


@pytest.mark.parametrize("build, pattern", [
    # the reader needs the rows before the update, which the kernel no longer holds
    (lambda g, kc, new: (me.silu(kc), me.kv_append(kc, new, me.sym("pos"))),
     r"silu %\d+\(silu\): reads cache 'kc' before kv_append %\d+\(kv_append\) updates it in place"),
    (lambda g, kc, new: (me.kv_append(kc, new, me.sym("pos")), me.kv_append(kc, new, me.sym("pos"))),
     r"kv_append %3\(kv_append\): updates cache 'kc' that kv_append %2\(kv_append\) updates too; chain the updates"),
    # five dims that no strides merge into four (the elementwise body's limit)
    (lambda g, kc, new: (me.silu(me.permute(g.input("x", [2, 3, 2, 4, 5], me.f32), [4, 2, 0, 3, 1])),),
     r"silu %\d+\(silu\): an elementwise op takes at most 4 dims .* \[5, 2, 2, 4, 3\] keeps more"),
    # moe_glu_down addresses a graph weight's experts: expert weights given as an input have no block op
    (lambda g, kc, new: (me.moe_mlp(g.input("x", [1, 16], me.f32), g.input("r", [1, 4], me.f32),
                                    g.input("wg", [4, 8, 16], me.f32), g.weight("wu", [4, 8, 16], me.f32),
                                    g.weight("wd", [4, 16, 8], me.f32), top_k=2, normalize=True),),
     r"moe_mlp %\d+\(moe_mlp\): no block op of the megakernel takes it with these operands \(.*'wg' f32\[4, 8, 16\].*\); "
     r"it needs one x row, expert weights that are graph weights"),
])
def test_unsupported_graphs_are_refused_at_compile_time(build, pattern):
    g = me.Graph()
    outs = build(g, g.input("kc", [2, 8, 16], me.f32), g.input("new", [2, 16], me.f32))
    for i, t in enumerate(outs):
        g.output(f"y{i}", t)
    with pytest.raises(me.GraphError, match=pattern):
        me.compile(g, {n: torch.randn([d.value for d in w.shape]) for n, w in g.weights.items()}, backend="sim",
                   max_dims={s: 7 for s in g.symbols()})


def test_slice_at_runtime_bounds_is_checked_each_call():
    """A slice whose bounds are runtime dims is checked on the host like an attention length:
    past its dim, the kernel would read outside the buffer."""
    g = me.Graph("window")
    g.output("y", me.silu(me.slice(g.input("a", [4, 32], me.f32), 1, S, S + 4)))
    k = me.compile(g, backend="sim", max_dims={"S": 40})
    a = torch.randn(4, 32)
    compare(k, g, {"a": a}, {}, {"S": 28}, 1e-6)
    with pytest.raises(me.GraphError, match=r"slice %1\(slice\): stop 33 outside \[29, 32\] \(S \+ 4 with S=29\)"):
        k(a=a, S=29)


def test_argmax_of_an_empty_row_is_refused_each_call():
    """argmax over a runtime dim that is 0 has no answer (the reference refuses it): the host checks it."""
    g = me.Graph("empty_rows")
    a = g.input("a", [2, S], me.f32)
    g.output("y", me.argmax(a))
    k = me.compile(g, backend="sim", max_dims={"S": 8})
    compare(k, g, {"a": torch.randn(2, 1)}, {}, {"S": 1}, 0)
    with pytest.raises(me.GraphError, match=r"argmax %1\(argmax\): the length of the reduced dim 0 outside \[1, 1\] \(S with S=0\)"):
        k(a=torch.randn(2, 0), S=0)


def test_a_split_over_k_is_read_once_every_split_has_arrived():
    """``matvec_split``: a batch's projection split over K, the last split to arrive sums the partials and
    adds the residual; its reader waits for every split of the weight tiles it reads. Up to 16 x rows a
    tile runs as two unsplit halves; past one row tile of x rows (64) the split program is not the cheaper
    one (one split there: its partials hold one tile), so the kernel takes its other regime. One split
    short, a reader fails."""
    g = me.Graph("split")
    n = me.sym("n")
    x = g.input("x", [n, 1024], me.bf16)
    r = g.input("r", [n, 256], me.bf16)
    y = r + me.linear(x, g.weight("wo", [256, 1024], me.bf16))
    g.output("z", me.linear(y, g.weight("w2", [64, 256], me.bf16)))
    torch.manual_seed(11)
    weights = {"wo": torch.randn(256, 1024).to(torch.bfloat16) * 0.05, "w2": torch.randn(64, 256).to(torch.bfloat16) * 0.1}
    k = me.compile(g, weights, backend="sim", max_dims={"n": 100}, dims_hint={"n": 32})
    split = k.queue.entries[0]
    assert split.op.kind == "matvec_split" and split.op.params["roles"] == ("x", "w", "r"), split.op
    s = split.op.params["splits"]
    tiles = 256 // split.op.params["rows"]
    for rows in (9, 40, 64, 100):
        args = {"x": torch.randn(rows, 1024).to(torch.bfloat16), "r": torch.randn(rows, 256).to(torch.bfloat16)}
        compare(k, g, args, k.weights, {"n": rows}, 1e-2, INTERLEAVINGS)
        env = k.queue.program.with_derived({"n": rows})
        assert split.op.launch_count.eval(env) == tiles * (2 if rows <= 16 else s if rows <= 64 else 0)
    reader = k.queue.entries[1]
    dims = {"n": 40}
    args = {"x": torch.randn(40, 1024).to(torch.bfloat16), "r": torch.randn(40, 256).to(torch.bfloat16)}
    early = tuple(dataclasses.replace(w, expected=w.expected - 1) for w in reader.waits)
    k.queue = dataclasses.replace(k.queue, entries=(split, dataclasses.replace(reader, waits=early)))
    with pytest.raises(SimulationError, match="read unwritten elements"):
        for seed in range(10):
            k.simulate(Interleaving(sms=8, seed=seed, adversarial=True), **args, **dims)


def test_rope_frequencies_seen_with_a_stride_are_copied_for_the_bodies():
    """The CUDA bodies that rotate read the frequencies through a bare pointer: a recovered RoPE whose
    frequencies are every other element of a constant (a view with stride 2) gets them copied adjacent
    (a review found the stride-2 view passed as is), and the result is the reference's."""
    from megaegg import ops as O
    from megaegg.ir.layout import layout_of

    D, K = 16, 8
    g = me.Graph("rope_strided_inv")
    x = g.input("x", [1, 2, D], me.bf16)
    p = g.input("p", [1, 1], me.i32)
    base = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    inv = O.reshape(O.slice(g.constant("inv2", torch.stack([base, torch.zeros(K)], 1)), 1, 0, 1), [K])
    a = O.concat([O.mul(O.cast(p, me.f32), inv)] * 2, -1)
    c, s = (O.reshape(O.cast(f(a), me.bf16), [1, 1, D]) for f in (O.cos, O.sin))
    rot = O.concat([O.neg(O.slice(x, 2, D // 2, D)), O.slice(x, 2, 0, D // 2)], -1)
    g.output("y", O.add(O.mul(x, c), O.mul(rot, s)))
    k = me.compile(g, {}, backend="sim")
    prog = k.queue.program
    (rope,) = [op for op in prog.ops if op.kind == "rope"]
    o = rope.inputs[rope.params["roles"].index("inv_freq")]
    assert str(layout_of(prog.buffers[o.buffer].shape, o.views)) == "(8):(1)+0"
    torch.manual_seed(4)
    ins = {"x": torch.randn(1, 2, D).to(torch.bfloat16), "p": torch.tensor([[29]], dtype=torch.int32)}
    assert torch.equal(k(**ins)["y"], me.run_reference(g, ins, {}, {})["y"])
