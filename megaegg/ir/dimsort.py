"""Dim expressions as an egglog sort, with a simplification ruleset that cannot blow up.

:class:`DimE` mirrors :class:`megaegg.dims.Dim` (``const sym + * // % min max
ceildiv``). There is no associativity or commutativity in the e-graph (e-nodes
grow ~3x per extra term): :func:`megaegg.ir.dimform.canonical` puts sums of products into one normal
form in Python (like terms collected, the constant last) and that form joins each
root's e-class; the rules then apply targeted identities. Every rule is sound for
all integer values of the symbols, given positive divisors (floor division).

Arithmetic on literals happens in rule conditions (``eq(c).to(a * b)``), so an
overflow makes the rule not match instead of panicking.

>>> from megaegg.dims import sym, ceildiv, dmin
>>> S = sym("S")
>>> str(simplify(ceildiv(S * 64, 64)))
'S'
>>> str(simplify((S + 1) * 2 + 3))
'S * 2 + 5'
>>> str(simplify(dmin(S, S + 4)))
'S'
"""

from __future__ import annotations


import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence, TypeAlias, TypeVar

from egglog import EGraph, Expr, Schedule, StringLike, eq, i64, i64Like, ne, rewrite, rule, ruleset, run, subsume
from egglog.declarations import CallDecl, ClassMethodRef, InitRef, LitDecl, MethodRef, TypedExprDecl
from egglog.runtime import RuntimeExpr

from .dimform import CanonMemo, canonical, same, size
from ..dims import Dim, as_dim, binary

T = TypeVar("T")

dims_ruleset = ruleset(name="dims")
dims_settle = ruleset(name="dims_settle")  # run to saturation before each round of dims_ruleset


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


# --- rules -------------------------------------------------------------------


def _floor(a: i64, b: i64) -> i64:
    """Floor division of i64 terms for ``b > 0`` (egglog's ``/`` truncates toward zero)."""
    return (a - (a % b + b) % b) / b


def _divides(b: i64, a: i64):
    """The condition ``b | a`` (for ``b != 0``)."""
    return eq(a % b).to(i64(0))


