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
    body = json.loads(evil["body"])
    body["queue"]["table"].append(["system", {"command": "echo pwned"}])  # not a class it may build
    body["queue"]["root"] = {"r": len(body["queue"]["table"]) - 1}
    evil["body"] = json.dumps(body)
    cases = {
        "pickle": pickle.dumps({"not": "an artifact"}),
        "empty": b"",
        "truncated": (tmp_path / "good.megaegg").read_bytes()[:200],
        "no_json": None,
        "bad_json": {**members, "artifact.json": b"{not json"},
        "other_format": {**members, "artifact.json": json.dumps({**meta, "format": "zzz"})},
        "other_code": {**members, "artifact.json": json.dumps({**meta, "code": "0" * 64})},
        "unknown_class": {**members, "artifact.json": json.dumps(evil)},
        "unknown_class_resigned": _resign({**members, "artifact.json": json.dumps(evil).encode()}),  # validation
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


# --- issue 36: every stored part is hashed; a bad entry is rebuilt; an unusable cache is off ----------------
import hashlib  # noqa: E402
import logging  # noqa: E402

import megaegg.artifact as artifact_mod  # noqa: E402
from megaegg.compiler import cached_artifact  # noqa: E402

ROOT = Path(__file__).parent.parent
PARTS = ("artifact.json", "constants.safetensors", "kernel.cu", "kernel.cubin")


def _small_graph():
    """A graph with a constant, a weight and an input: every part of an artifact has content."""
    g = me.Graph("cached")
    x = g.input("x", [1, 64], me.f32)
    c = g.constant("c", torch.linspace(-1, 1, 64).reshape(1, 64))
    w = g.weight("w", [32, 64], me.f32)
    g.output("y", me.silu(me.linear(x + c, w)))
    return g


def _data(seed=36):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 64, generator=gen)}, torch.randn(1, 64, generator=gen)


def _compile(cache=True):
    W, x = _data()
    k = me.compile(_small_graph(), W, backend="sim", cache=cache)
    return k, k(x=x)["y"]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MEGAEGG_CACHE", str(root))
    return root


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """NVRTC replaced by a deterministic fake (this machine may have none): the cubin cache logic is real."""
    from megaegg.interpreter import nvrtc

    calls = []

    def compile_(source, opts):
        calls.append(source)
        return b"\x7fELF-fake-cubin:" + hashlib.sha256(source.encode() + "".join(opts).encode()).digest(), ""

    monkeypatch.setattr(nvrtc, "_nvrtc_compile", compile_)
    monkeypatch.setattr(nvrtc, "include_dirs", lambda: [])
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 5))
    monkeypatch.setattr(nvrtc, "_warn_if_slow_nvrtc", lambda: None)
    return nvrtc, calls


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _resign(members):
    """Members with their hashes recomputed: what a careful forger writes (load must still validate)."""
    meta = json.loads(members["artifact.json"])
    meta["parts"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items() if n != "artifact.json"}
    meta["digest"] = artifact_mod._meta_digest(meta)
    return {**members, "artifact.json": json.dumps(meta).encode()}


def _edit_body(members, edit):
    meta = json.loads(members["artifact.json"])
    body = json.loads(meta["body"])
    edit(body)
    meta["body"] = json.dumps(body)
    return {**members, "artifact.json": json.dumps(meta).encode()}


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:] if data else b"x"


def _with_cubin(entry):
    """The cache entry again, with a cubin (a simulator compile stores none)."""
    art = Artifact.load(entry)
    art.cubins = [b"\x7fELF" + bytes(range(256)) * 4]
    art.save(entry)


