"""A user's mistakes through the Python API: each raises a GraphError subclass whose message names
the tensor, file, argument or dim and what was expected (the CLI prints the same message)."""

from __future__ import annotations

import json
import re
import time

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


@pytest.mark.parametrize("build, pattern", [
    (lambda g: g.input("x", 4, me.f32), r"input 'x': shape must be a list of ints and dims \(me\.sym\), got 4$"),
    (lambda g: g.input("x", [4.0, 2], me.f32), r"input 'x': shape must be .* got \[4\.0, 2\]"),
    (lambda g: g.weight("w", ["S", 8], me.f32), r"weight 'w': shape must be .* got \['S', 8\]"),
])
def test_a_shape_that_is_not_a_list_of_dims_names_the_leaf(build, pattern):
    with pytest.raises(ShapeError, match=pattern):
        build(me.Graph())


def test_compile_of_something_not_a_graph():
    with pytest.raises(GraphError, match="graph must be a megaegg.Graph, got dict"):
        me.compile({"w": torch.zeros(2)}, backend="sim")


def test_declared_but_unused_leaves_are_accepted_by_the_kernel_as_by_the_reference(tmp_path):
    """The arguments run_reference needs (every declared leaf) also run the kernel, through a saved
    artifact too; a name the graph never declared is still refused."""
    from megaegg.artifact import Artifact
    from megaegg.compiler import Kernel

    g = me.Graph()
    x, unused_in = g.input("x", [2, 8], me.f32), g.input("unused_in", [3], me.f32)
    w, unused_w = g.weight("w", [4, 8], me.f32), g.weight("unused_w", [5], me.f32)
    g.output("y", me.silu(me.linear(x, w)))
    gen = torch.Generator().manual_seed(11)
    inputs = {"x": torch.randn(2, 8, generator=gen), "unused_in": torch.randn(3, generator=gen)}
    weights = {"w": torch.randn(4, 8, generator=gen), "unused_w": torch.randn(5, generator=gen)}
    want = me.run_reference(g, inputs, weights)["y"]
    kernel = me.compile(g, weights)
    torch.testing.assert_close(kernel(**inputs)["y"], want)
    torch.testing.assert_close(kernel(x=inputs["x"])["y"], want)  # (and without them)
    kernel.artifact.save(tmp_path / "k.megaegg")
    loaded = Kernel(Artifact.load(tmp_path / "k.megaegg"), weights)
    torch.testing.assert_close(loaded(**inputs)["y"], want)
    with pytest.raises(GraphError, match=r"unknown argument\(s\) \['typo'\]"):
        kernel(**inputs, typo=torch.zeros(3))
    with pytest.raises(GraphError, match=r"unknown weight\(s\): 'typo'"):
        me.compile(g, {**weights, "typo": torch.zeros(1)})


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


def test_index_placing_a_tensor_in_a_shard_without_it(saved, tmp_path):
    """(was: the shard called unreadable, 'truncated or partly downloaded?', when the index is what is wrong)"""
    model, spec = broken_copy(saved, tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(f for f in _shards(model) if f != shard)
    index["weight_map"][name] = other
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index\.json: places tensor '{re.escape(name)}' in '{other}', which "
                                              "does not hold it"):
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


