"""Model hyperparameters, read from a Hugging Face ``config.json`` dict.

Only what the decode graph needs is kept; a feature the graph does not implement
(biases, sliding windows, other rope scalings, ...) raises :class:`UnsupportedConfig`
naming the config field, instead of silently computing something else.

>>> from megaegg.models.presets import PRESETS
>>> cfg = ModelConfig.from_hf(PRESETS["llama-3.2-1b"])
>>> cfg.arch, cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.rope_scaling["rope_type"], cfg.dtype
('llama', 16, 8, 64, 'llama3', bf16)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..dtypes import DType, bf16, f16, f32
from ..graph import GraphError

# (Mistral is Llama's graph; its sliding window, where one is set, bounds the context instead: below it the
# window is the whole cache, so the model is exact there)
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
ROPE_TYPES = ("default", "llama3")
_DTYPES = {"bfloat16": bf16, "float16": f16, "float32": f32}
# transformers' defaults of fields a config.json may leave out, where an architecture's differ from
# Llama's (head_dim: hidden_size // num_attention_heads, num_key_value_heads: num_attention_heads,
# max_position_embeddings: 2048, rms_norm_eps: 1e-6, rope_theta: 10000); e.g. Qwen3Config's head_dim is 128
# whatever the hidden size, MixtralConfig's rms_norm_eps 1e-5 and rope_theta 1e6
_DEFAULTS = {"qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768},
             "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768},
             "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
             "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": None,
                         "rms_norm_eps": 1e-5, "rope_theta": 1e6}}


class UnsupportedConfig(GraphError):
    """A config.json asks for something the decode graph does not implement; names the field."""


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts of a Qwen3-MoE model (``qwen3_moe``)."""

    experts: int  # num_experts (transformers 5: num_local_experts)
    top_k: int  # num_experts_per_tok
    intermediate: int  # moe_intermediate_size: one expert's MLP width
    normalize: bool  # norm_topk_prob: the top-k weights divided by their sum
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts' (the others are dense)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (Llama / Qwen3 / Qwen3-MoE family), sizes in elements."""

    arch: str  # a key of ARCHS (qwen3 and qwen3_moe add per-head q/k RMSNorm; qwen3_moe and mixtral route experts)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None (plain RoPE) or a llama3 dict with "rope_type": "llama3"
    tie_embeddings: bool  # the LM head reads model.embed_tokens.weight
    max_positions: int
    dtype: DType
    moe: MoeConfig | None = None  # qwen3_moe: the routed experts

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the routed experts' (Qwen3-MoE's sparse layers)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def weight_terms(self) -> dict[str, int]:
        """The weights' elements by the config.json fields that size them, largest first: e.g.
        ``{"vocab_size=1024 x hidden_size=256 (embedding, LM head)": 524288, ...}`` (for size messages)."""
        H, L, D, dense = self.hidden, self.layers, self.head_dim, self.layers
        terms = {f"vocab_size={self.vocab} x hidden_size={H} (embedding{'' if self.tie_embeddings else ', LM head'})":
                 self.vocab * H * (1 if self.tie_embeddings else 2),
                 f"num_hidden_layers={L} x num_attention_heads={self.heads} x head_dim={D} x hidden_size={H} (q, o)":
                 2 * L * self.heads * D * H,
                 f"num_hidden_layers={L} x num_key_value_heads={self.kv_heads} x head_dim={D} x hidden_size={H} (k, v)":
                 2 * L * self.kv_heads * D * H,
                 f"num_hidden_layers={L} x hidden_size={H} (norms)": (2 * L + 1) * H + (2 * L * D if self.qk_norm else 0)}
        if self.moe is not None:
            sparse = len(self.moe.sparse_layers)
            dense = L - sparse
            terms[f"{sparse} sparse layers x num_experts={self.moe.experts} x moe_intermediate_size={self.moe.intermediate} "
                  f"x hidden_size={H} (experts)"] = sparse * self.moe.experts * (3 * self.moe.intermediate + 1) * H
        if dense:
            terms[f"num_hidden_layers={dense} x intermediate_size={self.intermediate} x hidden_size={H} (MLP)"] = \
                3 * dense * self.intermediate * H
        return dict(sorted(terms.items(), key=lambda kv: -kv[1]))

    @property
    def weight_elements(self) -> int:
        """The model's parameter count (a tied LM head counted once)."""
        return sum(self.weight_terms().values())

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
        return self.arch in ("qwen3", "qwen3_moe")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Read a Hugging Face config.json dict (transformers 4 or 5 layout) of a supported model."""
        arch = cfg.get("model_type")
        if not isinstance(arch, str) or arch not in ARCHS:  # (a list or an object: unhashable, a TypeError)
            _unsupported("model_type", arch, f"one of {', '.join(ARCHS)}")
        archs = cfg.get("architectures") or [ARCHS[arch]]
        if list(archs) != [ARCHS[arch]]:
            _unsupported("architectures", archs, f"[{ARCHS[arch]!r}]")
        _require(cfg, "hidden_act", "silu", "silu")
        _require(cfg, "attention_bias", False, "false")
        _require(cfg, "mlp_bias", False, "false")
        _require(cfg, "use_sliding_window", False, "false (sliding-window attention is not implemented)")
        for field in ("quantization_config", "final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(field) is not None:
                _unsupported(field, cfg[field], "absent")
        layer_types = cfg.get("layer_types") or []
        if not isinstance(layer_types, list):  # (a str would be read letter by letter)
            _unsupported("layer_types", layer_types, "a list of 'full_attention'")
        if any(t != "full_attention" for t in layer_types):
            _unsupported("layer_types", sorted(set(map(str, layer_types))), "only 'full_attention'")

        defaults = _DEFAULTS.get(arch, {})
        heads = _int(cfg, "num_attention_heads")
        # (absent: the architecture's default; null: num_attention_heads, as transformers reads it)
        kv_default = heads if "num_key_value_heads" in cfg else defaults.get("num_key_value_heads", heads)
        kv_heads = _int(cfg, "num_key_value_heads", default=kv_default)
        if heads % kv_heads:
            _unsupported("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
        hidden = _int(cfg, "hidden_size")
        head_dim = _int(cfg, "head_dim", default=defaults.get("head_dim", hidden // heads))
        if head_dim % 2 or not head_dim:  # (0: hidden_size below num_attention_heads)
            _unsupported("head_dim", head_dim, "even, >= 2")
        theta, scaling = _rope(cfg, defaults.get("rope_theta", 10000.0))
        layers = _int(cfg, "num_hidden_layers")
        if layers > MAX_LAYERS:
            _unsupported("num_hidden_layers", layers, f"at most {MAX_LAYERS} (the queue has entries per layer: 1024 "
                                                      "layers compile in ~45 s)")
        moe = _moe(cfg, layers, arch) if arch in ("qwen3_moe", "mixtral") else None
        dtype_field = "dtype" if cfg.get("dtype") else "torch_dtype"  # (transformers 5 writes dtype, 4 torch_dtype)
        dtype_name = cfg.get(dtype_field) or "float32"  # transformers' default
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            _unsupported(dtype_field, dtype_name, f"one of {', '.join(_DTYPES)}")
        cfg = cls(
            arch=arch,
            hidden=hidden,
            intermediate=_int(cfg, "intermediate_size"),
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=_int(cfg, "vocab_size"),
            rms_eps=_float(cfg, "rms_norm_eps", default=defaults.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=_bool(cfg, "tie_word_embeddings", default=False),
            max_positions=_max_positions(cfg, defaults),
            dtype=_DTYPES[dtype_name],
            moe=moe,
        )
        _check_size(cfg)
        return cfg

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named preset (``tiny``, ``llama-3.2-1b``, ``qwen3-8b``, ...): see ``presets.PRESETS``."""
        from .presets import PRESETS

        if name not in PRESETS:
            raise GraphError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        return cls.from_hf(PRESETS[name])


