"""Hugging Face causal LMs through their own modelling code (megaegg.from_transformers, issue 41): small
random checkpoints of each architecture, on the simulator, generate transformers' own greedy tokens."""

from __future__ import annotations

import pytest
import torch

import megaegg as me

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(**SMALL)
    if arch == "qwen3":
        return transformers.Qwen3Config(**SMALL, head_dim=16)
    if arch == "mistral":
        return transformers.MistralConfig(**SMALL, sliding_window=None)
    if arch == "olmo2":
        return transformers.Olmo2Config(**SMALL)
    if arch == "granite":
        return transformers.GraniteConfig(**SMALL, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.25, logits_scaling=4.0)
    if arch == "phi3":
        return transformers.Phi3Config(**SMALL, pad_token_id=0)
    if arch == "qwen2":  # (q / k / v biases; the LM head tied to the embedding)
        return transformers.Qwen2Config(**{**SMALL, "tie_word_embeddings": True})
    if arch == "gemma":  # ((1 + w) norms: folded into weights; a scaled embedding; GELU-tanh gating)
        return transformers.GemmaConfig(**SMALL, head_dim=16)
    if arch == "gemma2":  # (+ post-norms, the final logits soft-capped; attention soft-capping off: refused)
        return transformers.Gemma2Config(**SMALL, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=30.0)
    if arch == "gemma3":  # (+ q / k norms, local and global RoPE; a window no shorter than max_len)
        return transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=64)
    # routed experts (hf.py: ROUTED_BLOCKS): top-2 of 4, Qwen3-MoE's first layer dense; Qwen2-MoE's shared expert
    moe = dict(num_experts_per_tok=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**SMALL, **moe, head_dim=16, num_experts=4, moe_intermediate_size=32,
                                           mlp_only_layers=[0], norm_topk_prob=True)
    if arch == "mixtral":
        return transformers.MixtralConfig(**SMALL, **moe, num_local_experts=4)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**SMALL, **moe, num_experts=4)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**SMALL, **moe, num_experts=4, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)
    # more architectures without a hand-written builder (interleaved RoPE: GLM, Helium, ERNIE 4.5; SmolLM3's
    # layers without RoPE; OLMo3's and EXAONE 4's norms after the blocks)
    more = {"exaone4": "Exaone4Config", "olmo3": "Olmo3Config", "seed_oss": "SeedOssConfig", "ministral": "MinistralConfig",
            "smollm3": "SmolLM3Config", "helium": "HeliumConfig", "ernie4_5": "Ernie4_5Config", "glm": "GlmConfig",
            "glm4": "Glm4Config"}
    if arch in more:
        return getattr(transformers, more[arch])(**SMALL, head_dim=16, pad_token_id=None, bos_token_id=None,
                                                 eos_token_id=None)
    raise KeyError(arch)


def _model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = _config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # weights large enough that the greedy tokens depend on every layer
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "olmo2", "granite", "phi3", "qwen2", "gemma", "gemma2",
                                  "gemma3", "exaone4", "olmo3", "seed_oss", "ministral", "smollm3", "helium", "ernie4_5",
                                  "glm", "glm4", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_greedy_tokens_equal_transformers(arch):
    model = _model(arch)
    prompt = [5, 17, 42, 8, 63, 1]
    lm = me.from_transformers(model, max_len=24, backend="sim")
    got = lm.generate(prompt, 8)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want, (arch, got, want)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "qwen3-moe-tiny"])
