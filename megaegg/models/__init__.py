"""Model definitions on the Graph API: Llama / Qwen3 configs, the decode-step graph, weights, generation.

>>> from megaegg.models import ModelConfig, build_decode_graph
>>> graph, spec = build_decode_graph(ModelConfig.preset("llama-3.2-1b"), max_len=2048)
>>> round(spec.weight_bytes / 1e9, 2)
2.47
"""

from .config import ModelConfig, UnsupportedConfig
from .decoder import ModelSpec, build_decode_graph, build_step_graph, decoder_layer, shard_caches, shard_weights
from .generate import Generation, Generator, StepFn, check_token_ids, kernel_step, reference_step
from .presets import PRESETS
from .weights import CheckpointError, eos_token_ids, load_checkpoint, random_weights, read_config

__all__ = [
    "ModelConfig", "UnsupportedConfig", "ModelSpec", "build_decode_graph", "build_step_graph", "decoder_layer",
    "shard_caches", "shard_weights", "Generation",
    "Generator", "StepFn", "check_token_ids", "kernel_step", "reference_step", "PRESETS", "CheckpointError",
    "eos_token_ids", "load_checkpoint", "random_weights", "read_config",
]
