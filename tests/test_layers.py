"""Identical layers are rewritten once (rewrite/layers.py): the program equals a full rewrite."""

import dataclasses

import pytest
import torch

import megaegg as me
import megaegg.rewrite.schedule as schedule
from megaegg.compiler import build_artifact
from megaegg.models import ModelConfig, build_decode_graph
from megaegg.rewrite.layers import KEEP, find_repeats


def _config(preset: str, layers: int):
    return dataclasses.replace(ModelConfig.preset(preset), layers=layers)


@pytest.mark.parametrize("preset, layers", [("tiny", 8), ("qwen3-tiny", 9), ("llama-3.2-1b", 7)])
def test_repeats_are_the_layers(preset, layers):
    graph, _ = build_decode_graph(_config(preset, layers), max_len=64)
    rep = find_repeats(graph)
    assert rep is not None and rep.count == layers
    first = {n.name for n in graph.nodes[rep.start : rep.start + rep.period] if n.op == "weight"}
    assert first and all(name.startswith("model.layers.0.") for name in first)


@pytest.mark.parametrize("preset, layers", [("tiny", KEEP + 1), ("tiny", 11), ("qwen3-tiny", 10), ("llama-3.2-1b", 9)])
@pytest.mark.parametrize("logits", [False, True])
def test_program_equals_a_full_rewrite(preset, layers, logits, monkeypatch):
    graph, _ = build_decode_graph(_config(preset, layers), max_len=256, logits=logits)
    kw = dict(max_dims={"pos": 255}, dims_hint={"pos": 128}, compile_cuda=False)
    once = build_artifact(graph, **kw)
    monkeypatch.setattr(schedule, "find_repeats", lambda g: None)
    full = build_artifact(graph, **kw)
    assert str(once.queue.program) == str(full.queue.program)
    assert once.source == full.source


def test_few_layers_are_rewritten_whole():
    graph, _ = build_decode_graph(_config("tiny", KEEP), max_len=64)
    assert find_repeats(graph) is None


def test_layers_reading_their_own_constant_are_not_copied():
    """Each block adds a different constant made before the loop: a copied block would read the
    template's constant, so no repeat is used, and the kernel matches the reference."""
    g = me.Graph()
    x = g.input("x", [1, 32], me.f32)
    consts = [g.constant(f"c{i}", torch.full((1, 32), float(i + 1))) for i in range(KEEP + 3)]
    for i, c in enumerate(consts):
        x = me.silu(me.linear(x, g.weight(f"w{i}", [32, 32], me.f32))) + c
    g.output("y", x)
    rep = find_repeats(g)
    assert rep is None
    torch.manual_seed(7)
    W = {f"w{i}": torch.randn(32, 32) * 0.2 for i in range(len(consts))}
    x0 = torch.randn(1, 32)
    out = me.compile(g, W, backend="sim", cache=False)(x=x0)["y"]
    ref = me.run_reference(g, {"x": x0}, W)["y"]
    assert torch.allclose(out, ref, atol=1e-5)


def test_a_repeated_user_graph_runs_like_the_reference():
    """Blocks built in a loop, each with its own weights: rewritten once, simulated, exact."""
    g = me.Graph()
    h = g.input("x", [1, 64], me.f32)
    for i in range(KEEP + 4):
        n = me.rms_norm(h, g.weight(f"g{i}", [64], me.f32), 1e-5)
        h = h + me.linear(me.silu(me.linear(n, g.weight(f"a{i}", [96, 64], me.f32))), g.weight(f"b{i}", [64, 96], me.f32))
    g.output("y", h)
    rep = find_repeats(g)
    assert rep is not None and rep.count >= KEEP + 3  # (the last block ends in the output: not a copy)
    torch.manual_seed(8)
    W = {n.name: (torch.randn(*[d.value for d in n.shape]) * 0.1 + (1 if n.name[0] == "g" else 0)) for n in g.weights.values()}
    x0 = torch.randn(1, 64)
    out = me.compile(g, W, backend="sim", cache=False)(x=x0)["y"]
    ref = me.run_reference(g, {"x": x0}, W)["y"]
    assert torch.allclose(out, ref, atol=1e-4)


def _repeated(block, n: int = KEEP + 4):
    """``n`` blocks ``h = block(g, i, h, first)`` over a [1, 32] input (``first``: block 0's values),
    simulated against the reference."""
    g = me.Graph()
    h, first = g.input("x", [1, 32], me.f32), {}
    for i in range(n):
        h = block(g, i, h, first)
    torch.manual_seed(9)
    W = {n.name: torch.randn(*[d.value for d in n.shape]) * 0.2 for n in g.weights.values()}
    x0 = torch.randn(1, 32)
    out = me.compile(g, W, backend="sim", cache=False)(x=x0)
    ref = me.run_reference(g, {"x": x0}, W)
    for name, r in ref.items():
        assert torch.allclose(out[name], r, atol=1e-5), name
    return g


def test_an_output_in_every_block():
    """The reduced graph leaves the middle blocks' outputs out (the template's stands for them);
    they indexed nodes it does not have."""
    def block(g, i, h, first):
        h = me.silu(me.linear(h, g.weight(f"w{i}", [32, 32], me.f32)))
        g.output(f"o{i}", h)
        return h

    assert find_repeats(_repeated(block)) is not None


def test_blocks_reading_a_node_of_the_first_block_are_not_copied():
    """Every block's matvec reads block 0's silu: a copied choice would shift that read to another
    block's silu (a wrong result), so no repeat is used."""
    def block(g, i, h, first):
        t = first.setdefault("t", me.silu(h)) if i == 0 else me.silu(h)
        h = me.linear(first["t"], g.weight(f"w{i}", [32, 32], me.f32)) + t
        g.output(f"o{i}", h)
        return h

    assert find_repeats(_repeated(block)) is None
