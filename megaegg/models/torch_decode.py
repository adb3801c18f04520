"""The decode step of :func:`~megaegg.models.build_decode_graph` in plain PyTorch: the baseline.

Same model (Llama with llama3 rope scaling, GQA; Qwen3 with per-head q/k RMSNorm),
same Hugging Face weight names, same rounding as :func:`megaegg.run_reference`
(tensors stored in the model dtype, norms / RoPE / softmax in fp32, matvecs with fp32
accumulation), written the way a fast static-cache decoder is (gpt-fast style):

- the position is a device tensor ``int64[1]``: no ``.item()``, no host sync, so one
  step can be captured in a CUDA graph and traced by ``torch.compile`` (fullgraph)
  once for every position;
- the KV caches are static buffers ``[kv_heads, max_len, head_dim]`` per layer; the
  new K/V row is written with ``index_copy_`` at ``pos``;
- attention runs over the WHOLE cache with the mask ``arange(max_len) <= pos``. It
  reads all ``max_len`` rows each step whatever ``pos`` is, so a benchmark at
  context ``C`` should use ``max_len = C + 1`` (then it reads exactly the rows the
  megakernel reads at ``pos = C``).

>>> import dataclasses, torch, megaegg as me
>>> from megaegg.models import ModelConfig, build_decode_graph, random_weights
>>> cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
>>> _, spec = build_decode_graph(cfg, max_len=8)
>>> dec = TorchDecoder(cfg, random_weights(spec), max_len=8, device="cpu")
>>> logits, nxt = dec.step(torch.tensor([3], dtype=torch.int32), torch.tensor([0]))
>>> logits.shape, nxt.dtype
(torch.Size([1, 1024]), torch.int32)
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..graph import GraphError
from ..ops import rope_inv_freq
from .config import ModelConfig
from .torch_moe import ExpertsMLP

ATTENTION = ("sdpa", "exact")


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A weight as a parameter that takes no gradient."""
    return nn.Parameter(t, requires_grad=False)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Like the reference: normalize in fp32, round, scale by the weight in fp32, round."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * w.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x: [heads, D]`` in fp32 with ``cos``/``sin: [1, D/2]``, rounded once."""
    xf = x.float()
    h = xf.shape[-1] // 2
    x1, x2 = xf[..., :h], xf[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm block with its own static KV caches (buffers, updated in place)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, *, max_len: int,
                 device, fuse: bool, attention: str) -> None:
        super().__init__()
        self.cfg, self.fuse, self.attention = cfg, fuse, attention
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = H * D, Hkv * D

        def w(name: str) -> torch.Tensor:
            return weights[f"model.layers.{layer}.{name}.weight"].to(device)

        self.input_layernorm = frozen(w("input_layernorm"))
        self.post_attention_layernorm = frozen(w("post_attention_layernorm"))
        self.sparse = cfg.is_sparse(layer)
        if fuse:  # one matvec for q/k/v and one for gate/up: fewer launches, identical rounding per element
            self.qkv_proj = frozen(torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")]))
        else:
            self.q_proj, self.k_proj, self.v_proj = (frozen(w(f"self_attn.{p}_proj")) for p in "qkv")
        if self.sparse:  # the routed experts (Qwen3-MoE)
            self.experts = ExpertsMLP(cfg, weights, layer, device)
        elif fuse:
            self.gate_up_proj = frozen(torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
        else:
            self.gate_proj, self.up_proj = frozen(w("mlp.gate_proj")), frozen(w("mlp.up_proj"))
        self.o_proj = frozen(w("self_attn.o_proj"))
        if not self.sparse:
            self.down_proj = frozen(w("mlp.down_proj"))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = frozen(w("self_attn.q_norm")), frozen(w("self_attn.k_norm"))
        dtype = self.o_proj.dtype
        self.register_buffer("k_cache", torch.zeros(Hkv, max_len, D, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(Hkv, max_len, D, dtype=dtype, device=device), persistent=False)

    def forward(self, x, pos, cos, sin, mask):
        cfg, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        h = rms_norm(x, self.input_layernorm, eps)
        if self.fuse:
            q, k, v = F.linear(h, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = F.linear(h, self.q_proj), F.linear(h, self.k_proj), F.linear(h, self.v_proj)
        q, k, v = q.reshape(H, D), k.reshape(Hkv, D), v.reshape(Hkv, D)
        if cfg.qk_norm:  # per-head RMSNorm before RoPE
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k_cache.index_copy_(1, pos, k.unsqueeze(1))  # [Hkv, 1, D] at row pos
        self.v_cache.index_copy_(1, pos, v.unsqueeze(1))
        o = self._attend(q, mask).reshape(1, H * D)
        x = x + F.linear(o, self.o_proj)

        h = rms_norm(x, self.post_attention_layernorm, eps)
        if self.sparse:
            return x + self.experts(h)
        if self.fuse:
            gate, up = F.linear(h, self.gate_up_proj).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, self.gate_proj), F.linear(h, self.up_proj)
        return x + F.linear(F.silu(gate) * up, self.down_proj)

    def _attend(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """GQA decode attention over all cache rows where ``mask`` holds; ``q: [H, D]`` -> ``[H, D]``.

        q head ``h`` reads KV head ``h // group``: q viewed as [Hkv, group, D] treats the
        group as the query length, so no K/V is repeated.
        """
        Hkv, D = self.cfg.kv_heads, self.cfg.head_dim
        group = self.cfg.heads // Hkv
        qg = q.reshape(Hkv, group, D)
        scale = 1.0 / math.sqrt(D)
        if self.attention == "sdpa":  # fp32 softmax inside; P may be rounded to the dtype before P @ V
            o = F.scaled_dot_product_attention(
                qg[None], self.k_cache[None], self.v_cache[None], attn_mask=mask.view(1, 1, 1, -1), scale=scale
            )[0]
        else:  # "exact": the reference's arithmetic, everything in fp32
            s = torch.einsum("kgd,kld->kgl", qg.float(), self.k_cache.float()) * scale
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("kgl,kld->kgd", p, self.v_cache.float())
        return o.to(q.dtype).reshape(Hkv * group, D)


class StaticCacheDecoder(nn.Module):
    """What every PyTorch decode step here shares: checked arguments, ``step`` and the per-layer
    static KV caches by the graph's input names. Subclasses build ``self.layers`` (each with
    ``k_cache`` and ``v_cache`` buffers) and ``forward(token, pos)``."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, max_len: int, device) -> None:
        super().__init__()
        if not 0 < max_len <= cfg.max_positions:
            raise GraphError(f"max_len {max_len} must be in [1, {cfg.max_positions}] (max_position_embeddings, "
                             "or a shorter sliding_window)")
        bad = sorted(n for n, t in weights.items() if t.dtype != cfg.dtype.torch)
        if bad:
            raise GraphError(f"weights must be {cfg.dtype} like the config; {bad[0]!r} is {weights[bad[0]].dtype}")
        self.cfg, self.max_len, self.device = cfg, max_len, torch.device(device)

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step (the module's forward); appends this token's K/V to the caches."""
        return self(token, pos)

    @property
    def caches(self) -> dict[str, torch.Tensor]:
        """The KV cache buffers by the graph's input names (``k_cache.{l}``, ``v_cache.{l}``): live, not copies."""
        out = {}
        for i, layer in enumerate(self.layers):
            out[f"k_cache.{i}"], out[f"v_cache.{i}"] = layer.k_cache, layer.v_cache
        return out

    def load_caches(self, caches: Mapping[str, torch.Tensor]) -> None:
        """Copy ``caches`` (by graph input name) into the buffers in place (addresses stay, for CUDA graphs)."""
        mine = self.caches
        if set(caches) != set(mine):
            raise GraphError(f"caches: expected {sorted(mine)}, got {sorted(caches)}")
        with torch.no_grad():
            for name, t in caches.items():
                mine[name].copy_(t)


class TorchDecoder(StaticCacheDecoder):
    """One decode step in PyTorch over static KV caches.

    ``weights``: Hugging Face names (as :func:`~megaegg.models.random_weights` or
    ``load_checkpoint`` return them), in ``cfg.dtype``. ``fuse`` concatenates q/k/v and
    gate/up weights into one matrix each (a copy; same results). ``attention``:
    ``"sdpa"`` (``F.scaled_dot_product_attention`` with a boolean mask, the fast
    baseline) or ``"exact"`` (the reference's fp32 arithmetic).
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, max_len: int, device="cuda",
                 fuse: bool = True, attention: str = "sdpa") -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        super().__init__(cfg, weights, max_len=max_len, device=device)
        self.embed_tokens = frozen(weights["model.embed_tokens.weight"].to(device))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, weights, i, max_len=max_len, device=device, fuse=fuse, attention=attention)
            for i in range(cfg.layers)
        )
        self.norm = frozen(weights["model.norm.weight"].to(device))
        self.lm_head = self.embed_tokens if cfg.tie_embeddings else frozen(weights["lm_head.weight"].to(device))
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # the graph's constant
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.register_buffer("positions", torch.arange(max_len, device=device), persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``token`` int32[1], ``pos`` int64[1] (device tensors) -> logits [1, vocab], next_token int32[1]."""
        x = F.embedding(token, self.embed_tokens)  # [1, hidden]
        angles = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [1, D/2], fp32 like the reference
        cos, sin = angles.cos(), angles.sin()
        mask = self.positions <= pos  # [max_len]: rows 0..pos (the new row included)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        x = rms_norm(x, self.norm, self.cfg.rms_eps)
        logits = F.linear(x, self.lm_head)
        return logits, logits.argmax(-1).to(torch.int32)  # first index on ties, like the reference
