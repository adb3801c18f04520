"""GPU: the CUDA sampler (``sample.cuh``) and the greedy argmax bodies at their edges, against
``megaegg.sampling.sample_row`` / the reference exactly (the definition is bit for bit the same on
the CPU and the GPU): tiny and huge temperatures, +inf / -inf rows, top-k / top-p at their edges,
one-token rows, random rows mixing them all, and NaN logits or settings, which raise a
``NaNError`` naming the row and leave the kernel usable. The CPU twin is ``tests/test_sampling.py``."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import megaegg as me
from megaegg.sampling import NaNError, sample_row
from test_sampling import KNOBS, argmax_set, rand_logits, wild_rows

pytestmark = pytest.mark.gpu
INF, NAN = math.inf, math.nan
ROWS = 512


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@functools.lru_cache(maxsize=None)
def kernel(v: int, dtype: str = "f32"):
    g = me.Graph(f"sample{v}")
    r = me.sym("r")
    knobs = [g.input(n, [r], dt) for n, dt in KNOBS]
    g.output("tok", me.sample(g.input("logits", [r, v], getattr(me, dtype)), *knobs))
    return me.compile(g, {}, backend="cuda", max_dims={"r": ROWS})


def on_gpu(logits: torch.Tensor, t, k, p, seeds, counter=0, dtype="f32") -> list[int]:
    """The CUDA body's tokens for rows ``logits [R, V]``, checked equal to ``sample_row``'s row by row."""
    r, v = logits.shape
    per_row = lambda x, dt: torch.tensor(x if isinstance(x, (list, tuple)) else [x] * r, dtype=dt)  # noqa: E731
    ins = {"logits": logits.to(getattr(me, dtype).torch), "temperature": per_row(t, torch.float32),
           "top_k": per_row(k, torch.int32), "top_p": per_row(p, torch.float32), "seed": per_row(seeds, torch.int32),
           "counter": per_row(counter, torch.int32)}
    want = [sample_row(ins["logits"][i], float(ins["temperature"][i]), int(ins["top_k"][i]), float(ins["top_p"][i]),
                       int(ins["seed"][i]), int(ins["counter"][i])) for i in range(r)]
    got = []
    for lo in range(0, r, ROWS):
        part = {n: x[lo:lo + ROWS].cuda() for n, x in ins.items()}
        got += kernel(v, dtype)(**part, r=part["logits"].shape[0])["tok"].cpu().tolist()
    bad = [(i, got[i], want[i]) for i in range(r) if got[i] != want[i]]
    assert not bad, f"{len(bad)} of {r} rows differ from sample_row (row, gpu, cpu): {bad[:8]}"
    return got


def one_row(l, t, k=0, p=1.0, n=64, dtype="f32"):
    return on_gpu(l.reshape(1, -1).expand(n, -1).contiguous(), t, k, p, list(range(n)), 3, dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("v", [37, 5003, 128256])
def test_finite_rows_match_the_definition_exactly(v, dtype):
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0), (1.2, 0, 0.9), (0.8, 20, 0.7), (1.0, 1, 1.0),
                (2.0, 0, 0.5), (0.5, v - 3, 0.99), (0.05, 0, 1.0), (30.0, 0, 0.95)]
    n = 160 if v < 100000 else 40
    logits = torch.stack([rand_logits(v, seed=i, scale=3.0) for i in range(n)])
    t, k, p = zip(*[settings[i % len(settings)] for i in range(n)])
    on_gpu(logits, list(t), list(k), list(p), list(range(n)), 9, dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_llama_vocab_at_the_serving_settings(dtype):
    """V = 128256 at temperature 0.8, top_p 0.95, top_k 0 / 50 (and 0.9 / 20): rows shaped like a language
    model's (a bulk in a few binades, so the radix passes' top digits concentrate, and a tail of likely
    tokens), some of them rounded (ties across the threshold)."""
    v, n = 128256, 48
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        l = torch.randn(v, generator=g) * (1.0 + i % 4)
        hot = torch.randint(0, v, (64,), generator=g)
        l[hot] += torch.rand(64, generator=g) * (8.0 + 3.0 * (i % 5))
        rows.append(l.round() if i % 6 == 5 else l)
    settings = [(0.8, 0, 0.95), (0.8, 50, 0.95), (0.8, 0, 0.9), (0.8, 20, 0.9)]
    t, k, p = zip(*[settings[i % len(settings)] for i in range(n)])
    on_gpu(torch.stack(rows), list(t), list(k), list(p), list(range(n)), 11, dtype)


@pytest.mark.parametrize("v", [1, 37, 5003])
def test_the_limits(v):
    l = rand_logits(v, seed=1)
    for t in (1e-45, 1e-40, 1e-38, 1e-30):
        assert set(one_row(l, t, n=16)) == {int(l.argmax())}
    if v > 3:
        tied = l.clone()
        tied[[0, v // 2, v - 1]] = l.max() + 30
        for t, k, p in ((1e-45, 0, 1.0), (0.5, 1, 1.0), (1.0, 0, 1e-9)):
            assert set(one_row(tied, t, k, p, n=64)) == {0, v // 2, v - 1}
        inf = l.clone()
        inf[[1, v - 2]] = INF
        for t in (1e-45, 1.0, 1e30, INF):
            assert set(one_row(inf, t, 3, 0.5, n=64)) == {1, v - 2}
        assert one_row(inf, 0.0, n=1) == [1]
    ninf = torch.full((v,), -INF)
    toks = one_row(ninf, 1.0, n=max(64, 20 * v) if v < 100 else 256)
    assert set(toks) == set(range(v)) if v < 100 else len(set(toks)) > 240  # uniform
    assert one_row(ninf, 0.0, n=1) == [0]
    mixed = l.clone()
    mixed[::2] = -INF
    assert all(mixed[i] > -INF for i in one_row(mixed, 1e30, n=128)) or v == 1  # (v = 1: the one token is -inf)
    huge = torch.tensor([-3e38, 3e38, 0.0, 1e38] * (v // 4) + [0.0] * (v % 4))
    for t in (1.0, 1e38, INF):
        one_row(huge, t, n=64)
    for k in (1, v - 1, v, v + 1, -1):
        one_row(l, 1e3, k, 1.0, n=32)
    for p in (1e-9, 0.0, 1.0, 1 - 1e-9, 2.0):
        one_row(l, 1.0, 0, p, n=32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wild_rows(seed):
    x, settings = wild_rows(400, seed)
    t, k, p = (list(c) for c in zip(*settings))
    toks = on_gpu(x, t, k, p, list(range(400)), 5)
    for i, tok in enumerate(toks):
        if (x[i] == INF).any():
            assert x[i, tok] == INF
        if t[i] <= 1e-38 and (x[i] > -INF).any() and x[i].abs()[x[i].abs() < INF].min() > 1e-6:
            assert tok in argmax_set(x[i])


def test_nan_is_an_error_naming_the_row_and_the_kernel_runs_on():
    v = 5003
    k = kernel(v)
    l = torch.stack([rand_logits(v, seed=i) for i in range(4)]).cuda()
    good = {"temperature": torch.tensor([0.0, 0.8, 1e-45, 1.0]), "top_k": torch.zeros(4, dtype=torch.int32),
            "top_p": torch.tensor([1.0, 0.9, 1.0, 1.0]), "seed": torch.arange(4, dtype=torch.int32),
            "counter": torch.zeros(4, dtype=torch.int32)}
    good = {n: x.cuda() for n, x in good.items()}
    want = k(logits=l, **good, r=4)["tok"].cpu().tolist()
    for row in range(4):  # greedy, sampled, tiny T
        bad = l.clone()
        bad[row, 1234] = NAN
        with pytest.raises(NaNError, match=rf"NaN logits in row {row} of op\d+ sample"):
            k(logits=bad, **good, r=4)
        assert k(logits=l, **good, r=4)["tok"].cpu().tolist() == want  # the next launch runs clean
    for name, val, msg in (("temperature", NAN, "temperature"), ("top_p", NAN, "top_p")):
        s = dict(good)
        s[name] = s[name].clone()
        s[name][2] = val
        with pytest.raises(NaNError, match=f"NaN {msg} in row 2 of op"):
            k(logits=l, **s, r=4)
    assert k(logits=l, **good, r=4)["tok"].cpu().tolist() == want


@pytest.mark.parametrize("v", [9, 5000, 128256])
def test_greedy_argmax_bodies_at_the_edges(v):
    g = me.Graph(f"argmax{v}")
    r = me.sym("r")
    g.output("i", me.argmax(g.input("x", [r, v], me.bf16)))
    kern = me.compile(g, {}, backend="cuda", max_dims={"r": 8})
    x = torch.randn(6, v).to(torch.bfloat16)
    x[1] = -INF
    x[2, v // 2:] = INF
    x[3] = 2.5
    x[4, : v - 1] = -INF
    x[5, -1] = INF
    want = me.run_reference(g, {"x": x.clone()}, {}, {"r": 6})["i"].tolist()
    assert want == [int(row.float().argmax()) for row in x]
    assert kern(x=x.cuda(), r=6)["i"].cpu().tolist() == want
    x[3, v - 1] = NAN
    with pytest.raises(NaNError, match="NaN logits in row 3 of op"):
        kern(x=x.cuda(), r=6)
    x[3, v - 1] = 2.5
    assert kern(x=x.cuda(), r=6)["i"].cpu().tolist() == want


def test_lm_head_argmax_at_the_edges():
    g = me.Graph("lm_head")
    x = g.input("x", [1, 256], me.bf16)
    g.output("i", me.argmax(me.linear(x, g.weight("w", [4000, 256], me.bf16))))
    ones = torch.ones(1, 256, dtype=torch.bfloat16)
    w = torch.randn(4000, 256).to(torch.bfloat16)
    for rows, val in (([], None), ([7, 3001], 3e38), (list(range(4000)), -3e38)):
        w2 = w.clone()
        if rows:
            w2[rows] = val  # these logits overflow to +inf / every logit to -inf
        kern = me.compile(g, {"w": w2}, backend="cuda")
        assert "matvec_argmax" in {e.op.kind for e in kern.queue.entries}
        ref = me.run_reference(g, {"x": ones}, {"w": w2})["i"].tolist()
        assert kern(x=ones.cuda())["i"].cpu().tolist() == ref
        assert ref == {None: ref, 3e38: [7], -3e38: [0]}[val]
    w2 = w.clone()
    w2[2222, 5] = NAN
    kern = me.compile(g, {"w": w2}, backend="cuda")
    with pytest.raises(NaNError, match="NaN logits in row 0 of op"):
        kern(x=ones.cuda())
