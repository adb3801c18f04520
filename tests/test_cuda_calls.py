"""Generated CUDA calls fill the body's parameters in its own order: each argument's label
(``blockops.base.c_call``) is checked against the parameter names parsed from the ``.cuh``."""

import re

import pytest

from megaegg.compiler import build_artifact
from megaegg.interpreter.nvrtc import CUDA_DIR
from megaegg.models import ModelConfig, build_decode_graph


def signature(fn: str, cuh: str) -> list[str]:
    text = (CUDA_DIR / cuh).read_text()
    m = re.search(rf"__device__[^;{{]*?\b{fn}\((.*?)\)\s*{{", text, re.S)
    assert m, f"no definition of {fn} in {cuh}"
    params = re.sub(r"//[^\n]*", "", m.group(1)).split(",")
    return [re.findall(r"\w+", p)[-1] for p in params]


BODIES = (("matvec", "matvec.cuh"), ("glu_down", "glu_down.cuh"), ("moe_glu_down", "moe.cuh"),
          ("attn_partial_merge", "attention.cuh"))
ATTN = "attn_partial_merge"


@pytest.mark.parametrize("preset,bodies", [("tiny", {"matvec", "glu_down", ATTN}), ("qwen3-0.6b", {"matvec", "glu_down", ATTN}),
                                           ("qwen3-moe-tiny", {"matvec", "glu_down", "moe_glu_down", ATTN})])
def test_labelled_calls_match_the_body_signatures(preset, bodies):
    graph, _ = build_decode_graph(ModelConfig.preset(preset), max_len=256, logits=False)
    source = build_artifact(graph, max_dims={"pos": 255}, compile_cuda=False).source
    checked = set()
    for fn, cuh in BODIES:
        for call in re.findall(rf"\b{fn}<[^>]*>\((/\*.*?)\);\n", source):
            labels = re.findall(r"/\*(\w+)\*/", call)
            assert labels == signature(fn, cuh), fn
            checked.add(fn)
    assert checked == bodies


def test_next_entry_prefetch_stays_in_the_table():
    """The kernel prefetches words [0, 16) of the next entry's constants (megakernel.cu); an entry
    with few or no constants of its own, last in the table, must still leave them inside it."""
    import megaegg as me
    from megaegg.interpreter.render import render

    g = me.Graph("ew")
    x = g.input("x", [2, 30], me.f32)
    x = x + g.input("b", [30], me.f32)
    x = me.silu(x)
    g.output("y", me.silu(x) * x)
    graphs = [g, build_decode_graph(ModelConfig.preset("tiny"), max_len=64, logits=False)[0]]
    for graph in graphs:
        queue = build_artifact(graph, max_dims={s: 63 for s in graph.symbols()}, compile_cuda=False).queue
        table = render(queue).table
        words = table.words()
        assert words[table.consts_at:][:len(table.consts)] == list(table.consts), graph.name  # (MEGA_CONSTS_AT)
        assert max(table.consts_at + off + 15 for off in table.offset) < len(words), graph.name