MAX_LAYERS = 1024  # published decoders have at most ~130; compile time grows faster than linearly past that

# more weights than any machine holds: refused when the config is read, naming the fields (what does not fit
# the machine at hand is refused before weights are drawn or read: weights.check_weights_fit)
MAX_WEIGHT_BYTES = 2**50  # 1.1 PB: the largest hosts hold tens of TB


def _check_size(cfg: ModelConfig) -> None:
    n = cfg.weight_elements * cfg.dtype.itemsize
    if n > MAX_WEIGHT_BYTES:
        from ..graph import fmt_bytes

        field, elements = next(iter(cfg.weight_terms().items()))
        raise UnsupportedConfig(f"config describes {fmt_bytes(n)} of weights ({cfg.dtype}), more than any machine holds: "
                                f"{field} is {elements} elements")


def _max_positions(cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> int:
    """max_position_embeddings, bounded by a sliding window (Mistral: absent is transformers' 4096, null none):
    below the window every cached row is attended, as the graph attends them."""
    limit = _int(cfg, "max_position_embeddings", default=defaults.get("max_position_embeddings", 2048))
    if "sliding_window" not in defaults or (cfg.get("sliding_window", defaults["sliding_window"]) is None):
        return limit  # (an architecture without one; or none set)
    return min(limit, _int(cfg, "sliding_window", default=defaults["sliding_window"]))


def _rope(cfg: Mapping[str, Any], default_theta: float) -> tuple[float, dict | None]:
    """(theta, scaling or None): transformers 5 nests both in ``rope_parameters``."""
    field = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    if not isinstance(cfg.get(field) or {}, Mapping):
        _unsupported(field, cfg[field], "an object, e.g. {\"rope_type\": \"default\"}")
    params = dict(cfg.get(field) or {})
    theta = _float(params, "rope_theta", default=_float(cfg, "rope_theta", default=default_theta), name=f"{field}.rope_theta")
    params.pop("rope_theta", None)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        _unsupported(field, f"rope_type {kind!r}", f"one of {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _unsupported(field, f"partial_rotary_factor {params['partial_rotary_factor']}", "1.0")
    if kind == "default":
        return theta, None
    if "factor" not in params:
        _unsupported(field, params, "a llama3 scaling with a 'factor'")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):  # (0: inf)
        _float(params, key, default=None if key == "factor" else 1.0, name=f"{field}.{key}")
    params["rope_type"] = kind
    params.pop("type", None)
    return theta, params


def _moe(cfg: Mapping[str, Any], layers: int, arch: str) -> MoeConfig:
    """The experts of a qwen3_moe config, which layers are sparse as transformers decides it; or of a mixtral
    one: every layer, experts of intermediate_size, the top-k weights always divided by their sum."""
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if cfg.get(field):  # (Qwen2-MoE style shared experts: not in Qwen3-MoE)
            _unsupported(field, cfg[field], "absent (shared experts are not implemented)")
    field = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts = _int(cfg, field)
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        _unsupported("num_experts_per_tok", top_k, f"at most {field}={experts}")
    if arch == "mixtral":
        return MoeConfig(experts=experts, top_k=top_k, intermediate=_int(cfg, "intermediate_size"), normalize=True,
                         sparse_layers=tuple(range(layers)))
    step = _int(cfg, "decoder_sparse_step") if "decoder_sparse_step" in cfg else 1
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        _unsupported("mlp_only_layers", dense, "a list of layer indices")
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return MoeConfig(experts=experts, top_k=top_k, intermediate=_int(cfg, "moe_intermediate_size"),
                     normalize=_bool(cfg, "norm_topk_prob", default=False), sparse_layers=sparse)


def _int(cfg: Mapping[str, Any], field: str, *, default: int | None = None) -> int:
    """A positive int field; absent or null: ``default`` (None: required)."""
    v = cfg.get(field)
    if v is None and default is not None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UnsupportedConfig(f"config field {field!r} must be a positive int, got {v!r}")
    return v


def _float(cfg: Mapping[str, Any], field: str, *, default: float | None = None, name: str | None = None) -> float:
    """A positive, finite number field (``name``: how the message names it); absent or null: ``default``."""
    v = cfg.get(field)
    if v is None and default is not None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise UnsupportedConfig(f"config field {name or field!r} must be a positive number, got {v!r}")
    return float(v)


def _bool(cfg: Mapping[str, Any], field: str, *, default: bool) -> bool:
    """A true/false field (not the string "false", which bool() would read as true); absent or null: ``default``."""
    v = cfg.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise UnsupportedConfig(f"config field {field!r} must be true or false, got {v!r}")
    return v


def _require(cfg: Mapping[str, Any], field: str, want: Any, desc: str) -> None:
    if field in cfg and cfg[field] is not None and cfg[field] != want:
        _unsupported(field, cfg[field], desc)


def _unsupported(field: str, value: Any, want: str) -> None:
    raise UnsupportedConfig(f"config field {field!r} = {value!r} is not supported (supported: {want})")