def test_the_traced_decode_step_runs_the_hand_built_graphs_block_ops(preset):
    """RoPE as transformers writes it (angles, cos / sin cast to bf16, slices, a negation, a concatenation,
    products and a sum) becomes one rope op each for q and k, rounded as transformers rounds (rules.py:
    _recover_rope), with qwen3's q / k norms and the K append folded into it: the traced bf16 decode step
    runs the block ops of the hand-built decode graph of the same config (no elementwise op left), but the
    built graph's greedy argmax (the traced step returns the logits), with the logits of transformers' bf16
    forward (to bf16's noise: the fused RoPE itself is bit for bit, test_frontend.py). Qwen3-MoE's sparse blocks
    (hf.py: ROUTED_BLOCKS) become the built graph's routed experts, the router and the norm fused alike."""
    from collections import Counter

    from megaegg.models import PRESETS, ModelConfig, build_decode_graph, random_weights

    cfg = dict(PRESETS[preset])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with torch.no_grad():  # (spread-out logits, as _model's)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    model = model.to(torch.bfloat16).eval()
    lm = me.from_transformers(model, max_len=16, backend="sim")
    traced = Counter(e.op.kind for e in lm.kernel.kernel.queue.entries)
    graph, spec = build_decode_graph(ModelConfig.preset(preset), max_len=16)
    built = Counter(e.op.kind for e in me.compile(graph, random_weights(spec), backend="sim").queue.entries)
    assert traced == built - Counter(argmax_partial=1, argmax_reduce=1), (traced, built)
    ropes = [e.op for e in lm.kernel.kernel.queue.entries if e.op.kind == "rope"]
    assert all(op.params.get("hf") and "pos_ids" in op.params["roles"] for op in ropes)
    assert all(("g" in op.params["roles"]) == preset.startswith("qwen3") for op in ropes)
    ids = [5, 17, 42, 8, 63, 1]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    lm.prompt(ids[:4])
    for p in (4, 5):
        got = lm.step(ids[p], p)
        assert ((got - want[p]).norm() / want[p].norm()).item() < 2e-2, p


def test_logits_of_a_step_match_the_model():
    model = _model("llama", seed=3)
    lm = me.from_transformers(model, max_len=16, backend="sim")
    ids = [3, 9, 27, 81 % 96]
    logits = [lm.step(t, p) for p, t in enumerate(ids)][-1]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bad_arguments_are_one_clear_error():
    lm = me.from_transformers(_model("llama"), max_len=8, backend="sim")
    with pytest.raises(ValueError, match="exceeds max_len 8"):
        lm.generate([1, 2, 3], 6)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        lm.generate([], 2)
    with pytest.raises(ValueError, match="position 8 is outside"):
        lm.step(1, 8)
    with pytest.raises(ValueError, match="position 1.5 is outside"):
        lm.step(1, 1.5)
    with pytest.raises(ValueError, match=r"prompt_ids: token 96 is outside the vocabulary \[0, 96\)"):
        lm.generate([1, 96], 2)
    with pytest.raises(ValueError, match="token ids must be ints"):
        lm.prompt([1.0, 2.0])
    with pytest.raises(ValueError, match="max_len must be an int >= 2"):
        me.from_transformers(_model("llama"), max_len=8.5, backend="sim")
    with pytest.raises(ValueError, match="takes a transformers causal LM .*got Linear"):
        me.from_transformers(torch.nn.Linear(4, 4), backend="sim")
    with pytest.raises(me.GraphError, match="backend must be one of"):
        me.from_transformers(_model("llama"), max_len=8, backend="gpu")


def test_generate_takes_a_tokenizers_tensor_and_several_eos_ids():
    model = _model("mistral", seed=6)
    lm = me.from_transformers(model, max_len=24, backend="sim")
    ids = torch.tensor([[5, 17, 42, 8]])  # (what a tokenizer returns with return_tensors="pt")
    full = lm.generate(ids, 8)
    assert lm.generate([5, 17, 42, 8], 8) == full
    stop = {full[3], 95}  # the 4th token ends it (and an id that never comes)
    first = next(k for k, t in enumerate(full) if t in stop)
    assert lm.generate(ids, 8, eos_token_id=sorted(stop)) == full[:first + 1]
    assert lm.generate(ids, 0) == []


def test_a_moe_prompt_routes_its_rows_inside_the_kernel():
    """Qwen3-MoE's prompt step (n rows) takes the step graph's routed experts (moe_route, moe_experts: each chosen
    expert once for its rows), its decode step the one-row moe_glu_down."""
    lm = me.from_transformers(_model("qwen3_moe"), max_len=24, backend="sim")
    assert {"moe_route", "moe_experts"} <= {e.op.kind for e in lm.prompt_kernel.kernel.queue.entries}
    assert "moe_glu_down" in {e.op.kind for e in lm.kernel.kernel.queue.entries}


