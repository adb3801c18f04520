"""Token sampling: the definition that :func:`megaegg.ops.sample`'s reference, its block op on the
simulator and its CUDA body (``interpreter/cuda/sample.cuh``) follow.

One row of logits ``l [V]`` with a temperature ``T``, ``top_k`` and ``top_p``:

1. ``T <= 0``: greedy, the first index of the largest logit.
2. ``z = l / T`` (f32); each token's weight ``w = floor(exp(z - max z) * 2**32)``, an integer, so
   that every sum below is exact and the same in any order.
3. ``0 < top_k < V``: keep the tokens whose ``z`` is at least the ``top_k``-th largest (ties kept).
4. ``top_p < 1``: of those, keep the tokens whose ``z`` is at least ``t``, the largest value such
   that the kept weight with ``z >= t`` reaches ``max(1, floor(top_p * kept weight))`` (the
   fewest most likely tokens whose probability reaches ``top_p``; ties kept).
5. Draw ``u``, a 24-bit integer from :func:`draw_bits` of ``(seed, counter)``; the token is the
   first index (in vocabulary order) where the running kept weight exceeds
   ``floor(kept weight * u / 2**24)``.

So a token's probability is its weight over the kept weight: ``softmax(l / T)`` restricted to
the kept tokens and renormalised, as torch's (and Hugging Face's) temperature, top-k and top-p
warpers give it; the same ``(seed, counter)`` gives the same token.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
WEIGHT_ONE = 1 << 32  # the weight of a token with z = max z


def draw_bits(seed: int, counter: int) -> int:
    """24 uniform bits from ``(seed, counter)`` (splitmix64 of the two as one 64-bit word)."""
    x = ((((seed & 0xFFFFFFFF) << 32) | (counter & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) >> 40


def weights(z: torch.Tensor) -> torch.Tensor:
    """Integer token weights ``floor(exp(z - max z) * 2**32)`` (int64) of f32 scores ``z``."""
    e = torch.exp(z - z.max())
    return (e.double() * WEIGHT_ONE).floor().long()


def kept(z: torch.Tensor, w: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens steps 3 and 4 keep, as a bool mask."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1.0:
        total = int(w[keep].sum())
        need = max(1, int(float(top_p) * float(total)))  # (the product in double, as the kernel's)
        order = torch.argsort(z[keep], descending=True, stable=True)  # most likely first
        zs, mass = z[keep][order], w[keep][order].cumsum(0)
        t = zs[min(int(torch.searchsorted(mass, torch.tensor(need))), len(zs) - 1)]  # (ties of t kept below)
        keep &= z >= t
    return keep


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, counter: int) -> int:
    """The token drawn from one row of logits (see the module docstring)."""
    l = logits.float()
    if temperature <= 0:
        return int(torch.argmax(l))
    z = l / torch.tensor(float(temperature), dtype=torch.float32)
    w = weights(z)
    w = torch.where(kept(z, w, int(top_k), float(top_p)), w, torch.zeros_like(w))
    total = int(w.sum())
    u = draw_bits(seed, counter)
    target = (total >> 24) * u + (((total & 0xFFFFFF) * u) >> 24)  # floor(total * u / 2**24), exact
    return int(torch.searchsorted(w.cumsum(0), torch.tensor(target), right=True))
