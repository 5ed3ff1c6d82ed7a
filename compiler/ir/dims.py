"""Symbolic dimensions.

A dimension is an int or a sympy expression over positive integer symbols
(batch ``B``, sequence ``T``, ...). Keeping them symbolic lets one compiled
graph serve every batch and sequence length, and lets the cost report give
formulas instead of numbers.
"""

from __future__ import annotations

from functools import lru_cache

import sympy

Dim = sympy.Expr
Shape = tuple[Dim, ...]


@lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def dim(value) -> Dim:
    """Normalise an int or sympy expression to a sympy dimension."""
    if isinstance(value, bool):
        raise TypeError("a boolean is not a dimension")
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, sympy.Expr):
        return value
    raise TypeError(f"not a dimension: {value!r}")


def shape(values) -> Shape:
    return tuple(dim(v) for v in values)


def equal(a: Dim, b: Dim) -> bool:
    """Whether two dimensions are the same for every value of their symbols. Most pairs compared
    while building a graph are two numbers or two symbols, which differ unless they are ``==``:
    answered without ``expand`` (the slow path, which on first use also imports much of sympy)."""
    if a == b:
        return True
    if _integer_or_symbol(a) and _integer_or_symbol(b):
        return False  # two different integers, two different symbols, or an integer and a symbol
    return sympy.expand(a - b) == 0


def _integer_or_symbol(d) -> bool:
    return getattr(d, "is_Integer", False) or getattr(d, "is_Symbol", False)


def is_static(d: Dim) -> bool:
    return not d.free_symbols


def static_int(d: Dim) -> int | None:
    return int(d) if is_static(d) else None


def fmt(d: Dim) -> str:
    return str(d).replace("**", "^")


def fmt_shape(s: Shape) -> str:
    return "[" + ", ".join(fmt(d) for d in s) + "]"


def shapes_equal(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))


def broadcast(a: Shape, b: Shape) -> Shape | None:
    """Numpy broadcasting of two symbolic shapes, or None if they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else sympy.Integer(1)
        y = b[-i] if i <= len(b) else sympy.Integer(1)
        if equal(x, y):
            out.append(x)
        elif x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        else:
            return None
    return tuple(reversed(out))


def numel(s: Shape) -> Dim:
    n = sympy.Integer(1)
    for d in s:
        n = n * d
    return n


def evaluate(d: Dim, bindings: dict[str, int]) -> int:
    if is_static(d):
        return int(d)
    value = d.subs({symbol(k): v for k, v in bindings.items()})
    if value.free_symbols:
        raise KeyError(f"unbound symbols in {d}: {sorted(map(str, value.free_symbols))}")
    return int(value)