def test_other_moe_blocks_are_refused_by_name():
    """Phi-3.5-MoE's router (sparsemixer) is not ops.moe_mlp's softmax top-k: one error naming the block."""
    cfg = transformers.PhimoeConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(me.frontend.UnsupportedTorch, match=r"routed experts \(PhimoeSparseMoeBlock\) are not supported"):
        me.from_transformers(model, max_len=16, backend="sim")


def test_what_the_attention_ops_do_not_compute_is_refused():
    """Gemma 2's attention soft-capping would be silently dropped: one error naming it instead."""
    cfg = transformers.Gemma2Config(**{**SMALL, "head_dim": 16})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(me.frontend.UnsupportedTorch, match="Gemma2Attention: attention logit soft-capping"):
        me.from_transformers(model, max_len=16, backend="sim")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "olmo2", "granite", "phi3", "qwen2", "gemma3", "qwen3_moe",
                                  "mixtral"])
def test_the_example_cli_generates_transformers_tokens(arch, capsys):
    """examples/hf.py's flags (--arch ... --random-weights, --prompt-ids, --json): its generated_ids are
    transformers' greedy tokens for the same random model."""
    import json

    from megaegg.frontend import hf_cli

    argv = ["--arch", arch, "--random-weights", "--backend", "sim", "--prompt-ids", "4", "8", "15",
            "--max-new-tokens", "5", "--ignore-eos", "--json"]
    out = hf_cli.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generated_ids"] == out["generated_ids"]
    model, _ = hf_cli.load_model(hf_cli.parse(argv), torch.float32, "cpu")
    with torch.no_grad():
        want = model.generate(torch.tensor([[4, 8, 15]]), max_new_tokens=5, do_sample=False, min_new_tokens=5,
                              pad_token_id=0)[0, 3:].tolist()
    assert out["generated_ids"] == want
    with pytest.raises(SystemExit, match="--prompt-ids: token 999 is outside the vocabulary"):
        hf_cli.main(["--arch", "llama", "--random-weights", "--backend", "sim", "--prompt-ids", "999"])


def test_sampling_is_reproducible_by_seed():
    from megaegg.models.batch import Sampling

    lm = me.from_transformers(_model("qwen3", seed=5), max_len=20, backend="sim")
    a = lm.generate([1, 2, 3], 8, sampling=Sampling(temperature=1.5, top_k=20, top_p=0.9, seed=11))
    b = lm.generate([1, 2, 3], 8, sampling=Sampling(temperature=1.5, top_k=20, top_p=0.9, seed=11))
    c = lm.generate([1, 2, 3], 8, sampling=Sampling(temperature=1.5, top_k=20, top_p=0.9, seed=12))
    assert a == b and len(a) == 8 and all(0 <= t < 96 for t in a)
    assert a != c  # (8 draws at temperature 1.5 over 20 tokens: equal by chance with probability ~0)


def test_the_example_cli_reads_a_checkpoint_and_its_tokenizer(tmp_path, capsys):
    """--model DIR with --prompt: transformers loads the checkpoint and tokenizer, the text is decoded; a
    directory that is no checkpoint is one error line."""
    from megaegg.frontend import hf_cli
    from tiny_checkpoints import save_tiny

    save_tiny(tmp_path / "m", "qwen3", seed=2, tokenizer=True)
    out = hf_cli.main(["--model", str(tmp_path / "m"), "--backend", "sim", "--prompt", "w5 w9 w13",
                       "--max-new-tokens", "4", "--ignore-eos"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([out["prompt_ids"]]), max_new_tokens=4, do_sample=False,
                              min_new_tokens=4, pad_token_id=0)[0, len(out["prompt_ids"]):].tolist()
    assert out["generated_ids"] == want
    assert capsys.readouterr().out.strip().splitlines()[-1] == " ".join(f"w{t}" for t in want)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="error: --model .*empty: transformers could not load it"):
        hf_cli.main(["--model", str(tmp_path / "empty"), "--backend", "sim", "--prompt-ids", "1"])


