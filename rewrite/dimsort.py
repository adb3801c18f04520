"""Dim expressions as an egglog sort, with a bounded simplification ruleset.

:class:`DimE` mirrors :class:`megaegg.dims.Dim` (``const sym + * // % min max
ceildiv``). The rules never add full associativity or commutativity (e-nodes grow
~3x per extra term): they rewrite towards one canonical form (constants on the
right, sums left-nested with the constant last) and apply targeted identities
that are sound for every integer value of the symbols with positive divisors.

>>> from megaegg.dims import sym, ceildiv
>>> S = sym("S")
>>> str(simplify(ceildiv(S * 64, 64)))
'S'
>>> str(simplify((S + 1) * 2 + 3))
'S * 2 + 5'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence, TypeAlias

from egglog import EGraph, Expr, ne, String, StringLike, eq, get_callable_args, get_literal_value, i64, i64Like
from egglog import rewrite, ruleset

from ..dims import Dim, as_dim, binary

dims_ruleset = ruleset(name="dims")


class DimE(Expr, ruleset=dims_ruleset):
    """An integer Dim expression in the e-graph; ``DimE(3)`` is a constant."""

    def __init__(self, value: i64Like) -> None: ...

    @classmethod
    def sym(cls, name: StringLike) -> DimE: ...

    def __add__(self, other: DimELike) -> DimE: ...

    def __mul__(self, other: DimELike) -> DimE: ...

    def __floordiv__(self, other: DimELike) -> DimE: ...

    def __mod__(self, other: DimELike) -> DimE: ...

    def min(self, other: DimELike) -> DimE: ...

    def max(self, other: DimELike) -> DimE: ...

    def ceildiv(self, other: DimELike) -> DimE: ...


DimELike: TypeAlias = DimE | i64Like


def _floor(a: i64, b: i64) -> i64:
    """Floor division of i64 terms for ``b > 0`` (egglog's ``/`` truncates toward zero)."""
    return (a - (a % b + b) % b) / b


def _fmod(a: i64, b: i64) -> i64:
    """Floor modulo (Python's ``%``) of i64 terms for ``b > 0``."""
    return (a % b + b) % b


@dims_ruleset.register
def _fold(a: i64, b: i64) -> Iterable:
    # constants: every op on two literals folds (divisions only for positive divisors)
    ca, cb = DimE(a), DimE(b)
    yield rewrite(ca + cb, subsume=True).to(DimE(a + b))
    yield rewrite(ca * cb, subsume=True).to(DimE(a * b))
    yield rewrite(ca // cb, subsume=True).to(DimE(_floor(a, b)), b > 0)
    yield rewrite(ca % cb, subsume=True).to(DimE(_fmod(a, b)), b > 0)
    yield rewrite(ca.ceildiv(cb), subsume=True).to(DimE(_floor(a + b - 1, b)), b > 0)
    yield rewrite(ca.min(cb), subsume=True).to(DimE(a.min(b)))
    yield rewrite(ca.max(cb), subsume=True).to(DimE(a.max(b)))


@dims_ruleset.register
def _canonical(x: DimE, y: DimE, z: DimE, a: i64, b: i64) -> Iterable:
    ca, cb = DimE(a), DimE(b)
    # constants go right in commutative ops, so one pattern per rule suffices
    yield rewrite(ca + x).to(x + ca)
    yield rewrite(ca * x).to(x * ca)
    yield rewrite(ca.min(x)).to(x.min(ca))
    yield rewrite(ca.max(x)).to(x.max(ca))
    # sums are left-nested with the constant last: one-way associativity cannot blow up
    yield rewrite(x + (y + z)).to((x + y) + z)
    yield rewrite((x + ca) + y).to((x + y) + ca)
    yield rewrite((x + ca) + cb).to(x + DimE(a + b))
    yield rewrite((x * ca) * cb).to(x * DimE(a * b))
    yield rewrite((x * ca) * y).to((x * y) * ca)
    # identities
    yield rewrite(x + DimE(0), subsume=True).to(x)
    yield rewrite(x * DimE(1), subsume=True).to(x)
    yield rewrite(x * DimE(0), subsume=True).to(DimE(0))
    yield rewrite(x // DimE(1), subsume=True).to(x)
    yield rewrite(x % DimE(1), subsume=True).to(DimE(0))
    yield rewrite(x.ceildiv(DimE(1)), subsume=True).to(x)
    yield rewrite(x.min(x), subsume=True).to(x)
    yield rewrite(x.max(x), subsume=True).to(x)


@dims_ruleset.register
def _linear(x: DimE, y: DimE, a: i64, b: i64) -> Iterable:
    ca, cb = DimE(a), DimE(b)
    # distributing a constant factor exposes constants to fold; extraction keeps the smaller form
    yield rewrite((x + y) * ca).to(x * ca + y * ca)
    # like terms next to each other in a left-nested sum
    yield rewrite(x + x).to(x * DimE(2))
    yield rewrite(x * ca + x).to(x * DimE(a + 1))
    yield rewrite(x * ca + x * cb).to(x * DimE(a + b))
    yield rewrite((y + x) + x).to(y + x * DimE(2))
    yield rewrite((y + x * ca) + x).to(y + x * DimE(a + 1))
    yield rewrite((y + x) + x * cb).to(y + x * DimE(b + 1))
    yield rewrite((y + x * ca) + x * cb).to(y + x * DimE(a + b))


@dims_ruleset.register
def _division(x: DimE, y: DimE, a: i64, b: i64) -> Iterable:
    ca, cb = DimE(a), DimE(b)
    # (x*c)//c == x exactly for c != 0; likewise % and ceildiv
    yield rewrite((x * ca) // ca, subsume=True).to(x, ne(a).to(i64(0)))
    yield rewrite((x * ca) % ca, subsume=True).to(DimE(0), ne(a).to(i64(0)))
    yield rewrite((x * ca).ceildiv(ca), subsume=True).to(x, ne(a).to(i64(0)))
    # a factor that the divisor divides (or that divides the divisor) cancels
    yield rewrite((x * ca) // cb).to(x * DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca) % cb, subsume=True).to(DimE(0), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca).ceildiv(cb)).to(x * DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca) // cb).to(x // DimE(b / a), a > 0, b > a, eq(b % a).to(i64(0)))
    yield rewrite((x * ca).ceildiv(cb)).to(x.ceildiv(DimE(b / a)), a > 0, b > a, eq(b % a).to(i64(0)))
    # a multiple of the divisor inside a sum leaves the quotient (floor: sound for any sign)
    yield rewrite((x * ca + y) // cb).to(x * DimE(a / b) + y // cb, b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + x * ca) // cb).to(y // cb + x * DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + ca) // cb).to(y // cb + DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca + y) % cb).to(y % cb, b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + x * ca) % cb).to(y % cb, b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + ca) % cb).to(y % cb + DimE(_fmod(a, b)) , b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca + y).ceildiv(cb)).to(x * DimE(a / b) + y.ceildiv(cb), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + x * ca).ceildiv(cb)).to(y.ceildiv(cb) + x * DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + ca).ceildiv(cb)).to(y.ceildiv(cb) + DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    # nested divisions by positive constants combine
    yield rewrite((x // ca) // cb).to(x // DimE(a * b), a > 0, b > 0)
    yield rewrite(x.ceildiv(ca).ceildiv(cb)).to(x.ceildiv(DimE(a * b)), a > 0, b > 0)
    yield rewrite((x % ca) % cb).to(x % cb, b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x % ca) // ca, subsume=True).to(DimE(0), a > 0)
    # x//c*c + x%c == x, and its subtraction form x - x%c == x//c*c
    yield rewrite((x // ca) * ca + x % ca, subsume=True).to(x, a > 0)
    yield rewrite(x + (x % ca) * DimE(-1)).to((x // ca) * ca, a > 0)


@dims_ruleset.register
def _minmax(x: DimE, y: DimE, a: i64, b: i64) -> Iterable:
    ca, cb = DimE(a), DimE(b)
    # min/max of x and x plus a constant decide by the constant's sign
    yield rewrite(x.min(x + ca), subsume=True).to(x, a >= 0)
    yield rewrite((x + ca).min(x), subsume=True).to(x, a >= 0)
    yield rewrite(x.min(x + ca)).to(x + ca, a < 0)
    yield rewrite((x + ca).min(x)).to(x + ca, a < 0)
    yield rewrite(x.max(x + ca)).to(x + ca, a >= 0)
    yield rewrite((x + ca).max(x)).to(x + ca, a >= 0)
    yield rewrite(x.max(x + ca), subsume=True).to(x, a < 0)
    yield rewrite((x + ca).max(x), subsume=True).to(x, a < 0)
    yield rewrite((x + ca).min(x + cb)).to(x + DimE(a.min(b)))
    yield rewrite((x + ca).max(x + cb)).to(x + DimE(a.max(b)))
    # a shared constant offset moves out
    yield rewrite((x + ca).min(y + ca)).to(x.min(y) + ca)
    yield rewrite((x + ca).max(y + ca)).to(x.max(y) + ca)
    yield rewrite(x.min(x.min(y))).to(x.min(y))
    yield rewrite(x.max(x.max(y))).to(x.max(y))


# --- conversion --------------------------------------------------------------

_TO_EGG = {
    "add": DimE.__add__,
    "mul": DimE.__mul__,
    "floordiv": DimE.__floordiv__,
    "mod": DimE.__mod__,
    "min": DimE.min,
    "max": DimE.max,
    "ceildiv": DimE.ceildiv,
}


def to_egg(dim: Dim, _memo: dict[Dim, DimE] | None = None) -> DimE:
    """The e-graph term of ``dim`` (shared subterms are built once)."""
    memo = {} if _memo is None else _memo
    got = memo.get(dim)
    if got is not None:
        return got
    if dim.op == "const":
        out = DimE(dim.args[0])
    elif dim.op == "sym":
        out = DimE.sym(dim.args[0])
    else:
        out = _TO_EGG[dim.op](to_egg(dim.args[0], memo), to_egg(dim.args[1], memo))
    memo[dim] = out
    return out


def from_egg(expr: DimE) -> Dim:
    """The :class:`Dim` of an extracted term, rebuilt through the folding constructors."""
    if (args := get_callable_args(expr, DimE)) is not None:
        return as_dim(get_literal_value(args[0]))
    if (args := get_callable_args(expr, DimE.sym)) is not None:
        return Dim("sym", (get_literal_value(args[0]),))
    for op, fn in _TO_EGG.items():
        if (args := get_callable_args(expr, fn)) is not None:
            return binary(op, from_egg(args[0]), from_egg(args[1]))
    raise ValueError(f"not a Dim term: {expr}")


def size(dim: Dim) -> int:
    """Node count of the expression tree (shared subterms counted each time)."""
    return 1 if dim.op in ("const", "sym") else 1 + size(dim.args[0]) + size(dim.args[1])


# --- simplification ----------------------------------------------------------


@dataclass
class DimSimplifier:
    """Simplifies Dims in the e-graph and memoizes the results (the only cache of this module)."""

    iterations: int = 12
    memo: dict[Dim, Dim] = field(default_factory=dict)

    def simplify(self, dim: Dim) -> Dim:
        return self.simplify_many([dim])[0]

    def simplify_many(self, dims: Sequence[Dim]) -> list[Dim]:
        """Simplify a batch in ONE e-graph (building and running one per Dim costs ~10x more)."""
        todo = list(dict.fromkeys(d for d in map(as_dim, dims) if d not in self.memo))
        if todo:
            egraph = EGraph()
            memo: dict[Dim, DimE] = {}
            roots = [to_egg(d, memo) for d in todo]
            egraph.register(*roots)
            egraph.run(self.iterations, ruleset=dims_ruleset)
            for d, root in zip(todo, roots):
                out = from_egg(egraph.extract(root))
                self.memo[d] = out if size(out) <= size(d) else d  # never return a larger form
        return [self.memo[as_dim(d)] for d in dims]

    def equal(self, a: Dim, b: Dim) -> bool:
        """Whether ``a`` and ``b`` simplify to the same expression (False may mean 'unknown')."""
        sa, sb = self.simplify_many([as_dim(a), as_dim(b)])
        return sa == sb


DEFAULT = DimSimplifier()  # the module's single cache; make your own DimSimplifier to isolate one


def simplify(dim: Dim) -> Dim:
    return DEFAULT.simplify(as_dim(dim))


def simplify_many(dims: Sequence[Dim]) -> list[Dim]:
    return DEFAULT.simplify_many(dims)


def equal(a: Dim, b: Dim) -> bool:
    return DEFAULT.equal(as_dim(a), as_dim(b))
