"""Sampling's definition (``megaegg.sampling``) and its edge cases, on the CPU: the reference
(``sample_row``, ``run_reference``), the sample block op on the simulator, and the greedy argmax
paths (``argmax_partial`` / ``argmax_reduce``, ``matvec_argmax``). Every token is in ``[0, V)``;
NaN logits (or a NaN temperature / top_p) are a :class:`NaNError` naming the row.

Expected answers come from independent computations: torch's float64 softmax with Hugging Face's
top-k / top-p filter for finite rows, exact sets (the tied maxima, the ``+inf`` positions, every
token of an all ``-inf`` row) for the limits. The same cases run on the GPU in
``tests/gpu/test_sample_gpu.py`` (``CASES`` below), compared with ``sample_row`` exactly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import megaegg as me
from megaegg.sampling import NaNError, draw_bits, kept, sample_row, scores, weights

INF, NAN = math.inf, math.nan
KNOBS = (("temperature", me.f32), ("top_k", me.i32), ("top_p", me.f32), ("seed", me.i32), ("counter", me.i32))
MAX_ROWS = 256


def rand_logits(v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * scale


@functools.lru_cache(maxsize=None)
def sample_graph(v: int, dtype: str = "f32"):
    g = me.Graph(f"sample{v}")
    r = me.sym("r")
    knobs = [g.input(n, [r], dt) for n, dt in KNOBS]
    g.output("tok", me.sample(g.input("logits", [r, v], getattr(me, dtype)), *knobs))
    return g, me.compile(g, {}, backend="sim", max_dims={"r": MAX_ROWS})


def inputs(logits: torch.Tensor, t, k, p, seeds, counter=0) -> dict[str, torch.Tensor]:
    """The sample op's inputs for rows ``logits [R, V]``; a setting is one value or one per row."""
    r = logits.shape[0]
    per_row = lambda x, dt: torch.tensor(x if isinstance(x, (list, tuple)) else [x] * r, dtype=dt)  # noqa: E731
    return {"logits": logits, "temperature": per_row(t, torch.float32), "top_k": per_row(k, torch.int32),
            "top_p": per_row(p, torch.float32), "seed": per_row(seeds, torch.int32), "counter": per_row(counter, torch.int32)}


def draw(logits: torch.Tensor, t, k, p, seeds, counter=0, dtype: str = "f32", graph_rows: int = MAX_ROWS) -> list[int]:
    """Tokens of rows ``logits [R, V]`` by ``sample_row``, each in [0, V), the first ``graph_rows`` checked
    equal to the reference graph's and the simulator's (the block op)."""
    ins = inputs(logits, t, k, p, seeds, counter)
    r, v = logits.shape
    want = [sample_row(logits[i], float(ins["temperature"][i]), int(ins["top_k"][i]), float(ins["top_p"][i]),
                       int(ins["seed"][i]), int(ins["counter"][i])) for i in range(r)]
    assert all(0 <= w < v for w in want), want
    g, kernel = sample_graph(v, dtype)
    for lo in range(0, min(r, graph_rows), MAX_ROWS):
        part = {n: x[lo:lo + MAX_ROWS] for n, x in ins.items()}
        n = part["logits"].shape[0]
        ref = me.run_reference(g, {a: b.clone() for a, b in part.items()}, {}, {"r": n})["tok"].tolist()
        sim = kernel(**part, r=n)["tok"].tolist()
        assert ref == want[lo:lo + n] and sim == want[lo:lo + n], (ref, sim, want[lo:lo + n])
    return want


def draw_one_row(l: torch.Tensor, t, k=0, p=1.0, n=64, dtype="f32") -> list[int]:
    """Tokens of one row under seeds 0..n-1 (rows of the same logits; the first 128 also through the graph)."""
    return draw(l.reshape(1, -1).expand(n, -1).contiguous(), t, k, p, list(range(n)), 3, dtype, graph_rows=128)


def argmax_set(l: torch.Tensor) -> set[int]:
    return set((l == l.max()).nonzero().reshape(-1).tolist())


def hf_probs(l: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Independent: torch float64 softmax(l / T) after Hugging Face's top-k, then top-p filter."""
    z = l.double() / t
    if 0 < k < z.numel():
        z = z.masked_fill(z < torch.topk(z, k).values[-1], -INF)
    q = z.softmax(0)
    if p < 1:
        s, idx = q.sort(descending=True)
        q[idx[(s.cumsum(0) - s) >= p]] = 0
        q /= q.sum()
    return q


def chi2_limit(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def implied_probs(l: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    d = scores(l, t)
    w = weights(d)
    w = torch.where(kept(l.float(), w, k, p), w, torch.zeros_like(w)).double()
    return w / w.sum()


# --- finite rows: the distribution ---------------------------------------------------------------------
@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.9), (3.0, 0, 1.0),
                                     (0.25, 0, 1.0)])
