"""Model graphs (Llama, Qwen3) on the reference executor against Hugging Face transformers (CPU, f32)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

import pytest
import torch
from tiny_checkpoints import save_tiny

import megaegg as me
from megaegg.models import (
    PRESETS, CheckpointError, Generator, ModelConfig, UnsupportedConfig, build_decode_graph, load_checkpoint,
    kernel_step, random_weights, read_config, reference_step,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=97, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,  # no EOS: 16 tokens always
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


def hf_model(arch: str, *, tie: bool, seed: int):
    """A tiny random HF model whose weights all matter (norm weights != 1, logits spread out)."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **TINY, tie_word_embeddings=tie, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mixtral":  # (routed experts in every layer, their top-2 weights renormalised; checkpoint names
        # block_sparse_moe.gate / experts.{e}.w1 / w3 / w2)
        cfg = transformers.MixtralConfig(**TINY, tie_word_embeddings=tie, num_local_experts=5, num_experts_per_tok=2,
                                         max_position_embeddings=4096)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "mistral":  # (a window longer than the test's context: the whole cache attended, as the graph does)
        cfg = transformers.MistralConfig(**TINY, tie_word_embeddings=tie, rope_theta=1e6, sliding_window=48,
                                         max_position_embeddings=4096)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**TINY, tie_word_embeddings=tie, rope_theta=1e6, max_position_embeddings=4096)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    return model.float().eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize(
    "arch,tie,shard,seed,executor",
    [("llama", True, False, 10, "reference"), ("llama", False, True, 11, "reference"),
     ("qwen3", False, False, 12, "reference"), ("qwen3", True, True, 13, "reference"),
     ("llama", True, False, 14, "megakernel-sim"), ("qwen3", False, True, 15, "megakernel-sim"),
     ("mistral", False, False, 16, "reference"), ("mistral", True, True, 17, "megakernel-sim"),
     ("mixtral", False, True, 18, "reference"), ("mixtral", False, False, 19, "megakernel-sim")],
)
def test_greedy_matches_transformers(tmp_path, arch, tie, shard, seed, executor):
    model = hf_model(arch, tie=tie, seed=seed)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()

    cfg = read_config(tmp_path)
    assert (cfg.arch, cfg.tie_embeddings, cfg.dtype) == (arch, tie, me.f32)
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if arch == "llama" else None)
    assert arch != "mistral" or cfg.max_positions == 48  # (its sliding window bounds the context)
    max_len = 32
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = load_checkpoint(tmp_path, spec)
    if executor == "reference":
        step = reference_step(graph, weights, spec.new_caches())
    else:  # the compiled queue on the CPU simulator: one compile serves every position
        step = kernel_step(me.compile(graph, weights, backend="sim", max_dims={"pos": max_len - 1}), spec.new_caches())
    gen = Generator(step, max_len=max_len)

    prompt = torch.randint(0, cfg.vocab, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = gen.generate(prompt, max_new_tokens=16, keep_logits=True)

    with torch.no_grad():
        ids = torch.tensor([prompt + out.tokens])
        want = model.generate(ids[:, : len(prompt)], max_new_tokens=16, do_sample=False)
        assert want[0, len(prompt) :].tolist() == out.tokens
        hf_logits = model(ids[:, :-1]).logits[0]  # logits at every position the driver stepped over
    ours = torch.cat(out.logits)
    assert ours.shape == hf_logits.shape == (len(prompt) + 15, cfg.vocab)
    errs = [rel_err(ours[pos], hf_logits[pos]) for pos in range(ours.shape[0])]
    print(f"\n{arch} tie={tie} shard={shard}: max logits rel err {max(errs):.2e}, tokens {out.tokens}")
    assert max(errs) < 1e-4, f"logits differ at position {errs.index(max(errs))}: rel err {max(errs):.2e}"
    assert len(set(out.tokens)) > 1  # not a degenerate model


def test_generate_stops_and_checks_length():
    cfg = ModelConfig.preset("tiny")
    graph, spec = build_decode_graph(dataclasses.replace(cfg, dtype=me.f32), max_len=16)
    weights = random_weights(spec, seed=1)
    gen = Generator(reference_step(graph, weights, spec.new_caches()), max_len=16)
    first = gen.generate([3, 4], max_new_tokens=8)
    assert len(first.tokens) == 8 and len(first.step_seconds) == 9
    again = gen.generate([3, 4], max_new_tokens=8, stop_tokens=[first.tokens[2]])  # caches reused from position 0
    assert again.tokens == first.tokens[: first.tokens.index(first.tokens[2]) + 1]
    with pytest.raises(me.GraphError, match="cache rows"):
        gen.generate([1] * 10, max_new_tokens=8)


def test_random_weights_bf16_logits_not_degenerate():
    graph, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=8)
    weights = random_weights(spec, seed=2)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    logits, _ = reference_step(graph, weights, spec.new_caches())(torch.tensor([5], dtype=torch.int32), 0)
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, 1024)
    assert torch.isfinite(logits).all() and logits.float().std() > 0.1
    with pytest.raises(me.GraphError, match="rebuild"):
        spec.new_caches(dtype=torch.float16)


