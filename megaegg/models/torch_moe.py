"""The routed experts of a Qwen3-MoE layer in plain PyTorch, for the PyTorch decode and batch steps.

As a user writes it, with static shapes (capturable in a CUDA graph, traceable by ``torch.compile``): the
router's softmax and top-k on the device, then, for few rows (``rows * top_k < experts``), each row's chosen
experts' weights gathered by their device-side ids (gpt-fast's MoE: ``w[ids]``, no ``.item()``) and batched
matvecs; for many rows (a batch, a prompt: most experts chosen), every expert for every row in three
matmuls, each expert's weights read once, the unchosen experts weighted 0 (16x the FLOPs of top-8 of 128,
but one pass over the weights instead of one a row).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decoder import EXPERT_PROJS, expert_stack


class ExpertsMLP(nn.Module):
    """``x [rows, hidden]`` -> each row's weighted sum of its ``top_k`` routed experts' gated MLPs ``[rows, hidden]``."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, device) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.moe.top_k, cfg.moe.normalize
        self.router = nn.Parameter(weights[f"model.layers.{layer}.mlp.gate.weight"].to(device), requires_grad=False)
        self.gate, self.up, self.down = (nn.Parameter(weights[expert_stack(layer, p)].to(device), requires_grad=False)
                                         for p in EXPERT_PROJS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)  # [rows, E]
        p, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            p = p / p.sum(-1, keepdim=True)
        p = p.to(x.dtype)
        experts, f, k = self.gate.shape
        if x.shape[0] * self.top_k < experts:  # few rows: each one's experts gathered
            gate = torch.einsum("rk,rjfk->rjf", x, self.gate[ids])  # [rows, top_k, F]
            up = torch.einsum("rk,rjfk->rjf", x, self.up[ids])
            y = torch.einsum("rjf,rjkf->rjk", F.silu(gate) * up, self.down[ids])  # [rows, top_k, hidden]
            return (y * p[..., None]).sum(1)
        weight = torch.zeros_like(probs, dtype=x.dtype).scatter(1, ids, p)  # [rows, E]: 0 for the unchosen
        h = F.silu(F.linear(x, self.gate.view(experts * f, k))) * F.linear(x, self.up.view(experts * f, k))
        h = (h.view(-1, experts, f) * weight[..., None]).transpose(0, 1)  # [E, rows, F]
        return torch.bmm(h, self.down.transpose(1, 2)).sum(0)  # [E, rows, hidden] summed over the experts
