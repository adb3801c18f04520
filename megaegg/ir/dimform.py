"""The sum-of-products normal form of a Dim, in plain Python (no e-graph): like terms collected,
terms in a fixed order, the constant last. The rewrite stage seeds its e-graph with it
(megaegg/ir/dimsort.py); the Graph API uses it to see that ``(S + 16) - S`` is 16."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..dims import Dim, as_dim, binary


def size(dim: Dim, memo: dict[Dim, int] | None = None) -> int:
    """Node count of the expression tree (a shared subterm counts each time it is printed)."""
    if dim.op in ("const", "sym"):
        return 1
    memo = {} if memo is None else memo
    if dim not in memo:
        memo[dim] = 1 + size(dim.args[0], memo) + size(dim.args[1], memo)
    return memo[dim]


Poly = dict  # {monomial (tuple of atom Dims in key order; () is the constant): coefficient}


@dataclass
class CanonMemo:
    """Per-DAG memo of :func:`canonical` (shared subterms are visited once)."""

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


def canonical(dim: Dim, memo: CanonMemo | None = None) -> Dim:
    """Sum-of-products normal form: like terms collected, terms in a fixed order, the
    constant last; a product of two sums stays unexpanded (expansion can blow up).

    >>> from megaegg.dims import sym
    >>> S, T = sym("S"), sym("T")
    >>> str(canonical(1 + T + (S + 1) * 2 + T * 3))
    'S * 2 + T * 4 + 3'
    """
    memo = CanonMemo() if memo is None else memo
    return _from_poly(_poly(as_dim(dim), memo), memo)


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
    return _poly(d, memo) if d.is_const else {(d,): 1}


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
