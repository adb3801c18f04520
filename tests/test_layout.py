"""Layout algebra against numpy: view chains, copies, tiling, and footprint pullback."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaegg.ir.footprint import At, Full, Span, Tile, access_range, coord
from megaegg.dims import Dim, const, sym
from megaegg.ir.layout import (
    Layout, apply_view, contiguous, index, is_contiguous_rows, layout_of, pullback, tile, view_shape,
)
from megaegg.ir.program import View

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- random view chains, applied to numpy alongside ----------------------------


def _np_view(arr: np.ndarray, v: View) -> np.ndarray:
    if v.kind == "permute":
        return arr.transpose(v.args)
    if v.kind == "slice":
        dim, start, stop = v.args
        return arr[(slice(None),) * dim + (slice(int(start), int(stop)),)]
    if v.kind == "expand":
        return np.broadcast_to(arr, tuple(int(d) for d in v.args))
    return arr.reshape(tuple(int(d) for d in v.args))


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(f,) + rest for f in range(1, n + 1) if n % f == 0 for rest in _factorizations(n // f, parts - 1)]


@st.composite
def _view(draw, shape: tuple[int, ...], kinds: tuple[str, ...]) -> View | None:
    kind = draw(st.sampled_from(kinds))
    n = len(shape)
    if kind == "permute":
        return View("permute", tuple(draw(st.permutations(range(n)))))
    if kind == "slice":
        dim = draw(st.integers(0, n - 1))
        start = draw(st.integers(0, shape[dim] - 1))
        stop = draw(st.integers(start + 1, shape[dim]))
        return View("slice", (dim, const(start), const(stop)))
    if kind == "expand":
        new = [draw(st.integers(1, 3)) if d == 1 else d for d in shape]
        lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 1)))]
        return View("expand", tuple(map(const, lead + new)))
    how = draw(st.sampled_from(("split", "merge", "any")))
    if how == "split":  # one dim into two factors (1 included: size-1 dims appear)
        dim = draw(st.integers(0, n - 1))
        a, b = draw(st.sampled_from(_factorizations(shape[dim], 2)))
        new = shape[:dim] + (a, b) + shape[dim + 1 :]
    elif how == "merge" and n > 1:
        dim = draw(st.integers(0, n - 2))
        new = shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2 :]
    else:  # any shape of the same element count, up to 3 dims
        new = draw(st.sampled_from(_factorizations(math.prod(shape), draw(st.integers(1, 3)))))
    return View("reshape", tuple(map(const, new)))


@st.composite
def chains(draw, kinds=("permute", "slice", "expand", "reshape", "reshape"), max_views=5):
    buffer = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    shape, views = buffer, []
    for _ in range(draw(st.integers(0, max_views))):
        v = draw(_view(shape, kinds))
        views.append(v)
        shape = tuple(int(d) for d in view_shape(tuple(map(const, shape)), v))
    return buffer, tuple(views)


def _numpy_chain(buffer, views):
    """The viewed array of element ids (flat buffer offsets), and at which step a reshape copied."""
    base = np.arange(math.prod(buffer)).reshape(buffer)
    arr, copied_at = base, None
    for k, v in enumerate(views):
        arr = _np_view(arr, v)
        if copied_at is None and arr.size and not np.shares_memory(arr, base):
            copied_at = k
    return arr, copied_at


# --- layouts -------------------------------------------------------------------


@FAST
@given(chains())
def test_layout_matches_numpy(chain):
    buffer, views = chain
    arr, copied_at = _numpy_chain(buffer, views)
    lay = layout_of(buffer, views)
    if copied_at is not None:  # None exactly when numpy's reshape had to copy
        assert lay is None
        assert layout_of(buffer, views[: copied_at + 1]) is None
        assert layout_of(buffer, views[:copied_at]) is not None
        return
    assert lay is not None, f"{views} has strides in numpy: {arr.strides}"
    assert tuple(int(d) for d in lay.shape) == arr.shape
    for c in np.ndindex(arr.shape):
        assert lay(c).eval({}) == arr[c]


@FAST
@given(chains(), st.data())
def test_tile_covers_the_layout_exactly(chain, data):
    buffer, views = chain
    lay = layout_of(buffer, views)
    if lay is None:
        return
    shape = [int(d) for d in lay.shape]
    ts = [data.draw(st.one_of(st.none(), st.integers(1, e))) for e in shape]
    tiles, inner = tile(lay, ts)
    t = [e if x is None else x for x, e in zip(ts, shape)]
    assert [int(d) for d in tiles.shape] == [-(-e // x) for e, x in zip(shape, t)]
    seen = set()
    for k in np.ndindex(*(int(d) for d in tiles.shape)):
        for j in np.ndindex(*t):
            c = tuple(kk * x + jj for kk, x, jj in zip(k, t, j))
            if all(ci < e for ci, e in zip(c, shape)):  # a ragged tail is masked
                assert tiles(k).eval({}) + inner(j).eval({}) == lay(c).eval({})
                seen.add(c)
    assert len(seen) == math.prod(shape)


S, H = sym("S"), sym("H")


@pytest.mark.parametrize(
    "buffer, views, want",
    [
        ((S * 64,), [View("reshape", (S, const(64)))], "(S, 64):(64, 1)+0"),
        ((S, const(64)), [View("reshape", (S * 64,))], "(S * 64):(1)+0"),
        ((S, const(8), const(8)), [View("reshape", (S, const(64)))], "(S, 64):(64, 1)+0"),
        ((S, const(1), const(64)), [View("reshape", (S, const(64)))], "(S, 64):(64, 1)+0"),
        ((S, const(64)), [View("reshape", (S, const(1), const(2), const(32)))], "(S, 1, 2, 32):(64, 64, 32, 1)+0"),
        ((const(1), const(64)), [View("expand", (S, const(64)))], "(S, 64):(0, 1)+0"),
        ((S, const(64)), [View("permute", (1, 0)), View("slice", (1, const(2), S))], "(64, S + -2):(1, 64)+128"),
        ((S, const(64)), [View("permute", (1, 0)), View("reshape", (S * 64,))], None),
        ((S, H, const(64)), [View("permute", (1, 0, 2)), View("reshape", (H, S * 64))], None),
        ((S, H, const(64)), [View("permute", (1, 0, 2)), View("reshape", (H, S, const(2), const(32)))],
         "(H, S, 2, 32):(64, H * 64, 32, 1)+0"),
    ],
)
def test_symbolic_layouts(buffer, views, want):
    lay = layout_of(buffer, views)
    assert (None if lay is None else str(lay)) == want
    env = {"S": 5, "H": 3}
    arr, copied_at = _numpy_chain(tuple(d.eval(env) if isinstance(d, Dim) else d for d in buffer),
                                  [View(v.kind, tuple(a.eval(env) if isinstance(a, Dim) else a for a in v.args))
                                   for v in views])
    assert (lay is None) == (copied_at is not None)
    if lay is not None:
        for c in np.ndindex(arr.shape):
            assert index(lay, c).eval(env) == arr[c]


def test_contiguous_rows_and_printing():
    lay = contiguous((S, 64))
    assert str(lay) == "(S, 64):(64, 1)+0"
    assert is_contiguous_rows(lay)
    assert not is_contiguous_rows(apply_view(lay, View("permute", (1, 0))))
    assert is_contiguous_rows(apply_view(lay, View("slice", (1, const(8), const(16)))))
    assert is_contiguous_rows(Layout((S, const(1)), (const(64), const(0)), const(0)))
    assert str(index(lay, (coord(0), 3))) == "_i0 * 64 + 3"


# --- footprint pullback ----------------------------------------------------------


@st.composite
def _access(draw, extent: int, env: dict[str, int]):
    kind = draw(st.sampled_from(("full", "at", "at_moving", "span", "tile")))
    axis = draw(st.integers(0, 1))
    c = env[f"_i{axis}"]
    if kind == "at":
        return At(const(draw(st.integers(0, extent - 1))))
    if kind == "at_moving" and c < extent:
        return At(coord(axis) + draw(st.integers(0, extent - 1 - c)))
    if kind == "span":
        a = draw(st.integers(0, extent - 1))
        return Span(const(a), const(draw(st.integers(a + 1, extent))))
    if kind == "tile":
        size = draw(st.integers(1, extent))
        stop = draw(st.one_of(st.none(), st.integers(1, extent)))
        if c * size < (extent if stop is None else stop):  # the instance is inside the grid
            return Tile(axis, size, None if stop is None else const(stop))
    return Full()


def _region(fp, shape, env) -> list[range]:
    out = []
    for a, e in zip(fp, shape):
        lo, hi = (d.eval(env) for d in access_range(a, const(e)))
        assert 0 <= lo and hi <= e, f"{a} leaves [0, {e}) at {env}"
        out.append(range(lo, max(lo, hi)))
    return out


def _touched(arr: np.ndarray, fp, env) -> set[int]:
    ranges = _region(fp, arr.shape, env)
    return {int(arr[c]) for c in itertools.product(*ranges)}


def _pulled(buffer, fp, env) -> set[int]:
    ranges = _region(fp, buffer, env)
    return {int(np.ravel_multi_index(c, buffer)) for c in itertools.product(*ranges)}


def _check_pullback(chain, data, exact: bool) -> None:
    buffer, views = chain
    arr, _ = _numpy_chain(buffer, views)
    env = {"_i0": data.draw(st.integers(0, 3)), "_i1": data.draw(st.integers(0, 3))}
    fp = tuple(data.draw(_access(e, env)) for e in arr.shape)
    pb = pullback(views, tuple(map(const, buffer)), fp)
    assert len(pb) == len(buffer)
    touched, pulled = _touched(arr, fp, env), _pulled(buffer, pb, env)
    assert touched <= pulled, f"{views} {fp} -> {pb} misses {sorted(touched - pulled)} at {env}"
    if exact:
        assert touched == pulled, f"{views} {fp} -> {pb} adds {sorted(pulled - touched)} at {env}"


@FAST
@given(chains(), st.data())
def test_pullback_is_sound(chain, data):
    _check_pullback(chain, data, exact=False)


@FAST
@given(chains(kinds=("permute", "slice", "expand")), st.data())
def test_pullback_is_exact_without_reshapes(chain, data):
    _check_pullback(chain, data, exact=True)


@FAST
@given(st.integers(2, 6), st.integers(1, 5), st.integers(1, 3), st.data())
def test_pullback_exact_reshape_cases(h, d, k, data):
    c = data.draw(st.integers(0, h - 1))
    env = {"_i0": c, "_i1": 0}
    split = (View("reshape", (const(h), const(d))),)
    # viewed [H, D] of buffer [H*D]: a row tile is a tile of D elements, a row a span
    pb = pullback(split, (const(h * d),), (Tile(0, 1), Full()))
    assert pb == (Tile(0, d),)
    arr, _ = _numpy_chain((h * d,), split)
    for fp in ((Tile(0, 1), Full()), (At(const(c)), Full()), (At(coord(0)), Full())):
        pb = pullback(split, (const(h * d),), fp)
        assert _touched(arr, fp, env) == _pulled((h * d,), pb, env), (fp, pb)
    # viewed [H*D] of buffer [H, D]: a tile of k*D elements is a tile of k rows
    merge = (View("reshape", (const(h * d),)),)
    pb = pullback(merge, (const(h), const(d)), (Tile(0, k * d),))
    assert pb == (Tile(0, k), Full())
    arr, _ = _numpy_chain((h, d), merge)
    if c * k < h:
        assert _touched(arr, (Tile(0, k * d),), env) == _pulled((h, d), pb, env)
    point = (At(const(data.draw(st.integers(0, h * d - 1)))),)  # a point is a point in each dim
    assert _touched(arr, point, env) == _pulled((h, d), pullback(merge, (const(h), const(d)), point), env)
    # rows fixed by At, then a (ragged) tile, then whole rows: still one contiguous run
    split3 = (View("reshape", (const(h), const(d), const(2))),)
    arr3, _ = _numpy_chain((h * d * 2,), split3)
    s = data.draw(st.integers(1, d))
    env3 = {"_i0": data.draw(st.integers(0, -(-d // s) - 1)), "_i1": 0}
    fp = (At(const(c)), Tile(0, s), Full())
    pb = pullback(split3, (const(h * d * 2),), fp)
    assert _touched(arr3, fp, env3) == _pulled((h * d * 2,), pb, env3), pb


def test_pullback_symbolic_examples():
    # the exact cases with a runtime dim: [H, 64] viewed from [H*64] and back
    assert pullback((View("reshape", (H, const(64))),), (H * 64,), (Tile(0, 1), Full())) == (Tile(0, 64),)
    h = sym("h")
    (a,) = pullback((View("reshape", (H, const(64))),), (H * 64,), (At(h), Full()))
    assert (str(a.start), str(a.stop)) == ("h * 64", "h * 64 + 64")
    assert pullback((View("reshape", (H * 64,)),), (H, const(64)), (Tile(0, 128),)) == (Tile(0, 2), Full())
    # a slice keeps a tile a tile (start 0) or makes it a based tile span
    assert pullback((View("slice", (0, const(0), H)),), (S,), (Tile(0, 4),)) == (Tile(0, 4, H),)
    (a,) = pullback((View("slice", (0, const(8), H)),), (S,), (Tile(0, 4),))
    assert (str(a.start), str(a.stop)) == ("_i0 * 4 + 8", "min(_i0 * 4 + 12, H)")
    # broadcast dims read element 0 of the buffer's size-1 dim; new leading dims vanish
    pb = pullback((View("expand", (S, H, const(64))),), (const(1), const(64)), (Tile(0, 1), At(const(2)), Full()))
    assert pb == (Full(), Full())