def _edits(members):
    """Every part edited one byte (first, middle, last), truncated, emptied, removed; and a foreign part."""
    out = {}
    for name, data in members.items():
        for at in sorted({0, len(data) // 2, max(len(data) - 1, 0)}):
            out[f"{name}: byte {at} flipped"] = {**members, name: _flip(data, at)}
        out[f"{name}: truncated"] = {**members, name: data[: len(data) // 2]}
        out[f"{name}: emptied"] = {**members, name: b""}
        out[f"{name}: removed"] = {n: d for n, d in members.items() if n != name}
    out["a foreign part added"] = {**members, "payload.py": b"print('hi')"}
    return out


def test_every_edit_of_every_part_of_a_cache_entry_is_one_warning_and_a_rebuild(cache, caplog):
    """Issue 36: an edited constants.safetensors (same key) was used (the token changed). Now each part,
    edited anyhow and re-zipped with valid CRCs, is one warning, a rebuild, and the uncached answer."""
    _, want = _compile(cache=False)
    _compile()
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    _with_cubin(entry)
    good = _members(entry)
    assert set(good) == set(PARTS)
    cases = _edits(good)
    # the issue's own case: the constant's value changed, the safetensors file still valid
    from safetensors.torch import load as load_tensors
    from safetensors.torch import save as save_tensors

    consts = {k: v + 0.5 for k, v in load_tensors(good["constants.safetensors"]).items()}
    cases["constants.safetensors: a constant's value changed"] = {**good, "constants.safetensors": save_tensors(consts)}
    cases["artifact.json: a Dim changed in the body"] = _edit_body(
        good, lambda b: b["queue"]["table"].__setitem__(0, ["Dim", "const", [7]]))
    meta = good["artifact.json"]
    cases["artifact.json: the digest edited"] = {**good, "artifact.json": meta.replace(b'"digest":"', b'"digest":"0')}
    assert len(cases) > 25
    for what, members in cases.items():
        _write_zip(entry, members)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megaegg"):
            k, got = _compile()
        warned = _warnings(caplog)
        assert len(warned) == 1 and str(entry) in warned[0] and warned[0].endswith("rebuilding"), (what, warned)
        assert "rewrite" in k.artifact.timings, what  # rebuilt, not used
        assert torch.equal(got, want), what
        assert Artifact.load(entry).queue == k.queue  # the bad entry was overwritten by a good one
        _write_zip(entry, good)


def test_any_byte_of_a_cache_entry_flipped_gives_the_uncached_answer(cache, caplog):
    """The raw file (zip headers included), one byte at a time: the right answer and at most one warning;
    when the entry is used, it is because what it holds is unchanged."""
    _, want = _compile(cache=False)
    _compile()
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    good = entry.read_bytes()
    rng = torch.Generator().manual_seed(7)
    spots = sorted({0, 1, len(good) - 1, *torch.randint(0, len(good), (24,), generator=rng).tolist()})
    variants = {f"byte {at}": _flip(good, at) for at in spots}
    variants |= {"truncated to 100": good[:100], "truncated by 1": good[:-1], "empty": b"", "garbage": b"garbage"}
    for what, data in variants.items():
        entry.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megaegg"):
            k, got = _compile()
        assert len(_warnings(caplog)) <= 1, (what, _warnings(caplog))
        assert torch.equal(got, want), what
        if not _warnings(caplog):  # used as is: then every part it holds is the good entry's
            assert _members(entry) == _members_of(good), what
        entry.write_bytes(good)


def _members_of(data: bytes):
    import io

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _queue_table_edit(kind):
    """Edits of the body that a forger re-signs: load's validation, not the digest, must refuse them."""
    def first(table, tag):
        return next(i for i, e in enumerate(table) if e[0] == tag)

    def edit(body):
        t = body["queue"]["table"]
        if kind == "unknown Dim op":
            t[first(t, "Dim")][1] = "pow"
        elif kind == "unknown dtype":
            t[first(t, "DType")][1] = "f64"
        elif kind == "foreign class":
            t[first(t, "Buffer")][0] = "Popen"
        elif kind == "wrong field name":
            fields = t[first(t, "Buffer")][1]
            fields["ident"] = fields.pop("id")
        elif kind == "missing field":
            t[first(t, "Buffer")][1].pop("dtype")
        elif kind == "wrong field type":
            t[first(t, "Buffer")][1]["id"] = "1"
        elif kind == "dangling reference":
            body["queue"]["root"] = {"r": len(t) + 5}
        elif kind == "negative reference":
            body["queue"]["root"] = {"r": -1}
        elif kind == "bad Dim arguments":
            t[first(t, "Dim")] = ["Dim", "const", ["seven"]]
        elif kind == "root not a queue":
            body["queue"]["root"] = {"r": first(t, "Buffer")}
        elif kind == "define not an int":
            body["defines"] = {k: "x" for k in body["defines"]} or {"A": "x"}
        elif kind == "body field missing":
            body.pop("table")
    return edit


BODY_EDITS = ["unknown Dim op", "unknown dtype", "foreign class", "wrong field name", "missing field",
              "wrong field type", "dangling reference", "negative reference", "bad Dim arguments", "root not a queue",
              "define not an int", "body field missing"]


@pytest.mark.parametrize("kind", BODY_EDITS)
def test_a_resigned_invalid_body_is_refused_at_load(kind, tmp_path):
    """Issue 36: an unknown Dim op loaded as a hit and failed every call (KeyError). Decoding validates."""
    art = build_artifact(_small_graph(), compile_cuda=False)
    art.save(tmp_path / "a.megaegg")
    forged = _resign(_edit_body(_members(tmp_path / "a.megaegg"), _queue_table_edit(kind)))
    _write_zip(tmp_path / "b.megaegg", forged)
    with pytest.raises(ArtifactError, match=r"b\.megaegg: artifact\.json: invalid content"):
        Artifact.load(tmp_path / "b.megaegg")
    unsigned = _edit_body(_members(tmp_path / "a.megaegg"), _queue_table_edit(kind))
    _write_zip(tmp_path / "c.megaegg", unsigned)
    with pytest.raises(ArtifactError, match=r"c\.megaegg: artifact\.json: content does not match its digest"):
        Artifact.load(tmp_path / "c.megaegg")


@pytest.mark.parametrize("kind", ["unknown Dim op", "foreign class", "wrong field type"])
def test_a_resigned_invalid_cache_entry_is_rebuilt(kind, cache, caplog):
    _, want = _compile(cache=False)
    _compile()
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    _write_zip(entry, _resign(_edit_body(_members(entry), _queue_table_edit(kind))))
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        k, got = _compile()
    assert len(_warnings(caplog)) == 1 and "invalid content" in _warnings(caplog)[0]
    assert "rewrite" in k.artifact.timings and torch.equal(got, want)


def test_resigned_constants_are_checked_against_the_queue_and_the_graph(cache, caplog):
    """Belt and braces behind the hashes: constants that are not the queue's (load) or not the graph's
    (the cache) are refused, even re-signed."""
    from safetensors.torch import load as load_tensors
    from safetensors.torch import save as save_tensors

    _, want = _compile(cache=False)
    _compile()
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    good = _members(entry)
    consts = load_tensors(good["constants.safetensors"])
    cases = {
        "differs from the graph's": {k: v + 0.5 for k, v in consts.items()},
        "the queue wants": {k: v.double() for k, v in consts.items()},
        "the queue's constants are": {},
        "not a buffer id": {f"c{k}": v for k, v in consts.items()},
    }
    for message, tensors in cases.items():
        _write_zip(entry, _resign({**good, "constants.safetensors": save_tensors(tensors) if tensors else b""}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megaegg"):
            k, got = _compile()
        assert len(_warnings(caplog)) == 1 and message in _warnings(caplog)[0], (message, _warnings(caplog))
        assert "constants.safetensors" in _warnings(caplog)[0]
        assert "rewrite" in k.artifact.timings and torch.equal(got, want), message


def test_load_names_the_part_that_does_not_match(tmp_path):
    art = build_artifact(_small_graph(), compile_cuda=False)
    art.cubins = [b"\x7fELF" + bytes(100)]
    art.save(tmp_path / "a.megaegg")
    good = _members(tmp_path / "a.megaegg")
    for name in ("constants.safetensors", "kernel.cu", "kernel.cubin"):
        _write_zip(tmp_path / "b.megaegg", {**good, name: _flip(good[name], len(good[name]) - 1)})
        with pytest.raises(ArtifactError, match=rf"b\.megaegg: {name}: does not match its hash"):
            Artifact.load(tmp_path / "b.megaegg")
    _write_zip(tmp_path / "b.megaegg", {n: d for n, d in good.items() if n != "kernel.cubin"})
    with pytest.raises(ArtifactError, match=r"kernel\.cubin: recorded in artifact\.json but missing"):
        Artifact.load(tmp_path / "b.megaegg")
    with pytest.raises(ArtifactError, match=r"a folder, not an artifact file"):
        Artifact.load(tmp_path)


def test_a_cache_entry_that_is_a_folder_is_one_warning(cache, caplog):
    _, want = _compile(cache=False)
    _compile()
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    entry.unlink()
    entry.mkdir()
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="megaegg"):
            k, got = _compile()
        assert torch.equal(got, want)
    assert len(_warnings(caplog)) == 1 and str(entry) in _warnings(caplog)[0]


def _unusable(kind, tmp_path, monkeypatch):
    """Point the cache somewhere it cannot be used; returns the path the warning must name."""
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    if kind == "a file":
        monkeypatch.setenv("MEGAEGG_CACHE", str(f))
        return f
    if kind == "under a file":
        monkeypatch.setenv("MEGAEGG_CACHE", str(f / "sub" / "cache"))
        return f
    if kind == "home under a file":
        monkeypatch.delenv("MEGAEGG_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(f))
        return f
    if kind == "its artifacts folder is a file":
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "artifacts").write_text("")
        monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path / "c"))
        return tmp_path / "c" / "artifacts"
    if kind == "a broken link":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere" / "cache")
        monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path / "link"))
        return tmp_path / "link"
    if kind == "unwritable":
        if os.geteuid() == 0:
            pytest.skip("running as root: chmod does not stop root writing (the file variants cover the family)")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        monkeypatch.setenv("MEGAEGG_CACHE", str(d / "cache"))
        return d
    raise AssertionError(kind)


UNUSABLE = ["a file", "under a file", "home under a file", "its artifacts folder is a file", "a broken link",
            "unwritable"]


@pytest.mark.parametrize("kind", UNUSABLE)
def test_an_unusable_cache_is_off_with_one_warning(kind, tmp_path, monkeypatch, caplog):
    """Issue 36: MEGAEGG_CACHE a file, under a file, unwritable: was a FileExistsError / NotADirectoryError /
    PermissionError traceback. Now compile works, uncached, and says so once."""
    _, want = _compile(cache=False)
    named = _unusable(kind, tmp_path, monkeypatch)
    before = sorted(map(str, tmp_path.rglob("*")))
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        for _ in range(2):
            k, got = _compile()
            assert torch.equal(got, want) and "rewrite" in k.artifact.timings
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(named) in warned[0] and "caching is off" in warned[0], warned
    assert sorted(map(str, tmp_path.rglob("*"))) == before and (tmp_path / "a-file").read_text() == "not a folder"


def test_an_unwritable_cache_entry_turns_caching_off_once(cache, monkeypatch, caplog):
    """A cache whose writes fail (a full disk, say) only costs the time: one warning, then no more tries."""
    _, want = _compile(cache=False)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        for _ in range(2):
            _, got = _compile()
            assert torch.equal(got, want)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "No space left on device" in warned[0] and "caching is off" in warned[0]
    assert not [p for p in cache.rglob("*") if p.is_file()]  # no stray temp file


def test_cubin_cache_hit_corrupt_entry_and_unusable_folder(cache, fake_nvrtc, caplog):
    nvrtc, calls = fake_nvrtc
    cold = nvrtc.compile_cubin("// kernel A")
    warm = nvrtc.compile_cubin("// kernel A")
    assert not cold.cached and warm.cached and warm.cubin == cold.cubin and len(calls) == 1
    (entry,) = (cache / "cubin").glob("*.cubin")
    good = entry.read_bytes()
    for what, data in {"flipped": _flip(good, len(good) - 1), "truncated": good[:20], "empty": b"",
                       "hash edited": _flip(good, 0)}.items():
        entry.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megaegg"):
            out = nvrtc.compile_cubin("// kernel A")
        assert not out.cached and out.cubin == cold.cubin, what
        warned = _warnings(caplog)
        assert len(warned) == 1 and str(entry) in warned[0] and "recompiling" in warned[0], (what, warned)
        assert entry.read_bytes() == good and nvrtc.compile_cubin("// kernel A").cached  # the entry is good again


@pytest.mark.parametrize("kind", ["a file", "under a file", "its cubin folder is a file"])
def test_cubin_cache_unusable_is_off_with_one_warning(kind, tmp_path, monkeypatch, fake_nvrtc, caplog):
    nvrtc, calls = fake_nvrtc
    if kind == "its cubin folder is a file":
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "cubin").write_text("")
        monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path / "c"))
        named = tmp_path / "c" / "cubin"
    else:
        named = _unusable(kind, tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        a, b = nvrtc.compile_cubin("// kernel B"), nvrtc.compile_cubin("// kernel B")
    assert a.cubin == b.cubin and not a.cached and not b.cached and len(calls) == 2
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(named) in warned[0] and "caching is off" in warned[0], warned


def test_both_cache_folders_files_is_still_one_warning(tmp_path, monkeypatch, fake_nvrtc, caplog):
    """artifacts/ and cubin/ both files: the cache is off as a whole after the first, one warning in all."""
    nvrtc, calls = fake_nvrtc
    (tmp_path / "c").mkdir()
    for name in ("artifacts", "cubin"):
        (tmp_path / "c" / name).write_text("")
    monkeypatch.setenv("MEGAEGG_CACHE", str(tmp_path / "c"))
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        arts = [cached_artifact(_small_graph()) for _ in range(2)]
        cubins = [nvrtc.compile_cubin("// kernel C") for _ in range(2)]
    assert arts[0].cubin == arts[1].cubin and "rewrite" in arts[1].timings and not cubins[1].cached
    assert len(_warnings(caplog)) == 1 and "caching is off" in _warnings(caplog)[0]


def test_a_full_disk_for_cubins_is_one_warning(cache, monkeypatch, fake_nvrtc, caplog):
    nvrtc, calls = fake_nvrtc
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        outs = [nvrtc.compile_cubin("// kernel D") for _ in range(3)]
    assert len({o.cubin for o in outs}) == 1 and len(calls) == 3
    warned = _warnings(caplog)
    assert len(warned) == 1 and "No space left on device" in warned[0] and "caching is off" in warned[0], warned
    assert not [p for p in cache.rglob("*") if p.is_file()]  # no stray temp file


def test_a_cached_artifact_with_a_cubin_edited_is_rebuilt(cache, fake_nvrtc, caplog):
    """The CUDA path's cache entry (its cubin from the fake NVRTC): an edited cubin is never used."""
    first = cached_artifact(_small_graph())
    assert first.cubin and "rewrite" in first.timings
    (entry,) = (cache / "artifacts").glob("*.megaegg")
    good = _members(entry)
    assert cached_artifact(_small_graph()).cubin == first.cubin
    _write_zip(entry, {**good, "kernel.cubin": _flip(good["kernel.cubin"], 3)})
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        again = cached_artifact(_small_graph())
    assert len(_warnings(caplog)) == 1 and "kernel.cubin: does not match its hash" in _warnings(caplog)[0]
    assert again.cubin == first.cubin and "rewrite" in again.timings
    rewritten = _members(entry)  # good again: the same parts (artifact.json differs by its timings)
    parts = ("constants.safetensors", "kernel.cu", "kernel.cubin")
    assert [rewritten[n] for n in parts] == [good[n] for n in parts]
    assert Artifact.load(entry).cubin == first.cubin


def test_save_to_a_bad_place_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    art = build_artifact(_small_graph(), compile_cuda=False)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "pipe")  # (like /dev/null: a rename onto it would replace the device node)
    cases = {
        tmp_path / "pipe": r"cannot save artifact to .*pipe: .*pipe is not a regular file",
        tmp_path / "missing" / "a.megaegg": rf"cannot save artifact to .*a\.megaegg: folder .*missing does not exist",
        tmp_path / "dir": r"cannot save artifact to .*dir: .*dir is a folder",
        tmp_path / "file" / "a.megaegg": r"cannot save artifact to .*a\.megaegg: .*file is not a folder",
    }
    for path, pattern in cases.items():
        with pytest.raises(ArtifactError, match=pattern):
            art.save(path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "file", "pipe"]
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(ArtifactError, match=r"cannot save artifact to .*b\.megaegg: Permission denied"):
        art.save(tmp_path / "dir" / "b.megaegg")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "file", "pipe"]  # the temp file went too
    monkeypatch.undo()
    art.save(tmp_path / "dir" / "b.megaegg")
    art.save(tmp_path / "dir" / "b.megaegg")  # overwriting is fine
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["b.megaegg", "dir", "file", "pipe"]
    assert Artifact.load(tmp_path / "dir" / "b.megaegg").queue == art.queue