# --- config.json field values: each names the field; none is a traceback or a silent default -------
@pytest.mark.parametrize("preset, fields, pattern", [
    ("tiny", {"num_key_value_heads": "2"}, r"'num_key_value_heads' must be a positive int, got '2'"),  # was a TypeError
    ("tiny", {"num_key_value_heads": 0}, r"'num_key_value_heads' must be a positive int, got 0"),  # was read as absent
    ("tiny", {"num_key_value_heads": -2}, r"'num_key_value_heads' must be a positive int, got -2"),
    ("tiny", {"head_dim": -64}, r"'head_dim' must be a positive int, got -64"),
    ("tiny", {"head_dim": None, "hidden_size": 2}, r"'head_dim' = 0 is not supported"),  # hidden_size // heads
    ("tiny", {"rms_norm_eps": "x"}, r"'rms_norm_eps' must be a positive number, got 'x'"),
    ("tiny", {"rms_norm_eps": -1e-5}, r"'rms_norm_eps' must be a positive number, got -1e-05"),
    ("tiny", {"rope_theta": 0}, r"'rope_theta' must be a positive number, got 0"),  # was inf frequencies
    ("tiny", {"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     r"'rope_parameters\.rope_theta' must be a positive number, got 'abc'"),
    ("tiny", {"rope_parameters": [1, 2]}, r"'rope_parameters' = \[1, 2\] is not supported \(supported: an object"),
    ("llama-3.2-1b", {"rope_scaling": {"rope_type": "llama3", "factor": 0}},
     r"'rope_scaling\.factor' must be a positive number, got 0"),
    ("tiny", {"max_position_embeddings": 0}, r"'max_position_embeddings' must be a positive int, got 0"),
    ("tiny", {"tie_word_embeddings": "false"}, r"'tie_word_embeddings' must be true or false, got 'false'"),  # was True
    ("qwen3-moe-tiny", {"norm_topk_prob": "false"}, r"'norm_topk_prob' must be true or false, got 'false'"),
    ("qwen3-tiny", {"layer_types": "full_attention"}, r"'layer_types' = 'full_attention' is not supported"),  # letters
])
def test_bad_config_field_values_name_the_field(preset, fields, pattern):
    cfg = {k: v for k, v in {**PRESETS[preset], **fields}.items() if v is not None}
    with pytest.raises(UnsupportedConfig, match=r"config field " + pattern):
        ModelConfig.from_hf(cfg)


def test_null_optional_config_fields_take_their_defaults():
    cfg = ModelConfig.from_hf({**PRESETS["tiny"], "num_key_value_heads": None, "rms_norm_eps": None,
                               "max_position_embeddings": None, "tie_word_embeddings": None})
    assert (cfg.kv_heads, cfg.rms_eps, cfg.max_positions, cfg.tie_embeddings) == (cfg.heads, 1e-6, 2048, False)


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


@pytest.mark.parametrize("prompt, stop, pattern", [
    ("hello", (), r"generate: prompt must be a list of int token ids, got str 'hello'"),  # was int('h')
    ([3.7], (), r"generate: prompt must be a list of int token ids, got list \[3\.7\]"),  # was cut to 3
    ([3], 5, r"generate: stop_tokens must be a list of int token ids, got int 5"),  # was a TypeError after a step
])
def test_prompt_and_stop_tokens_must_be_token_ids(tiny_gen, prompt, stop, pattern):
    with pytest.raises(GraphError, match=pattern):
        tiny_gen.generate(prompt, 2, stop_tokens=stop)


def test_prompt_as_a_tensor_or_range_still_works(tiny_gen):
    assert tiny_gen.generate(torch.tensor([3, 4]), 2).tokens == tiny_gen.generate(range(3, 5), 2).tokens


# --- batches ----------------------------------------------------------------------------------------
def test_a_sampling_request_on_a_greedy_step_graph_is_refused():
    """A step graph built without sampling inputs would drop the request's temperature: greedy tokens, silently."""
    from megaegg.models import build_step_graph
    from megaegg.models.batch import Batcher, Request, Sampling, reference_batch_step

    graph, spec = build_step_graph(ModelConfig.preset("tiny"), max_len=16, slots=2)
    batcher = Batcher(reference_batch_step(graph, random_weights(spec), spec.new_caches()), slots=2, max_len=16)
    with pytest.raises(GraphError, match=r"a request samples \(temperature > 0\) but the step graph has no sampling "
                                         r"inputs: build it with build_step_graph\(\.\.\., sampling=True\)"):
        batcher.run([Request([1, 2], 2, sampling=Sampling(temperature=0.8))])


@pytest.mark.parametrize("make, pattern", [
    (lambda b: b.Batcher(lambda rows: None, slots=0, max_len=8), r"slots must be an int >= 1, got 0"),  # was max([])
    (lambda b: b.Sampling(top_p="0.5"), r"top_p must be in \(0, 1\] \(1: every token\), got '0\.5'"),
    (lambda b: b.Sampling(temperature="1"), r"temperature must be >= 0 \(0: greedy\), got '1'"),
    (lambda b: b.Batcher(lambda rows: None, slots=1, max_len=8).submit(b.Request("ab", 2)),
     r"a request's prompt must be a list of int token ids, got str 'ab'"),
])
def test_bad_batch_arguments(make, pattern):
    from megaegg.models import batch

    with pytest.raises(GraphError, match=pattern):
        make(batch)


# --- aliasing: a tensor the kernel updates in place shares memory with no other tensor of the call (issue 36) -----
HQ, HKV, SMAX, D = 4, 2, 8, 16


def _attention_graph(ranks: int = 1):
    """q = x @ wq^T; the new k, v appended to the caches in place; attention over them."""
    g = me.Graph()
    pos = me.sym("pos")
    x = g.input("x", [1, 32], me.f32)
    q = me.linear(x, g.weight("wq", [HQ * D, 32], me.f32)).reshape(HQ, D)
    kc = me.kv_append(g.input("kc", [HKV, SMAX, D], me.f32), g.input("k", [HKV, D], me.f32), pos)
    vc = me.kv_append(g.input("vc", [HKV, SMAX, D], me.f32), g.input("v", [HKV, D], me.f32), pos)
    out = me.attention(q, kc, vc, pos + 1)
    g.output("y", me.all_reduce(out, ranks=ranks) if ranks > 1 else out)
    return g


@pytest.fixture(scope="module")
def attn():
    g = _attention_graph()
    gen = torch.Generator().manual_seed(36)
    weights = {"wq": torch.randn(HQ * D, 32, generator=gen) * 0.2}
    return g, weights, me.compile(g, weights, backend="sim")


def _fresh(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(1, 32, generator=gen), "k": torch.randn(HKV, D, generator=gen),
            "v": torch.randn(HKV, D, generator=gen), "kc": torch.randn(HKV, SMAX, D, generator=gen),
            "vc": torch.randn(HKV, SMAX, D, generator=gen)}


def _expect(g, weights, inputs, pos):
    """The reference on copies (what the call would give with separate tensors), and the copies after it."""
    copies = {n: t.clone() for n, t in inputs.items()}
    return me.run_reference(g, copies, weights, {"pos": pos})["y"], copies


@pytest.mark.parametrize("make, pattern", [
    # the same tensor as both caches: was accepted, and returned a wrong answer
    (lambda i: {**i, "vc": i["kc"]}, r"input 'kc' and input 'vc' share memory \(the same tensor, or overlapping views\): "
                                     r"the kernel updates both in place"),
    # overlapping views of one buffer
    (lambda i: (lambda buf: {**i, "kc": buf[:HKV * SMAX * D].view(HKV, SMAX, D),
                             "vc": buf[D:D + HKV * SMAX * D].view(HKV, SMAX, D)})(torch.randn(2 * HKV * SMAX * D)),
     r"input 'kc' and input 'vc' share memory"),
    # a read-only input that is a (contiguous) view into a cache
    (lambda i: {**i, "k": i["kc"].view(-1)[: HKV * D].view(HKV, D)},
     r"input 'k' shares memory with input 'kc', which the kernel updates in place: pass separate tensors \(or a copy of 'k'\)"),
    (lambda i: {**i, "x": i["vc"].view(-1)[-32:].view(1, 32)}, r"input 'x' shares memory with input 'vc'"),
])
def test_inputs_sharing_memory_with_a_cache_are_refused(attn, make, pattern):
    g, weights, kernel = attn
    inputs = make(_fresh(1))
    before = {n: t.clone() for n, t in inputs.items()}
    with pytest.raises(GraphError, match=pattern):
        kernel(**inputs, pos=3)
    assert all(torch.equal(inputs[n], before[n]) for n in inputs)  # refused before it ran: nothing written


def test_a_cache_sharing_memory_with_a_weight_is_refused(attn):
    g, weights, kernel = attn
    wq = kernel.weights["wq"]  # the bound weight (here the caller's own tensor)
    inputs = {**_fresh(2), "vc": wq.view(-1)[: HKV * SMAX * D].view(HKV, SMAX, D)}
    before = wq.clone()
    with pytest.raises(GraphError, match=r"input 'vc', which the kernel updates in place, shares memory with weight 'wq': "
                                         r"the call would overwrite it"):
        kernel(**inputs, pos=1)
    assert torch.equal(wq, before)


@pytest.mark.parametrize("make", [
    lambda i: (lambda buf: {**i, "kc": buf[0], "vc": buf[1]})(torch.stack([i["kc"], i["vc"]])),  # disjoint views of one
    lambda i: {**i, "v": i["k"]},  # two read-only inputs may alias
    lambda i: {**i, "k": i["kc"][:, 5]},  # a strided view of a cache: copied before the call, so it aliases nothing
    lambda i: (lambda buf: {**i, "x": buf[:32].view(1, 32), "k": buf[:HKV * D].view(HKV, D)})(torch.randn(64)),
])
def test_allowed_sharing_gives_the_reference_answer(attn, make):
    g, weights, kernel = attn
    inputs = make(_fresh(3))
    want, after = _expect(g, weights, inputs, 5)
    got = kernel(**inputs, pos=5)["y"]
    torch.testing.assert_close(got, want)
    for n in ("kc", "vc"):
        torch.testing.assert_close(inputs[n], after[n])  # the caches updated as the reference updated its copies


def test_aliasing_is_checked_at_every_call_not_only_the_first(attn):
    """The check is cached on the caches' addresses: a call after good calls is still checked, both ways."""
    g, weights, kernel = attn
    inputs = _fresh(4)
    for pos in range(3):
        want, _ = _expect(g, weights, inputs, pos)
        torch.testing.assert_close(kernel(**inputs, pos=pos)["y"], want)
    with pytest.raises(GraphError, match=r"input 'v' shares memory with input 'vc'"):  # same caches, a new input aliasing
        kernel(**{**inputs, "v": inputs["vc"].view(-1)[: HKV * D].view(HKV, D)}, pos=3)
    with pytest.raises(GraphError, match=r"input 'kc' and input 'vc' share memory"):  # new caches
        kernel(**{**inputs, "vc": inputs["kc"]}, pos=3)
    want, _ = _expect(g, weights, inputs, 3)
    torch.testing.assert_close(kernel(**inputs, pos=3)["y"], want)  # and good calls still run


def test_decode_kernel_with_one_tensor_for_both_caches_of_a_layer_is_refused():
    """The issue's case: the tiny model's decode kernel given the same tensor as k_cache.0 and v_cache.0."""
    import dataclasses

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    graph, spec = build_decode_graph(cfg, max_len=8)
    kernel = me.compile(graph, random_weights(spec, seed=5), backend="sim", max_dims={"pos": 7})
    caches = spec.new_caches()
    token = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(GraphError, match=r"input 'k_cache\.0' and input 'v_cache\.0' share memory"):
        kernel(token=token, **{**caches, "v_cache.0": caches["k_cache.0"]}, pos=0)
    with pytest.raises(GraphError, match=r"input 'k_cache\.1' and input 'v_cache\.0' share memory"):
        kernel(token=token, **{**caches, "k_cache.1": caches["v_cache.0"]}, pos=0)


def test_ranks_sharing_a_cache_are_refused():
    """ParallelKernel (simulated ranks share the host): one rank's cache must not be another rank's tensor."""
    from megaegg.parallel import ParallelKernel

    g = _attention_graph(ranks=2)
    gen = torch.Generator().manual_seed(37)
    shards = [{"wq": torch.randn(HQ * D, 32, generator=gen) * 0.2} for _ in range(2)]
    kernel = ParallelKernel(me.compiler.build_artifact(g, compile_cuda=False), shards, backend="sim")
    a, b = _fresh(5), _fresh(6)
    with pytest.raises(GraphError, match=r"rank 0's input 'kc' and rank 1's input 'kc' share memory"):
        kernel([a, {**b, "kc": a["kc"]}], pos=2)
    with pytest.raises(GraphError, match=r"rank 1's input 'x' shares memory with rank 0's input 'vc'"):
        kernel([a, {**b, "x": a["vc"].view(-1)[:32].view(1, 32)}], pos=2)
    with pytest.raises(GraphError, match=r"rank 1's input 'vc', which the kernel updates in place, shares memory with "
                                         r"rank 0's weight 'wq'"):
        kernel([a, {**b, "vc": shards[0]["wq"].view(-1)[: HKV * SMAX * D].view(HKV, SMAX, D)}], pos=2)
    want = me.run_reference_ranks(g, [{n: t.clone() for n, t in a.items()}, {n: t.clone() for n, t in b.items()}],
                                  shards, {"pos": 2})
    got = kernel([a, b], pos=2)
    torch.testing.assert_close(got[0]["y"], want[0]["y"])
    torch.testing.assert_close(got[1]["y"], want[1]["y"])


# --- sizes: what cannot fit the device (the host for the simulator) is refused where it is declared (issue 36) ----
def test_a_work_area_beyond_the_host_is_refused_at_compile_with_its_size():
    """Small inputs, a 17.6 TB intermediate at max_dims: refused when the kernel is built (was: at the call)."""
    g = me.Graph()
    x = g.input("x", [me.sym("S"), 1], me.f32)
    g.output("y", me.silu(me.silu(me.expand(x, [me.sym("S"), 2**12]))))
    with pytest.raises(GraphError, match=r"work area \(arena and counters at max_dims S=2147483648\) needs (35\.2|70\.4) TB; "
                                         r"the host has .* \(compile with smaller max_dims\)"):
        me.compile(g, backend="sim", max_dims={"S": 2**31}, cache=False)
    kernel = me.compile(g, backend="sim", max_dims={"S": 4}, cache=False)  # the same graph, bounded: runs
    x0 = torch.randn(2, 1, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(kernel(x=x0, S=2)["y"], me.run_reference(g, {"x": x0}, {}, {"S": 2})["y"])


@pytest.mark.parametrize("build, weights, pattern", [
    (lambda g: g.input("x", [me.sym("S"), 2**28], me.f32), {},  # at the default max_dims, S = 8192
     r"input 'x' f32\[S, 268435456\] needs 8\.8 TB; the host has .* \(compile with smaller max_dims\)"),
    (lambda g: me.kv_append(g.input("kc", [8, 2**30, 128], me.bf16), g.input("k", [8, 128], me.bf16), me.sym("pos")),
     {}, r"cache 'kc' bf16\[8, 1073741824, 128\] needs 2\.2 TB; the host has"),
    (lambda g: me.linear(g.input("x", [1, 2**20], me.f32), g.weight("w", [2**20, 2**20], me.f32)),
     {"w": torch.zeros(1, 1).expand(2**20, 2**20)},  # a 4 TB weight that takes no memory until it is copied
     r"weight 'w' f32\[1048576, 1048576\] needs 4\.4 TB; the host has"),
])
def test_a_leaf_beyond_the_host_is_refused_before_the_rewrite(build, weights, pattern):
    g = me.Graph()
    g.output("y", build(g))
    t0 = time.perf_counter()
    with pytest.raises(GraphError, match=pattern):
        me.compile(g, weights, backend="sim", cache=False)
    assert time.perf_counter() - t0 < 5  # before the rewrite, and before copying anything


def test_all_of_it_together_beyond_the_host_is_refused_naming_the_sum(monkeypatch, attn):
    from megaegg import compiler

    g, weights, kernel = attn
    need = sum(n for _, _, n in kernel.memory())
    assert {k for k, _, _ in kernel.memory()} == {"weight", "constant", "input", "cache", "work area"} - {"constant"}
    monkeypatch.setattr(compiler, "host_memory", lambda: need - 1)  # each alone fits, not all together
    with pytest.raises(GraphError, match=rf"the kernel needs {compiler.fmt_bytes(need)} in all \(.*caches .*\); the host has"):
        me.compiler.Kernel(kernel.artifact, weights, backend="sim")
    monkeypatch.setattr(compiler, "host_memory", lambda: need)
    me.compiler.Kernel(kernel.artifact, weights, backend="sim")  # exactly enough


def test_check_fits_on_a_gpu_counts_what_binding_allocates_against_the_free_memory(monkeypatch):
    from megaegg import compiler

    monkeypatch.setattr(compiler, "memory_of", lambda device: ("GPU cuda:0", 80 * 10**9, 10 * 10**9))
    compiler.check_fits([("weight", "weight 'w'", 30 * 10**9)], "cuda", now=5 * 10**9)  # fits
    with pytest.raises(GraphError, match=r"binding the kernel allocates 12\.0 GB on GPU cuda:0, which has 10\.0 GB free"):
        compiler.check_fits([("weight", "weight 'w'", 30 * 10**9)], "cuda", now=12 * 10**9)
    with pytest.raises(GraphError, match=r"weight 'w' needs 81\.0 GB; GPU cuda:0 has 80\.0 GB$"):
        compiler.check_fits([("weight", "weight 'w'", 81 * 10**9)], "cuda")


def test_parallel_ranks_on_the_simulator_share_the_host(monkeypatch):
    from megaegg import compiler, parallel

    art = me.compiler.build_artifact(_attention_graph(ranks=2), compile_cuda=False)
    one = sum(n for _, _, n in compiler.kernel_memory(art))
    monkeypatch.setattr(compiler, "host_memory", lambda: one + one // 2)  # one rank fits, two do not
    shards = [{"wq": torch.zeros(HQ * D, 32)} for _ in range(2)]
    with pytest.raises(GraphError, match=r"the kernel needs .* in all .*; the host has"):
        parallel.ParallelKernel(art, shards, backend="sim")


@pytest.mark.parametrize("where", ["weight", "input"])
def test_a_tensor_without_data_is_named(attn, where):
    g, weights, kernel = attn
    if where == "weight":
        with pytest.raises(GraphError, match=r"weight 'wq' is on the meta device \(no data\): load it first"):
            me.compile(g, {"wq": torch.empty(HQ * D, 32, device="meta")}, backend="sim")
        with pytest.raises(GraphError, match=r"weight 'wq' is a torch.sparse_coo tensor: pass a dense one"):
            me.compile(g, {"wq": weights["wq"].to_sparse()}, backend="sim")
    else:
        with pytest.raises(GraphError, match=r"input 'x' is on the meta device \(no data\)"):
            kernel(**{**_fresh(7), "x": torch.empty(1, 32, device="meta")}, pos=0)
        with pytest.raises(GraphError, match=r"input 'kc' is on the meta device"):
            kernel(**{**_fresh(7), "kc": torch.empty(HKV, SMAX, D, device="meta")}, pos=0)


# --- random weights for a config too large for the machine: refused before drawing, naming the field --------------
@pytest.mark.parametrize("fields, pattern", [
    ({"vocab_size": 2**36}, r"the weights need 70\.4 TB \(bf16\), more than the host has \(.*\): most of it config fields "
                            r"vocab_size=68719476736 x hidden_size=256 \(embedding, LM head\), 70\.4 TB"),
    ({"hidden_size": 2**31}, r"the weights need 28\.6 TB .* hidden_size=2147483648"),
    ({"intermediate_size": 2**36}, r"intermediate_size=68719476736 x hidden_size=256 \(MLP\)"),
])
def test_random_weights_too_large_for_the_host_name_the_config_field(fields, pattern):
    cfg = ModelConfig.from_hf({**PRESETS["tiny"], **fields})
    graph, spec = build_decode_graph(cfg, max_len=8)
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedConfig, match=pattern):
        random_weights(spec)
    assert time.perf_counter() - t0 < 2  # nothing drawn


@pytest.mark.parametrize("fields, pattern", [
    ({"vocab_size": 2**62}, r"config describes 4722\.4 EB of weights \(bf16\), more than any machine holds: "
                            r"vocab_size=4611686018427387904 x hidden_size=256"),
    ({"vocab_size": 2**40}, r"config describes 1\.1 PB of weights .* vocab_size=1099511627776 x hidden_size=256"),
    ({"vocab_size": 2**40, "hidden_size": 2**31}, r"vocab_size=1099511627776 x hidden_size=2147483648"),
    ({"num_hidden_layers": 10**12}, r"'num_hidden_layers' = 1000000000000 is not supported \(supported: at most 1024"),
])
def test_configs_beyond_any_machine_are_refused_when_read(fields, pattern):
    with pytest.raises(UnsupportedConfig, match=pattern):
        ModelConfig.from_hf({**PRESETS["tiny"], **fields})
