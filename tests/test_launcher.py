"""Kernel.launcher: a call checked once, launched again with some read-only inputs and runtime dims changed
(each change checked as a call checks it), on the simulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights


@pytest.fixture(scope="module")
def decode():
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    g, spec = build_decode_graph(cfg, max_len=16)
    weights = random_weights(spec, seed=4)
    return me.compile(g, weights, backend="sim", max_dims={"pos": 15}), spec


def test_a_launcher_with_a_new_token_and_position_gives_the_calls_outputs(decode):
    kernel, spec = decode
    torch.manual_seed(0)
    start = {n: torch.randn(c.shape) for n, c in spec.new_caches().items()}
    by_call, by_launcher = ({n: c.clone() for n, c in start.items()} for _ in range(2))
    launch = kernel.launcher(token=torch.tensor([3], dtype=torch.int32), pos=4, **by_launcher)
    for pos, tok in ((4, 3), (5, 9), (6, 1)):
        want = kernel(token=torch.tensor([tok], dtype=torch.int32), pos=pos, **by_call)
        launch(token=torch.tensor([tok], dtype=torch.int32), pos=pos)
        got = launch.outputs()
        assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["next_token"], want["next_token"])
    for n in start:
        assert torch.equal(by_call[n], by_launcher[n]), n
    assert launch.dims["pos"] == 6


def test_each_change_is_checked_and_a_refused_one_changes_nothing(decode):
    kernel, spec = decode
    caches = {n: torch.randn(c.shape) for n, c in spec.new_caches().items()}
    launch = kernel.launcher(token=torch.tensor([3], dtype=torch.int32), pos=4, **caches)
    bad = [({"pos": 16}, "runtime dim 'pos' = 16 outside [0, 15]"),
           ({"pos": 2.0}, "runtime dim 'pos' must be an int"),
           ({"token": torch.tensor([1, 2], dtype=torch.int32)}, "input 'token': expected i32[1]"),
           ({"tokens": torch.tensor([1], dtype=torch.int32)}, "unknown argument 'tokens'"),
           ({"k_cache.0": caches["k_cache.0"].clone()}, "input 'k_cache.0' is updated in place"),
           ({"pos": 5, "v_cache.1": caches["v_cache.1"].clone()}, "input 'v_cache.1' is updated in place"),
           ({"token": caches["k_cache.0"].view(torch.int32).reshape(-1)[:1]}, "shares memory with input 'k_cache.0'")]
    for change, message in bad:
        with pytest.raises(me.GraphError, match=message.replace("[", r"\[").replace("]", r"\]")):
            launch(**change)
        assert launch.dims["pos"] == 4


def test_where_an_inputs_shape_holds_a_dim_a_change_of_dims_checks_the_whole_call():
    """A graph whose input is [n, 8]: n changed with a tensor of the new shape launches as a call does; n changed
    alone leaves the input of the old shape, which the whole call's check refuses."""
    g = me.Graph()
    x = g.input("x", [me.sym("n"), 8], me.f32)
    g.output("y", me.silu(me.linear(x, g.weight("w", [4, 8], me.f32))))
    w = torch.randn(4, 8)
    kernel = me.compile(g, {"w": w}, backend="sim", max_dims={"n": 6})
    launch = kernel.launcher(x=torch.randn(2, 8), n=2)
    x5 = torch.randn(5, 8)
    launch(x=x5, n=5)
    assert torch.allclose(launch.outputs()["y"], torch.nn.functional.silu(x5 @ w.T), atol=1e-5)
    with pytest.raises(me.GraphError, match=r"input 'x': expected f32\[3, 8\]"):
        launch(n=3)


def test_a_change_is_checked_against_the_launchers_own_caches(decode):
    """Two launchers of one kernel on two slots' caches: a token aliasing the first launcher's cache is refused
    by it even after the second launcher was made (the kernel's last checked call)."""
    kernel, spec = decode
    first = {n: torch.randn(c.shape) for n, c in spec.new_caches().items()}
    second = {n: torch.randn(c.shape) for n, c in spec.new_caches().items()}
    token = torch.tensor([3], dtype=torch.int32)
    launch = kernel.launcher(token=token, pos=4, **first)
    kernel.launcher(token=token, pos=4, **second)
    with pytest.raises(me.GraphError, match="shares memory with input 'v_cache.1'"):
        launch(token=first["v_cache.1"].view(torch.int32).reshape(-1)[5:6])