@dims_settle.register
def _settle(x: DimE, y: DimE, a: i64) -> Iterable:
    # a class holding a literal is settled: its other nodes only feed rules self-loops
    # (0 == 0*6 matches (x*c1)*c2 forever, minting 0*36, 0*1296, ...), so they go
    for node in (x + y, x * y, x // y, x % y, x.min(y), x.max(y), x.ceildiv(y)):
        yield rule(eq(node).to(DimE(a))).then(subsume(node))


@dims_ruleset.register
def _fold(a: i64, b: i64, c: i64) -> Iterable:
    # every op on two literals folds (divisions only for positive divisors)
    ca, cb, cc = DimE(a), DimE(b), DimE(c)
    yield rewrite(ca + cb, subsume=True).to(cc, eq(c).to(a + b))
    yield rewrite(ca * cb, subsume=True).to(cc, eq(c).to(a * b))
    yield rewrite(ca // cb, subsume=True).to(cc, b > 0, eq(c).to(_floor(a, b)))
    yield rewrite(ca % cb, subsume=True).to(cc, b > 0, eq(c).to((a % b + b) % b))
    yield rewrite(ca.ceildiv(cb), subsume=True).to(cc, b > 0, eq(c).to(_floor(a + b - 1, b)))
    yield rewrite(ca.min(cb), subsume=True).to(cc, eq(c).to(a.min(b)))
    yield rewrite(ca.max(cb), subsume=True).to(cc, eq(c).to(a.max(b)))


@dims_ruleset.register
def _canonical(x: DimE, a: i64, b: i64, c: i64) -> Iterable:
    ca, cb, cc = DimE(a), DimE(b), DimE(c)
    # constants go right in commutative ops, so one pattern per rule suffices (subsumed:
    # the swapped node equals the original only when both sides are literals, which fold)
    yield rewrite(ca + x, subsume=True).to(x + ca)
    yield rewrite(ca * x, subsume=True).to(x * ca)
    yield rewrite(ca.min(x), subsume=True).to(x.min(ca))
    yield rewrite(ca.max(x), subsume=True).to(x.max(ca))
    # trailing constants collect; general associativity is left to :func:`canonical`
    yield rewrite((x + ca) + cb).to(x + cc, eq(c).to(a + b))
    yield rewrite((x * ca) * cb).to(x * cc, eq(c).to(a * b))
    # identities (subsumed: the right side is an existing class, never the same e-node)
    yield rewrite(x + DimE(0), subsume=True).to(x)
    yield rewrite(x * DimE(1), subsume=True).to(x)
    yield rewrite(x * DimE(0), subsume=True).to(DimE(0))
    yield rewrite(x // DimE(1), subsume=True).to(x)
    yield rewrite(x % DimE(1), subsume=True).to(DimE(0))
    yield rewrite(x.ceildiv(DimE(1)), subsume=True).to(x)
    yield rewrite(x.min(x), subsume=True).to(x)
    yield rewrite(x.max(x), subsume=True).to(x)


@dims_ruleset.register
def _linear(x: DimE, a: i64, b: i64, c: i64) -> Iterable:
    # a constant factor distributes over a constant term only: (x + c1) * c2 -> x*c2 + c1*c2;
    # like terms are collected by :func:`canonical`, before and after the e-graph
    ca, cb, cc = DimE(a), DimE(b), DimE(c)
    yield rewrite((x + ca) * cb).to(x * cb + cc, eq(c).to(a * b))


@dims_ruleset.register
def _division(x: DimE, y: DimE, a: i64, b: i64, c: i64) -> Iterable:
    ca, cb, cc = DimE(a), DimE(b), DimE(c)
    # (x*c)//c == x exactly for c != 0; likewise % and ceildiv
    yield rewrite((x * ca) // ca, subsume=True).to(x, ne(a).to(i64(0)))
    yield rewrite((x * ca) % ca, subsume=True).to(DimE(0), ne(a).to(i64(0)))
    yield rewrite((x * ca).ceildiv(ca), subsume=True).to(x, ne(a).to(i64(0)))
    # a factor that the divisor divides cancels, and one that divides the divisor shrinks it
    yield rewrite((x * ca) // cb).to(x * cc, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((x * ca) % cb, subsume=True).to(DimE(0), b > 0, _divides(b, a))
    yield rewrite((x * ca).ceildiv(cb)).to(x * cc, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((x * ca) // cb).to(x // cc, a > 0, b > a, _divides(a, b), eq(c).to(b / a))
    yield rewrite((x * ca).ceildiv(cb)).to(x.ceildiv(cc), a > 0, b > a, _divides(a, b), eq(c).to(b / a))
    # a multiple of the divisor inside a sum leaves the quotient (floor: sound for any sign)
    yield rewrite((x * ca + y) // cb).to(x * cc + y // cb, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((y + x * ca) // cb).to(y // cb + x * cc, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((y + ca) // cb).to(y // cb + cc, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((x * ca + y) % cb).to(y % cb, b > 0, _divides(b, a))
    yield rewrite((y + x * ca) % cb).to(y % cb, b > 0, _divides(b, a))
    yield rewrite((y + ca) % cb).to(y % cb, b > 0, _divides(b, a))
    yield rewrite((x * ca + y).ceildiv(cb)).to(x * cc + y.ceildiv(cb), b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((y + x * ca).ceildiv(cb)).to(y.ceildiv(cb) + x * cc, b > 0, _divides(b, a), eq(c).to(a / b))
    yield rewrite((y + ca).ceildiv(cb)).to(y.ceildiv(cb) + cc, b > 0, _divides(b, a), eq(c).to(a / b))
    # division by a positive constant is monotone, so it moves inside min/max (a capped tile end)
    yield rewrite(x.min(y) // cb).to((x // cb).min(y // cb), b > 0)
    yield rewrite(x.max(y) // cb).to((x // cb).max(y // cb), b > 0)
    yield rewrite(x.min(y).ceildiv(cb)).to(x.ceildiv(cb).min(y.ceildiv(cb)), b > 0)
    yield rewrite(x.max(y).ceildiv(cb)).to(x.ceildiv(cb).max(y.ceildiv(cb)), b > 0)
    # nested divisions by positive constants combine
    yield rewrite((x // ca) // cb).to(x // cc, a > 0, b > 0, eq(c).to(a * b))
    yield rewrite(x.ceildiv(ca).ceildiv(cb)).to(x.ceildiv(cc), a > 0, b > 0, eq(c).to(a * b))
    yield rewrite((x % ca) % cb).to(x % cb, a > 0, b > 0, _divides(b, a))
    yield rewrite((x % ca) // ca, subsume=True).to(DimE(0), a > 0)
    # x//c*c + x%c == x, and its subtraction form x - x%c == x//c*c
    yield rewrite((x // ca) * ca + x % ca, subsume=True).to(x, a > 0)
    yield rewrite(x % ca + (x // ca) * ca, subsume=True).to(x, a > 0)
    yield rewrite(x + (x % ca) * DimE(-1)).to((x // ca) * ca, a > 0)


@dims_ruleset.register
def _minmax(x: DimE, y: DimE, a: i64, b: i64, c: i64) -> Iterable:
    ca, cb, cc = DimE(a), DimE(b), DimE(c)
    # min/max of x and x plus a constant decide by the constant's sign
    yield rewrite(x.min(x + ca), subsume=True).to(x, a >= 0)
    yield rewrite((x + ca).min(x), subsume=True).to(x, a >= 0)
    yield rewrite(x.min(x + ca)).to(x + ca, a < 0)
    yield rewrite((x + ca).min(x)).to(x + ca, a < 0)
    yield rewrite(x.max(x + ca)).to(x + ca, a >= 0)
    yield rewrite((x + ca).max(x)).to(x + ca, a >= 0)
    yield rewrite(x.max(x + ca), subsume=True).to(x, a < 0)
    yield rewrite((x + ca).max(x), subsume=True).to(x, a < 0)
    yield rewrite((x + ca).min(x + cb)).to(x + cc, eq(c).to(a.min(b)))
    yield rewrite((x + ca).max(x + cb)).to(x + cc, eq(c).to(a.max(b)))
    # a shared constant offset moves out; a repeated operand is absorbed
    yield rewrite((x + ca).min(y + ca)).to(x.min(y) + ca)
    yield rewrite((x + ca).max(y + ca)).to(x.max(y) + ca)
    yield rewrite(x.min(x.min(y)), subsume=True).to(x.min(y))
    yield rewrite(x.max(x.max(y)), subsume=True).to(x.max(y))
    yield rewrite(x.min(y).min(y), subsume=True).to(x.min(y))
    yield rewrite(x.max(y).max(y), subsume=True).to(x.max(y))


def dims_schedule(iterations: int) -> Schedule:
    """Rounds of :data:`dims_ruleset`, each after settling the constant classes."""
    return (dims_settle.saturate() + run(dims_ruleset)) * iterations


# --- conversion --------------------------------------------------------------

_METHODS = {"add": "__add__", "mul": "__mul__", "floordiv": "__floordiv__", "mod": "__mod__",
            "min": "min", "max": "max", "ceildiv": "ceildiv"}
_TO_EGG: dict[str, Callable[[DimE, DimE], DimE]] = {op: getattr(DimE, m) for op, m in _METHODS.items()}
_FROM_EGG = {m: op for op, m in _METHODS.items()}


# One term built the public way; its declarations are the templates of the fast builder below.
_SAMPLE = DimE.sym("S") + DimE(3)
_DECLS, _DIM_TP = _SAMPLE.__egg_decls__, _SAMPLE.__egg_typed_expr__.tp
_SYM_DECL, _CONST_DECL = (a.expr for a in _SAMPLE.__egg_typed_expr__.expr.args)
_REFS = {op: MethodRef(_DIM_TP.ident, m) for op, m in _METHODS.items()}
_I64 = 2**62  # literals beyond this stay out of the e-graph (i64 arithmetic would overflow)


def to_egg(dim: Dim, memo: dict[Dim, TypedExprDecl] | None = None) -> DimE:
    """The e-graph term of ``dim``; pass ``memo`` to share subterms across calls.

    Builds egglog's declarations directly: the operator path type-checks each node (~0.3 ms).
    """
    return RuntimeExpr.__from_values__(_DECLS, _to_decl(dim, {} if memo is None else memo))


def _to_decl(dim: Dim, memo: dict[Dim, TypedExprDecl]) -> TypedExprDecl:
    got = memo.get(dim)
    if got is not None:
        return got
    if dim.op in ("const", "sym"):
        tmpl = _CONST_DECL if dim.op == "const" else _SYM_DECL
        lit = tmpl.args[0]
        out = TypedExprDecl(_DIM_TP, replace(tmpl, args=(replace(lit, expr=LitDecl(dim.args[0])),)))
    else:
        out = TypedExprDecl(_DIM_TP, CallDecl(_REFS[dim.op], (_to_decl(dim.args[0], memo), _to_decl(dim.args[1], memo))))
    memo[dim] = out
    return out


def from_egg(expr: DimE) -> Dim:
    """The :class:`Dim` of an extracted term, rebuilt through the folding constructors.

    Reads egglog's declarations directly: ``get_callable_args`` costs ~0.4 ms a node.
    """
    return _from_decl(expr.__egg_typed_expr__.expr, {})


def _from_decl(e: object, memo: dict[int, Dim]) -> Dim:
    got = memo.get(id(e))  # by identity: the extracted tree holds every node while we walk it
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
    memo[id(e)] = out
    return out


def _batch(roots: Sequence[DimE]) -> DimBatch:
    if len(roots) == 1:
        return DimBatch.one(roots[0])
    mid = len(roots) // 2
    return DimBatch.pair(_batch(roots[:mid]), _batch(roots[mid:]))


def _leaves(e: object, out: list[Dim], memo: dict[int, Dim]) -> list[Dim]:
    """The Dims of an extracted :class:`DimBatch` tree's declaration, left to right."""
    args = [a.expr for a in e.args]
    if e.callable.method_name == "one":
        out.append(_from_decl(args[0], memo))
    else:
        for a in args:
            _leaves(a, out, memo)
    return out


# --- simplification ----------------------------------------------------------


def _guarded(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when egglog fails; its PanicException derives from BaseException."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException:  # noqa: BLE001
        return None


_PROBES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 31, 64, 97, 100, 127, 512, 1000, 4096, 32768)


_SMALL = (0, 1, 2, 5, 64)  # every combination of these for up to 3 symbols; of 0 and 1 up to 8


def _agrees(a: Dim, b: Dim, probes: int = 24) -> bool:
    """A numeric check of a result: the second guard against e-graph unsoundness (the
    first, :func:`_rebind_lets`, removed the cause seen so far); on a mismatch the caller
    falls back to the unsimplified dim. Checked at every combination of small values and 64
    (where min, max, // and % change branch: spread points alone missed S = T = 0, and
    small values alone missed S = 0 with T >= 9) and at fixed spread points."""
    names = sorted(a.symbols() | b.symbols())
    small = _SMALL if len(names) <= 3 else _SMALL[:2] if len(names) <= 8 else ()
    envs = [dict(zip(names, v)) for v in itertools.product(small, repeat=len(names))] if small else [
        dict.fromkeys(names, 0), dict.fromkeys(names, 1)]
    envs += [{n: _PROBES[(k * 7 + i * (k + 5) + i * i * 3) % len(_PROBES)] for i, n in enumerate(names)}
             for k in range(probes)]
    for env in envs:
        try:
            if a.eval(env) != b.eval(env):
                return False
        except ZeroDivisionError:
            continue
    return True


def _fits(d: Dim, seen: set[Dim]) -> bool:
    """Whether every literal of ``d`` is a safe i64."""
    if d in seen:
        return True
    seen.add(d)
    if d.op == "const":
        return -_I64 < d.value < _I64
    return d.op == "sym" or all(_fits(a, seen) for a in d.args)


def _rebind_lets(egraph: EGraph, term: Expr) -> None:
    """Make ``egraph.extract(term)`` read the classes the run left, not those of registration.

    egglog-python lowers a subterm with several parents to a global ``let`` and caches
    that lowering; a later ``extract`` of the same term goes through the cached ``let``
    names, which can still hold a class that the run has since merged away. Extracting
    through them returned terms of unrelated classes (``max(S, S // 3)`` came back as
    ``max(S, 1)``): 9 wrong results in 72 batches of 500 random dims, in a different place
    each process (egglog 13.2). Forgetting the cached lowering and registering the term
    again binds fresh ``let``s to the current classes: 0 wrong results in 120 batches.
    """
    egraph._state.expr_to_egg_cache.clear()  # private: egglog has no public way to drop it
    egraph.register(term)


@dataclass
class DimSimplifier:
    """Simplifies Dims in the e-graph and memoizes the results (the only cache of this module)."""

    iterations: int = 10
    growth: int = 16  # e-node budget: this many times the input's distinct nodes (+4096)
    memo: dict[Dim, Dim] = field(default_factory=dict)

    def simplify(self, dim: Dim) -> Dim:
        return self.simplify_many([dim])[0]

    def simplify_many(self, dims: Sequence[Dim]) -> list[Dim]:
        """Simplify a batch in ONE e-graph: ~1 ms a Dim, against ~20 ms with an e-graph each."""
        dims = [as_dim(d) for d in dims]
        todo = [d for d in dict.fromkeys(dims) if d not in self.memo]
        leaves = [d for d in todo if d.op in ("const", "sym")]
        self.memo.update((d, d) for d in leaves)  # nothing to simplify
        todo = [d for d in todo if d.op not in ("const", "sym")]
        if todo:
            fits = [d for d in todo if _fits(d, set())]
            got = dict(zip(fits, _guarded(lambda: self._run(fits)) or ())) if fits else {}
            outs = [got.get(d) for d in todo]
            for d, out in zip(todo, outs):
                # never larger than the input; on ties the canonical form of the e-graph's pick
                forms = (canonical(out), out) if out is not None else ()
                self.memo[d] = min((*forms, canonical(d), d), key=size)
        return [self.memo[d] for d in dims]

    def _run(self, todo: list[Dim]) -> list[Dim | None]:
        # ONE registered term, the batch of canonical forms, extracted in one call
        egraph, memo, canon = EGraph(), {}, CanonMemo()
        roots = [to_egg(canonical(d, canon), memo) for d in todo]
        batch = _batch(roots)
        egraph.register(batch)
        budget = self.growth * len(memo) + 4096
        for _ in range(self.iterations):  # round by round, stopping at a fixpoint or past the budget
            if not egraph.run(dims_schedule(1)).updated:
                break
            if sum(n for _, n in egraph.all_function_sizes()) > budget:
                break
        if _guarded(lambda: _rebind_lets(egraph, batch) or True) is None:
            return [None] * len(todo)  # (extracting through the old lets could be wrong: keep the inputs)
        outs = _guarded(lambda: _leaves(egraph.extract(batch).__egg_typed_expr__.expr, [], {}))
        if outs is None:  # the batch failed to extract: one by one, giving up on those that fail
            outs = [_guarded(lambda r=r: from_egg(egraph.extract(r))) for r in roots]
        return [o if o is None or _agrees(d, o) else None for d, o in zip(todo, outs)]

    def equal(self, a: Dim, b: Dim) -> bool:
        """Whether ``a`` and ``b`` simplify to the same expression (False may mean 'unknown')."""
        sa, sb = self.simplify_many([as_dim(a), as_dim(b)])
        return sa == sb or same(sa, sb)


DEFAULT = DimSimplifier()  # the module's single cache; make a DimSimplifier of your own to isolate one


def simplify(dim: Dim) -> Dim:
    """``dim`` simplified in the e-graph (memoized in :data:`DEFAULT`); never larger than ``dim``."""
    return DEFAULT.simplify(as_dim(dim))


def simplify_many(dims: Sequence[Dim]) -> list[Dim]:
    """:func:`simplify` of a batch, in one e-graph."""
    return DEFAULT.simplify_many(dims)


def equal(a: Dim, b: Dim) -> bool:
    """Whether ``a`` and ``b`` are the same after simplification."""
    return DEFAULT.equal(as_dim(a), as_dim(b))
