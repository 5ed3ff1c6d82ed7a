"""Exact polynomials over the graph's symbolic dimensions, fast enough for whole-graph sums.

The cost report adds and multiplies one size expression per node (thousands for
GPT-3). sympy is exact but slow at that volume, so costs are kept as plain
dicts {monomial: coefficient} with integer or Fraction coefficients, converted
from sympy once per distinct dimension and back to sympy only for printing.
A monomial is a sorted tuple of (symbol name, exponent) pairs; () is the
constant term.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import sympy

from tessera.compiler.ir import dims

Monomial = tuple[tuple[str, int], ...]

SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def _norm(c):
    if type(c) is Fraction and c.denominator == 1:
        return int(c)
    return c


@lru_cache(maxsize=None)
def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    if not a:
        return b
    if not b:
        return a
    d = dict(a)
    for s, e in b:
        d[s] = d.get(s, 0) + e
    return tuple(sorted(d.items()))


class Poly:
    """A polynomial with rational coefficients; immutable by convention."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict[Monomial, int | Fraction] | None = None):
        if terms and 0 in terms.values():
            terms = {m: c for m, c in terms.items() if c != 0}
        self.terms = terms if terms is not None else {}

    # ------------------------------------------------------------ construction
    @staticmethod
    def const(c) -> "Poly":
        return Poly({(): _norm(Fraction(c)) if not isinstance(c, int) else c})

    @staticmethod
    def symbol(name: str) -> "Poly":
        return Poly({((name, 1),): 1})

    @staticmethod
    def from_dim(d) -> "Poly":
        """A sympy dimension (or int) as a Poly; raises ValueError if it is not a polynomial."""
        if isinstance(d, int):
            return Poly({(): d})
        return _from_sympy(d)

    @staticmethod
    def sum(polys) -> "Poly":
        """Sum of many polynomials, accumulated in one dict (much faster than repeated +)."""
        out: dict[Monomial, int | Fraction] = {}
        for p in polys:
            for m, c in p.terms.items():
                out[m] = out.get(m, 0) + c
        return Poly({m: _norm(c) for m, c in out.items()})

    # ------------------------------------------------------------ arithmetic
    def __add__(self, other) -> "Poly":
        other = _coerce(other)
        out = dict(self.terms)
        for m, c in other.terms.items():
            out[m] = _norm(out.get(m, 0) + c)
        return Poly(out)

    __radd__ = __add__

    def __neg__(self) -> "Poly":
        return Poly({m: -c for m, c in self.terms.items()})

    def __sub__(self, other) -> "Poly":
        return self + (-_coerce(other))

    def __rsub__(self, other) -> "Poly":
        return _coerce(other) - self

    def __mul__(self, other) -> "Poly":
        if type(other) is int:
            return Poly({m: c * other for m, c in self.terms.items()})
        if isinstance(other, Fraction):
            return Poly({m: _norm(c * other) for m, c in self.terms.items()})
        out: dict[Monomial, int | Fraction] = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
                m = _mono_mul(m1, m2)
                out[m] = _norm(out.get(m, 0) + c1 * c2)
        return Poly(out)

    __rmul__ = __mul__

    def __truediv__(self, k) -> "Poly":
        """Division by a number, or by a single monomial (e.g. B·N) that divides every term."""
        if isinstance(k, (int, Fraction)):
            return Poly({m: _norm(Fraction(c) / k) for m, c in self.terms.items()})
        if len(k.terms) != 1:
            raise ValueError("can only divide by a monomial")
        (km, kc), = k.terms.items()
        out = {}
        for m, c in self.terms.items():
            d = dict(m)
            for s, e in km:
                if d.get(s, 0) < e:
                    raise ValueError(f"{self} is not divisible by {k}")
                d[s] -= e
            out[tuple(sorted((s, e) for s, e in d.items() if e))] = _norm(Fraction(c) / kc)
        return Poly(out)

    def __eq__(self, other) -> bool:
        return isinstance(other, (Poly, int, Fraction)) and (self - other).is_zero()

    def __hash__(self):
        return hash(frozenset(self.terms.items()))

    # ------------------------------------------------------------ queries
    def is_zero(self) -> bool:
        return not self.terms

    @property
    def symbols(self) -> set[str]:
        return {s for m in self.terms for s, _ in m}

    def degree(self, name: str) -> int:
        return max((dict(m).get(name, 0) for m in self.terms), default=0)

    def evaluate(self, bindings: dict[str, int | Fraction]):
        """The exact value (int or Fraction) with every symbol bound; KeyError names a missing one."""
        total = 0
        for m, c in self.terms.items():
            v = c
            for s, e in m:
                if s not in bindings:
                    raise KeyError(s)
                v = v * bindings[s] ** e
            total += v
        return _norm(Fraction(total)) if isinstance(total, Fraction) else total

    def partial(self, bindings: dict[str, int]) -> "Poly":
        """Bind some symbols, keep the others."""
        out: dict[Monomial, int | Fraction] = {}
        for m, c in self.terms.items():
            keep = []
            for s, e in m:
                if s in bindings:
                    c = c * bindings[s] ** e
                else:
                    keep.append((s, e))
            key = tuple(keep)
            out[key] = _norm(out.get(key, 0) + c)
        return Poly(out)

    def rename(self, mapping: dict[str, str]) -> "Poly":
        """Rename symbols; symbols mapped to the same name merge (S and T both to N)."""
        out: dict[Monomial, int | Fraction] = {}
        for m, c in self.terms.items():
            d: dict[str, int] = {}
            for s, e in m:
                t = mapping.get(s, s)
                d[t] = d.get(t, 0) + e
            key = tuple(sorted(d.items()))
            out[key] = _norm(out.get(key, 0) + c)
        return Poly(out)

    def coefficients(self, name: str) -> dict[int, "Poly"]:
        """{power of `name`: the coefficient polynomial in the other symbols}."""
        out: dict[int, dict] = {}
        for m, c in self.terms.items():
            d = dict(m)
            p = d.pop(name, 0)
            out.setdefault(p, {})[tuple(sorted(d.items()))] = c
        return {p: Poly(t) for p, t in sorted(out.items())}

    def to_sympy(self) -> sympy.Expr:
        expr = sympy.Integer(0)
        for m, c in self.terms.items():
            term = sympy.Rational(c.numerator, c.denominator) if isinstance(c, Fraction) else sympy.Integer(c)
            for s, e in m:
                term = term * dims.symbol(s) ** e
            expr += term
        return expr

    def __repr__(self) -> str:
        return f"Poly({format_poly(self)})"


