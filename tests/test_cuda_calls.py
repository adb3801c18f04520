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
