"""A user's mistakes through the Python API: each raises a GraphError subclass whose message names
the tensor, file, argument or dim and what was expected (the CLI prints the same message)."""

from __future__ import annotations

import pytest
import torch

import megaegg as me
from megaegg import GraphError, ShapeError


# --- graph building: static dims must be >= 1 --------------------------------------------------
@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda g: g.input("x", [0, 4], me.f32), r"input 'x': dim 0 of shape \[0, 4\] is 0; static dims must be >= 1"),
        (lambda g: g.input("x", [me.sym("S"), -3], me.f32), r"input 'x': dim 1 of shape \[S, -3\] is -3"),
        (lambda g: g.weight("w", [8, 0], me.bf16), r"weight 'w': dim 1 of shape \[8, 0\] is 0"),
        (lambda g: g.weight("w", [-8, 4], me.bf16), r"weight 'w': dim 0 of shape \[-8, 4\] is -8"),
        (lambda g: g.constant("c", torch.zeros(0, 3)), r"constant 'c': dim 0 of shape \[0, 3\] is 0"),
        (lambda g: me.reshape(g.input("x", [4, 6], me.f32), [-2, -12]), r"reshape of 'x' f32\[4, 6\]: dim 0 .* is -2"),
        (lambda g: me.reshape(g.input("x", [4, 6], me.f32), [0, -1]), r"reshape of 'x' f32\[4, 6\]: dim 0 .* is 0"),
        (lambda g: me.expand(g.input("x", [1, 6], me.f32), [0, 6]), r"expand of 'x' f32\[1, 6\]: dim 0 .* is 0"),
    ],
)
def test_zero_or_negative_static_dims_fail_at_build_time(build, pattern):
    with pytest.raises(ShapeError, match=pattern):
        build(me.Graph())


def test_reshape_hole_and_symbolic_dims_still_build():
    g = me.Graph()
    S = me.sym("S")
    x = g.input("x", [S, 4, 6], me.f32)
    assert me.reshape(x, [S, -1]).shape == (S, me.Dim("const", (24,)))
    assert me.expand(g.input("y", [1, 6], me.f32), [S, 6]).shape[0] == S


# --- runtime dims ------------------------------------------------------------------------------
def _pos_graph():
    g = me.Graph()
    kc = g.input("kc", [2, 8, 4], me.f32)
    g.output("k", me.kv_append(kc, g.input("n", [2, 4], me.f32), me.sym("pos")))
    return g, {"kc": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(5)), "n": torch.randn(2, 4)}


@pytest.mark.parametrize("pos, pattern", [(3.0, "runtime dim 'pos' must be an int, got float 3.0"),
                                          ("3", "runtime dim 'pos' must be an int, got str '3'"),
                                          (True, "runtime dim 'pos' must be an int, got bool True"),
                                          (-1, "runtime dim 'pos' must be a non-negative int, got -1")])
def test_reference_runtime_dim_must_be_an_int(pos, pattern):
    g, inputs = _pos_graph()
    with pytest.raises(GraphError, match=pattern):
        me.run_reference(g, inputs, {}, {"pos": pos})
