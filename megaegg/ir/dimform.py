"""The ONE normal form of Dim expressions, in plain Python (no e-graph), and the queries every
stage asks of it: the e-graph simplifier seeds with it (``megaegg/ir/dimsort.py``), the barrier
derivation reasons with it (``lowering/barriers.py``), layouts compare strides with it and the
Graph API checks shapes with it (``megaegg/ir/layout.py``, ``megaegg/ops.py``).

The form is a polynomial (:func:`poly`): ``{monomial: coefficient}``, a monomial being a sorted
tuple of *atoms* (``()`` is the constant term). An atom is a symbol, or a term the form does not
see through, itself in normal form: ``min``, ``max``, a division it cannot split, a product of
two sums (left unexpanded: expansion can blow up). Like terms are collected, a constant factor
distributes, and a term that is a multiple of a positive constant divisor leaves the division
(``(x*k + r) // k == x + r // k``, and likewise ``ceildiv`` and ``%``). Grid coordinates
(``_i0``, ...) are symbols like any other.

- :func:`poly`, :func:`canonical` (the form as a Dim: terms in a fixed order, the constant last),
  :func:`from_poly` (a polynomial, or a part of one, as a Dim);
- :func:`same` (equal for all values), :func:`const_diff` (``a - b`` when constant),
  :func:`nonneg` (provably ``>= 0``: symbols are sizes, positions and grid coordinates);
- :class:`Product`, :func:`product`: a product of dims up to factor order (each factor in normal
  form), with :meth:`Product.divides` and :meth:`Product.quotient`: equal element counts and
  reshape grouping.

>>> from megaegg.dims import sym
>>> S, T = sym("S"), sym("T")
>>> poly((S + 16) - S), str(canonical(T * 2 + S + T))
({(): 16}, 'S + T * 3')
>>> same((S + 1) * 2, S * 2 + 2), const_diff(S * 4 + 7, (S * 8 + 6) // 2)
(True, 4)
>>> product((S, 64)) == product((S * 64,))
True
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable

from ..dims import Dim, DimLike, as_dim, binary


def size(dim: Dim, memo: dict[Dim, int] | None = None) -> int:
    """Node count of the expression tree (a shared subterm counts each time it is printed)."""
    if dim.op in ("const", "sym"):
        return 1
    memo = {} if memo is None else memo
    if dim not in memo:
        memo[dim] = 1 + size(dim.args[0], memo) + size(dim.args[1], memo)
    return memo[dim]


Monomial = tuple  # atom Dims in key order, with repetition; () is the constant
Poly = dict  # {Monomial: coefficient}; no zero coefficients


@dataclass
class CanonMemo:
    """Per-DAG memo of :func:`poly` and :func:`canonical` (shared subterms are visited once)."""

    polys: dict[Dim, Poly] = field(default_factory=dict)
    keys: dict[Dim, str] = field(default_factory=dict)
    sizes: dict[Dim, int] = field(default_factory=dict)

    def key(self, d: Dim) -> str:
        """Sort key of an atom: its text, or for a huge tree a digest (printing is exponential)."""
        got = self.keys.get(d)
        if got is None:
            if size(d, self.sizes) <= 64:
                got = str(d)
            else:
                parts = f"{d.op}|" + "|".join(self.key(a) if isinstance(a, Dim) else repr(a) for a in d.args)
                got = "~" + hashlib.blake2b(parts.encode(), digest_size=12).hexdigest()
            self.keys[d] = got
        return got


# --- the form ------------------------------------------------------------------


def poly(dim: DimLike, memo: CanonMemo | None = None) -> Poly:
    """The polynomial of ``dim`` (shared with ``memo``: do not mutate it).

    >>> from megaegg.dims import sym, dmin
    >>> S, i = sym("S"), sym("_i0")
    >>> poly((i * 64 + S) // 64)  # the multiple of 64 leaves the division
    {(Dim(_i0),): 1, (Dim(S // 64),): 1}
    >>> poly(dmin(S, 3) * (S + 1) * 2)  # a product of two sums is one atom
    {(Dim(min(S, 3) * (S + 1)),): 2}
    """
    return _poly(as_dim(dim), CanonMemo() if memo is None else memo)


def canonical(dim: DimLike, memo: CanonMemo | None = None) -> Dim:
    """The normal form as a Dim: like terms collected, terms in a fixed order, the constant last.

    >>> from megaegg.dims import sym
    >>> S, T = sym("S"), sym("T")
    >>> str(canonical(1 + T + (S + 1) * 2 + T * 3))
    'S * 2 + T * 4 + 3'
    """
    memo = CanonMemo() if memo is None else memo
    return _from_poly(_poly(as_dim(dim), memo), memo)


def from_poly(p: Poly, memo: CanonMemo | None = None) -> Dim:
    """A polynomial (any part of one: a dict of its terms) as a Dim, in the order of :func:`canonical`.

    >>> from megaegg.dims import sym
    >>> S, i = sym("S"), sym("_i0")
    >>> p = poly(i * 32 + S + 5)
    >>> str(from_poly({m: c for m, c in p.items() if i not in m}))  # the part without _i0
    'S + 5'
    """
    return _from_poly(p, CanonMemo() if memo is None else memo)


def _poly(d: Dim, memo: CanonMemo) -> Poly:
    got = memo.polys.get(d)
    if got is not None:
        return got
    if d.is_const:
        out = {(): d.value} if d.value else {}
    elif d.op == "add":
        out = _plus(_poly(d.args[0], memo), _poly(d.args[1], memo))
    elif d.op == "mul":
        out = _times(_poly(d.args[0], memo), _poly(d.args[1], memo), memo)
    elif d.op in ("floordiv", "ceildiv", "mod") and d.args[1].is_const and d.args[1].value > 0:
        # terms that are multiples of the divisor leave the quotient: (x*k + r) // k == x + r // k
        k, p = d.args[1].value, _poly(d.args[0], memo)
        rest = {m: v for m, v in p.items() if v % k}
        out = {} if d.op == "mod" else {m: v // k for m, v in p.items() if not v % k}
        if rest:
            out = _plus(out, _atom(binary(d.op, _from_poly(rest, memo), k), memo))
    elif d.op == "sym":
        out = {(d,): 1}
    else:
        out = _atom(binary(d.op, canonical(d.args[0], memo), canonical(d.args[1], memo)), memo)
    memo.polys[d] = out
    return out


def _atom(d: Dim, memo: CanonMemo) -> Poly:
    # (an op whose arguments folded away, min(S + T, T + S) -> S + T, is a sum again: its terms, not an atom,
    # or the normal form would not be one: canonical(canonical(x)) != canonical(x))
    return _poly(d, memo) if d.is_const or d.op in ("add", "mul", "sym") else {(d,): 1}


def _plus(pa: Poly, pb: Poly) -> Poly:
    out = dict(pa)
    for m, v in pb.items():
        out[m] = out.get(m, 0) + v
    return {m: v for m, v in out.items() if v}


def _times(pa: Poly, pb: Poly, memo: CanonMemo) -> Poly:
    for p, q in ((pa, pb), (pb, pa)):
        if set(p) <= {()}:  # a constant factor scales every term
            k = p.get((), 0)
            return {m: v * k for m, v in q.items() if v * k}
    if len(pa) == 1 and len(pb) == 1:  # monomial times monomial
        (ma, va), (mb, vb) = *pa.items(), *pb.items()
        return {tuple(sorted(ma + mb, key=memo.key)): va * vb}
    return {(binary("mul", _from_poly(pa, memo), _from_poly(pb, memo)),): 1}


def _from_poly(p: Poly, memo: CanonMemo) -> Dim:
    out: Dim | None = None
    for m in sorted((m for m in p if m), key=lambda m: [memo.key(a) for a in m]):
        term = m[0]
        for atom in m[1:]:
            term = term * atom
        term = term * p[m]
        out = term if out is None else out + term
    return as_dim(p.get((), 0)) if out is None else out + p.get((), 0)


# --- queries -------------------------------------------------------------------


def same(a: DimLike, b: DimLike, memo: CanonMemo | None = None) -> bool:
    """Whether ``a == b`` for all values of the symbols (False may mean unknown).

    >>> from megaegg.dims import sym, ceildiv
    >>> S = sym("S")
    >>> same(ceildiv(S * 64 + 3, 64), S + 1), same(S // 2 * 2, S)
    (True, False)
    """
    memo = CanonMemo() if memo is None else memo
    return poly(a, memo) == poly(b, memo)


def const_diff(a: DimLike, b: DimLike, memo: CanonMemo | None = None) -> int | None:
    """``a - b`` when it is a constant (None: not provably one).

    >>> from megaegg.dims import sym, dmin
    >>> S, i = sym("S"), sym("_i0")
    >>> const_diff(i * 64 + S + 64, S + i * 64), const_diff(S * 2, S), const_diff(dmin(S, 4) + 1, dmin(S, 4))
    (64, None, 1)
    """
    memo = CanonMemo() if memo is None else memo
    pa, pb = poly(a, memo), poly(b, memo)
    if any(pa.get(m, 0) != pb.get(m, 0) for m in (*pa, *pb) if m):
        return None
    return pa.get((), 0) - pb.get((), 0)


def nonneg(d: DimLike, memo: CanonMemo | None = None) -> bool:
    """Provably ``d >= 0`` when every symbol is (sizes, positions, grid coordinates); False may mean unknown.

    >>> from megaegg.dims import sym, dmax
    >>> S, i = sym("S"), sym("_i0")
    >>> nonneg(S * 3 - S + i % 4), nonneg((S + 63) // 64 - 1), nonneg(dmax(S - 8, 0) * S)
    (True, False, True)
    """
    memo = CanonMemo() if memo is None else memo
    p = poly(d, memo)
    return p.get((), 0) >= 0 and all(c > 0 and all(_nonneg_atom(a, memo) for a in m) for m, c in p.items() if m)


def _nonneg_atom(t: Dim, memo: CanonMemo) -> bool:
    if t.op in ("sym", "const"):
        return t.op == "sym" or t.value >= 0
    a, b = t.args
    if t.op in ("floordiv", "ceildiv", "mod"):
        return b.is_const and b.value > 0 and (t.op == "mod" or nonneg(a, memo))
    if t.op in ("mul", "min"):
        return nonneg(a, memo) and nonneg(b, memo)
    if t.op == "max":
        return nonneg(a, memo) or nonneg(b, memo)
    return False


# --- products up to factor order ------------------------------------------------


@dataclass(frozen=True)
class Product:
    """``coef * atoms[0] * atoms[1] * ...``: a product of dims, compared up to factor order.

    Each factor that is not itself a product is put in normal form: a single term gives its
    coefficient and atoms (``S * 2 + S * 2`` is ``4 * S``), a sum stays one atom (``S + 1``), so
    ``(S + 1) * 64`` is ``64 * (S + 1)`` (not the sum ``S*64 + 64`` of :func:`poly`) and factors
    divide as in a product of integers. A zero factor makes the product zero whatever the atoms.

    >>> from megaegg.dims import sym
    >>> S, H = sym("S"), sym("H")
    >>> a, b = Product.of((S + 1) * H * 64), Product.of(H * 8)
    >>> a, b.divides(a), str(a.quotient(b).dim())
    (Product(coef=64, atoms=(Dim(H), Dim(S + 1))), True, '(S + 1) * 8')
    """

    coef: int
    atoms: tuple  # atom Dims in key order, with repetition

    @staticmethod
    def of(d: DimLike, memo: CanonMemo | None = None) -> Product:
        memo = CanonMemo() if memo is None else memo
        d = as_dim(d)
        if d.is_const:
            return Product(d.value, ())
        if d.op == "mul":
            return Product.of(d.args[0], memo).times(Product.of(d.args[1], memo), memo)
        p = _poly(d, memo)
        if len(p) != 1:  # a sum stays whole (zero has no terms)
            return Product(1, (_from_poly(p, memo),)) if p else Product(0, ())
        ((m, c),) = p.items()
        out = Product(c, ())
        for a in m:  # an atom that is a product of sums is factored again
            out = out.times(Product.of(a, memo) if a.op == "mul" else Product(1, (a,)), memo)
        return out

    def times(self, o: Product, memo: CanonMemo | None = None) -> Product:
        if self.coef == 0 or o.coef == 0:  # a product with a zero (a stride 0) is zero whatever the atoms
            return Product(0, ())
        memo = CanonMemo() if memo is None else memo
        return Product(self.coef * o.coef, tuple(sorted(self.atoms + o.atoms, key=memo.key)))

    __mul__ = times

    def quotient(self, o: Product) -> Product | None:
        """``self / o`` when ``o`` divides ``self``, else None."""
        if self.coef == 0:  # zero is a multiple of everything (of zero too, here)
            return self
        if o.coef == 0 or self.coef % o.coef:
            return None
        left = list(self.atoms)
        for a in o.atoms:
            if a not in left:
                return None
            left.remove(a)
        return Product(self.coef // o.coef, tuple(left))

    def divides(self, o: Product) -> bool:
        """Whether ``o`` is a multiple of ``self`` (an integer times ``self``)."""
        return o.quotient(self) is not None

    def dim(self) -> Dim:
        """The product as a Dim: the coefficient times the atoms in order."""
        out = as_dim(self.coef)
        for a in self.atoms:
            out = out * a
        return out


def product(dims: Iterable[DimLike]) -> Product:
    """The :class:`Product` of ``dims`` (a shape's element count).

    >>> from megaegg.dims import sym
    >>> S = sym("S")
    >>> product((S, 8, 8)) == product((64, S)), product((S, 2)) == product((S + 1, 2))
    (True, False)
    """
    memo, out = CanonMemo(), Product(1, ())
    for d in dims:
        out = out.times(Product.of(d, memo), memo)
    return out