# --- config errors name the field ----------------------------------------------------------------
LLAMA_HF = {**PRESETS["tiny"]}
QWEN_HF = {**PRESETS["qwen3-0.6b"]}


@pytest.mark.parametrize(
    "base,override,field",
    [
        (LLAMA_HF, {"model_type": "gemma"}, "model_type"),
        (LLAMA_HF, {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        (LLAMA_HF, {"hidden_act": "gelu"}, "hidden_act"),
        (LLAMA_HF, {"attention_bias": True}, "attention_bias"),
        (LLAMA_HF, {"mlp_bias": True}, "mlp_bias"),
        (LLAMA_HF, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        (LLAMA_HF, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        (LLAMA_HF, {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters"),
        (LLAMA_HF, {"num_key_value_heads": 3}, "num_key_value_heads"),
        (LLAMA_HF, {"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        (LLAMA_HF, {"dtype": "float8_e4m3fn"}, "dtype"),  # (transformers 5's name: the message names it)
        (LLAMA_HF, {"dtype": ["bfloat16"]}, "dtype"),  # (unhashable: was a TypeError)
        (LLAMA_HF, {"model_type": ["llama"]}, "model_type"),  # (likewise)
        (LLAMA_HF, {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        (LLAMA_HF, {"hidden_size": None}, "hidden_size"),
        (QWEN_HF, {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        (QWEN_HF, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (LLAMA_HF, {"num_hidden_layers": 10**7, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
                    "num_key_value_heads": 2}, "num_hidden_layers"),  # (small weights: it used to hang building the graph)
    ],
)
def test_config_errors_name_the_field(base, override, field):
    with pytest.raises(UnsupportedConfig, match=repr(field)):
        ModelConfig.from_hf({**base, **override})


def test_config_reads_both_rope_layouts():
    old = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])  # transformers 4: rope_theta + rope_scaling
    new_hf = {k: v for k, v in PRESETS["llama-3.1-8b"].items() if k not in ("rope_theta", "rope_scaling")}
    rope_parameters = {**PRESETS["llama-3.1-8b"]["rope_scaling"], "rope_theta": 5e5}
    new = ModelConfig.from_hf({**new_hf, "rope_parameters": rope_parameters})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling["factor"] == 8.0
    qwen = ModelConfig.from_hf(PRESETS["qwen3-8b"])
    got = (qwen.arch, qwen.rope_scaling, qwen.rope_theta, qwen.head_dim, qwen.tie_embeddings)
    assert got == ("qwen3", None, 1e6, 128, False)


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral", "qwen3", "qwen3_moe"])
def test_config_fields_left_out_take_the_architectures_defaults(arch):
    """A config.json may leave out head_dim, num_key_value_heads, max_position_embeddings, rms_norm_eps,
    rope_theta: transformers' defaults differ by architecture (Qwen3's head_dim is 128 whatever the hidden size;
    they were read as Llama's, hidden // heads, heads and 2048, so such a Qwen3 checkpoint failed to load;
    Mixtral's eps 1e-5 and theta 1e6 were read as 1e-6 and 1e4, other logits)."""
    sizes = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=32, vocab_size=97)
    if arch == "qwen3_moe":
        sizes.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "mixtral":
        sizes.update(num_local_experts=4, num_experts_per_tok=2)
    cfg = ModelConfig.from_hf({"model_type": arch, **sizes})
    hf = transformers.AutoConfig.for_model(arch, **sizes)
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # (the models' fallback)
    window = getattr(hf, "sliding_window", None) if arch == "mistral" else None  # (Mistral's default: 4096)
    assert (cfg.head_dim, cfg.kv_heads, cfg.max_positions) == (
        hf_head_dim, hf.num_key_value_heads, min(hf.max_position_embeddings, window or hf.max_position_embeddings))
    assert (cfg.rms_eps, cfg.rope_theta) == (hf.rms_norm_eps, hf.rope_parameters["rope_theta"])
    # null num_key_value_heads: transformers reads num_attention_heads
    assert ModelConfig.from_hf({"model_type": arch, **sizes, "num_key_value_heads": None}).kv_heads == 32


def test_qwen3_checkpoint_without_head_dim_loads_and_matches(tmp_path):
    save_tiny(tmp_path, "qwen3", head_dim=128, seed=16)  # not hidden 64 / 4 heads
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    del hf_cfg["head_dim"]  # transformers reads Qwen3Config's default, 128
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    cfg = read_config(tmp_path)
    assert cfg.head_dim == model.config.head_dim == 128
    graph, spec = build_decode_graph(cfg, max_len=16)
    step = reference_step(graph, load_checkpoint(tmp_path, spec), spec.new_caches())  # was: q_proj misshaped
    out = Generator(step, max_len=16).generate([5, 6, 7], max_new_tokens=6)
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    assert out.tokens == want


# --- checkpoint errors name the tensor -----------------------------------------------------------
def write_checkpoint(path, hf_config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.fixture
def tiny_f32():
    hf = {**PRESETS["tiny"], "torch_dtype": "float32"}
    graph, spec = build_decode_graph(ModelConfig.from_hf(hf), max_len=8)
    return hf, spec, random_weights(spec, seed=3)


def test_checkpoint_round_trip_casts_to_model_dtype(tmp_path, tiny_f32):
    hf, spec, weights = tiny_f32
    write_checkpoint(tmp_path, hf, {**weights, "unused.extra": torch.zeros(2)})
    loaded = load_checkpoint(tmp_path, spec)
    assert list(loaded) == list(spec.weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)
    _, spec16 = build_decode_graph(ModelConfig.from_hf(PRESETS["tiny"]), max_len=8)  # same model in bf16
    loaded16 = load_checkpoint(tmp_path, spec16, dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in loaded16.values())


def test_checkpoint_missing_tensor_is_named(tmp_path, tiny_f32):
    hf, spec, weights = tiny_f32
    name = "model.layers.1.mlp.up_proj.weight"
    write_checkpoint(tmp_path, hf, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path, spec)


def test_checkpoint_misshaped_tensor_is_named(tmp_path, tiny_f32):
    hf, spec, weights = tiny_f32
    name = "model.layers.0.self_attn.k_proj.weight"
    write_checkpoint(tmp_path, hf, {**weights, name: weights[name][:64]})
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*shape \[64, 256\], expected \[128, 256\]"):
        load_checkpoint(tmp_path, spec)


def test_checkpoint_of_another_model_names_the_field(tmp_path, tiny_f32):
    hf, spec, weights = tiny_f32
    write_checkpoint(tmp_path, {**hf, "num_hidden_layers": 3}, weights)
    with pytest.raises(CheckpointError, match="layers is 3"):
        load_checkpoint(tmp_path, spec)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "nowhere", spec)
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_checkpoint(tmp_path / "config_only", spec)


# --- presets --------------------------------------------------------------------------------------
PARAMS = {  # published parameter counts (tied heads counted once)
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build(name):
    cfg = ModelConfig.preset(name)
    t0 = time.perf_counter()
    graph, spec = build_decode_graph(cfg, max_len=2048)
    seconds = time.perf_counter() - t0
    print(f"\n{name}: {len(graph.nodes)} nodes, {spec.weight_bytes / 1e9:.2f} GB, built in {seconds * 1e3:.1f} ms")
    assert seconds < 2.0
    assert graph.symbols() == {"pos"} and set(graph.outputs) == {"logits", "next_token"}
    assert len(spec.caches) == 2 * cfg.layers
    assert ("lm_head.weight" in spec.weights) != cfg.tie_embeddings
    assert ("model.layers.0.self_attn.q_norm.weight" in spec.weights) == cfg.qk_norm
    if name in PARAMS:
        assert spec.weight_bytes == 2 * PARAMS[name]


# --- checkpoints that disagree with their config.json: read as transformers reads them, with a warning (issue 36) ---
def _hf_tokens(path, prompt, n):
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def _our_tokens(path, cfg, prompt, n, executor="reference"):
    graph, spec = build_decode_graph(cfg, max_len=32)
    weights = load_checkpoint(path, spec)
    if executor == "reference":
        step = reference_step(graph, weights, spec.new_caches())
    else:
        step = kernel_step(me.compile(graph, weights, backend="sim", max_dims={"pos": 31}), spec.new_caches())
    return Generator(step, max_len=32).generate(prompt, max_new_tokens=n).tokens


def _set_config(path, **fields):
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, **fields}))


@pytest.mark.parametrize("shard, executor", [(False, "reference"), (True, "megakernel-sim")])
def test_tied_config_with_a_different_stored_head_uses_the_stored_head_as_transformers(tmp_path, caplog, shard, executor):
    """transformers 5 does not tie a config's head to the embeddings when the checkpoint stores both with different
    values: it uses the stored lm_head.weight (and warns). megaegg read the config and used the embedding: other tokens."""
    save_tiny(tmp_path, "llama", seed=21, tie_word_embeddings=False, max_shard_size="40KB" if shard else "1GB")
    _set_config(tmp_path, tie_word_embeddings=True)
    prompt = torch.randint(0, 97, (4,), generator=torch.Generator().manual_seed(21)).tolist()
    want = _hf_tokens(tmp_path, prompt, 8)
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        cfg = read_config(tmp_path)
    assert not cfg.tie_embeddings
    warned = [r.getMessage() for r in caplog.records if r.name == "megaegg"]
    assert len(warned) == 1 and re.search(r"config\.json sets tie_word_embeddings, but the checkpoint's lm_head\.weight "
                                          r"differs from model\.embed_tokens\.weight: using the stored lm_head\.weight, "
                                          r"as transformers does", warned[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        assert _our_tokens(tmp_path, cfg, prompt, 8, executor) == want
    assert not [r for r in caplog.records if r.name == "megaegg"]  # said once, by read_config
    # a graph built from config.json as written (tied) would read the embedding as its head: refused, not wrong tokens
    tied = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    _, spec = build_decode_graph(tied, max_len=32)
    with pytest.raises(CheckpointError, match=r"the graph ties the LM head to the embeddings \(tie_word_embeddings\), but "
                                              r"the checkpoint's lm_head\.weight differs .* build the graph from "
                                              r"megaegg\.models\.read_config\(path\)"):
        load_checkpoint(tmp_path, spec)


def test_tied_config_with_a_stored_copy_of_the_embedding_loads_silently(tmp_path, caplog):
    save_tiny(tmp_path, "qwen3", seed=22, tie_word_embeddings=True)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # (save_pretrained drops a tied head) ...
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # ... other tools keep a copy
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompt = [5, 6, 7]
    want = _hf_tokens(tmp_path, prompt, 6)
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        cfg = read_config(tmp_path)
        assert cfg.tie_embeddings and _our_tokens(tmp_path, cfg, prompt, 6) == want
    assert not [r for r in caplog.records if r.name == "megaegg"]


def test_checkpoint_tensors_the_config_does_not_name_are_ignored_and_listed(tmp_path, caplog):
    """Layers beyond num_hidden_layers and unknown tensors: transformers ignores them (its UNEXPECTED keys); so does
    megaegg, in one warning. Old checkpoints' rotary_emb.inv_freq buffers are dropped silently, as transformers does."""
    save_tiny(tmp_path, "llama", seed=23, num_hidden_layers=4, max_shard_size="60KB")
    _set_config(tmp_path, num_hidden_layers=2)
    extra = {"model.extra.weight": torch.zeros(3), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    safetensors_torch.save_file(extra, str(tmp_path / "extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "extra.safetensors" for n in extra})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    prompt = [9, 10, 11, 12]
    want = _hf_tokens(tmp_path, prompt, 6)
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        assert _our_tokens(tmp_path, read_config(tmp_path), prompt, 6) == want
    warned = [r.getMessage() for r in caplog.records if r.name == "megaegg"]
    assert len(warned) == 1, warned
    assert re.search(r"ignored 19 checkpoint tensor\(s\) that config\.json does not name \(as transformers does\): "
                     r"layers 2-3 \(18 tensors\), beyond num_hidden_layers=2; model\.extra\.weight$", warned[0])
    assert "inv_freq" not in warned[0]


def test_a_long_list_of_ignored_tensors_is_cut_short(tmp_path, caplog, tiny_f32):
    hf, spec, weights = tiny_f32
    extra = {f"vision_tower.block{i:02d}.weight": torch.zeros(2) for i in range(20)}
    write_checkpoint(tmp_path, hf, {**weights, **extra, "model.layers.7.mlp.up_proj.weight": torch.zeros(2),
                                    "model.layers.5.mlp.up_proj.weight": torch.zeros(2)})
    with caplog.at_level(logging.WARNING, logger="megaegg"):
        loaded = load_checkpoint(tmp_path, spec)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "megaegg"]
    assert re.search(r"ignored 22 checkpoint tensor\(s\) .*: layers 5, 7 \(2 tensors\), beyond num_hidden_layers=2; "
                     r"vision_tower\.block00\.weight, .*vision_tower\.block07\.weight and 12 more$", msg)
