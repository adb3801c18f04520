"""Named model configs in Hugging Face ``config.json`` form (read them with ``ModelConfig.from_hf``).

The real models' published architecture hyperparameters (training-only fields such
as ``initializer_range`` are left out), plus ``tiny``, ``qwen3-tiny`` and ``qwen3-moe-tiny``,
small Llama-, Qwen3- and Qwen3-MoE-style models for demos and CI (no EOS token: random weights would
stop at it by chance).
"""

from __future__ import annotations

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}

_LLAMA3 = {
    **_LLAMA,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "use_sliding_window": False,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_QWEN3_MOE = {  # Qwen3-MoE: Qwen3's attention, routed experts in every layer but mlp_only_layers
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}

_TINY = {  # the shape of the small demo/CI models
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {
    "tiny": {**_LLAMA, **_TINY, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "qwen3-tiny": {**_QWEN3, **_TINY, "max_window_layers": 2, "bos_token_id": None, "eos_token_id": None},
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
        "rope_scaling": _llama3_rope(32.0),
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rope_scaling": _llama3_rope(8.0),
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        **_QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
    },
    "qwen3-moe-tiny": {**_QWEN3_MOE, **_TINY, "moe_intermediate_size": 128, "num_experts": 7, "num_experts_per_tok": 3,
                       "mlp_only_layers": [0], "bos_token_id": None, "eos_token_id": None},
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_window_layers": 48,
        "tie_word_embeddings": False,
    },
}

DEFAULT_PRESET = {"llama": "tiny", "qwen3": "qwen3-tiny"}  # what each example runs with --random-weights alone
FAMILY = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3"}  # model_type -> the example that runs it


def presets_of(family: str) -> list[str]:
    """The presets one example runs (``FAMILY``), in PRESETS order."""
    return [name for name, cfg in PRESETS.items() if FAMILY[cfg["model_type"]] == family]