def test_finite_rows_follow_torchs_softmax(t, k, p):
    """The weights give torch's probabilities (to 1e-6, the same zeros), and 4000 draws (seed, counter)
    follow them (chi-square)."""
    l = rand_logits(40, seed=11)
    want = hf_probs(l, t, k, p)
    got = implied_probs(l, t, k, p)
    assert not (got[want == 0] > 0).any() and want[got == 0].sum() < 1e-9  # (weight 0: below 2**-32 of the max)
    assert (got - want).abs().max() < 1e-6
    n = 4000
    toks = [sample_row(l, t, k, p, s, c) for s, c in zip(range(n), [7, 8] * (n // 2))]
    counts = torch.bincount(torch.tensor(toks), minlength=40).double()
    keep = want > 0
    assert counts[~keep].sum() == 0
    expected = n * want[keep]
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_limit(int(keep.sum()) - 1), chi2


def test_the_weights_are_an_exp_of_the_scores():
    d = torch.cat([torch.linspace(-22, 0, 20001), torch.tensor([-1e-45, -1e-30, -22.18, -22.19, -1e30, -INF])])
    w = weights(d).double()
    e = torch.exp(d.double()) * 2**32
    assert w.max() == 2**32 and w[-1] == 0 and w[-2] == 0
    big = e > 2**20
    assert ((w[big] - e[big]).abs() / e[big]).max() < 1e-6
    assert ((w - e).abs()[~big] <= 1.0 + 1e-6 * e[~big]).all()


def test_the_sample_op_follows_the_definition_for_bf16_rows():
    l = rand_logits(300, seed=3, scale=4).to(torch.bfloat16).reshape(1, -1).expand(32, -1).contiguous()
    t = [0.0, 0.6, 1.0, 1.7] * 8
    draw(l, t, [0, 5, 0, 40] * 8, [1.0, 1.0, 0.9, 0.5] * 8, list(range(32)), dtype="bf16")


# --- the limits: tiny and huge temperatures, infinities ------------------------------------------------
TINY = [1e-45, 3e-45, 1e-42, 1e-40, 1e-38, 1.5e-38, 1e-30, 1e-20]


@pytest.mark.parametrize("t", TINY)
def test_a_tiny_temperature_draws_the_argmax(t):
    """l / T would overflow: the draw is the argmax (a unique max), never V or a non-maximal token."""
    for seed in (1, 2, 3):
        l = rand_logits(500, seed)
        assert set(draw_one_row(l, t, n=16)) == {int(l.argmax())}
        assert set(draw_one_row(l, t, k=1, p=1e-9, n=8)) == {int(l.argmax())}


@pytest.mark.parametrize("t", [1e-45, 1e-38, 1e-30, 0.5])
def test_tied_maxima_share_the_draw(t):
    l = rand_logits(200, seed=5)
    l[[3, 77, 150]] = l.max() + 30  # (at T = 0.5 the rest weigh below 2**-32 of them: 0)
    assert set(draw_one_row(l, t, n=64)) == {3, 77, 150}
    assert set(draw_one_row(l, t, k=1, n=64)) == {3, 77, 150}  # top-k 1 keeps ties of the k-th
    assert set(draw_one_row(l, t, p=1e-9, n=64)) == {3, 77, 150}


@pytest.mark.parametrize("t", [1e-45, 1e-20, 0.8, 1.0, 50.0, 1e30, INF])
@pytest.mark.parametrize("where", [[0], [17], [63], [2, 40], [5, 6, 60]])
def test_plus_inf_logits_share_the_draw_among_themselves(t, where):
    l = rand_logits(64, seed=7)
    l[where] = INF
    for k, p in ((0, 1.0), (1, 1.0), (3, 0.5), (0, 1e-9), (63, 0.99)):
        assert set(draw_one_row(l, t, k, p, n=48)) == set(where)
    assert draw_one_row(l, 0.0, n=1) == [where[0]]  # greedy: the first +inf


@pytest.mark.parametrize("v", [1, 2, 7, 64])
def test_an_all_minus_inf_row_draws_uniformly(v):
    l = torch.full((v,), -INF)
    n = 40 * v
    toks = draw_one_row(l, 0.9, n=n)
    assert set(toks) == set(range(v))
    counts = torch.bincount(torch.tensor(toks), minlength=v).double()
    if v > 1:
        assert float(((counts - n / v) ** 2 / (n / v)).sum()) < chi2_limit(v - 1)
    for k, p in ((1, 1.0), (0, 1e-9), (v + 3, 0.5)):  # ties: all kept
        assert set(draw_one_row(l, 1.0, k, p, n=8 * v)) == set(range(v))
    assert draw_one_row(l, 0.0, n=1) == [0]  # greedy
    assert draw_one_row(l, 1e-45, n=1)[0] in range(v)


def test_minus_inf_logits_are_never_drawn():
    l = rand_logits(48, seed=9)
    ninf = torch.zeros(48, dtype=torch.bool)
    ninf[::3] = True
    l[ninf] = -INF
    for t, k, p in ((1.0, 0, 1.0), (2.0, 40, 0.95), (1e30, 0, 1.0), (INF, 0, 1.0), (1.0, 47, 1.0)):
        toks = draw_one_row(l, t, k, p, n=200)
        assert not ninf[toks].any()
        if t >= 1e30:  # the T -> inf limit: uniform over the finite tokens
            assert set(toks) == set((~ninf).nonzero().reshape(-1).tolist())
    want = hf_probs(l, 1.0, 0, 1.0)
    assert (implied_probs(l, 1.0, 0, 1.0) - want).abs().max() < 1e-6


def test_a_huge_temperature_is_nearly_uniform_and_extreme_logits_do_not_overflow():
    l = rand_logits(16, seed=1)
    assert set(draw_one_row(l, 1e30, n=300)) == set(range(16))
    x = torch.tensor([-3e38, 3e38, 0.0, 1e38])  # l - max l overflows for the first
    assert set(draw_one_row(x, 1.0, n=64)) == {1}
    assert (implied_probs(x, 1e38, 0, 1.0) - hf_probs(x, 1e38, 0, 1.0)).abs().max() < 1e-6
    assert set(draw_one_row(x, INF, n=200)) == {0, 1, 2, 3}
    denormal = torch.tensor([1e-45, 0.0, -1e-45, 3e-45])  # 1, 0, -1, 2 times the smallest f32 denormal
    t = float(torch.tensor(1e-45))  # that denormal: l / T is 1, 0, -1, 2
    assert (implied_probs(denormal, t, 0, 1.0) - torch.tensor([1.0, 0, -1, 2]).double().softmax(0)).abs().max() < 1e-6
    assert set(draw_one_row(denormal, t, n=200)) == {0, 1, 2, 3}
    assert set(draw_one_row(denormal, t * 0.5, n=64)) == {3}  # (T rounds to 0: greedy)
    assert set(draw_one_row(denormal, 1.0, n=300)) == {0, 1, 2, 3}


# --- top-k and top-p at their edges --------------------------------------------------------------------
@pytest.mark.parametrize("v", [1, 2, 9, 100])
def test_top_k_at_its_edges(v):
    """The kept set is exact; the draws stay in it (T = 1000: nearly uniform, so they also cover it)."""
    l = rand_logits(v, seed=v)
    order = torch.argsort(l, descending=True)
    d = scores(l, 1e3)
    w = weights(d)
    for k, want in ((0, range(v)), (v, range(v)), (v + 1, range(v)), (2**31 - 1, range(v)), (-1, range(v)),
                    (1, order[:1].tolist()), (v - 1, order[: max(v - 1, 1)].tolist())):
        assert set(kept(l, w, k, 1.0).nonzero().reshape(-1).tolist()) == set(want), k
        toks = draw_one_row(l, 1e3, k, 1.0, n=8 * v + 8)
        assert set(toks) <= set(want) and len(set(toks)) >= min(len(want), 0.9 * len(want) + 1)


def test_top_p_at_its_edges():
    l = rand_logits(30, seed=4)
    top = int(l.argmax())
    for p in (1e-9, 1e-30, 0.0, -1.0, -INF):  # (the op takes any f32; the CLI refuses <= 0)
        assert set(draw_one_row(l, 1.0, 0, p, n=32)) == {top}
    full = set(draw_one_row(l, 1e3, 0, 1.0, n=900))
    assert full == set(range(30)) and set(draw_one_row(l, 1e3, 0, 2.0, n=900)) == full
    assert set(draw_one_row(l, 1e3, 0, 1 - 1e-9, n=900)) == full  # (rounds to f32 1.0)
    # ties at the threshold are kept: two tokens of probability 0.4 each, top_p 0.3 keeps both
    x = torch.tensor([math.log(4), math.log(4), math.log(1), math.log(1)])
    assert set(draw_one_row(x, 1.0, 0, 0.3, n=64)) == {0, 1}
    assert set(draw_one_row(x, 1.0, 0, 0.85, n=200)) == {0, 1, 2, 3}
    assert set(draw_one_row(x, 1.0, 1, 0.3, n=64)) == {0, 1}


@pytest.mark.parametrize("t", [0.0, 1e-45, 1.0, INF])
def test_one_token(t):
    for x in (0.5, INF, -INF, 3e38):
        assert draw_one_row(torch.tensor([x]), t, 1, 1e-9, n=4) == [0] * 4
        assert draw_one_row(torch.tensor([x]), t, 0, 1.0, n=4) == [0] * 4


def test_greedy_is_the_first_maximum():
    l = torch.tensor([[0.0, 5.0, 5.0, -1.0], [-INF, INF, 3.0, INF], [-INF] * 4, [1.0, 1.0, 1.0, 1.0], [-INF, -INF, -3e38, -INF]])
    assert draw(l, [0.0, -1.0, 0.0, -INF, 0.0], 0, 1.0, 0) == [1, 1, 0, 0, 2]


# --- NaN: an error naming the row -----------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 0.8, 1e-45])
def test_nan_logits_are_an_error_naming_the_row(t):
    l = rand_logits(50, seed=2).reshape(1, -1).repeat(4, 1)
    l[2, 17] = NAN
    with pytest.raises(NaNError, match="NaN logits in row 3 of here"):
        sample_row(l[2], t, 0, 1.0, 0, 0, row=3, where="here")
    g, kernel = sample_graph(50)
    ins = inputs(l, t, 0, 1.0, [0, 1, 2, 3])
    with pytest.raises(NaNError, match=r"NaN logits in row 2 of sample "):
        me.run_reference(g, ins, {}, {"r": 4})
    with pytest.raises(NaNError, match=r"NaN logits in row 2 of op\d+ sample \(graph nodes \[\d+\]\)"):
        kernel(**ins, r=4)
    l[:] = NAN  # a whole row of NaN, every row: the first
    with pytest.raises(NaNError, match="NaN logits in row 0 of"):
        kernel(**inputs(l, t, 0, 1.0, [0, 1, 2, 3]), r=4)
    l[:] = INF
    l[1, 0] = NAN  # among +inf
    with pytest.raises(NaNError, match="NaN logits in row 1 of"):
        kernel(**inputs(l, t, 0, 1.0, [0, 1, 2, 3]), r=4)


@pytest.mark.parametrize("what, t, p", [("temperature", NAN, 1.0), ("top_p", 0.8, NAN), ("top_p", 0.0, NAN),
                                        ("temperature", NAN, NAN)])
def test_a_nan_setting_is_an_error_naming_the_row(what, t, p):
    l = rand_logits(20, seed=1).reshape(1, -1).repeat(3, 1)
    g, kernel = sample_graph(20)
    ins = inputs(l, [0.5, t, 0.5], 0, [0.9, p, 0.9], [0, 1, 2])
    with pytest.raises(NaNError, match=f"NaN {what} in row 1 of op"):
        kernel(**ins, r=3)
    with pytest.raises(NaNError, match=f"NaN {what} in row 1 of sample"):
        me.run_reference(g, ins, {}, {"r": 3})


def test_a_nan_error_can_name_the_step():
    try:
        sample_row(torch.tensor([NAN]), 1.0, 0, 1.0, 0, 0)
    except NaNError as e:
        assert str(e.at_step(5)) == "step 5: NaN logits in row 0 of sample" and isinstance(e.at_step(5), ValueError)


# --- greedy argmax block ops ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def argmax_graph(v: int):
    g = me.Graph(f"argmax{v}")
    r = me.sym("r")
    g.output("i", me.argmax(g.input("x", [r, v], me.f32)))
    kernel = me.compile(g, {}, backend="sim", max_dims={"r": 8})
    assert {e.op.kind for e in kernel.queue.entries} == {"argmax_partial", "argmax_reduce"}
    return g, kernel


@pytest.mark.parametrize("v", [1, 9, 5000])
def test_argmax_ops_at_the_edges(v):
    g, kernel = argmax_graph(v)
    x = torch.randn(6, v, generator=torch.Generator().manual_seed(v))
    x[1] = -INF
    x[2, v // 2:] = INF
    x[3, :] = 2.5
    x[4, : v - 1] = -INF
    x[5, -1] = INF
    want = [int(r.argmax()) for r in x]
    assert want[1] == 0 and want[2] == v // 2 and want[3] == 0 and want[5] == v - 1
    assert me.run_reference(g, {"x": x.clone()}, {}, {"r": 6})["i"].tolist() == want
    assert kernel(x=x, r=6)["i"].tolist() == want
    x[3, v - 1] = NAN
    for run in (lambda: me.run_reference(g, {"x": x.clone()}, {}, {"r": 6}), lambda: kernel(x=x, r=6)):
        with pytest.raises(NaNError, match="NaN logits in row 3 of"):
            run()


def test_the_lm_head_argmax_at_the_edges():
    """matvec_argmax (the LM head fused with argmax partials): +inf, all -inf and NaN logits."""
    g = me.Graph("lm_head")
    x = g.input("x", [1, 16], me.f32)
    g.output("i", me.argmax(me.linear(x, g.weight("w", [40, 16], me.f32))))
    ones = torch.ones(1, 16)
    for fill, want in (({7: 3e38, 30: 3e38}, 7), ({}, None), ("-inf", 0)):
        w = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
        if fill == "-inf":
            w[:] = -3e38  # every logit overflows to -inf
        else:
            for row, val in fill.items():
                w[row] = val  # this logit overflows to +inf
        kernel = me.compile(g, {"w": w}, backend="sim")
        assert "matvec_argmax" in {e.op.kind for e in kernel.queue.entries}
        ref = me.run_reference(g, {"x": ones}, {"w": w})["i"].tolist()
        assert kernel(x=ones)["i"].tolist() == ref == [want if want is not None else int((w @ ones[0]).argmax())]
    w[11, 3] = NAN
    kernel = me.compile(g, {"w": w}, backend="sim")
    for run in (lambda: me.run_reference(g, {"x": ones}, {"w": w}), lambda: kernel(x=ones)):
        with pytest.raises(NaNError, match="NaN logits in row 0 of"):
            run()


# --- variants: random rows mixing every edge -----------------------------------------------------------
def wild_rows(n: int, seed: int) -> tuple[torch.Tensor, list]:
    """Rows (V = 37) mixing scales, ties, +/-inf and denormals, with settings from every range."""
    gen = torch.Generator().manual_seed(seed)
    v = 37
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    rows, settings = [], []
    for _ in range(n):
        x = torch.randn(v, generator=gen) * pick([1e-30, 1e-3, 1.0, 30.0, 1e20, 1e38])
        if pick([0, 1]):
            x = x.round()  # ties
        for val, frac in ((INF, pick([0, 0, 0.05, 0.5])), (-INF, pick([0, 0.3, 0.9, 1.0])), (1e-45, pick([0, 0.2]))):
            x[torch.rand(v, generator=gen) < frac] = val
        rows.append(x)
        settings.append((pick([0.0, 1e-45, 1e-41, 1e-38, 1e-12, 0.3, 1.0, 7.0, 1e30, INF]),
                         pick([0, 1, 2, v - 1, v, v + 9, -4]), pick([1e-9, 0.1, 0.5, 0.9, 0.999, 1.0, 1.5, 0.0])))
    return torch.stack(rows), settings


@pytest.mark.parametrize("seed", [0, 1])
def test_wild_rows_give_a_sensible_token(seed):
    x, settings = wild_rows(200, seed)
    t, k, p = (list(c) for c in zip(*settings))
    toks = draw(x, t, k, p, list(range(200)), 5)
    for i, tok in enumerate(toks):
        l = x[i]
        if (l == INF).any():
            assert l[tok] == INF, (i, settings[i])
        elif (l > -INF).any():
            assert l[tok] > -INF, (i, settings[i])
        if t[i] <= 0:
            assert tok == int(l.argmax())
        elif t[i] <= 1e-38 and (l > -INF).any() and l.abs()[l.abs() < INF].min() > 1e-6:
            assert tok in argmax_set(l), (i, settings[i])
        if t[i] > 0:
            d = scores(l, t[i])
            w = weights(d)
            assert kept(l, w, k[i], p[i])[tok] and w[tok] > 0


def test_the_draw_is_a_uniform_hash_of_seed_and_counter():
    bits = [draw_bits(9, c) for c in range(3000)]
    assert all(0 <= b < 2**24 for b in bits) and abs(sum(bits) / len(bits) / 2**24 - 0.5) < 0.02
