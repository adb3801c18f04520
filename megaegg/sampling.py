"""Token sampling: the definition that :func:`megaegg.ops.sample`'s reference, its block op on the
simulator and its CUDA body (``interpreter/cuda/sample.cuh``) follow, bit for bit.

One row of logits ``l [V]`` (f32; bf16 / f16 rows widen exactly) with the row's f32 settings
``T`` (temperature), ``top_k`` and ``top_p``:

0. A NaN in ``l``, ``T`` or ``top_p`` is an error (:class:`NaNError`, naming the row), never a token.
1. ``T <= 0``: greedy, the first index of the largest logit (``+inf`` included; an all ``-inf``
   row gives 0).
2. The scaled scores ``d``, every one ``<= 0`` (f32 operations): ``d = 0`` where ``l == max l`` (so
   ``+inf`` logits, and an all ``-inf`` row, score 0 rather than NaN); else ``d = (l - max l) / T``
   where ``l - max l`` is finite, ``l / T - max l / T`` where it overflows (both finite: logits
   beyond +/-1.7e38), ``-inf`` otherwise (``l = -inf``, or ``max l = +inf``); ``-0`` made ``+0``.
   Subtracting the max first means a tiny ``T`` can only send ``d`` to ``-inf``, never to ``+inf``
   (``l / T`` would overflow every positive logit to ``+inf`` and tie them), and ``T = +inf`` gives
   every finite token ``d = 0``: the limits of ``softmax(l / T)``.
3. Each token's integer weight ``w = floor(2**32 * 2**(d * log2 e))`` by :func:`weights`' fixed
   f32 sequence (an exp whose every step is one IEEE-rounded f32 operation, so that the CPU and
   the GPU agree bit for bit): a token with ``d == 0`` (the maxima) weighs exactly ``2**32``, one
   with ``d * log2 e < -32`` (``d = -inf`` included) weighs 0. Sums below are exact integers, the
   same in any order; the total is at most ``V * 2**32 < 2**63`` for ``V < 2**31``.
4. ``0 < top_k < V``: keep the tokens whose logit is at least the ``top_k``-th largest (ties kept;
   ``-0 == +0``). (Steps 4 and 5 order tokens by ``l``, as ``d`` and ``w`` do, only without the ties
   that rounding makes among scores.)
5. ``top_p < 1``: of those, keep the tokens whose logit is at least ``t``, the largest value such
   that the kept weight with ``l >= t`` reaches ``need = max(1, floor(top_p * kept weight))``
   (the product in double; ``need`` is 1 for ``top_p <= 0``): the fewest most likely tokens whose
   probability reaches ``top_p``, ties kept.
6. Draw ``u``, a 24-bit integer from :func:`draw_bits` of ``(seed, counter)``; the token is the
   first index (in vocabulary order) where the running kept weight exceeds
   ``floor(kept weight * u / 2**24)``. The maxima always stay kept and weigh ``2**32``, so the
   kept weight is positive and the token is always in ``[0, V)``.

So a token's probability is its weight over the kept weight: ``softmax(l / T)`` restricted to
the kept tokens and renormalised, as torch's (and Hugging Face's) temperature, top-k and top-p
warpers give it, and its limits where ``l / T`` would overflow: ``+inf`` logits share the draw
among themselves, an all ``-inf`` row draws uniformly, ``T -> 0`` draws among the tied maxima.
The same ``(seed, counter)`` gives the same token.
"""

from __future__ import annotations

import copy

import torch

from .graph import GraphError

MASK64 = (1 << 64) - 1
WEIGHT_ONE = 1 << 32  # the weight of a token with d = 0 (l = max l)
LOG2E = float.fromhex("0x1.715476p+0")  # log2(e) rounded to f32 (sample.cuh: the same literal)
# 2**f ~ sum ln2**k / k! * f**k for |f| <= 1/2, k = 0..6 (relative error below 2e-7), each coefficient
# rounded to f32 (sample.cuh: the same literals)
EXP2_POLY = tuple(float.fromhex(h) for h in (
    "0x1p+0", "0x1.62e43p-1", "0x1.ebfbep-3", "0x1.c6b08ep-5", "0x1.3b2ab6p-7", "0x1.5d87fep-10", "0x1.430912p-13"))


class NaNError(GraphError):
    """NaN logits (or a NaN temperature / top_p) met by ``sample`` or ``argmax``: no token can be
    drawn. The message names the row and the op; :meth:`at_step` adds the generation step."""

    def at_step(self, step: int) -> "NaNError":
        """The same error, its message prefixed with ``step {step}: ``."""
        e = copy.copy(self)
        e.args = (f"step {step}: {self.args[0] if self.args else ''}",)
        return e


