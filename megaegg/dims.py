"""Symbolic integer dimensions.

A `Dim` is an immutable integer expression over named symbols (``sym("pos")``)
and constants, built with ``+ * // %`` and :func:`ceildiv`, :func:`dmin`,
:func:`dmax`. Shapes, launch counts, offsets and barrier indices are all Dims.

The constructors fold constants and drop identities (``x + 0``, ``x * 1``) so
that shapes print readably and compare structurally; deeper simplification is
the e-graph's job (``megaegg.ir.dimsort``).

>>> S = sym("S")
>>> str((S + 1) * 2 + 3)
'(S + 1) * 2 + 3'
>>> ((S + 1) * 2).eval({"S": 4})
10
>>> str(ceildiv(S, 1))
'S'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

DimLike = Union["Dim", int]

_COMMUTATIVE = frozenset({"add", "mul", "min", "max"})
_BINARY = ("add", "mul", "floordiv", "mod", "min", "max", "ceildiv")
_INFIX = {"add": "+", "mul": "*", "floordiv": "//", "mod": "%"}
_PRECEDENCE = {"add": 1, "mul": 2, "floordiv": 2, "mod": 2}


def _floordiv(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("Dim division by zero")
    return a // b


def _ceildiv(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("Dim division by zero")
    return -(-a // b)


_APPLY: dict[str, Callable[[int, int], int]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "floordiv": _floordiv,
    "mod": lambda a, b: a % b if b else _floordiv(a, b),
    "min": min,
    "max": max,
    "ceildiv": _ceildiv,
}


@dataclass(frozen=True)
class Dim:
    """An integer expression node: ``op`` is ``const``, ``sym`` or a binary op name."""

    op: str
    args: tuple
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.op, self.args)))

    def __hash__(self) -> int:
        return self._hash

    # --- queries -------------------------------------------------------------
    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def value(self) -> int:
        """The constant value; raises for a symbolic expression."""
        if self.op != "const":
            raise ValueError(f"dim {self} is symbolic, not a constant")
        return self.args[0]

    def symbols(self) -> frozenset[str]:
        if self.op == "const":
            return frozenset()
        if self.op == "sym":
            return frozenset({self.args[0]})
        return self.args[0].symbols() | self.args[1].symbols()

    def eval(self, env: Mapping[str, int]) -> int:
        """Value of the expression with the symbols bound by ``env``."""
        if self.op == "const":
            return self.args[0]
        if self.op == "sym":
            name = self.args[0]
            if name not in env:
                raise KeyError(f"no value given for dim {name!r}")
            return int(env[name])
        return _APPLY[self.op](self.args[0].eval(env), self.args[1].eval(env))

    def subs(self, mapping: Mapping[str, DimLike]) -> "Dim":
        """Replace symbols by expressions (rebuilt through the folding constructors)."""
        if self.op == "const":
            return self
        if self.op == "sym":
            return as_dim(mapping[self.args[0]]) if self.args[0] in mapping else self
        return binary(self.op, self.args[0].subs(mapping), self.args[1].subs(mapping))

    def to_c(self, symbol: Callable[[str], str] = lambda s: s) -> str:
        """C source of the expression (int64 arithmetic, non-negative operands)."""
        if self.op == "const":
            return f"{self.args[0]}LL"
        if self.op == "sym":
            return symbol(self.args[0])
        a, b = (x.to_c(symbol) for x in self.args)
        if self.op in _INFIX:
            op = "/" if self.op == "floordiv" else _INFIX[self.op]
            return f"({a} {op} {b})"
        if self.op == "ceildiv":
            return f"((({a}) + ({b}) - 1) / ({b}))"
        return f"{self.op}_i64({a}, {b})"

    # --- printing ------------------------------------------------------------
    def __str__(self) -> str:
        return self._fmt(0)

    def _fmt(self, parent: int) -> str:
        if self.op == "const":
            return str(self.args[0])
        if self.op == "sym":
            return self.args[0]
        if self.op in _INFIX:
            p = _PRECEDENCE[self.op]
            lhs = self.args[0]._fmt(p)
            rhs = self.args[1]._fmt(p + (0 if self.op in _COMMUTATIVE else 1))
            s = f"{lhs} {_INFIX[self.op]} {rhs}"
            return f"({s})" if p < parent else s
        return f"{self.op}({self.args[0]}, {self.args[1]})"

    def __repr__(self) -> str:
        return f"Dim({self})"

    # --- arithmetic ----------------------------------------------------------
    def __add__(self, o: DimLike) -> "Dim":
        return binary("add", self, o)

    def __radd__(self, o: DimLike) -> "Dim":
        return binary("add", o, self)

    def __sub__(self, o: DimLike) -> "Dim":
        return binary("add", self, binary("mul", o, -1))

    def __rsub__(self, o: DimLike) -> "Dim":
        return binary("add", o, binary("mul", self, -1))

    def __mul__(self, o: DimLike) -> "Dim":
        return binary("mul", self, o)

    def __rmul__(self, o: DimLike) -> "Dim":
        return binary("mul", o, self)

    def __floordiv__(self, o: DimLike) -> "Dim":
        return binary("floordiv", self, o)

    def __rfloordiv__(self, o: DimLike) -> "Dim":
        return binary("floordiv", o, self)

    def __mod__(self, o: DimLike) -> "Dim":
        return binary("mod", self, o)

    def __rmod__(self, o: DimLike) -> "Dim":
        return binary("mod", o, self)

    def __index__(self) -> int:
        return self.value

    def __int__(self) -> int:
        return self.value


def const(v: int) -> Dim:
    return Dim("const", (int(v),))


def sym(name: str) -> Dim:
    """A named runtime dimension, e.g. ``sym("pos")``; its value is given at call time."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"dim name must be an identifier, got {name!r}")
    return Dim("sym", (name,))