def _coerce(x) -> Poly:
    if isinstance(x, Poly):
        return x
    if isinstance(x, (int, Fraction)):
        return Poly({(): x})
    raise TypeError(f"not a polynomial: {x!r}")


@lru_cache(maxsize=4096)
def _from_sympy(expr) -> Poly:
    if expr.is_Integer:
        return Poly({(): int(expr)})
    if expr.is_Symbol:
        return Poly({((str(expr), 1),): 1})
    if expr.is_Rational:
        return Poly({(): Fraction(int(expr.p), int(expr.q))})
    gens = sorted(expr.free_symbols, key=str)
    try:
        p = sympy.Poly(expr, *gens)
    except sympy.PolynomialError:
        raise ValueError(f"dimension {expr} is not a polynomial in {', '.join(map(str, gens))}") from None
    if not p.domain.is_QQ and not p.domain.is_ZZ:
        raise ValueError(f"dimension {expr} has non-rational coefficients")
    out = {}
    for monom, coeff in p.terms():
        key = tuple((str(g), e) for g, e in zip(gens, monom) if e)
        q = sympy.Rational(coeff)
        out[key] = _norm(Fraction(int(q.p), int(q.q)))
    return Poly(out)


@lru_cache(maxsize=8192)
def numel(shape: tuple) -> Poly:
    """Number of elements of a symbolic shape (cached: graphs repeat a few shapes many times).
    The result is shared; Poly operations never modify their operands."""
    n = Poly({(): 1})
    for d in shape:
        n = n * Poly.from_dim(d)
    return n


# ------------------------------------------------------------------ printing
def _fmt_coeff(c) -> str:
    if isinstance(c, Fraction):
        return f"{c.numerator}/{c.denominator}"
    return str(c)


def _fmt_mono(m: Monomial) -> str:
    return "·".join(s + (str(e).translate(SUPERSCRIPT) if e > 1 else "") for s, e in m)


def _order(m: Monomial, lead: str | None):
    d = dict(m)
    return (sum(d.values()), d.get(lead, 0) if lead else 0, m)


def _fmt_sum(p: Poly, lead: str | None) -> str:
    parts = []
    for m in sorted(p.terms, key=lambda m: _order(m, lead)):
        c = p.terms[m]
        mono = _fmt_mono(m)
        sign = "-" if c < 0 else "+"
        a = -c if c < 0 else c
        if not mono:
            body = _fmt_coeff(a)
        elif a == 1:
            body = mono
        else:
            body = f"{_fmt_coeff(a)}·{mono}"
        parts.append((sign, body))
    if not parts:
        return "0"
    text = ("-" if parts[0][0] == "-" else "") + parts[0][1]
    for sign, body in parts[1:]:
        text += f" {sign} {body}"
    return text


def format_poly(p: Poly, factor: str | None = "B", lead: str | None = "N") -> str:
    """Readable form, e.g. B·(123532032·N + 18432·N²): a symbol common to every term is
    factored out, the rest is ordered by degree."""
    if p.is_zero():
        return "0"
    if factor and all(dict(m).get(factor, 0) >= 1 for m in p.terms):
        inner = p / Poly.symbol(factor)
        if len(inner.terms) > 1:
            return f"{factor}·({_fmt_sum(inner, lead)})"
    return _fmt_sum(p, lead)
