"""A matvec of one x row too tall for MATVEC_ROWS to fill the SMs (an LM head) also gets the tile heights that
run it in one or two waves (rewrite/rules.py: wave_tiles), for the cost model's SM count."""

import pytest
import torch

import megaegg as me
from megaegg.interpreter import Interleaving
from megaegg.rewrite.cost import CostModel
from megaegg.rewrite.encode import encode
from megaegg.rewrite.extract import alternatives, computing_nodes
from megaegg.rewrite.rules import MATVEC_ROWS, lowering, wave_tiles

INTERLEAVINGS = (Interleaving(sms=4, seed=1), Interleaving(sms=3, seed=2, adversarial=True))


def matvec_heights(x_shape, w_shape, sms: int, dtype=me.bf16) -> set[int]:
    """The tile heights of the matvec alternatives the lowering rules give ``x @ w^T``."""
    g = me.Graph()
    g.output("y", me.linear(g.input("x", x_shape, dtype), g.weight("w", w_shape, dtype)))
    live = g.live_nodes()
    egraph = encode(g, live)
    egraph.run(lowering.saturate())
    egraph.run(wave_tiles(sms))
    (alts,) = alternatives(egraph, g, computing_nodes(g, live)).values()
    return {c.named["rows"] for c in alts if c.term == "matvec"}


def test_an_lm_head_gets_the_heights_of_one_and_two_waves():
    """llama-3.2-1b's LM head on 132 SMs: ceil(128256 / 132) = 972 rows, rounded up to whole row groups of 8."""
    assert matvec_heights([1, 2048], [128256, 2048], 132) == set(MATVEC_ROWS) | {976, 488}
    assert matvec_heights([1, 1, 2048], [151936, 2048], 132) == set(MATVEC_ROWS) | {1152, 576}  # (a traced [1, 1, K])


@pytest.mark.parametrize("x_shape, w_shape", [
    ([1, 2048], [8192, 2048]),  # a layer's projection: MATVEC_ROWS fill the SMs
    ([1, 2048], [128 * 132, 2048]),  # (the tallest MATVEC_ROWS tile fills one wave exactly)
    ([4, 2048], [128256, 2048]),  # several x rows (a batch's bodies are instantiated per height)
    ([me.sym("n"), 2048], [128256, 2048]),
])
def test_other_matvecs_keep_the_fixed_heights(x_shape, w_shape):
    assert matvec_heights(x_shape, w_shape, 132) == set(MATVEC_ROWS)


def compile_head(rows: int, *, tokens: bool, sms: int = 4):
    """``x[1, 64] @ w[rows, 64]^T`` (its argmax only, with ``tokens``) on the simulator, costed for ``sms`` SMs."""
    g = me.Graph()
    y = me.linear(g.input("x", [1, 64], me.f32), g.weight("w", [rows, 64], me.f32))
    g.output("t" if tokens else "y", me.argmax(y, 1) if tokens else y)
    w = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    return g, me.compile(g, {"w": w}, backend="sim", cost_model=CostModel(sms=sms), cache=False), w


def test_one_wave_of_a_tall_matvec_on_the_simulator():
    """1000 rows on 4 SMs: 4 tiles of 256 rows, as torch computes them."""
    g, kernel, w = compile_head(1000, tokens=False)
    assert [(e.op.kind, e.op.params["rows"], str(e.launch)) for e in kernel.queue.entries] == [("matvec", 256, "4")]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    for sch in INTERLEAVINGS:
        torch.testing.assert_close(kernel.simulate(sch, x=x)["y"], x @ w.T)


@pytest.mark.parametrize("rows, head", [(1000, ("matvec_argmax", 256, "4")), (5000, ("matvec_argmax", 632, "8"))])
def test_a_tall_lm_head_with_its_argmax(rows, head):
    """The LM head fused with its argmax partials takes one wave's tiles where their rows fit the epilogue tile
    (f32: 1024 rows); for 5000 rows one wave's would be 1256, and two waves' 632 rows a tile are chosen."""
    g, kernel, w = compile_head(rows, tokens=True)
    assert [(e.op.kind, e.op.params.get("rows"), str(e.launch)) for e in kernel.queue.entries][0] == head
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    for sch in INTERLEAVINGS:
        assert torch.equal(kernel.simulate(sch, x=x)["t"], torch.argmax(x @ w.T, 1).int())
