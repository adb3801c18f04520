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
from typing import Callable, Iterable, Sequence, TypeAlias, TypeVar

from egglog import EGraph, Expr, StringLike, eq, i64, i64Like, ne, rewrite, ruleset
from egglog.declarations import CallDecl, ClassMethodRef, InitRef, MethodRef

from ..dims import Dim, as_dim, binary

T = TypeVar("T")

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


class DimBatch(Expr):
    """A balanced tree of Dim roots, so that a batch extracts in ONE call (~2 ms a call).

    ``Vec[DimE]`` would be the obvious container, but its extraction returned the
    elements out of order here (egglog 13.2.0).
    """

    @classmethod
    def one(cls, x: DimE) -> DimBatch: ...

    @classmethod
    def pair(cls, left: DimBatch, right: DimBatch) -> DimBatch: ...


def _batch(roots: Sequence[DimE]) -> DimBatch:
    if len(roots) == 1:
        return DimBatch.one(roots[0])
    mid = len(roots) // 2
    return DimBatch.pair(_batch(roots[:mid]), _batch(roots[mid:]))


def _leaves(e: object, out: list[Dim], memo: dict[object, Dim]) -> list[Dim]:
    """The Dims of an extracted :class:`DimBatch` tree, left to right."""
    args = [a.expr for a in e.args]
    if e.callable.method_name == "one":
        out.append(_from_decl(args[0], memo))
    else:
        for a in args:
            _leaves(a, out, memo)
    return out


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
    yield rewrite((y + ca) % cb).to(y % cb, b > 0, eq(a % b).to(i64(0)))
    yield rewrite((x * ca + y).ceildiv(cb)).to(x * DimE(a / b) + y.ceildiv(cb), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + x * ca).ceildiv(cb)).to(y.ceildiv(cb) + x * DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    yield rewrite((y + ca).ceildiv(cb)).to(y.ceildiv(cb) + DimE(a / b), b > 0, eq(a % b).to(i64(0)))
    # division by a positive constant is monotone, so it moves inside min/max (a capped tile end)
    yield rewrite(x.min(y) // cb).to((x // cb).min(y // cb), b > 0)
    yield rewrite(x.max(y) // cb).to((x // cb).max(y // cb), b > 0)
    yield rewrite(x.min(y).ceildiv(cb)).to(x.ceildiv(cb).min(y.ceildiv(cb)), b > 0)
    yield rewrite(x.max(y).ceildiv(cb)).to(x.ceildiv(cb).max(y.ceildiv(cb)), b > 0)
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

_METHODS = {
    "add": "__add__",
    "mul": "__mul__",
    "floordiv": "__floordiv__",
    "mod": "__mod__",
    "min": "min",
    "max": "max",
    "ceildiv": "ceildiv",
}
_TO_EGG: dict[str, Callable[[DimE, DimE], DimE]] = {op: getattr(DimE, m) for op, m in _METHODS.items()}


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


_FROM_EGG = {m: op for op, m in _METHODS.items()}


def from_egg(expr: DimE) -> Dim:
    """The :class:`Dim` of an extracted term, rebuilt through the folding constructors.

    Reads egglog's declarations directly: ``get_callable_args`` costs ~0.4 ms a node.
    """
    return _from_decl(expr.__egg_typed_expr__.expr, {})


def _from_decl(e: object, memo: dict[object, Dim]) -> Dim:
    got = memo.get(e)
    if got is not None:
        return got
    if not isinstance(e, CallDecl):
        raise ValueError(f"not a Dim term: {e}")
    ref, args = e.callable, [a.expr for a in e.args]
    if isinstance(ref, InitRef):
        out = as_dim(args[0].value)
    elif isinstance(ref, ClassMethodRef) and ref.method_name == "sym":
        out = Dim("sym", (args[0].value,))
    elif isinstance(ref, MethodRef) and ref.method_name in _FROM_EGG:
        out = binary(_FROM_EGG[ref.method_name], _from_decl(args[0], memo), _from_decl(args[1], memo))
    else:
        raise ValueError(f"not a Dim term: {e}")
    memo[e] = out
    return out


def size(dim: Dim) -> int:
    """Node count of the expression tree (shared subterms counted each time)."""
    return 1 if dim.op in ("const", "sym") else 1 + size(dim.args[0]) + size(dim.args[1])


# --- simplification ----------------------------------------------------------


def _guarded(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when egglog fails; its PanicException derives from BaseException."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException:  # noqa: BLE001
        return None


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
            batch = _batch(roots)
            egraph.register(batch)
            egraph.run(self.iterations, ruleset=dims_ruleset)
            outs = _guarded(lambda: _leaves(egraph.extract(batch).__egg_typed_expr__.expr, [], {}))
            if outs is None:  # the batch failed to extract: retry one by one, keeping inputs that fail
                outs = [_guarded(lambda r=r: from_egg(egraph.extract(r))) for r in roots]
            for d, out in zip(todo, outs):
                self.memo[d] = out if out is not None and size(out) <= size(d) else d  # never larger
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
