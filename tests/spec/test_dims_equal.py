"""compiler/ir/dims.equal's shortcut (two atoms differ unless ``==``) against sympy itself: for every
pair of a set of dimensions, ``equal`` must agree with ``simplify(a - b) == 0``."""

from __future__ import annotations

import itertools

import sympy

from tessera.compiler.ir import dims

B, T, D = dims.symbol("B"), dims.symbol("T"), dims.symbol("D")
SAME_NAME_OTHER_KIND = sympy.Symbol("B")  # no assumptions: a different symbol from B for sympy
VALUES = [sympy.Integer(0), sympy.Integer(1), sympy.Integer(64), sympy.Rational(1, 2), sympy.Float(0.5), B, T, D,
          SAME_NAME_OTHER_KIND, B * T, T * B, B + T, T + B, 2 * T, T + T, (B + 1) * T - T, B * T + T,
          (T + 1) * (T - 1), T ** 2 - 1, 64 * D / 64, D * 64 // 64, 1 + 0 * T]


def test_equal_agrees_with_sympy_on_every_pair():
    for a, b in itertools.product(VALUES, repeat=2):
        want = sympy.simplify(a - b) == 0
        assert dims.equal(a, b) == want, (a, b)


def test_the_shortcut_cases_by_hand():
    assert not dims.equal(sympy.Integer(3), sympy.Integer(4))
    assert not dims.equal(B, T)
    assert not dims.equal(B, SAME_NAME_OTHER_KIND)  # same name, different assumptions
    assert dims.equal(sympy.Integer(3), sympy.Integer(3))
    assert dims.equal(2 * T, T + T)
    assert dims.broadcast((B, T, sympy.Integer(1)), (T, D)) == (B, T, D)
    assert dims.broadcast((B, T), (D,)) is None
