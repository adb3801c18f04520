"""Batched decode and prompt prefill in plain PyTorch (gpt-fast style): the peer of the step graph.

:class:`PlainBatch` holds per-layer static caches ``[slots, kv_heads, max_len, head_dim]`` (sequence
``i`` in slot ``i``) and the fused q/k/v and gate/up weights (Qwen3-MoE: the routed experts of
:class:`~megaegg.models.torch_moe.ExpertsMLP`) of
:class:`~megaegg.models.torch_plain.PlainDecoder`, with the same numerics (``F.rms_norm``, fp32
RoPE from a cos/sin table, SDPA):

- ``decode(token, pos)``: one token for each of the first ``B`` sequences (``token`` int32[B],
  ``pos`` int64[B] device tensors, any positions): K and V written at ``(i, pos[i])``, attention
  over the whole cache with the mask ``row <= pos[i]``; one CUDA graph or ``torch.compile`` trace
  per batch size serves every position;
- ``prefill(tokens)``: a prompt of ``T`` tokens into slot 0 (positions ``0..T-1``), causal
  attention (SDPA ``is_causal``); returns the last token's logits and greedy next token.

>>> import dataclasses, torch, megaegg as me
>>> from megaegg.models import ModelConfig, build_decode_graph, random_weights
>>> cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
>>> _, spec = build_decode_graph(cfg, max_len=16)
>>> peer = PlainBatch(cfg, random_weights(spec), max_len=16, slots=3, device="cpu")
>>> peer.prefill(torch.tensor([1, 2, 3], dtype=torch.int32))[1].shape
torch.Size([1])
>>> peer.decode(torch.tensor([4, 5], dtype=torch.int32), torch.tensor([3, 0]))[0].shape
torch.Size([2, 1024])
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import rope_inv_freq
from .config import ModelConfig
from .torch_decode import frozen
from .torch_moe import ExpertsMLP
from .torch_plain import HAS_ENABLE_GQA, _rms_norm


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x: [rows, heads, D]`` in fp32 (``cos``/``sin``: fp32 ``[rows, 1, D/2]``)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def _sdpa(q, k, v, **kw):
    """SDPA with grouped-query heads (``enable_gqa`` where this torch has it)."""
    if q.shape[1] != k.shape[1]:
        if HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kw)


class PlainBatch(nn.Module):
    """Llama, Qwen3 and Qwen3-MoE models (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, max_len: int, slots: int,
                 device="cuda") -> None:
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.sizes = [H * D, Hkv * D, Hkv * D]

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device)

        self.embed = frozen(w("model.embed_tokens.weight"))
        self.norm = frozen(w("model.norm.weight"))
        self.lm_head = self.embed if cfg.tie_embeddings else frozen(w("lm_head.weight"))
        self.layers = []
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            layer = {
                "ln1": w(p + "input_layernorm.weight"), "ln2": w(p + "post_attention_layernorm.weight"),
                "wqkv": torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                "wo": w(p + "self_attn.o_proj.weight"),
                "k": torch.zeros(slots, Hkv, max_len, D, dtype=cfg.dtype.torch, device=device),
                "v": torch.zeros(slots, Hkv, max_len, D, dtype=cfg.dtype.torch, device=device),
            }
            if cfg.qk_norm:
                layer["qn"], layer["kn"] = w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")
            if cfg.is_sparse(i):  # Qwen3-MoE's routed experts (torch_moe.py: gathered for few rows, all for many)
                layer["experts"] = ExpertsMLP(cfg, weights, i, device)
            else:
                layer["w13"] = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
                layer["w2"] = w(p + "mlp.down_proj.weight")
            self.layers.append(layer)
        inv = rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling).to(torch.float32)
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
        self.rope_cos, self.rope_sin = angles.cos().to(device), angles.sin().to(device)
        self.positions = torch.arange(max_len, device=device)

    def caches(self) -> list[torch.Tensor]:
        """The static caches (for ``torch._dynamo.mark_static_address``)."""
        return [t for layer in self.layers for t in (layer["k"], layer["v"])]

    def _qkv(self, layer, x, pos):
        cfg, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        q, k, v = F.linear(_rms_norm(x, layer["ln1"], eps), layer["wqkv"]).split(self.sizes, dim=-1)
        q, k, v = q.view(-1, H, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
        if cfg.qk_norm:
            q, k = _rms_norm(q, layer["qn"], eps), _rms_norm(k, layer["kn"], eps)
        cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp(self, layer, x, o):
        x = x + F.linear(o, layer["wo"])
        h = _rms_norm(x, layer["ln2"], self.cfg.rms_eps)
        if "experts" in layer:
            return x + layer["experts"](h)
        gate, up = F.linear(h, layer["w13"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer["w2"])

    def _head(self, x):
        logits = F.linear(_rms_norm(x, self.norm, self.cfg.rms_eps), self.lm_head)
        return logits, logits.argmax(-1).to(torch.int32)

    def decode(self, token: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of the first ``B`` sequences -> logits [B, vocab], next tokens int32[B]."""
        b = token.shape[0]
        rows = torch.arange(b, device=token.device)
        mask = (self.positions[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, max_len]
        x = F.embedding(token, self.embed)
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos)
            layer["k"][rows, :, pos] = k
            layer["v"][rows, :, pos] = v
            o = _sdpa(q[:, :, None], layer["k"][:b], layer["v"][:b], attn_mask=mask)  # [B, H, 1, D]
            x = self._mlp(layer, x, o.reshape(b, -1))
        return self._head(x)

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt of ``T`` tokens into slot 0 -> the last token's logits [1, vocab] and next token int32[1]."""
        t = tokens.shape[0]
        pos = torch.arange(t, device=tokens.device)
        x = F.embedding(tokens, self.embed)
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos)
            layer["k"][0, :, :t] = k.transpose(0, 1)
            layer["v"][0, :, :t] = v.transpose(0, 1)
            o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True)
            x = self._mlp(layer, x, o[0].transpose(0, 1).reshape(t, -1))
        return self._head(x[-1:])
