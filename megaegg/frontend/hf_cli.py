"""``examples/hf.py``: text generation with a Hugging Face causal LM through its own modelling code
(``megaegg.from_transformers``: the prompt in one launch, then one a token), with examples/llama.py's flags. ``--arch NAME --random-weights``: a tiny
random model of that architecture (no download)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..graph import GraphError
from ..models.batch import Sampling
from ..models.cli import (OneLineParser, non_negative_float, one_line, pick_backend, positive_int, seed_int, top_k_int,
                          unit_float)

# A tiny random config of each architecture --arch takes (transformers' config class, extra fields).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
ARCHS = {"llama": ("LlamaConfig", {}), "qwen3": ("Qwen3Config", {"head_dim": 16}),
         "mistral": ("MistralConfig", {"sliding_window": None}), "olmo2": ("Olmo2Config", {}),
         "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                       "attention_multiplier": 0.25, "logits_scaling": 4.0}),
         "phi3": ("Phi3Config", {"pad_token_id": 0}), "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
         "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 256}),
         "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32, "norm_topk_prob": True}),
         "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2})}


def parse(argv=None) -> argparse.Namespace:
    p = OneLineParser(description="Generate text with a Hugging Face causal LM through its own modelling code, "
                                  "one megakernel launch per token (megaegg.from_transformers)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="local Hugging Face checkpoint directory")
    src.add_argument("--arch", choices=sorted(ARCHS), help="a tiny random model of this architecture (with --random-weights)")
    p.add_argument("--random-weights", action="store_true", help="random weights (required with --arch)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids (default: 1 2 3 4)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=top_k_int, default=0, help="0: every token (default)")
    p.add_argument("--top-p", type=unit_float, default=1.0, help="1: every token (default)")
    p.add_argument("--seed", type=seed_int, default=0, help="the sampling seed (default: 0)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="(default: %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=None, help="KV cache rows (default: prompt + new tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even past the EOS token")
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda when a GPU is present")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="default: bf16 on cuda, f32 on the simulator and for --arch")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    a = p.parse_args(argv)
    if a.arch and not a.random_weights:
        p.error("--arch builds a random model: add --random-weights (or give --model DIR)")
    if a.model and a.random_weights:
        p.error("--random-weights goes with --arch, not --model")
    if a.prompt is not None and not a.model:
        p.error("--prompt needs --model DIR with a tokenizer; with --arch, give --prompt-ids")
    return a


def load_model(a: argparse.Namespace, dtype: torch.dtype, device: str):
    import transformers

    if a.arch:
        name, extra = ARCHS[a.arch]
        torch.manual_seed(a.seed)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**{**TINY, **extra}))
        with torch.no_grad():  # weights large enough that the tokens depend on every layer
            for w in model.parameters():
                w.copy_(torch.randn_like(w) * (0.5 if w.ndim > 1 else 0.2) + (1.0 if w.ndim == 1 else 0.0))
        return model.to(dtype=dtype, device=device).eval(), None
    if not a.model.is_dir():
        raise GraphError(f"--model {a.model}: not a directory")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    except Exception as e:  # (a missing or corrupt file, an unknown architecture)
        raise GraphError(f"--model {a.model}: transformers could not load it: {one_line(e)}") from None
    tokenizer = None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    except Exception:
        if a.prompt is not None:
            raise GraphError(f"--prompt: --model {a.model} has no tokenizer transformers can load; give --prompt-ids") from None
    return model.to(device).eval(), tokenizer


def eos_ids(model) -> set[int]:
    """Every end-of-sequence id the checkpoint names (its generation config's and its config's)."""
    out = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        ids = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        out |= set() if ids is None else {ids} if isinstance(ids, int) else set(ids)
    return out


def run(a: argparse.Namespace) -> dict:
    import megaegg as me

    backend = pick_backend(a.backend)
    device = "cuda" if backend == "cuda" else "cpu"
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}.get(a.dtype) or (
        torch.float32 if backend == "sim" or a.arch else torch.bfloat16)
    model, tokenizer = load_model(a, dtype, device)
    prompt = tokenizer(a.prompt)["input_ids"] if a.prompt is not None else (a.prompt_ids or [1, 2, 3, 4])
    vocab = model.config.get_text_config().vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise GraphError(f"--prompt-ids: token {bad[0]} is outside the vocabulary [0, {vocab})")
    max_len = a.max_len or len(prompt) + a.max_new_tokens
    if len(prompt) + a.max_new_tokens > max_len:
        raise GraphError(f"--max-new-tokens {a.max_new_tokens} after a {len(prompt)}-token prompt needs "
                         f"{len(prompt) + a.max_new_tokens} cache rows; --max-len is {max_len}")
    print(f"{type(model).__name__}: {model.config.get_text_config().num_hidden_layers} layers, {dtype}, backend {backend}, "
          f"max_len {max_len}", file=sys.stderr)
    t0 = time.perf_counter()
    lm = me.from_transformers(model, max_len=max_len, backend=backend, device=device)
    t1 = time.perf_counter()
    eos = None if a.ignore_eos else eos_ids(model)
    ids = lm.generate(prompt, a.max_new_tokens, sampling=Sampling(a.temperature, a.top_k, a.top_p, a.seed),
                      eos_token_id=eos)
    t2 = time.perf_counter()
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    print(text)
    result = {"prompt_ids": list(prompt), "generated_ids": ids, "compile_s": round(t1 - t0, 3),
              "generate_s": round(t2 - t1, 3), "backend": backend, "model": type(model).__name__}
    if a.json:
        print(json.dumps(result))
    return result


def main(argv=None) -> dict:
    a = parse(argv)
    try:
        return run(a)
    except (GraphError, ValueError) as e:  # a bad checkpoint, argument or unsupported op: one line
        raise SystemExit(f"error: {one_line(e)}") from None