def draw_bits(seed: int, counter: int) -> int:
    """24 uniform bits from ``(seed, counter)`` (splitmix64 of the two as one 64-bit word)."""
    x = ((((seed & 0xFFFFFFFF) << 32) | (counter & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) >> 40


def f32(x: float) -> float:
    """``x`` rounded to f32 (the op's settings are f32 tensors)."""
    return float(torch.tensor(float(x), dtype=torch.float32))


def _c(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, x)  # (tensor op tensor: the scalar paths may use a reciprocal)


def scores(l: torch.Tensor, temperature: float) -> torch.Tensor:
    """The scaled scores ``d`` of step 2 (f32, all ``<= 0``, 0 at the maxima, no -0)."""
    l = l.float()
    top = l.max().expand_as(l)
    t = _c(f32(temperature), l)
    s = l - top
    over = torch.isfinite(l) & torch.isfinite(top)  # (and s is not: l - max l overflowed)
    d = torch.where(torch.isfinite(s), s / t, torch.where(over, l / t - top / t, _c(-float("inf"), l)))
    return torch.where((l == top) | (d == 0), torch.zeros_like(d), d)


def weights(d: torch.Tensor) -> torch.Tensor:
    """Integer token weights (int64) of step 3, of scores ``d`` (relative to their max: raw scores
    such as ``l / T`` are first made ``scores(d, 1)``, which leaves ``scores()``' output as it is)."""
    d = scores(d, 1.0)
    x = d * _c(LOG2E, d)
    small = ~(x >= -32.0)  # weight 0 (d = -inf included)
    x = torch.where(small, torch.zeros_like(x), x)
    n = torch.round(x)  # (to nearest, ties to even: rintf)
    f = x - n
    p = _c(EXP2_POLY[-1], f)
    for c in reversed(EXP2_POLY[:-1]):
        p = p * f  # (two roundings: the kernel uses __fmul_rn / __fadd_rn, never an fma)
        p = p + _c(c, f)
    w = (p * _c(float(WEIGHT_ONE), p)).long() >> (-n).long()
    w = torch.where(d == 0, torch.full_like(w, WEIGHT_ONE), w)
    return torch.where(small, torch.zeros_like(w), w)


def kept(d: torch.Tensor, w: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens steps 4 and 5 keep, as a bool mask: ``d`` orders the tokens (the logits in
    :func:`sample_row`; scores in the same order give the same mask up to ties), ``w``: :func:`weights`."""
    keep = torch.ones_like(d, dtype=torch.bool)
    if 0 < top_k < d.numel():
        keep &= d >= torch.topk(d, top_k).values[-1]
    top_p = f32(top_p)
    if top_p < 1.0:
        total = int(w[keep].sum())
        prod = top_p * float(total)  # (in double, as the kernel's)
        need = max(1, int(prod)) if prod > 0 else 1
        order = torch.argsort(d[keep], descending=True, stable=True)  # most likely first
        ds, mass = d[keep][order], w[keep][order].cumsum(0)
        t = ds[min(int(torch.searchsorted(mass, torch.tensor(need))), len(ds) - 1)]  # (ties of t kept below)
        keep &= d >= t
    return keep


def check_row(logits: torch.Tensor, temperature: float, top_p: float, row: int, where: str) -> None:
    """Step 0: raise :class:`NaNError` for NaN settings or logits (the settings first, as the kernel)."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if v != v:
            raise NaNError(f"NaN {name} in row {row} of {where}")
    if bool(torch.isnan(logits).any()):
        raise NaNError(f"NaN logits in row {row} of {where}")


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, counter: int,
               *, row: int = 0, where: str = "sample") -> int:
    """The token drawn from one row of logits (see the module docstring); ``row`` and ``where`` name
    the row in a :class:`NaNError`."""
    l = logits.detach().reshape(-1).float().cpu()
    temperature, top_p = f32(temperature), f32(top_p)
    check_row(l, temperature, top_p, row, where)
    if not temperature > 0:
        return int(torch.argmax(l))  # (first index of the max; an all -inf row: 0)
    d = scores(l, temperature)
    w = weights(d)
    w = torch.where(kept(l, w, int(top_k), top_p), w, torch.zeros_like(w))
    total = int(w.sum())
    u = draw_bits(seed, counter)
    target = (total >> 24) * u + (((total & 0xFFFFFF) * u) >> 24)  # floor(total * u / 2**24), exact
    return int(torch.searchsorted(w.cumsum(0), torch.tensor(target), right=True))
