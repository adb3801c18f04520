"""The routed experts of a Qwen3-MoE layer in plain PyTorch, for the PyTorch decode steps.

As a user writes it (gpt-fast's MoE): the router's softmax and top-k on the device, the chosen
experts' weights gathered by their device-side ids (``w[ids]``: no ``.item()``, so the step
stays capturable in a CUDA graph and traceable by ``torch.compile``), then batched matvecs.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decoder import EXPERT_PROJS, expert_stack


class ExpertsMLP(nn.Module):
    """``x [1, hidden]`` -> the weighted sum of its ``top_k`` routed experts' gated MLPs ``[1, hidden]``."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], layer: int, device) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.moe.top_k, cfg.moe.normalize
        self.router = nn.Parameter(weights[f"model.layers.{layer}.mlp.gate.weight"].to(device), requires_grad=False)
        self.gate, self.up, self.down = (nn.Parameter(weights[expert_stack(layer, p)].to(device), requires_grad=False)
                                         for p in EXPERT_PROJS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)  # [1, E]
        p, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            p = p / p.sum(-1, keepdim=True)
        p, ids = p.to(x.dtype)[0], ids[0]  # [top_k]
        h = x[0]
        gate = torch.einsum("k,efk->ef", h, self.gate[ids])  # [top_k, F]
        up = torch.einsum("k,efk->ef", h, self.up[ids])
        y = torch.einsum("ef,ekf->ek", F.silu(gate) * up, self.down[ids])  # [top_k, hidden]
        return (y * p[:, None]).sum(0, keepdim=True)
