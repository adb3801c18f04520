"""Compiled artifacts: saved and loaded without recompiling; the generated CUDA compiles (no GPU needed)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from test_reference import WEIGHTS, build_layer

import megaegg as me
from megaegg.artifact import Artifact, ArtifactError, artifact_key
from megaegg.compiler import Kernel, build_artifact
from megaegg.interpreter.render import render
from megaegg.models import ModelConfig, build_decode_graph


def _no_rewrite(monkeypatch):
    """Make any rewrite or barrier derivation fail the test (the compiler calls them through their modules)."""
    import megaegg.lowering.queue as queue
    import megaegg.rewrite.schedule as schedule

    monkeypatch.setattr(schedule, "rewrite", lambda *a, **k: pytest.fail("rewrote the graph"))
    monkeypatch.setattr(queue, "derive_barriers", lambda *a, **k: pytest.fail("derived barriers again"))


def test_the_no_rewrite_guard_trips_on_a_compile(monkeypatch):
    """The guard below is live: a real compile goes through what it patches."""
    _no_rewrite(monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="rewrote the graph"):
        build_artifact(build_layer(me.f32), max_dims={"pos": 31}, compile_cuda=False)


def test_save_load_runs_without_recompiling(tmp_path, monkeypatch):
    torch.manual_seed(11)
    g = build_layer(me.f32)
    W = {n: torch.randn(s) * 0.3 for n, s in WEIGHTS.items()}
    art = build_artifact(g, max_dims={"pos": 31}, compile_cuda=False)
    art.save(tmp_path / "layer.megaegg")
    _no_rewrite(monkeypatch)
    loaded = Artifact.load(tmp_path / "layer.megaegg")
    assert loaded.queue == art.queue and loaded.source == art.source and loaded.defines == art.defines
    assert all(e.op is op for e, op in zip(loaded.queue.entries, loaded.queue.program.ops))  # sharing survives
    assert render(loaded.queue).source == art.source and loaded.table == art.table
    kernel = Kernel(loaded, W, backend="sim")
    x, kc, vc = torch.randn(1, 64), torch.randn(2, 32, 16), torch.randn(2, 32, 16)
    ref = me.run_reference(g, {"x": x, "k_cache": kc.clone(), "v_cache": vc.clone()}, W, {"pos": 4})["y"]
    out = kernel(x=x, k_cache=kc, v_cache=vc, pos=4)["y"]
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_constants_round_trip(tmp_path):
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    graph, _ = build_decode_graph(cfg, max_len=32)
    art = build_artifact(graph, max_dims={"pos": 31}, compile_cuda=False)
    art.save(tmp_path / "a.megaegg")
    back = Artifact.load(tmp_path / "a.megaegg").constants
    assert back.keys() == art.constants.keys() and back
    assert all(torch.equal(back[k], art.constants[k]) for k in back)


def _write_zip(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _good_members(tmp_path):
    art = build_artifact(build_layer(me.f32), max_dims={"pos": 31}, compile_cuda=False)
    art.save(tmp_path / "good.megaegg")
    with zipfile.ZipFile(tmp_path / "good.megaegg") as z:
        return {n: z.read(n) for n in z.namelist()}


def test_load_rejects_foreign_and_corrupt_files(tmp_path):
    import pickle

    members = _good_members(tmp_path)
    meta = json.loads(members["artifact.json"])
    evil = json.loads(members["artifact.json"])
    evil["queue"]["table"].append(["system", {"command": "echo pwned"}])  # not a class it may build
    evil["queue"]["root"] = {"r": len(evil["queue"]["table"]) - 1}
    cases = {
        "pickle": pickle.dumps({"not": "an artifact"}),
        "empty": b"",
        "truncated": (tmp_path / "good.megaegg").read_bytes()[:200],
        "no_json": None,
        "bad_json": {**members, "artifact.json": b"{not json"},
        "other_format": {**members, "artifact.json": json.dumps({**meta, "format": "zzz"})},
        "other_code": {**members, "artifact.json": json.dumps({**meta, "code": "0" * 64})},
        "unknown_class": {**members, "artifact.json": json.dumps(evil)},
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.megaegg"
        if data is None:
            _write_zip(path, {k: v for k, v in members.items() if k != "artifact.json"})
        elif isinstance(data, dict):
            _write_zip(path, data)
        else:
            path.write_bytes(data)
        with pytest.raises(ArtifactError, match=str(path.name)):
            Artifact.load(path)
    with pytest.raises(ArtifactError, match="no such artifact"):
        Artifact.load(tmp_path / "absent.megaegg")


def test_compile_reuses_the_cache_in_a_new_process(tmp_path):
    """The second process loads the artifact: no rewrite, no barrier derivation (both patched to fail)."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import megaegg as me
        from test_reference import WEIGHTS, build_layer
        if sys.argv[1] == "warm":
            import megaegg.lowering.queue as queue, megaegg.rewrite.schedule as schedule
            schedule.rewrite = queue.derive_barriers = lambda *a, **k: sys.exit("recompiled")
        torch.manual_seed(3)
        W = {{n: torch.randn(s) * 0.3 for n, s in WEIGHTS.items()}}
        k = me.compile(build_layer(me.f32), W, backend="sim", max_dims={{"pos": 31}})
        x, kc, vc = torch.randn(1, 64), torch.randn(2, 32, 16), torch.randn(2, 32, 16)
        y = k(x=x, k_cache=kc, v_cache=vc, pos=5)["y"]
        print(json.dumps({{"timings": k.artifact.timings, "y": y.reshape(-1).tolist()}}))
    """)
    env = {**os.environ, "MEGAEGG_CACHE": str(tmp_path / "cache")}

    def run(mode):
        out = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run("cold"), run("warm")
    assert "rewrite" in cold["timings"] and set(warm["timings"]) == {"cache_load"}
    assert warm["y"] == cold["y"]
    assert len(list((tmp_path / "cache" / "artifacts").glob("*.megaegg"))) == 1


def test_cache_key_and_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path))
    W = {n: torch.randn(s) for n, s in WEIGHTS.items()}
    me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 31}, cache=False)
    assert not (tmp_path / "artifacts").exists()  # cache=False writes nothing
    first = me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 31})
    again = me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 31})  # a rebuilt, equal graph
    assert "rewrite" in first.artifact.timings and "cache_load" in again.artifact.timings
    other = me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 30})  # other options: other key
    assert "rewrite" in other.artifact.timings
    assert len(list((tmp_path / "artifacts").glob("*.megaegg"))) == 2
    opts = {"max_dims": {"pos": 31}}
    g1, g2 = build_layer(me.f32), build_layer(me.f32)
    assert artifact_key(g1, opts) == artifact_key(g2, opts)
    g3 = me.Graph("layer")  # a constant's value is part of the key
    g4 = me.Graph("layer")
    for g, v in ((g3, 1.0), (g4, 2.0)):
        g.output("y", me.add(g.input("x", [4], me.f32), g.constant("c", torch.full((4,), v))))
    assert artifact_key(g3, opts) != artifact_key(g4, opts)


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path))
    W = {n: torch.randn(s) for n, s in WEIGHTS.items()}
    me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 31})
    (entry,) = (tmp_path / "artifacts").glob("*.megaegg")
    entry.write_bytes(b"garbage")
    k = me.compile(build_layer(me.f32), W, backend="sim", max_dims={"pos": 31})
    assert "rewrite" in k.artifact.timings
    assert Artifact.load(entry).queue == k.queue  # and the entry is good again


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
        (dict(x=torch.randn(1, 64), pos=3.0), r"runtime dim 'pos' must be an int, got float 3.0"),
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


def test_compile_rejects_unknown_weights_and_dims():
    g = build_layer(me.f32)
    W = {n: torch.randn(s) for n, s in WEIGHTS.items()}
    with pytest.raises(me.GraphError, match=r"unknown weight\(s\): 'wqq'; the compiled graph reads: 'ln1', 'ln2', 'wd'"):
        me.compile(g, {**W, "wqq": torch.randn(3)}, backend="sim")
    with pytest.raises(me.GraphError, match=r"max_dims: unknown runtime dim\(s\) 'ps'; the graph's runtime dims are: 'pos'"):
        me.compile(g, W, backend="sim", max_dims={"ps": 31})
    with pytest.raises(me.GraphError, match=r"dims_hint: unknown runtime dim\(s\) 'S'"):
        me.compile(g, W, backend="sim", dims_hint={"S": 3})
    with pytest.raises(me.GraphError, match=r"max_dims\['pos'\] must be a non-negative int, got -4"):
        me.compile(g, W, backend="sim", max_dims={"pos": -4})
    with pytest.raises(me.GraphError, match=r"backend must be one of 'cuda', 'sim', got 'gpu'"):
        me.compile(g, W, backend="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_backend_without_a_gpu_is_one_clear_error():
    with pytest.raises(me.GraphError, match="backend 'cuda' needs a CUDA GPU and none is available"):
        me.compile(build_layer(me.f32), {n: torch.randn(s) for n, s in WEIGHTS.items()}, backend="cuda")


def test_attention_past_the_cache_is_refused_like_the_reference():
    """max_dims lets pos reach 40 but the caches hold 32 rows: the kernel refuses as run_reference does."""
    torch.manual_seed(5)
    g = build_layer(me.f32)
    W = {n: torch.randn(s) for n, s in WEIGHTS.items()}
    k = me.compile(g, W, backend="sim", max_dims={"pos": 40})
    args = dict(x=torch.randn(1, 64), k_cache=torch.randn(2, 32, 16), v_cache=torch.randn(2, 32, 16))
    with pytest.raises(me.GraphError, match=r"kv_append .*: position 35 outside"):
        me.run_reference(g, args, W, {"pos": 35})
    with pytest.raises(me.GraphError, match=r"kv_append .*: position 35 outside \[0, 31\]"):
        k(**args, pos=35)
    assert torch.isfinite(k(**args, pos=31)["y"]).all()  # the last row is fine
