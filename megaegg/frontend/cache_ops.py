"""Four torch custom ops for a KV cache, which the translator maps onto the Graph API's (aten.py:
``megaegg.kv_append`` -> ``ops.kv_append``, ``megaegg.attention`` -> ``ops.attention`` for one token;
``megaegg.kv_store`` / ``megaegg.ragged_attention`` -> ``ops.kv_store`` / ``ops.ragged_attention`` for n).
A module calls them where its attention writes a cache and reads it (hf.py routes transformers'
attention layers here). One token: a tensor ``positions`` of length ``ctx`` carries the runtime dim: the row
written is ``ctx - 1`` and the rows attended ``[0, ctx)``.
"""

from __future__ import annotations

import torch

from ..reference import ragged_rows  # (the Graph API's reference rows: one definition)


@torch.library.custom_op("megaegg::kv_append", mutates_args=())
def kv_append(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``cache`` [kv_heads, max_len, head_dim] with row ``len(positions) - 1`` set to ``new`` [kv_heads,
    head_dim] (a copy here; the megakernel writes its input in place)."""
    out = cache.clone()
    out[:, positions.shape[0] - 1] = new.to(cache.dtype)
    return out


@kv_append.register_fake
def _(cache, new, positions):
    return torch.empty_like(cache)


@torch.library.custom_op("megaegg::attention", mutates_args=())
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """One query row a head, q [heads, head_dim], over the first ``len(positions)`` cache rows of its KV
    head (heads / kv_heads query heads a KV head), softmax in f32: [heads, head_dim] in q's dtype."""
    n = positions.shape[0]
    return ragged_rows(q, k_cache[:, :n], v_cache[:, :n], scale).to(q.dtype)


@attention.register_fake
def _(q, k_cache, v_cache, positions, scale):
    return torch.empty_like(q)




# A prompt's tokens, or a batch's (the step graph's ops): row i of ``new`` / ``q`` is the token at position
# ``pos[i]`` of sequence ``slot[i]``; caches are [slots, kv_heads, max_len, head_dim]; ``bound``'s length is
# the runtime dim that bounds every ``pos[i] + 1``.
@torch.library.custom_op("megaegg::kv_store", mutates_args=())
def kv_store(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``cache`` with ``new[i]`` [kv_heads, head_dim] at (``slot[i]``, position ``pos[i]``) (a copy here)."""
    out = cache.clone()
    out[slot.long(), :, pos.long()] = new.to(cache.dtype)
    return out


@kv_store.register_fake
def _(cache, new, pos, slot):
    return torch.empty_like(cache)


@torch.library.custom_op("megaegg::ragged_attention", mutates_args=())
def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     slot: torch.Tensor, bound: torch.Tensor, scale: float) -> torch.Tensor:
    """Row i, q[i] [heads, head_dim], over cache rows [0, pos[i]] of slot[i] (causal), softmax in f32."""
    rows = [ragged_rows(q[i], k_cache[int(slot[i]), :, : int(pos[i]) + 1], v_cache[int(slot[i]), :, : int(pos[i]) + 1], scale)
            for i in range(q.shape[0])]
    return torch.stack(rows).to(q.dtype)


@ragged_attention.register_fake
def _(q, k_cache, v_cache, pos, slot, bound, scale):
    return torch.empty_like(q)
