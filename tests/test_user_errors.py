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


# --- checkpoint folders: every broken file is a CheckpointError naming it ---------------------------
from megaegg.models import (  # noqa: E402
    PRESETS, CheckpointError, Generator, ModelConfig, UnsupportedConfig, build_decode_graph, eos_token_ids,
    load_checkpoint, random_weights, read_config, reference_step,
)

pytest.importorskip("transformers")
from tiny_checkpoints import save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small llama checkpoint in two shards, and the spec it loads into."""
    path = save_tiny(tmp_path_factory.mktemp("ckpt") / "llama", seed=7, max_shard_size="60KB")
    _, spec = build_decode_graph(read_config(path), max_len=16)
    return path, spec


def broken_copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved[0], tmp_path / "model"), saved[1]


@pytest.mark.parametrize("text, pattern", [
    ('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}', r"config\.json: invalid JSON at line 3, column 21"),
    ('["llama"]', r"config\.json: expected a JSON object, got list \['llama'\]"),
    ("", r"config\.json: invalid JSON at line 1, column 1"),
    ('{"model_type": "llama"}', r"config\.json: config field 'num_attention_heads' must be a positive int, got None"),
])
def test_bad_config_json_names_the_file(saved, tmp_path, text, pattern):
    model, spec = broken_copy(saved, tmp_path)
    (model / "config.json").write_text(text)
    with pytest.raises(CheckpointError if "field" not in pattern else UnsupportedConfig, match=pattern):
        read_config(model)
    with pytest.raises(GraphError, match=pattern):
        load_checkpoint(model, spec)


def _shards(model):
    return sorted(p.name for p in model.glob("model-*.safetensors"))


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_truncated_or_empty_safetensors_names_the_file(saved, tmp_path, how):
    model, spec = broken_copy(saved, tmp_path)
    shard = model / _shards(model)[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2] if how == "truncated" else b"")
    with pytest.raises(CheckpointError, match=rf"{shard.name}: not a readable safetensors file \(.*\); is it trunc"):
        load_checkpoint(model, spec)


def test_single_file_checkpoint_truncated(tmp_path):
    model = save_tiny(tmp_path / "one", seed=8)
    _, spec = build_decode_graph(read_config(model), max_len=16)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(model, spec)


def test_index_naming_a_missing_shard(saved, tmp_path):
    model, spec = broken_copy(saved, tmp_path)
    gone = _shards(model)[0]
    (model / gone).unlink()
    with pytest.raises(CheckpointError, match=rf"safetensors\.index\.json: shard '{gone}' \(holding '.*'\) not found"):
        load_checkpoint(model, spec)


@pytest.mark.parametrize("text, pattern", [
    ("{not json", r"index\.json: invalid JSON at line 1, column 2"),
    ('"weights"', r"index\.json: expected a JSON object, got str"),
    ('{"metadata": {}}', r"index\.json: expected a 'weight_map' object .* got None"),
    ('{"weight_map": {"a": 3}}', r"index\.json: expected a 'weight_map' object"),
])
def test_corrupt_index_names_the_file(saved, tmp_path, text, pattern):
    model, spec = broken_copy(saved, tmp_path)
    (model / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(model, spec)


def test_undecodable_index_names_the_file(saved, tmp_path):
    model, spec = broken_copy(saved, tmp_path)
    (model / "model.safetensors.index.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match=r"index\.json: cannot be read"):
        load_checkpoint(model, spec)


def test_loading_reports_progress_per_shard(saved):
    path, spec = saved
    lines: list[str] = []
    weights = load_checkpoint(path, spec, progress=lines.append)
    n = len(_shards(path))
    assert n >= 2 and len(weights) == len(spec.weights)
    shard_lines = [line for line in lines if line.startswith("shard ")]
    assert [line.split(" ")[1] for line in shard_lines] == [f"{i}/{n}" for i in range(1, n + 1)]
    assert shard_lines[-1].endswith(f"{len(spec.weights)}/{len(spec.weights)} tensors, "
                                    f"{spec.weight_bytes / 1e9:.2f}/{spec.weight_bytes / 1e9:.2f} GB")


def test_random_weights_report_progress_when_slow(monkeypatch):
    from megaegg.models import weights as w

    _, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=8)
    clock = iter(range(0, 10_000, 2))  # every tensor takes "2 s"
    monkeypatch.setattr(w.time, "perf_counter", lambda: next(clock))
    lines: list[str] = []
    random_weights(spec, progress=lines.append)
    assert len(lines) == len(spec.weights) and lines[-1].startswith(f"random weights: {len(spec.weights)}/")


# --- EOS token ids ------------------------------------------------------------------------------
def test_eos_token_ids_from_generation_config_then_config(tmp_path):
    import json

    def folder(config: dict, generation: dict | None):
        path = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        if generation is not None:
            (path / "generation_config.json").write_text(json.dumps(generation))
        return path

    assert eos_token_ids(folder({"eos_token_id": 5}, {"eos_token_id": [7, 9]})) == (7, 9)
    assert eos_token_ids(folder({"eos_token_id": 5}, {"eos_token_id": None})) == (5,)
    assert eos_token_ids(folder({"eos_token_id": [5, 6]}, None)) == (5, 6)
    assert eos_token_ids(folder({}, {"bos_token_id": 1})) == ()
    assert eos_token_ids(PRESETS["llama-3.2-1b"]) == (128001,) and eos_token_ids(PRESETS["qwen3-tiny"]) == ()
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be a token id .* got 'x'"):
        eos_token_ids(folder({}, {"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match=r"config\.json: eos_token_id must be .* got \[1, -2\]"):
        eos_token_ids(folder({"eos_token_id": [1, -2]}, None))


# --- generation ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gen():
    import dataclasses

    graph, spec = build_decode_graph(dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32), max_len=16)
    step = reference_step(graph, random_weights(spec, seed=4), spec.new_caches())
    return Generator(step, max_len=16, vocab=1024)


@pytest.mark.parametrize("prompt, bad", [([3, 1024], "1024 \\(at index 1\\)"), ([-1], "-1 \\(at index 0\\)")])
def test_prompt_ids_outside_the_vocab(tiny_gen, prompt, bad):
    with pytest.raises(GraphError, match=rf"generate: prompt token id {bad} is outside the vocabulary: ids must be in "
                                         r"\[0, 1023\] for vocab size 1024"):
        tiny_gen.generate(prompt, 2)


@pytest.mark.parametrize("n", [0, -5, 2.0])
def test_max_new_tokens_must_be_positive(tiny_gen, n):
    with pytest.raises(GraphError, match=f"max_new_tokens must be an int >= 1, got {n}"):
        tiny_gen.generate([3], n)


def test_on_token_streams_each_token_before_the_next_step(tiny_gen):
    events = []
    step = tiny_gen.step
    gen = Generator(lambda tok, pos: (events.append(("step", pos)), step(tok, pos))[1], max_len=16, vocab=1024)
    out = gen.generate([3, 4], 3, on_token=lambda t: events.append(("token", t)))
    assert events == [("step", 0), ("step", 1), ("token", out.tokens[0]), ("step", 2), ("token", out.tokens[1]),
                      ("step", 3), ("token", out.tokens[2])]
    assert out.stop_token is None
    stopped = gen.generate([3, 4], 3, stop_tokens=[out.tokens[1]])
    assert stopped.tokens == out.tokens[: out.tokens.index(out.tokens[1]) + 1] and stopped.stop_token == out.tokens[1]
