"""CuTe-like layout algebra over Dims: views compose into ``shape:stride`` instead of copying.

A :class:`Layout` maps a logical coordinate to an element offset in its buffer:
``offset + sum(c[i] * stride[i])``. Views (reshape, permute, slice, expand) act on
layouts (:func:`apply_view`); a reshape that no strides can express gives ``None``
and the caller inserts a copy. :func:`tile` is CuTe's logical divide, and
:func:`pullback` maps a footprint given on a view back to the buffer's own dims.

>>> from megaegg.dims import sym
>>> S = sym("S")
>>> lay = layout_of((S, 64), (View("permute", (1, 0)),))
>>> str(lay)
'(64, S):(1, 64)+0'
>>> str(lay((3, 2)))
'131'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .footprint import Access, At, Footprint, Full, Span, Tile, coord
from ..dims import Dim, DimLike, as_dim, binary, ceildiv, const, dmin
from .dimform import Product
from .dimsort import simplify
from .program import View

ZERO, ONE = const(0), const(1)


@dataclass(frozen=True)
class Layout:
    """Logical coordinate ``c`` -> element offset ``offset + sum(c[i] * stride[i])``."""

    shape: tuple[Dim, ...]
    stride: tuple[Dim, ...]
    offset: Dim = ZERO

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.shape))}):({', '.join(map(str, self.stride))})+{self.offset}"

    def __call__(self, coords: Sequence[DimLike]) -> Dim:
        return index(self, coords)


def contiguous(shape: Sequence[DimLike]) -> Layout:
    """Row-major layout of ``shape``.

    >>> str(contiguous((2, 3, 4)))
    '(2, 3, 4):(12, 4, 1)+0'
    """
    shape = tuple(as_dim(d) for d in shape)
    stride, s = [], ONE
    for d in reversed(shape):
        stride.append(s)
        s = s * d
    return Layout(shape, tuple(reversed(stride)), ZERO)


def index(layout: Layout, coords: Sequence[DimLike]) -> Dim:
    """Element offset of a logical coordinate.

    >>> str(index(contiguous((4, 8)), (2, 3)))
    '19'
    """
    if len(coords) != len(layout.shape):
        raise ValueError(f"{len(coords)} coords for layout {layout}")
    out = layout.offset
    for c, s in zip(coords, layout.stride):
        out = out + as_dim(c) * s
    return out


def is_contiguous_rows(layout: Layout) -> bool:
    """Whether each row (the last dim) is contiguous in memory, as a matvec's 16-byte loads need.

    >>> is_contiguous_rows(contiguous((4, 8))), is_contiguous_rows(apply_view(contiguous((4, 8)), View("permute", (1, 0))))
    (True, False)
    """
    return not layout.shape or layout.stride[-1] == ONE or layout.shape[-1] == ONE


# --- reshape grouping: products of dims compared up to factor order (dimform.Product) --


def _is_one(d: Dim) -> bool:
    return d.is_const and d.value == 1


def _groups(src: Sequence[Dim], dst: Sequence[Dim]) -> list[tuple[list[int], list[int]]] | None:
    """Consecutive dims of ``src`` and ``dst`` (size-1 dims left out) with equal products.

    >>> _groups((const(6), const(4)), (const(2), const(3), const(4)))
    [([0], [0, 1]), ([1], [2])]
    """
    si = [i for i, d in enumerate(src) if not _is_one(d)]
    di = [i for i, d in enumerate(dst) if not _is_one(d)]
    out, i, j = [], 0, 0
    while i < len(si) or j < len(di):
        gs, gd, ps, pd = [], [], Product(1, ()), Product(1, ())
        while not (gs and gd and ps == pd):
            nxt = pd * Product.of(dst[di[j]]) if j < len(di) else None
            if gs and nxt is not None and nxt.divides(ps):  # dst dims split the src product so far
                gd.append(di[j])
                j, pd = j + 1, nxt
            elif i < len(si):
                gs.append(si[i])
                i, ps = i + 1, ps * Product.of(src[si[i]])
            else:
                return None  # the products never meet (not provably the same element count)
        out.append((gs, gd))
    return out


def _prod(ds: Sequence[Dim]) -> Dim:
    out = ONE
    for d in ds:
        out = out * d
    return out


# --- views -------------------------------------------------------------------


def view_shape(shape: Sequence[Dim], view: View) -> tuple[Dim, ...]:
    """The logical shape after one view step."""
    if view.kind in ("reshape", "expand"):
        return tuple(as_dim(d) for d in view.args)
    if view.kind == "permute":
        return tuple(shape[d] for d in view.args)
    dim, start, stop = view.args
    return tuple(shape[:dim]) + (simplify(as_dim(stop) - start),) + tuple(shape[dim + 1 :])  # (pos+1)-pos -> 1


def apply_view(layout: Layout, view: View) -> Layout | None:
    """The layout of ``view`` applied to ``layout``; None when a reshape needs a copy.

    >>> lay = apply_view(contiguous((4, 6)), View("permute", (1, 0)))
    >>> str(apply_view(lay, View("reshape", (const(2), const(3), const(4)))))
    '(2, 3, 4):(3, 1, 6)+0'
    >>> apply_view(lay, View("reshape", (const(24),))) is None
    True
    >>> str(apply_view(contiguous((4, 6)), View("slice", (1, 2, 5))))
    '(4, 3):(6, 1)+2'
    >>> str(apply_view(contiguous((1, 6)), View("expand", (const(3), const(4), const(6)))))
    '(3, 4, 6):(0, 0, 1)+0'
    """
    shape, stride = layout.shape, layout.stride
    if view.kind == "permute":
        return Layout(tuple(shape[d] for d in view.args), tuple(stride[d] for d in view.args), layout.offset)
    if view.kind == "slice":
        dim, start, stop = view.args
        new = view_shape(shape, view)
        return Layout(new, stride, layout.offset + as_dim(start) * stride[dim])
    if view.kind == "expand":
        new = tuple(as_dim(d) for d in view.args)
        lead = len(new) - len(shape)
        # new leading dims and broadcast size-1 dims read the same element: stride 0
        kept = tuple(ZERO if _is_one(old) and not _is_one(d) else s for old, s, d in zip(shape, stride, new[lead:]))
        return Layout(new, (ZERO,) * lead + kept, layout.offset)
    if view.kind == "reshape":
        return _reshape(layout, tuple(as_dim(d) for d in view.args))
    raise ValueError(f"unknown view {view}")


def _reshape(layout: Layout, new: tuple[Dim, ...]) -> Layout | None:
    groups = _groups(layout.shape, new)
    if groups is None:
        return None
    stride: list[Dim | None] = [None] * len(new)
    for src, dst in groups:
        # the group's source dims must be one strided run: stride[a] == shape[b] * stride[b]
        for a, b in zip(src, src[1:]):
            if Product.of(layout.stride[a]) != Product.of(layout.shape[b] * layout.stride[b]):
                return None
        s = layout.stride[src[-1]]
        for d in reversed(dst):
            stride[d] = s
            s = s * new[d]
    for d in reversed(range(len(new))):  # size-1 dims: any stride works; pick the row-major one
        if stride[d] is None:
            stride[d] = stride[d + 1] * new[d + 1] if d + 1 < len(new) else ONE
    return Layout(new, tuple(stride), layout.offset)


def layout_of(buffer_shape: Sequence[DimLike], views: Sequence[View]) -> Layout | None:
    """The layout of a buffer seen through ``views``, or None when some reshape needs a copy.

    >>> str(layout_of((8, 6), (View("reshape", (const(8), const(2), const(3))), View("permute", (1, 0, 2)))))
    '(2, 8, 3):(3, 6, 1)+0'
    """
    layout: Layout | None = contiguous(buffer_shape)
    for v in views:
        layout = apply_view(layout, v)
        if layout is None:
            return None
    return layout


def tile(layout: Layout, tile_shape: Sequence[DimLike | None]) -> tuple[Layout, Layout]:
    """Logical divide: ``(tiles, inner)`` with ``tiles(k)`` the base offset of tile ``k`` and
    ``inner(j)`` the offset of element ``j`` inside it (None in ``tile_shape``: the whole dim).

    Element ``k * tile_shape + j`` sits at ``tiles(k) + inner(j)``; in a ragged last tile only
    ``j < shape - k * tile_shape`` exist (the caller masks them).

    >>> tiles, inner = tile(contiguous((10, 64)), (4, None))
    >>> str(tiles), str(inner)
    ('(3, 1):(256, 64)+0', '(4, 64):(64, 1)+0')
    """
    ts = tuple(as_dim(t) if t is not None else d for t, d in zip(tile_shape, layout.shape))
    tiles = Layout(tuple(ceildiv(d, t) for d, t in zip(layout.shape, ts)),  # (ceil(M/TM), ceil(N/TN))
                   tuple(t * s for t, s in zip(ts, layout.stride)), layout.offset)
    return tiles, Layout(ts, layout.stride, ZERO)  # (TM, TN)


# --- footprints back through views -------------------------------------------


def pullback(views: Sequence[View], buffer_shape: Sequence[DimLike], footprint: Footprint) -> Footprint:
    """Map a footprint on the viewed tensor back to the buffer's natural dims, soundly.

    Every buffer element the viewed footprint touches lies in the result; the result is
    exact for permute, slice, expand, and reshapes whose inner dims are accessed whole.

    >>> from megaegg.dims import sym
    >>> H = sym("H")
    >>> [str(a) for a in pullback((View("reshape", (H, 64)),), (H * 64,), (Tile(0, 1), Full()))]
    ['tile(_i0, 64)']
    >>> [str(a) for a in pullback((View("reshape", (H, 64)),), (H * 64,), (At(sym("h")), Full()))]
    ['h * 64:h * 64 + 64']
    >>> [str(a) for a in pullback((View("reshape", (H * 64,)),), (H, 64), (Tile(0, 128),))]
    ['tile(_i0, 2)', ':']
    """
    shapes = [tuple(as_dim(d) for d in buffer_shape)]
    for v in views:
        shapes.append(view_shape(shapes[-1], v))
    fp = tuple(footprint)
    for v, src, dst in reversed(list(zip(views, shapes, shapes[1:]))):
        fp = _pull_view(v, src, dst, fp)
    return fp


def _pull_view(view: View, src: tuple[Dim, ...], dst: tuple[Dim, ...], fp: Footprint) -> Footprint:
    if view.kind == "permute":
        out: list[Access] = [Full()] * len(src)
        for i, d in enumerate(view.args):
            out[d] = fp[i]
        return tuple(out)
    if view.kind == "expand":
        lead = len(dst) - len(src)  # new leading dims read nothing of their own: dropped
        return tuple(Full() if _is_one(s) else a for s, a in zip(src, fp[lead:]))
    if view.kind == "slice":
        dim, start, stop = view.args
        return fp[:dim] + (_shift(fp[dim], as_dim(start), as_dim(stop), src[dim]),) + fp[dim + 1 :]
    groups = _groups(src, dst)
    if groups is None:
        return (Full(),) * len(src)
    out = [Full()] * len(src)  # size-1 source dims: Full is their one element
    for gs, gd in groups:
        flat = _linearize([fp[d] for d in gd], [dst[d] for d in gd])
        for d, a in zip(gs, _delinearize(flat, [src[d] for d in gs])):
            out[d] = a
    return tuple(out)


def _shift(a: Access, start: Dim, stop: Dim, extent: Dim) -> Access:
    """An access on ``x[start:stop]`` in the coordinates of ``x`` (extent ``extent``)."""
    if isinstance(a, Full):
        return Full() if start == ZERO and stop == extent else Span(start, stop)
    if isinstance(a, At):
        return At(as_dim(a.index) + start)
    if isinstance(a, Span):
        return Span(as_dim(a.start) + start, as_dim(a.stop) + start)
    limit = start + as_dim(a.stop) if a.stop is not None else stop  # the tile's end, in x's coordinates
    if start == ZERO:
        return Tile(a.axis, a.size, None if limit == extent else limit)
    # a tile based at ``start``: exact, and the form the barrier pass reads back as a based tile
    lo = start + coord(a.axis) * a.size
    return Span(lo, dmin(lo + a.size, limit))


def _linearize(accs: Sequence[Access], dims: Sequence[Dim]) -> Access:
    """The access on the merged dim ``prod(dims)`` covering ``accs`` on ``dims`` (row-major)."""
    keep = [(a, d) for a, d in zip(accs, dims) if not _is_one(d)]  # size-1 dims hold index 0 only
    moving = [k for k, (a, _) in enumerate(keep) if not isinstance(a, Full)]
    if not moving:
        return Full()
    j = moving[-1]
    if not all(isinstance(a, At) for a, _ in keep[:j]):
        return Full()  # not one contiguous run: cover everything (sound)
    inner = _prod([d for _, d in keep[j + 1 :]])
    base = ZERO
    for k, (a, _) in enumerate(keep[:j]):
        base = base + as_dim(a.index) * _prod([d for _, d in keep[k + 1 :]])
    a, extent = keep[j]
    if isinstance(a, At):
        lo = base + as_dim(a.index) * inner
        return At(lo) if _is_one(inner) else Span(lo, lo + inner)
    if isinstance(a, Span):
        return Span(base + as_dim(a.start) * inner, base + as_dim(a.stop) * inner)
    if j == 0 and inner.is_const:  # a tile of whole rows of the outermost dim stays a tile
        return Tile(a.axis, a.size * inner.value, None if a.stop is None else as_dim(a.stop) * inner)
    start = base + coord(a.axis) * a.size * inner
    limit = base + (as_dim(a.stop) if a.stop is not None else extent) * inner
    return Span(start, dmin(start + a.size * inner, limit))  # lo + size*inner, capped: a based tile


def _delinearize(a: Access, dims: Sequence[Dim]) -> list[Access]:
    """Accesses on ``dims`` covering access ``a`` of their row-major merged dim."""
    out: list[Access] = [Full()] * len(dims)
    keep = [k for k, d in enumerate(dims) if not _is_one(d)]
    if isinstance(a, Full) or not keep:
        return out
    first = keep[0]
    inner = _prod([dims[k] for k in keep[1:]])  # elements per index of the outermost dim
    if isinstance(a, At):
        x = as_dim(a.index)
        for k in keep:  # the row-major digits of x
            below = _prod([dims[m] for m in keep if m > k])
            digit = x // below if k == first else (x // below) % dims[k]
            out[k] = At(digit)
        return out
    if isinstance(a, Tile):
        if inner.is_const and a.size % inner.value == 0:  # whole rows of the outer dim
            stop = None if a.stop is None else _ceil_div(as_dim(a.stop), inner.value)
            out[first] = Tile(a.axis, a.size // inner.value, stop)
            return out
        return out  # a tile cutting rows: Full on the group (sound)
    lo, hi = as_dim(a.start), as_dim(a.stop)
    if inner.is_const:
        out[first] = Span(_floor_div(lo, inner.value), _ceil_div(hi, inner.value))  # the rows it meets
    return out


def _exact_div(d: Dim, k: int) -> Dim | None:
    """``d / k`` when ``d`` is visibly a multiple of ``k`` (linear terms with divisible coefficients)."""
    if d.is_const:
        return const(d.value // k) if d.value % k == 0 else None
    if d.op == "mul" and d.args[1].is_const and d.args[1].value % k == 0:
        return d.args[0] * (d.args[1].value // k)
    if d.op == "add":
        a, b = _exact_div(d.args[0], k), _exact_div(d.args[1], k)
        return a + b if a is not None and b is not None else None
    if d.op in ("min", "max"):
        a, b = _exact_div(d.args[0], k), _exact_div(d.args[1], k)
        return binary(d.op, a, b) if a is not None and b is not None else None
    return None


def _floor_div(d: Dim, k: int) -> Dim:
    q = _exact_div(d, k)
    return q if q is not None else d // k


def _ceil_div(d: Dim, k: int) -> Dim:
    q = _exact_div(d, k)
    if q is not None:
        return q
    if d.op == "min":  # ceildiv is monotone: it moves inside min, keeping a tile's form
        return dmin(_ceil_div(d.args[0], k), _ceil_div(d.args[1], k))
    return ceildiv(d, k)
