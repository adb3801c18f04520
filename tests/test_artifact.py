"""Compiled artifacts: saved and loaded without recompiling; the generated CUDA compiles (no GPU needed)."""

import pytest
import torch
from test_reference import WEIGHTS, build_layer

import megaegg as me
from megaegg.compiler import Artifact, Kernel, build_artifact
from megaegg.models import ModelConfig, build_decode_graph


def test_save_load_runs_without_recompiling(tmp_path, monkeypatch):
    g = build_layer(me.f32)
    W = {n: torch.randn(s) * 0.3 for n, s in WEIGHTS.items()}
    art = build_artifact(g, max_dims={"pos": 31}, compile_cuda=False)
    art.save(tmp_path / "layer.megaegg")
    import megaegg.rewrite.schedule as schedule

    monkeypatch.setattr(schedule, "rewrite", lambda *a, **k: pytest.fail("recompiled"))
    kernel = Kernel(Artifact.load(tmp_path / "layer.megaegg"), W, backend="sim")
    x, kc, vc = torch.randn(1, 64), torch.randn(2, 32, 16), torch.randn(2, 32, 16)
    ref = me.run_reference(g, {"x": x, "k_cache": kc.clone(), "v_cache": vc.clone()}, W, {"pos": 4})["y"]
    out = kernel(x=x, k_cache=kc, v_cache=vc, pos=4)["y"]
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_load_rejects_other_files(tmp_path):
    import pickle

    (tmp_path / "x").write_bytes(pickle.dumps({"not": "an artifact"}))
    with pytest.raises(TypeError, match="megaegg artifact"):
        Artifact.load(tmp_path / "x")


def _nvrtc_or_skip():
    try:
        from megaegg.interpreter.nvrtc import nvrtc_version

        nvrtc_version()
    except Exception as e:  # no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {e}")


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])
def test_generated_cuda_compiles(preset, tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path))  # a cold compile, not a cache hit
    graph, _ = build_decode_graph(ModelConfig.preset(preset), max_len=1024)
    art = build_artifact(graph, max_dims={"pos": 1023}, dims_hint={"pos": 512})
    assert art.cubin and not art.timings["nvrtc_cached"]
    warm = build_artifact(graph, max_dims={"pos": 1023}, dims_hint={"pos": 512})
    assert warm.cubin == art.cubin and warm.timings["nvrtc_cached"]


def _layer_kernel():
    g = build_layer(me.f32)
    return me.compile(g, {n: torch.randn(s) for n, s in WEIGHTS.items()}, backend="sim", max_dims={"pos": 31})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(x=torch.randn(1, 63)), r"input 'x': expected f32\[1, 64\], got torch.float32\[1, 63\]"),
        (dict(x=torch.randn(1, 64).double()), r"input 'x': expected f32\[1, 64\], got torch.float64"),
        (dict(x=torch.randn(1, 64), pos=32), r"runtime dim 'pos' = 32 outside \[0, 31\]"),
        (dict(x=torch.randn(1, 64), pos=-1), r"runtime dim 'pos' = -1 outside"),
        (dict(x=torch.randn(1, 64), bogus=1), r"unknown argument\(s\) \['bogus'\]"),
        (dict(pos=3), r"missing input 'x'"),
        (dict(x=torch.randn(1, 64)), r"missing value for runtime dim 'pos'"),
    ],
)
def test_kernel_rejects_bad_calls(kwargs, pattern):
    k = _layer_kernel()
    kwargs = {"k_cache": torch.randn(2, 32, 16), "v_cache": torch.randn(2, 32, 16), "pos": 3, **kwargs}
    if "missing value" in pattern:
        kwargs.pop("pos")
    with pytest.raises(me.GraphError, match=pattern):
        k(**kwargs)


def test_compile_rejects_missing_or_misshaped_weights():
    g = build_layer(me.f32)
    W = {n: torch.randn(s) for n, s in WEIGHTS.items()}
    with pytest.raises(me.GraphError, match="missing weight.*wq"):
        me.compile(g, {n: t for n, t in W.items() if n != "wq"}, backend="sim")
    with pytest.raises(me.GraphError, match=r"weight 'wo': expected f32\[64, 64\]"):
        me.compile(g, {**W, "wo": torch.randn(64, 32)}, backend="sim")


def test_state_input_must_be_contiguous():
    k = _layer_kernel()
    with pytest.raises(me.GraphError, match="updated in place and must be contiguous"):
        k(x=torch.randn(1, 64), k_cache=torch.randn(2, 16, 32).transpose(1, 2), v_cache=torch.randn(2, 32, 16), pos=1)