def test_save_to_an_unwritable_folder_is_one_clear_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod does not stop root writing (os.replace failing is tested above)")
    art = build_artifact(_small_graph(), compile_cuda=False)
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(ArtifactError, match=r"cannot save artifact to .*a\.megaegg: Permission denied"):
            art.save(d / "a.megaegg")
        assert not list(d.iterdir())
    finally:
        d.chmod(0o700)


def test_cli_with_the_cache_on_a_file_warns_once_and_works(tmp_path):
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0::/root:/bin/sh\n")
    env = {**os.environ, "MEGAEGG_CACHE": str(f)}
    out = subprocess.run([sys.executable, "examples/llama.py", "--random-weights", "--max-new-tokens", "2",
                          "--backend", "sim", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in out.stderr.splitlines() if "cache" in line.lower()] == [
        f"    megaegg cache: cannot use {f} (it is a file, not a folder): caching is off"], out.stderr
    assert len(json.loads(out.stdout.strip().splitlines()[-1])["generated_ids"][0]) == 2
    assert f.read_text() == "root:x:0:0::/root:/bin/sh\n"


def test_every_kernel_image_of_a_row_regime_round_trips(tmp_path):
    """A program with row regimes keeps one kernel image a band (``cubins``) through save and load, and an
    artifact missing one is not compiled for the cuda backend."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gemm import mlp

    from megaegg.artifact import Artifact
    from megaegg.compiler import build_artifact

    art = build_artifact(mlp(), max_dims={"n": 1024}, dims_hint={"n": 16}, compile_cuda=False)
    regime = art.queue.program.regime
    assert regime is not None and not art.compiled and art.images_needed == regime.bands
    art.cubins = [f"image of band {i}".encode() for i in range(regime.bands)]
    art.save(tmp_path / "a.megaegg")
    back = Artifact.load(tmp_path / "a.megaegg")
    assert (back.cubins, back.cubin, back.compiled) == (art.cubins, art.cubins[0], True)
    assert back.queue.program.regime == art.queue.program.regime
    art.cubins = art.cubins[:-1]
    art.save(tmp_path / "b.megaegg")
    assert not Artifact.load(tmp_path / "b.megaegg").compiled


def test_three_kernel_images_round_trip(tmp_path):
    """Three bands' images: saved as kernel.cubin, kernel.1.cubin and kernel.2.cubin, each hashed; loaded back
    in band order; a missing middle one leaves the artifact not compiled, an edited one is an error."""
    from megaegg.ir.program import Regime

    art = build_artifact(_small_graph(), compile_cuda=False)
    program = dataclasses.replace(art.queue.program, regime=Regime("n", (8, 64)))
    art.queue = dataclasses.replace(art.queue, program=program)
    art.cubins = [b"\x7fELF band 0", b"\x7fELF band 1", b"\x7fELF band 2"]
    assert art.images_needed == 3 and art.compiled
    art.save(tmp_path / "a.megaegg")
    good = _members(tmp_path / "a.megaegg")
    assert {"kernel.cubin", "kernel.1.cubin", "kernel.2.cubin"} <= set(good) and "kernel.3.cubin" not in good
    back = Artifact.load(tmp_path / "a.megaegg")
    assert back.cubins == art.cubins and back.compiled and back.queue.program.regime == Regime("n", (8, 64))
    art.cubins = [art.cubins[0], art.cubins[2]]  # (band 1's image lost)
    art.save(tmp_path / "b.megaegg")
    assert not Artifact.load(tmp_path / "b.megaegg").compiled
    _write_zip(tmp_path / "c.megaegg", {**good, "kernel.1.cubin": _flip(good["kernel.1.cubin"], 2)})
    with pytest.raises(ArtifactError, match=r"kernel\.1\.cubin: does not match its hash"):
        Artifact.load(tmp_path / "c.megaegg")
