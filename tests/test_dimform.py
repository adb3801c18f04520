"""The Dim normal form's queries against brute-force evaluation on random small expressions.

Every query answers "provably" or "don't know": each True (or each number) it gives must hold at
every point tried; symbols are non-negative, as sizes, positions and grid coordinates are.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megaegg as me
from megaegg.dims import Dim, binary, const, dmin, sym
from megaegg.ir.dimform import Product, canonical, const_diff, from_poly, nonneg, poly, product, same

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

S, T, I = sym("S"), sym("T"), sym("_i0")
SYMS = (S, T, I)
ENVS = [dict(zip(("S", "T", "_i0"), v)) for v in itertools.product((0, 1, 2, 3, 7, 64), repeat=3)]

leaf = st.one_of(st.sampled_from(SYMS), st.integers(-3, 9).map(const))
divisor = st.one_of(st.sampled_from((1, 2, 3, 4, 8, 64)).map(const), st.sampled_from(SYMS))


def _node(children: st.SearchStrategy[Dim]) -> st.SearchStrategy[Dim]:
    return st.one_of(
        st.tuples(st.sampled_from(("add", "add", "mul", "min", "max")), children, children).map(lambda t: binary(*t)),
        st.tuples(st.sampled_from(("floordiv", "mod", "ceildiv")), children, divisor).map(lambda t: binary(*t)),
        st.tuples(children, children).map(lambda ab: Dim("add", ab)),  # raw nodes too: x + 0, 2 * 3
        st.tuples(children, st.integers(-2, 8).map(const)).map(lambda ab: Dim("mul", ab)),
    )


dims = st.recursive(leaf, _node, max_leaves=8)


def values(d: Dim) -> list[int | None]:
    """``d`` at every point (None where a divisor is 0)."""
    out = []
    for env in ENVS:
        try:
            out.append(d.eval(env))
        except ZeroDivisionError:
            out.append(None)
    return out


def agree(a: Dim, b: Dim, diff: int = 0) -> bool:
    """``a - b == diff`` wherever both are defined."""
    return all(x - y == diff for x, y in zip(values(a), values(b)) if x is not None and y is not None)


@st.composite
def related(draw) -> tuple[Dim, Dim, str, int]:
    """``(a, b, how, k)``: ``b`` rewritten from ``a`` (``a - b == k``, or a product with its factors
    swapped), or ``how == "random"``: two unrelated dims."""
    a = draw(dims)
    how = draw(st.sampled_from(("random", "offset", "scaled", "split", "swapped", "cancel")))
    k = draw(st.integers(-5, 5))
    if how == "offset":
        return a, binary("add", const(k), a), how, -k
    if how == "scaled":  # (a*m + k) // m == a + k // m
        m = draw(st.sampled_from((2, 4, 64)))
        return a + k // m, binary("floordiv", binary("add", binary("mul", a, m), k), m), how, 0
    if how == "split":
        b = draw(dims)
        return a * 3 + b, binary("add", b, binary("add", a, a * 2)), how, 0
    if how == "swapped":
        b = draw(dims)
        return a * b * 2, b * (a * 2), how, 0
    if how == "cancel":
        b = draw(dims)
        return a, binary("add", binary("add", a, b), b * -1), how, 0
    return a, draw(dims), how, 0


@SETTINGS
@given(related())
def test_same_and_const_diff_hold_at_every_point(pair):
    a, b, _, _ = pair
    if same(a, b):
        assert agree(a, b), f"same({a}, {b})"
        assert const_diff(a, b) == 0
    k = const_diff(a, b)
    if k is not None:
        assert agree(a, b, k), f"const_diff({a}, {b}) = {k}"
        assert const_diff(b, a) == -k


@SETTINGS
@given(related())
def test_rewrites_within_reach_are_proven(pair):
    a, b, how, k = pair  # not only sound: these the form must see through
    if how == "swapped":  # a product of two sums is one atom of poly, in operand order; Product sorts
        assert Product.of(a) == Product.of(b)
    elif how != "random":
        assert const_diff(a, b) == k, f"{a} vs {b}"
        assert same(a, b) == (k == 0)


# near zero: differences, and min/max of dims pushed below zero
signed = st.one_of(
    dims,
    st.tuples(dims, dims).map(lambda ab: ab[0] - ab[1]),
    st.tuples(st.sampled_from(("min", "max", "mul")), dims, dims, st.integers(-6, 2), st.integers(-6, 2))
    .map(lambda t: binary(t[0], t[1] + t[3], t[2] + t[4])),
)


@SETTINGS
@given(signed)
def test_nonneg_holds_at_every_point(d):
    if nonneg(d):
        assert all(v is None or v >= 0 for v in values(d)), d
    if nonneg(d * -1) and nonneg(d):
        assert all(v is None or v == 0 for v in values(d)), d


@SETTINGS
@given(st.lists(dims, min_size=1, max_size=3), st.lists(dims, min_size=1, max_size=3), st.permutations(range(3)))
def test_products_compare_and_divide_soundly(xs, ys, order):
    pa = product(xs)
    for v, vals in zip(values(pa.dim()), zip(*(values(x) for x in xs))):
        if v is not None and None not in vals:
            assert v == math.prod(vals)
    shuffled = [xs[i] for i in order if i < len(xs)]
    assert product(shuffled) == pa  # factor order never matters
    pb = product(xs + ys)
    assert pa.divides(pb)
    q = pb.quotient(pa)
    assert agree(q.dim() * pa.dim(), pb.dim())
    other = product(ys)
    if other == pa:
        assert agree(other.dim(), pa.dim())
    if other.divides(pa):
        assert agree(pa.quotient(other).dim() * other.dim(), pa.dim())


def test_examples():
    assert same((S + 1) * 2, S * 2 + 2) and not same(S // 2 * 2, S)
    assert const_diff(I * 64 + S + 64, S + I * 64) == 64 and const_diff(S * 2, S) is None
    assert const_diff((I * 64 + S) // 64, I) is None and same((I * 64 + S) // 64, I + S // 64)
    assert nonneg(S * 3 - S + I % 4) and not nonneg((S + 63) // 64 - 1) and not nonneg(S - T)
    assert Product.of((S + 1) * 64) == Product.of(64 * (1 + S)) != Product.of(S * 64 + 64)
    assert product((S, 8, 8)) == product((S * 64,)) and product((S, 2)) != product((S + 1, 2))
    assert Product.of(S - S) == Product(0, ()) and Product.of(S).divides(Product(0, ()))
    assert Product.of(S + 5 - S) == Product(5, ()) and Product.of(T * 2 + T * 2) == Product(4, (T,))
    assert str(product((S * 4, T, 8)).quotient(product((T, 2))).dim()) == "S * 16"
    assert str(canonical(dmin(S + 1, T) * (T + 1) + dmin(S + 1, T) * (T + 1))) == "min(S + 1, T) * (T + 1) * 2"


@pytest.mark.parametrize("shape, new, want", [
    ((S * 4, 32), (-1, 8), "S * 16"),
    ((S, T, 6), (T, -1), "S * 6"),
    ((S + 1, 4), (-1,), "(S + 1) * 4"),
])
def test_reshape_infers_the_missing_factors(shape, new, want):
    g = me.Graph()
    x = g.input("x", list(shape), me.f32)
    assert str(me.reshape(x, list(new)).shape[new.index(-1)]) == want


def test_reshape_rejects_what_it_cannot_prove():
    g = me.Graph()
    x = g.input("x", [S, 6], me.f32)
    with pytest.raises(me.ShapeError, match="cannot infer -1"):
        me.reshape(x, [T, -1])
    with pytest.raises(me.ShapeError, match="element counts differ"):
        me.reshape(x, [S + 1, 6])


@given(dims)
@SETTINGS
def test_bounds_hold_at_every_point(d):
    """``lowering.queue.bounds`` (the sizes of buffers, counters and the trace, from the largest dims) holds at
    every point with the symbols in [0, max], negative coefficients included (matvec_split's split count falls
    as the rows grow); points that divide by 0 are not runtime points."""
    from megaegg.dims import bounds

    top = {"S": 64, "T": 7, "_i0": 3}
    lo, hi = bounds(d, top)
    for env in ENVS:
        if any(env[k] > top[k] for k in top):
            continue
        try:
            v = d.eval(env)
        except ZeroDivisionError:
            continue
        assert lo <= v <= hi, (str(d), env, v, lo, hi)


def test_a_count_that_falls_with_the_rows_is_bounded_by_its_largest_value():
    from megaegg.blockops.matvec_split import split_count
    from megaegg.dims import upper_bound

    n = sym("n")
    for top in (16, 40, 64, 65, 100, 2112):
        assert upper_bound(split_count(n, 4), {"n": top}) >= max(split_count(n, 4).eval({"n": m}) for m in range(top + 1))
