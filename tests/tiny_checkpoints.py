"""Small Hugging Face checkpoints for the CLI and API tests, written with transformers' save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(  # a 2-layer GQA model that compiles and steps on the simulator in well under a second
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=97, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
)


SMALL_MOE = dict(moe_intermediate_size=48, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True)  # (qwen3_moe)


def save_tiny(path: Path, arch: str = "llama", *, seed: int = 0, tokenizer: bool = False, max_shard_size="1GB",
              **config) -> Path:
    """A random ``arch`` checkpoint (f32) in ``path``; ``config`` overrides SMALL. With ``tokenizer``, a
    word-level one: token i is the word ``w{i}`` (so ``decode([3, 5]) == "w3 w5"``)."""
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[arch]
    model = cls[1](cls[0](**{**SMALL, **(SMALL_MOE if arch == "qwen3_moe" else {}), **config}))
    with torch.no_grad():  # spread-out logits: greedy tokens vary and do not tie
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    model.float().save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        save_word_tokenizer(path, model.config.vocab_size)
    return path


def save_word_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
