"""The weight page ring's rendering (interpreter/render.py, cuda/pages.cuh), without a GPU: which
entries page their weights, the loader's streams in the order the bodies read them, the table's
flags, and that the ring off leaves no trace of it. tests/gpu/test_pages_gpu.py runs it."""

import re

import pytest

from megaegg.blockops import REGISTRY
from megaegg.compiler import build_artifact
from megaegg.interpreter.render import defines, launch_shape, paged_streams, render
from megaegg.models import ModelConfig, build_decode_graph

PAGED = {**defines(), "MEGA_SMEM": 57344, "MEGA_PAGES": 10, "MEGA_PAGE_BYTES": 16384}
OFF = {**defines(), "MEGA_PAGES": 0}


@pytest.fixture(scope="module", params=["tiny", "qwen3-tiny"])
def queue(request):
    graph, _ = build_decode_graph(ModelConfig.preset(request.param), max_len=64)
    return build_artifact(graph, max_dims={"pos": 63}, compile_cuda=False).queue


def case_text(source: str, variant: int, loader: bool) -> str | None:
    """The text of ``case variant`` in the body switch (or the loader's switch)."""
    body, _, loader_switch = source.partition("the loader warp: one thread claims and streams")
    loader_switch, _, consumer = loader_switch.partition("for (unsigned n = 0;; ++n) {\n#if MEGA_PAGES")
    text = loader_switch if loader else consumer
    m = re.search(rf"      case {variant}: \{{.*?\n      \}} break;", text, re.S)
    return m.group() if m else None


def test_every_weight_streaming_op_is_paged_and_its_loader_streams_what_the_body_reads(queue):
    r = render(queue, PAGED)
    kinds_paged = set()
    for k, e in enumerate(queue.entries):
        streams = paged_streams(queue, e.op, PAGED)
        offered = REGISTRY[e.op.kind].paged_inputs(e.op)
        assert r.table.paged[k] == int(streams is not None)
        loader = case_text(r.source, r.table.variant[k], loader=True)
        body = case_text(r.source, r.table.variant[k], loader=False)
        assert body is not None
        if streams is None:
            assert loader is None and not offered, f"op{e.op.id} {e.op.kind} offers pages but is not paged"
            continue
        kinds_paged.add(e.op.kind)
        assert [s.input for s in streams] == list(offered)  # the loader fills them in the body's order
        assert loader.count("mega_load_rows(") == len(streams)
        assert re.search(r", true>\(", body), f"op{e.op.id}: the body is not told its weights are paged"
        assert "mega_prefetch_l2" not in body  # (the loader streams them instead)
    assert {"matvec", "glu_down"} <= kinds_paged


def test_ring_off_renders_no_loader_and_no_paged_body(queue):
    r = render(queue, OFF)
    assert not any(r.table.paged)
    assert "mega_load_rows(" not in r.source
    for k, e in enumerate(queue.entries):
        if REGISTRY[e.op.kind].paged_inputs(e.op):  # the PAGED template argument, last, is false
            assert re.search(r", false>\(", case_text(r.source, r.table.variant[k], loader=False))
    assert launch_shape(OFF) == (OFF["MEGA_THREADS"], OFF["MEGA_SMEM"])
    assert launch_shape(PAGED) == (PAGED["MEGA_THREADS"] + 32, 57344 + 10 * 16384)


def test_rows_that_do_not_fit_a_page_are_not_paged(queue):
    small = {**PAGED, "MEGA_PAGE_BYTES": 256}  # smaller than any weight row here
    assert all(paged_streams(queue, e.op, small) is None for e in queue.entries)


def test_the_paged_kernel_compiles(queue):
    nvrtc = pytest.importorskip("megaegg.interpreter.nvrtc")
    try:
        out = nvrtc.compile_cubin(render(queue, PAGED).source, defines=PAGED)
    except (ImportError, OSError, RuntimeError) as exc:  # no NVRTC library on this machine
        if "NVRTC could not compile" in str(exc):
            raise
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert out.cubin
