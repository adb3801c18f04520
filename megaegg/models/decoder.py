"""One decode step of a Llama / Qwen3 / Qwen3-MoE model as a megaegg Graph.

Batch 1, one token at runtime position ``pos``: the token's K and V are appended to
the per-layer caches in place and attention reads the first ``pos + 1`` rows. Weights
carry Hugging Face's state-dict names, so a checkpoint binds by name.

>>> from megaegg.models import ModelConfig, build_decode_graph
>>> g, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=128)
>>> sorted(g.outputs), spec.caches["k_cache.0"], g.symbols()
(['logits', 'next_token'], (2, 128, 64), {'pos'})
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..dims import sym
from ..dtypes import DType, as_dtype, i32
from ..graph import Graph, GraphError, Tensor
from ..ops import argmax, attention, embedding, kv_append, linear, moe_mlp, rms_norm, rope, rope_inv_freq, silu
from .config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """What a decode graph needs bound: weight and cache names with shapes, and its dtype."""

    config: ModelConfig
    max_len: int
    weights: dict[str, tuple[int, ...]]  # Hugging Face state-dict name (or a stack of them, below) -> shape
    caches: dict[str, tuple[int, ...]]  # "k_cache.{l}" / "v_cache.{l}" -> [kv_heads, max_len, head_dim]

    @property
    def dtype(self) -> DType:
        return self.config.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the weights (what binding them costs)."""
        return sum(_numel(s) for s in self.weights.values()) * self.dtype.itemsize

    @property
    def step_bytes(self) -> int:
        """Bytes of weights one decode step reads (the memory floor's numerator, without KV): of
        each stack of routed experts, only the ``top_k`` chosen ones."""
        stacks, total = self.stacks, 0
        for name, shape in self.weights.items():
            n = _numel(shape)
            total += n // shape[0] * self.config.moe.top_k if name in stacks else n
        return total * self.dtype.itemsize

    @functools.cached_property  # (a 30B MoE stacks 18432 checkpoint tensors: built once)
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """Graph weights that stack per-expert checkpoint tensors on a leading axis: name -> the
        tensors' names, in expert order (``load_checkpoint`` stacks them)."""
        moe = self.config.moe
        if moe is None:
            return {}
        return {expert_stack(layer, proj): tuple(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                                                  for e in range(moe.experts))
                for layer in moe.sparse_layers if layer < self.config.layers for proj in EXPERT_PROJS}

    def new_caches(self, device="cpu", dtype=None) -> dict:
        """Fresh KV caches by input name (zeros: rows at or past ``pos`` are never read)."""
        import torch

        dtype = check_dtype(self, dtype)
        return {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in self.caches.items()}


def build_decode_graph(cfg: ModelConfig, *, max_len: int, logits: bool = True) -> tuple[Graph, ModelSpec]:
    """The graph of one decode step: ``token`` i32[1] at ``pos`` -> ``logits`` [1, vocab], ``next_token`` i32[1].

    ``logits=False`` outputs only ``next_token``: the compiler may then fuse the LM head
    with the argmax partials and never store the logits.
    """
    if not 0 < max_len <= cfg.max_positions:
        raise GraphError(f"max_len {max_len} must be in [1, {cfg.max_positions}] (max_position_embeddings)")
    g = Graph(f"{cfg.arch}_decode")
    pos = sym("pos")
    inv_freq = g.constant("rope_inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    embed = g.weight("model.embed_tokens.weight", [cfg.vocab, cfg.hidden], cfg.dtype)
    x = embedding(embed, g.input("token", [1], i32))  # [1, hidden]
    for layer in range(cfg.layers):
        x = decoder_layer(cfg, x, layer, pos=pos, inv_freq=inv_freq, max_len=max_len)
    x = rms_norm(x, g.weight("model.norm.weight", [cfg.hidden], cfg.dtype), cfg.rms_eps)
    lm_head = embed if cfg.tie_embeddings else g.weight("lm_head.weight", [cfg.vocab, cfg.hidden], cfg.dtype)
    scores = linear(x, lm_head)  # [1, vocab]
    if logits:
        g.output("logits", scores)
    g.output("next_token", argmax(scores))  # i32[1]
    weights = {n.name: tuple(d.value for d in n.shape) for n in g.weights.values()}
    caches = {n.name: tuple(int(d) for d in n.shape) for n in g.inputs.values() if n.name != "token"}
    return g, ModelSpec(config=cfg, max_len=max_len, weights=weights, caches=caches)


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_stack(layer: int, proj: str) -> str:
    """The graph weight stacking layer ``layer``'s experts' ``proj`` weights ``[E, ...]``."""
    return f"model.layers.{layer}.mlp.experts.{proj}.stacked"


def decoder_layer(cfg: ModelConfig, x: Tensor, layer: int, *, pos, inv_freq: Tensor, max_len: int) -> Tensor:
    """One pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``x`` is [1, hidden]."""
    g, dt, eps = x.graph, cfg.dtype, cfg.rms_eps
    H, Hkv, D, E, F = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden, cfg.intermediate

    def w(name: str, *shape: int) -> Tensor:
        return g.weight(f"model.layers.{layer}.{name}.weight", shape, dt)

    # attention: q [H, D], k/v [Hkv, D] for this token; GQA over the caches
    h = rms_norm(x, w("input_layernorm", E), eps)
    q = linear(h, w("self_attn.q_proj", H * D, E)).reshape(H, D)
    k = linear(h, w("self_attn.k_proj", Hkv * D, E)).reshape(Hkv, D)
    v = linear(h, w("self_attn.v_proj", Hkv * D, E)).reshape(Hkv, D)
    if cfg.qk_norm:  # per-head RMSNorm of q and k, before RoPE
        q = rms_norm(q, w("self_attn.q_norm", D), eps)
        k = rms_norm(k, w("self_attn.k_norm", D), eps)
    q, k = rope(q, pos, inv_freq=inv_freq), rope(k, pos, inv_freq=inv_freq)
    k_cache = kv_append(g.input(f"k_cache.{layer}", [Hkv, max_len, D], dt), k, pos)
    v_cache = kv_append(g.input(f"v_cache.{layer}", [Hkv, max_len, D], dt), v, pos)
    o = attention(q, k_cache, v_cache, pos + 1).reshape(1, H * D)
    x = x + linear(o, w("self_attn.o_proj", E, H * D))

    # MLP: down(silu(gate(h)) * up(h)); or the routed experts' (Qwen3-MoE's sparse layers)
    h = rms_norm(x, w("post_attention_layernorm", E), eps)
    if cfg.is_sparse(layer):
        moe = cfg.moe
        n, f = moe.experts, moe.intermediate
        stacks = [g.weight(expert_stack(layer, p), s, dt) for p, s in zip(EXPERT_PROJS, ((n, f, E), (n, f, E), (n, E, f)))]
        logits = linear(h, w("mlp.gate", n, E))
        return x + moe_mlp(h, logits, *stacks, top_k=moe.top_k, normalize=moe.normalize)
    gate = silu(linear(h, w("mlp.gate_proj", F, E)))
    up = linear(h, w("mlp.up_proj", F, E))
    return x + linear(gate * up, w("mlp.down_proj", E, F))


def check_dtype(spec: ModelSpec, dtype=None):
    """The torch dtype of ``spec``'s tensors; asking for another one is an error, not a silent cast."""
    if dtype is not None and as_dtype(dtype) != spec.dtype:
        raise GraphError(
            f"the graph was built for {spec.dtype}, not {as_dtype(dtype)}; "
            "rebuild it with dataclasses.replace(config, dtype=...)"
        )
    return spec.dtype.torch


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
