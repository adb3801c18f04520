"""A torch custom op for routed experts, which the translator maps onto the Graph API's ``moe_mlp`` (aten.py:
``megaegg.moe_mlp`` -> ``ops.moe_mlp``). hf.py routes transformers' sparse MoE blocks here while it exports
them (their own expert loops pick rows by data-dependent indices, which torch.export and the Graph API do not
take)."""

from __future__ import annotations

import torch

from ..reference import expert_mlp, moe_routing  # (the Graph API's reference: one definition)


@torch.library.custom_op("megaegg::moe_mlp", mutates_args=())
def moe_mlp(x: torch.Tensor, logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            top_k: int, normalize: bool) -> torch.Tensor:
    """Each row of ``x [..., K]``: the ``top_k`` experts of ``softmax(logits [..., E])`` (``ops.moe_mlp``'s routing
    and rounding), their gated MLPs ``w_gate``, ``w_up [E, F, K]``, ``w_down [E, K, F]`` summed by the weights."""
    dt, rows = x.dtype, x.reshape(-1, x.shape[-1]).float()
    p, ids = moe_routing(logits.reshape(-1, logits.shape[-1]), top_k, normalize, dt)
    out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)
    for r in range(rows.shape[0]):
        for j, e in enumerate(ids[r].tolist()):
            h = expert_mlp(rows[r : r + 1], w_gate[e], w_up[e], dt)
            out[r] += p[r, j].float() * (h @ w_down[e].float().T)[0]
    return out.reshape(x.shape).to(dt)


@moe_mlp.register_fake
def _(x, logits, w_gate, w_up, w_down, top_k, normalize):
    return torch.empty_like(x)
