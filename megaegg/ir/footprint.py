"""What one block-op instance reads or writes, per dim of an operand.

An instance is a point of the op's launch grid; its coordinates are the reserved
symbols ``_i0, _i1, ...`` (see :func:`coord`). A footprint gives, for each dim of
the operand's logical shape, one access:

- ``Full()``: the whole extent;
- ``Tile(axis, size, stop=None)``: elements ``[c*size, min(c*size + size, stop or extent))``
  where ``c`` is grid coordinate ``axis`` (the last tile is ragged, masked);
- ``At(index)``: the single element ``index`` (an expression of runtime dims);
- ``Span(start, stop)``: elements ``[start, stop)`` (expressions of runtime dims).

>>> str(Tile(axis=0, size=64))
'tile(_i0, 64)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..dims import Dim, as_dim, dmin, sym


def coord(axis: int) -> Dim:
    """The grid coordinate ``axis`` of the current instance, as a Dim symbol."""
    return sym(f"_i{axis}")


@dataclass(frozen=True)
class Full:
    def __str__(self) -> str:
        return ":"


@dataclass(frozen=True)
class Tile:
    axis: int
    size: int
    stop: Dim | None = None

    def __str__(self) -> str:
        s = f"tile(_i{self.axis}, {self.size}"
        return s + (f", stop={self.stop})" if self.stop is not None else ")")


@dataclass(frozen=True)
class At:
    index: Dim

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", as_dim(self.index))

    def __str__(self) -> str:
        return f"at({self.index})"


@dataclass(frozen=True)
class Span:
    start: Dim
    stop: Dim

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", as_dim(self.start))
        object.__setattr__(self, "stop", as_dim(self.stop))

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"


Access = Union[Full, Tile, At, Span]
Footprint = tuple  # tuple[Access, ...], one per operand dim


def fmt_footprint(fp: Footprint) -> str:
    return "[" + ", ".join(str(a) for a in fp) + "]"


def access_range(a: Access, extent: Dim) -> tuple[Dim, Dim]:
    """``(start, stop)`` of the access for the current instance, as Dims of ``_i*`` and runtime dims."""
    extent = as_dim(extent)
    if isinstance(a, Full):
        return as_dim(0), extent
    if isinstance(a, Tile):
        c = coord(a.axis)
        return c * a.size, dmin(c * a.size + a.size, a.stop if a.stop is not None else extent)
    if isinstance(a, At):
        return a.index, a.index + 1
    return a.start, a.stop


def grid_coords(index: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of linear instance ``index`` in a concrete grid."""
    out = []
    for extent in reversed(grid):
        out.append(index % extent)
        index //= extent
    return tuple(reversed(out))


def footprint_slices(fp: Footprint, shape: Sequence[Dim], env: dict) -> tuple:
    """Concrete Python slices of a footprint, with ``env`` binding runtime dims and ``_i*``."""
    out = []
    for a, extent in zip(fp, shape):
        start, stop = access_range(a, extent)
        lo, hi = start.eval(env), stop.eval(env)
        out.append(slice(lo, max(lo, hi)))
    return tuple(out)