def test_a_prompt_in_one_launch_and_in_chunks_gives_the_models_logits():
    """prompt(ids): the tokens' K / V written and the last token's logits in one launch; a second chunk
    at start > 0 continues from the caches (chunked prefill), then decode steps go on from there."""
    model = _model("qwen3", seed=4)
    lm = me.from_transformers(model, max_len=24, backend="sim")
    ids = [7, 3, 91, 40, 2, 66, 18, 5, 33]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    tol = dict(rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(lm.prompt(ids), want[-1], **tol)
    lm.reset()
    lm.prompt(ids[:4])
    torch.testing.assert_close(lm.prompt(ids[4:8], start=4), want[7], **tol)
    torch.testing.assert_close(lm.step(ids[8], 8), want[8], **tol)
    with pytest.raises(ValueError, match="outside the caches' max_len 24"):
        lm.prompt(list(range(20)), start=10)


def test_the_smallest_caches():
    """max_len 2: the export's example sizes stay in range."""
    lm = me.from_transformers(_model("llama"), max_len=2, backend="sim")
    assert len(lm.generate([7], 1)) == 1


def test_rope_that_transformers_rescales_by_length_runs_below_that_length():
    """LongRoPE (Phi-3.5-mini, Phi-3-128k) and dynamic NTK scaling recompute their frequencies from the sequence
    length in the forward (an in-place buffer update torch.export refused): below the length past which they
    change, the compiled steps take the frequencies transformers uses there, with its logits; a max_len past it
    is one error naming the rope type and the length. The model is left as it was."""
    rope = dict(rope_type="longrope", short_factor=[1.5] * 8, long_factor=[3.0] * 8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
        **SMALL, pad_token_id=0, rope_scaling=rope, original_max_position_embeddings=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    ids = [5, 17, 42, 8, 63, 1]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    lm = me.from_transformers(model, max_len=24, backend="sim")
    tol = dict(rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(lm.prompt(ids[:5]), want[4], **tol)
    torch.testing.assert_close(lm.step(ids[5], 5), want[5], **tol)
    assert model.model.rotary_emb.rope_type == "longrope"
    with pytest.raises(me.frontend.UnsupportedTorch, match="rope_type 'longrope' changes its frequencies past 32 "
                                                           "positions.*give max_len <= 32"):
        me.from_transformers(model, max_len=40, backend="sim")
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**SMALL, "max_position_embeddings": 16}, rope_scaling=dict(rope_type="dynamic", factor=2.0)))
    with pytest.raises(me.frontend.UnsupportedTorch, match="rope_type 'dynamic' changes its frequencies past 16"):
        me.from_transformers(llama, max_len=24, backend="sim")


def test_numpy_and_tensor_integers_are_token_ids_and_positions():
    """What tokenizers (return_tensors="np") and argmax return: numpy integers and 0-d integer tensors are ints
    (they were refused as 'not ints'); a sampling that is no Sampling, and caches beyond the host's memory, are
    one error naming them (an AttributeError and the allocator's message before)."""
    import numpy as np

    lm = me.from_transformers(_model("llama", seed=8), max_len=12, backend="sim")
    want = lm.generate([5, 17, 42], 4)
    assert lm.generate(np.array([5, 17, 42]), np.int64(4)) == want
    assert lm.generate([np.int32(5), torch.tensor(17), 42], 4) == want
    lm.reset()
    logits = [lm.step(t, p) for p, t in enumerate([torch.tensor(5), np.int64(17)])][-1]
    lm.reset()
    torch.testing.assert_close(lm.prompt(np.array([5, 17]), start=np.int64(0)), logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="token ids must be ints, got tensor\\(5.\\)"):
        lm.step(torch.tensor(5.0), 0)
    with pytest.raises(ValueError, match="sampling must be a megaegg.models.batch.Sampling, got dict"):
        lm.generate([5], 2, sampling={"temperature": 1.0})
    with pytest.raises(me.GraphError, match=r"KV caches of max_len 1000000000 .* needs .*: give a smaller max_len"):
        me.from_transformers(_model("llama"), max_len=10**9, backend="sim")
