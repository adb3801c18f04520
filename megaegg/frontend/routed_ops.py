"""A torch custom op for routed experts, which the translator maps onto the Graph API's ``moe_mlp`` (aten.py:
``megaegg.moe_mlp`` -> ``ops.moe_mlp``). hf.py routes transformers' sparse MoE blocks here while it exports
them (their own expert loops pick rows by data-dependent indices, which torch.export and the Graph API do not
take)."""

from __future__ import annotations

import torch

from ..reference import moe_sum  # (the Graph API's reference: one definition)


@torch.library.custom_op("megaegg::moe_mlp", mutates_args=())
def moe_mlp(x: torch.Tensor, logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            top_k: int, normalize: bool) -> torch.Tensor:
    """Each row of ``x [..., K]``: the ``top_k`` experts of ``softmax(logits [..., E])`` (``ops.moe_mlp``'s routing
    and rounding), their gated MLPs ``w_gate``, ``w_up [E, F, K]``, ``w_down [E, K, F]`` summed by the weights."""
    return moe_sum(x, logits, w_gate, w_up, w_down, top_k, normalize, x.dtype).to(x.dtype)


@moe_mlp.register_fake
def _(x, logits, w_gate, w_up, w_down, top_k, normalize):
    return torch.empty_like(x)
