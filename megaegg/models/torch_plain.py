"""The decode step as a performance-minded PyTorch user writes it (gpt-fast style): the peer at full strength.

Same model, weights, KV-cache layout and interface as
:class:`~megaegg.models.torch_decode.TorchDecoder` (``step(token, pos)``, ``caches``,
``load_caches``), but with no emulation of the reference's rounding: it computes the
way the framework's fused ops want to.

- ``F.rms_norm`` (one op; fp32 inside, one rounding) for every norm, Qwen3's per-head
  q/k norms included;
- q/k/v and gate/up weights concatenated ONCE at construction (one matmul each; the
  concatenation is a copy of those weights, the rest are shared with ``weights``);
- RoPE as gpt-fast does it: the rotation in fp32 from an fp32 cos/sin table
  ``[max_len, head_dim/2]`` built at construction (llama3 scaling through
  :func:`megaegg.ops.rope_inv_freq`), rounded once to the model dtype;
- static KV caches ``[kv_heads, max_len, head_dim]`` per layer, the new row written
  with ``index_copy_`` at ``pos``; ``pos`` is a device tensor ``int64[1]`` (no host
  sync), so one CUDA graph or one ``torch.compile`` (fullgraph) trace serves every
  position;
- attention over the WHOLE cache with the mask ``arange(max_len) <= pos`` (a benchmark
  at context ``C`` uses ``max_len = C + 1``), made once per step as an additive mask
  (0 / -inf, the model dtype) in a row padded to a multiple of 16 elements, so SDPA
  neither converts a boolean mask nor pads an unaligned one in every layer; through
  ``F.scaled_dot_product_attention``: ``attention="gqa"`` (default) passes
  ``q: [1, H, 1, D]`` with ``enable_gqa=True`` (``repeat_interleave`` of K/V where
  this torch's SDPA lacks ``enable_gqa``); ``attention="grouped"`` views q as
  ``[1, kv_heads, group, D]`` (the group as the query length), so no K/V is repeated
  and no GQA support is needed from the SDPA backend;
- everything else in the model dtype (bf16 for the real models).

>>> import dataclasses, torch, megaegg as me
>>> from megaegg.models import ModelConfig, build_decode_graph, random_weights
>>> cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
>>> _, spec = build_decode_graph(cfg, max_len=8)
>>> dec = PlainDecoder(cfg, random_weights(spec), max_len=8, device="cpu")
>>> logits, nxt = dec.step(torch.tensor([3], dtype=torch.int32), torch.tensor([0]))
>>> logits.shape, nxt.dtype
(torch.Size([1, 1024]), torch.int32)
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import rope_inv_freq
from .config import ModelConfig
from .torch_moe import ExpertsMLP
from .torch_decode import StaticCacheDecoder, frozen

ATTENTION = ("gqa", "grouped")


def _sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 2, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


HAS_ENABLE_GQA = _sdpa_has_gqa()


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if hasattr(F, "rms_norm"):  # torch >= 2.4
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()  # gpt-fast's RMSNorm
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x: [heads, D]`` in fp32 (``cos``/``sin``: fp32 ``[1, D/2]``), rounded once."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class PlainLayer(nn.Module):
    """One pre-norm block with fused q/k/v and gate/up weights and its own static KV caches."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, *, max_len: int,
                 device, attention: str, reduce=None) -> None:
        super().__init__()
        self.cfg, self.attention = cfg, attention
        self.reduce = reduce or (lambda t: t)  # tensor parallel: the all-reduce of a row-parallel projection
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.sizes = [H * D, Hkv * D, Hkv * D]

        def w(name: str) -> torch.Tensor:
            return weights[f"model.layers.{layer}.{name}.weight"].to(device)

        self.input_layernorm = frozen(w("input_layernorm"))
        self.post_attention_layernorm = frozen(w("post_attention_layernorm"))
        self.wqkv = frozen(torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")]))
        self.wo = frozen(w("self_attn.o_proj"))
        self.sparse = cfg.is_sparse(layer)
        if self.sparse:
            self.experts = ExpertsMLP(cfg, weights, layer, device)
        else:
            self.w13 = frozen(torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
            self.w2 = frozen(w("mlp.down_proj"))
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm, self.k_norm = frozen(w("self_attn.q_norm")), frozen(w("self_attn.k_norm"))
        dtype = self.wo.dtype
        self.register_buffer("k_cache", torch.zeros(Hkv, max_len, D, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(Hkv, max_len, D, dtype=dtype, device=device), persistent=False)

    def forward(self, x, pos, cos, sin, mask):
        cfg, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        q, k, v = F.linear(_rms_norm(x, self.input_layernorm, eps), self.wqkv).split(self.sizes, dim=-1)
        q, k, v = q.view(H, D), k.view(Hkv, D), v.view(Hkv, D)
        if self.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q, k = _rms_norm(q, self.q_norm, eps), _rms_norm(k, self.k_norm, eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache.index_copy_(1, pos, k.unsqueeze(1))  # [Hkv, 1, D] at row pos
        self.v_cache.index_copy_(1, pos, v.unsqueeze(1))
        x = x + self.reduce(F.linear(self._attend(q, mask).reshape(1, H * D), self.wo))
        h = _rms_norm(x, self.post_attention_layernorm, eps)
        if self.sparse:
            return x + self.experts(h)
        gate, up = F.linear(h, self.w13).chunk(2, dim=-1)
        return x + self.reduce(F.linear(F.silu(gate) * up, self.w2))

    def _attend(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q: [H, D]`` over the cache rows ``mask: [1, 1, 1, max_len]`` (additive) lets through -> ``[H, D]``."""
        H, Hkv, D = self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim
        k, v, m = self.k_cache[None], self.v_cache[None], mask
        if self.attention == "grouped":  # q head h reads KV head h // group: the group is the query length
            return F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), k, v, attn_mask=m).reshape(H, D)
        if H == Hkv:
            return F.scaled_dot_product_attention(q.view(1, H, 1, D), k, v, attn_mask=m).reshape(H, D)
        if HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(q.view(1, H, 1, D), k, v, attn_mask=m, enable_gqa=True).reshape(H, D)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        return F.scaled_dot_product_attention(q.view(1, H, 1, D), k, v, attn_mask=m).reshape(H, D)


class PlainDecoder(StaticCacheDecoder):
    """One decode step in plain PyTorch over static KV caches (gpt-fast style; see the module doc).

    ``weights``: Hugging Face names (as :func:`~megaegg.models.random_weights` or
    ``load_checkpoint`` return them), in ``cfg.dtype``. Holds a copy of the q/k/v and
    gate/up weights (concatenated); shares the others' storage when ``weights`` is
    already on ``device``. ``attention``: ``"gqa"`` (SDPA with ``enable_gqa``) or
    ``"grouped"`` (SDPA on q viewed per KV head). ``reduce``: applied to the O and down projections'
    outputs, ``gather`` to the logits (tensor parallel: their all-reduce, and the all-gather of a
    vocabulary-parallel LM head's logits, :meth:`tensor_parallel`; default: none).
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, max_len: int, device="cuda",
                 attention: str = "gqa", reduce=None, gather=None) -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        super().__init__(cfg, weights, max_len=max_len, device=device)
        self.attention = attention
        self.gather = gather or (lambda t: t)
        self.embed_tokens = frozen(weights["model.embed_tokens.weight"].to(device))
        self.layers = nn.ModuleList(
            PlainLayer(cfg, weights, i, max_len=max_len, device=device, attention=attention, reduce=reduce)
            for i in range(cfg.layers)
        )
        self.norm = frozen(weights["model.norm.weight"].to(device))
        self.lm_head = self.embed_tokens if cfg.tie_embeddings else frozen(weights["lm_head.weight"].to(device))
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(torch.float32)
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]  # [max_len, D/2]
        self.register_buffer("rope_cos", angles.cos().to(device), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(device), persistent=False)
        padded = -(-max_len // 16) * 16  # the mask's row stride: aligned for the fused SDPA kernels
        self.register_buffer("positions", torch.arange(padded, device=device).view(1, 1, 1, padded), persistent=False)
        dtype = self.norm.dtype
        self.register_buffer("mask_open", torch.zeros((), dtype=dtype, device=device), persistent=False)
        self.register_buffer("mask_shut", torch.full((), float("-inf"), dtype=dtype, device=device), persistent=False)

    @classmethod
    def tensor_parallel(cls, cfg: ModelConfig, shards: Mapping[str, torch.Tensor], *, tp: int, max_len: int,
                        device="cuda", attention: str = "gqa") -> "PlainDecoder":
        """This process's rank of the step over ``tp`` processes (Megatron-style, as gpt-fast does it):
        ``shards`` from :func:`~megaegg.models.shard_weights`, the O and down projections' outputs
        summed over the default process group (``torch.distributed`` initialised, NCCL on GPUs) with
        the functional all-reduce, which CUDA graphs and ``torch.compile`` take; a vocabulary-parallel
        LM head's logits (:func:`~megaegg.models.decoder.vocab_parallel`) all-gathered the same way."""
        import dataclasses

        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        from .decoder import check_tp, vocab_parallel

        check_tp(cfg, tp)
        local = dataclasses.replace(cfg, heads=cfg.heads // tp, kv_heads=cfg.kv_heads // tp,
                                    intermediate=cfg.intermediate // tp)
        group = dist.group.WORLD
        return cls(local, shards, max_len=max_len, device=device, attention=attention,
                   reduce=lambda t: funcol.all_reduce(t, "sum", group),
                   gather=(lambda t: funcol.wait_tensor(funcol.all_gather_tensor(t, 0, group)).reshape(1, -1)) if vocab_parallel(cfg, tp) else None)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``token`` int32[1], ``pos`` int64[1] (device tensors) -> logits [1, vocab], next_token int32[1]."""
        x = F.embedding(token, self.embed_tokens)  # [1, hidden]
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [1, D/2]
        # [1, 1, 1, max_len] additive: rows 0..pos (the new row included) open
        mask = torch.where(self.positions <= pos, self.mask_open, self.mask_shut)[..., : self.max_len]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        logits = self.gather(F.linear(_rms_norm(x, self.norm, self.cfg.rms_eps), self.lm_head))
        return logits, logits.argmax(-1).to(torch.int32)
