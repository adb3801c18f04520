"""GPU: routed experts over many rows (blockops/moe_rows.py: moe_route, moe_experts) in the step graph and
alone, against the reference executor on the CPU."""

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.interpreter import MegakernelError
from megaegg.models import ModelConfig, build_step_graph, random_weights

pytestmark = pytest.mark.gpu
N = me.sym("n")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-4), (me.bf16, 3e-2)], ids=["f32", "bf16"])
def test_the_moe_step_graph_on_the_gpu_gives_the_references_logits(dt, tol):
    """qwen3-moe-tiny (top-3 of 7 experts) with random weights, its step graph compiled for the GPU: a decode
    batch of four sequences, a 37-token prompt (each expert ~16 rows: one or two blocks, on tensor cores in bf16), and a mixed step of
    a prompt beside decoding rows; each against the reference executor (f32: the same greedy tokens)."""
    cfg = dataclasses.replace(ModelConfig.preset("qwen3-moe-tiny"), dtype=dt)
    graph, spec = build_step_graph(cfg, max_len=64, slots=4)
    w = random_weights(spec, seed=2, device="cuda")
    w = {n: t * 3 if ".mlp.gate." in n else t for n, t in w.items()}  # (router logits spread out: fewer near-ties)
    kernel = me.compile(graph, w, backend="cuda", max_dims={"n": 64, "r": 4, "ctx": 64})
    kinds = [e.op.kind for e in kernel.queue.entries]
    assert "moe_route" in kinds and "moe_experts" in kinds, kinds
    w_cpu = {n: t.cpu() for n, t in w.items()}
    gen = torch.Generator().manual_seed(9)
    caches = {n: (torch.randn(c.shape, generator=gen) * 0.5).to(dt.torch) for n, c in spec.new_caches().items()}
    steps = {
        "decode": ([5, 17, 40, 63], [0, 1, 2, 3], [0, 1, 2, 3]),
        "prompt": (list(range(37)), [0] * 37, [36]),
        "mixed": ([*range(10, 20), 50, 33, 7], [1] * 10 + [0, 2, 3], [9, 10, 11, 12]),
    }
    for name, (pos, slot, out) in steps.items():
        n = len(pos)
        ins = {"token": torch.randint(0, cfg.vocab, (n,), generator=gen, dtype=torch.int32),
               "pos": torch.tensor(pos, dtype=torch.int32), "slot": torch.tensor(slot, dtype=torch.int32),
               "out": torch.tensor(out, dtype=torch.int32)}
        dims = {"n": n, "r": len(out), "ctx": max(pos) + 1}
        ref = me.run_reference(graph, {**ins, **{k: c.clone() for k, c in caches.items()}}, w_cpu, dims)
        got = kernel(**{k: v.cuda() for k, v in ins.items()}, **{k: c.cuda() for k, c in caches.items()}, **dims)
        err = rel(got["logits"].cpu(), ref["logits"])
        print(f"{dt} {name}: {n} rows, logits rel err {err:.2e}")
        assert err < tol, (name, err)
        if dt == me.f32:
            assert got["next_token"].cpu().tolist() == ref["next_token"].tolist(), name


@pytest.mark.parametrize("rows", [1, 5, 40, 200])
def test_many_experts_over_many_rows(rows):
    """qwen3-30b-a3b's routing (top-8 of 128, renormalised) over 1 to 200 rows in bf16, an MLP width of 96 rows
    (tiles of 64: a ragged last one), the norm fused: few rows leave most expert instances without an expert,
    200 rows give each expert ~12 rows (three passes); the sum against the reference's. The router logits are
    an input: computed by the kernel, a last-bit difference from the reference's would flip near-tied experts."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    dt, e, f, k = me.bf16, 128, 96, 512
    g = me.Graph("moe_rows")
    x = g.input("x", [N, k], dt)
    h = me.rms_norm(x, g.weight("g", [k], dt), 1e-6)
    logits = g.input("logits", [N, e], dt)
    y = x + me.moe_mlp(h, logits, g.weight("wg", [e, f, k], dt), g.weight("wu", [e, f, k], dt),
                       g.weight("wd", [e, k, f], dt), top_k=8, normalize=True)
    g.output("y", y)
    w = {n: (torch.randn([d.value for d in t.shape], device="cuda", generator=gen) * (1.0 if n == "g" else 0.1)).to(dt.torch)
         for n, t in g.weights.items()}
    kern = me.compile(g, w, backend="cuda", max_dims={"n": 256})
    assert any(e.op.kind == "moe_experts" for e in kern.queue.entries)
    xs = torch.randn(rows, k, device="cuda", generator=gen).to(dt.torch)
    lg = (torch.randn(rows, e, device="cuda", generator=gen) * 2).to(dt.torch)
    out = kern(x=xs, logits=lg, n=rows)["y"]
    ref = me.run_reference(g, {"x": xs.cpu(), "logits": lg.cpu()}, {n: t.cpu() for n, t in w.items()}, {"n": rows})["y"]
    err = rel(out.cpu() - xs.cpu(), ref - xs.cpu())  # (the experts' part: the residual would hide it)
    print(f"{rows} rows: rel err {err:.2e}")
    assert err < 2e-2


def test_nan_router_logits_are_an_error_naming_the_row():
    g = me.Graph("moe_nan")
    x, lg = g.input("x", [N, 128], me.f32), g.input("logits", [N, 6], me.f32)
    g.output("y", me.moe_mlp(x, lg, g.weight("wg", [6, 32, 128], me.f32), g.weight("wu", [6, 32, 128], me.f32),
                             g.weight("wd", [6, 128, 32], me.f32), top_k=2, normalize=True))
    w = {n: torch.randn([d.value for d in t.shape], device="cuda") * 0.1 for n, t in g.weights.items()}
    kern = me.compile(g, w, backend="cuda", max_dims={"n": 16})
    logits = torch.randn(9, 6, device="cuda")
    logits[6, 2] = float("nan")
    with pytest.raises(MegakernelError, match="NaN logits in row 6 of .*moe_route"):
        kern(x=torch.randn(9, 128, device="cuda"), logits=logits, n=9)
