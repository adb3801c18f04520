"""GPU end to end: the megakernel against the reference executor (run on the GPU machine)."""

import sys
from pathlib import Path

import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_reference import WEIGHTS, build_layer  # noqa: E402

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(me.f32, 1e-4), (me.bf16, 2e-2)])
def test_layer_20_positions_one_compile(dtype, tol):
    torch.manual_seed(3)
    g = build_layer(dtype)
    W = {n: (torch.randn(s) * 0.3).to(dtype.torch).cuda() for n, s in WEIGHTS.items()}
    k = me.compile(g, W, backend="cuda", max_dims={"pos": 31})
    kc, vc = (torch.randn(2, 32, 16, device="cuda").to(dtype.torch) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    for pos in range(20):
        x = torch.randn(1, 64, device="cuda").to(dtype.torch)
        out = k(x=x, k_cache=kc, v_cache=vc, pos=pos)["y"]
        ref = me.run_reference(g, {"x": x, "k_cache": kc2, "v_cache": vc2}, W, {"pos": pos})["y"]
        assert rel(out, ref) < tol, f"pos {pos}"
        assert rel(kc, kc2) < tol and rel(vc, vc2) < tol
    assert k.launches == 20  # one launch per call


@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b", "qwen3-moe-tiny", "qwen3-30b-a3b"])
def test_model_matches_reference(preset):
    cfg = ModelConfig.preset(preset)
    if preset != "tiny":
        import dataclasses

        cfg = dataclasses.replace(cfg, layers=2)
    g, spec = build_decode_graph(cfg, max_len=64)
    W = random_weights(spec, seed=1, device="cuda")
    k = me.compile(g, W, backend="cuda", max_dims={"pos": 63})
    caches, ref_caches = spec.new_caches("cuda"), spec.new_caches("cuda")
    for pos, tok in enumerate([5, 17, 99, 3, 42, 7, 8, 9]):
        t = torch.tensor([tok], dtype=torch.int32, device="cuda")
        out = k(token=t, pos=pos, **caches)
        ref = me.run_reference(g, {"token": t, **ref_caches}, W, {"pos": pos})
        assert rel(out["logits"], ref["logits"]) < 2e-2, f"pos {pos}"
        top2 = ref["logits"].float().topk(2).values[0]
        if (top2[0] - top2[1]) > 2e-2 * top2[0].abs():
            assert out["next_token"].item() == ref["next_token"].item()


def test_out_of_range_token_raises():
    g, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=16)
    k = me.compile(g, random_weights(spec, device="cuda"), backend="cuda", max_dims={"pos": 15})
    with pytest.raises(RuntimeError, match="index out of range"):
        k(token=torch.tensor([10**6], dtype=torch.int32, device="cuda"), pos=0, **spec.new_caches("cuda"))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_simulator import case_data, random_graph  # noqa: E402


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graph(), st.integers(0, 2**16))
def test_random_graphs_on_gpu(case, seed):
    g = case[0]
    dims, inputs, weights = case_data(case, seed, "cuda")
    k = me.compile(g, weights, backend="cuda", max_dims={s: 64 for s in g.symbols()})
    out = k(**inputs, **dims)
    ref = me.run_reference(g, inputs, weights, dims)
    for name, r in ref.items():
        assert rel(out[name], r) < 1e-4, name


def test_barrier_timeout_raises_instead_of_hanging(monkeypatch):
    """A wait whose count can never be reached: the kernel gives up and the host names the op."""
    import dataclasses

    from megaegg.compiler import Kernel, build_artifact
    from megaegg.interpreter.nvrtc import compile_cubin
    from megaegg.interpreter.render import defines, render

    g = build_layer(me.f32)
    art = build_artifact(g, max_dims={"pos": 31}, compile_cuda=False)
    q = art.queue
    e = q.entries[-1]
    bad = tuple(dataclasses.replace(w, expected=w.expected + 1) for w in e.waits)
    q = dataclasses.replace(q, entries=q.entries[:-1] + (dataclasses.replace(e, waits=bad),))
    rendered = render(q)
    defs = {**art.defines, **defines(), "MEGA_TIMEOUT_NS": 200_000_000}  # (one image: the layer has no row regime)
    art = dataclasses.replace(art, queue=q, source=rendered.source, table=rendered.table.words(), defines=defs,
                              cubins=[compile_cubin(rendered.source, defines=defs).cubin])
    W = {n: torch.randn(s, device="cuda") for n, s in WEIGHTS.items()}
    k = Kernel(art, W, backend="cuda")
    kc, vc = torch.randn(2, 32, 16, device="cuda"), torch.randn(2, 32, 16, device="cuda")
    with pytest.raises(RuntimeError, match=rf"barrier wait timed out in op{e.op.id} {e.op.kind}"):
        k(x=torch.randn(1, 64, device="cuda"), k_cache=kc, v_cache=vc, pos=2)
    # the runtime recovers: counters reset, a good kernel on the same device still runs
    good = me.compile(g, W, backend="cuda", max_dims={"pos": 31})
    assert torch.isfinite(good(x=torch.randn(1, 64, device="cuda"), k_cache=kc, v_cache=vc, pos=3)["y"]).all()


def test_token_only_model_on_gpu():
    """Final norm + LM head + argmax partials fused (matvec_argmax) on the GPU."""
    import dataclasses

    cfg = dataclasses.replace(ModelConfig.preset("qwen3-0.6b"), layers=2)
    g, spec = build_decode_graph(cfg, max_len=32, logits=False)
    W = random_weights(spec, seed=2, device="cuda")
    k = me.compile(g, W, backend="cuda", max_dims={"pos": 31})
    assert "matvec_argmax" in [e.op.kind for e in k.queue.entries]
    g_ref, _ = build_decode_graph(cfg, max_len=32)
    caches, ref_caches = spec.new_caches("cuda"), spec.new_caches("cuda")
    for pos, tok in enumerate([3, 99, 1234, 7, 50000]):
        t = torch.tensor([tok], dtype=torch.int32, device="cuda")
        got = k(token=t, pos=pos, **caches)["next_token"].item()
        ref = me.run_reference(g_ref, {"token": t, **ref_caches}, W, {"pos": pos})
        top2 = ref["logits"].float().topk(2).values[0]
        if (top2[0] - top2[1]) > 2e-2 * top2[0].abs():
            assert got == ref["next_token"].item(), f"pos {pos}"
