"""Generated CUDA calls fill the body's parameters in its own order: every kind's call is built with
``blockops.base.c_call``, each argument labelled, and the labels are checked against the parameter
names parsed from the kind's ``.cuh`` (a kind whose call has an unlabelled argument fails)."""

import re

import pytest

from megaegg.blockops import REGISTRY
from megaegg.compiler import build_artifact
from megaegg.interpreter.nvrtc import CUDA_DIR
from megaegg.models import ModelConfig, build_decode_graph


def signatures(fn: str, cuh: str) -> list[list[str]]:
    """The parameter names of every definition of ``fn`` in ``cuh`` (overloads: elementwise)."""
    text = (CUDA_DIR / cuh).read_text()
    found = []
    for m in re.finditer(rf"__device__[^;{{]*?\b{fn}\((.*?)\)\s*{{", text, re.S):
        params = re.sub(r"//[^\n]*", "", m.group(1)).split(",")
        found.append([re.findall(r"\w+", p)[-1] for p in params])
    assert found, f"no definition of {fn} in {cuh}"
    return found


def top_level_args(text: str) -> list[str]:
    """A call's argument list split at its top-level commas (inside (), {} and <> they are kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, "{": 1, "<": 1, ")": -1, "}": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def check_call(kind: str, call: str) -> str:
    """``call`` (a kind's cuda_call) is ``fn<...>(/*name*/ value, ...)`` with every argument labelled, the labels
    those of ``fn``'s parameters in the kind's .cuh, in order; returns ``fn``."""
    m = re.fullmatch(r"(\w+)(?:<[^()]*>)?\((.*)\)", call.strip(), re.S)
    assert m, (kind, call)
    fn, args = m.groups()
    args = top_level_args(args)
    labels = [re.match(r"/\*(\w+)\*/", a) for a in args]
    assert all(labels), f"{kind}: an unlabelled argument in {call} (build the call with blockops.base.c_call)"
    assert [x.group(1) for x in labels] in signatures(fn, REGISTRY[kind].cuda_file), (kind, fn, call)
    return fn


def test_every_kinds_call_is_labelled_and_matches_its_body():
    """Every kind's cuda_call, on the body-compile test's cases (every kind but the peer ones), is labelled
    and its labels are its body's parameters; the peer kinds' calls come from a tensor-parallel kernel."""
    from test_cuda_bodies_compile import GROUPS, cases, kernel_source  # (the body-compile test's cases)
    from megaegg import dtypes as dt

    checked = set()
    for group in GROUPS:
        for _label, kind, inputs, output, params in cases(dt.bf16)[group]:
            src = kernel_source("k", kind, inputs, output, params)
            call = re.search(r"\n    (?:MegaWaits wl\{\}; wl.n = 0;\n    )?(\w+(?:<[^()]*>)?\(/\*.*?\));\n", src, re.S)
            assert call, (kind, src)
            check_call(kind, call.group(1))
            checked.add(kind)
    assert set(REGISTRY) - checked <= PEER_KINDS | {"gemm"}
    graph, _ = build_decode_graph(ModelConfig.preset("tiny"), max_len=32, tp=2)
    source = build_artifact(graph, max_dims={"pos": 31}, compile_cuda=False).source
    assert check_source(source) >= PEER_KINDS
    # gemm, a deferred kind, in the kernel of a prompt's MLP (tests/test_gemm.py)
    from test_gemm import mlp

    source = build_artifact(mlp(), max_dims={"n": 512}, dims_hint={"n": 512}, compile_cuda=False).source
    assert "gemm" in check_source(source)


PEER_KINDS = {"allreduce_send", "allreduce_sum", "allgather_copy"}


def check_source(source: str) -> set[str]:
    """Check every body call of a generated kernel (one a line, after its case's comment naming the kind);
    return the kinds met."""
    kinds, kind = set(), None
    for line in source.splitlines():
        head = re.match(r"\s*case \d+: \{  // (\w+):", line)
        if head:
            kind = head.group(1)
            continue
        if kind and re.match(r"\s*\w+(<[^()]*>)?\(/\*", line):
            check_call(kind, line.strip().removesuffix(";"))
            kinds.add(kind)
    return kinds


@pytest.mark.parametrize("preset,kinds", [
    ("tiny", {"embedding", "matvec", "glu_down", "attn_partial_merge", "rope", "kv_append", "acc_residual"}),
    ("qwen3-0.6b", {"embedding", "matvec", "glu_down", "attn_partial_merge", "rope", "kv_append"}),
    ("qwen3-moe-tiny", {"matvec", "glu_down", "moe_glu_down", "attn_partial_merge"})])
def test_labelled_calls_match_the_body_signatures(preset, kinds):
    graph, _ = build_decode_graph(ModelConfig.preset(preset), max_len=256, logits=False)
    source = build_artifact(graph, max_dims={"pos": 255}, compile_cuda=False).source
    assert check_source(source) >= kinds


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
        rendered = render(queue)
        table, words = rendered.table, rendered.table.words()
        # the kernel finds the constants at MEGA_CONSTS_AT, evaluated from the rendered source's own #defines
        # (a graph whose launch counts are all constants once read them 5 words early: every random graph
        # without runtime dims that shared a case faulted or timed out on the GPU)
        macros = dict(re.findall(r"#define (MEGA_\w+) ([^/\n]+)", rendered.source))
        expr = re.sub(r"MEGA_\w+", lambda m: f"({macros[m.group()]})", macros["MEGA_CONSTS_AT"])
        assert eval(expr) == table.consts_at, graph.name
        assert words[table.consts_at:][:len(table.consts)] == list(table.consts), graph.name
        assert max(table.consts_at + off + 15 for off in table.offset) < len(words), graph.name