def as_dim(x: DimLike) -> Dim:
    if isinstance(x, Dim):
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        try:
            import numpy as np

            if isinstance(x, np.integer):
                return const(int(x))
        except ImportError:  # pragma: no cover
            pass
        raise TypeError(f"expected an int or Dim, got {type(x).__name__}: {x!r}")
    return const(x)


def binary(op: str, a: DimLike, b: DimLike) -> Dim:
    """Build ``op(a, b)`` with local folding: constants, identities, constant-right order."""
    a, b = as_dim(a), as_dim(b)
    if a.is_const and b.is_const:
        return const(_APPLY[op](a.value, b.value))
    if op in _COMMUTATIVE and a.is_const:  # canonical order: constant on the right
        a, b = b, a
    if b.is_const:
        v = b.value
        if op == "add" and v == 0:
            return a
        if op == "mul":
            if v == 0:
                return b
            if v == 1:
                return a
        if op in ("floordiv", "ceildiv") and v == 1:
            return a
        if op == "mod" and v == 1:
            return const(0)
        # (x + c1) + c2 -> x + (c1 + c2); (x * c1) * c2 -> x * (c1 * c2)
        if op in ("add", "mul") and a.op == op and a.args[1].is_const:
            return binary(op, a.args[0], _APPLY[op](a.args[1].value, v))
    if op in ("min", "max") and a == b:
        return a
    return Dim(op, (a, b))


def ceildiv(a: DimLike, b: DimLike) -> Dim:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``."""
    return binary("ceildiv", a, b)


def dmin(a: DimLike, b: DimLike) -> Dim:
    return binary("min", a, b)


def dmax(a: DimLike, b: DimLike) -> Dim:
    return binary("max", a, b)


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def evaluate_shape(shape, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(as_dim(d).eval(env) for d in shape)


def upper_bound(d: Dim, max_env: Mapping[str, int]) -> int:
    """An upper bound of ``d`` with every runtime dim in ``[0, max_env[name]]`` (``bounds``)."""
    return bounds(d, max_env)[1]


def bounds(d: Dim, max_env: Mapping[str, int]) -> tuple[int, int]:
    """(lower, upper) bounds of ``d`` with every runtime dim in ``[0, max_env[name]]``, by interval
    arithmetic: a product takes the extremes of its endpoints' products, so negative coefficients (a
    count that falls as the rows grow, matvec_split's split count) are bounded too. A quotient by a
    constant divisor is monotone; by a runtime one (at least 1 wherever the queue divides by it) it lies
    between 0 and the dividend; ``x % c`` in ``[0, c)``."""
    if d.op == "const":
        return d.args[0], d.args[0]
    if d.op == "sym":
        return 0, d.eval(max_env)
    (alo, ahi), (blo, bhi) = bounds(d.args[0], max_env), bounds(d.args[1], max_env)
    if d.op == "mod":  # (a divisor of at least 1)
        return 0, (min(ahi, bhi - 1) if alo >= 0 else bhi - 1)
    if d.op in ("floordiv", "ceildiv"):
        if blo != bhi:
            return min(0, alo), max(0, ahi)
        q = (lambda v: v // blo) if d.op == "floordiv" else (lambda v: -(-v // blo))
        return tuple(sorted((q(alo), q(ahi))))
    if d.op == "add":
        return alo + blo, ahi + bhi
    if d.op == "mul":
        ends = (alo * blo, alo * bhi, ahi * blo, ahi * bhi)
        return min(ends), max(ends)
    if d.op == "min":
        return min(alo, blo), min(ahi, bhi)
    return max(alo, blo), max(ahi, bhi)  # max
