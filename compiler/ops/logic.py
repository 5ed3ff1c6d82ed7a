"""Comparisons, logic and selection: the ops that make and use bool tensors.

Why a family of their own: their outputs are masks (``where(positions < n, a, b)``,
relative-position buckets, padding-derived positions) rather than activations, so their
type rules are about dtypes (what compares with what, what a condition must be) more
than shapes. Shapes broadcast as numpy's do. Each is one ONNX op (``not_equal`` is
Not(Equal)); none does arithmetic worth more than one FLOP per element, and none keeps
anything for backward (comparisons have no gradient; ``where`` keeps its condition)."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, op, per_element


def _broadcast(*ts: TensorType) -> tuple:
    out = ts[0].shape
    for t in ts[1:]:
        b = dims.broadcast(out, t.shape)
        if b is None:
            raise ShapeError("shapes " + " and ".join(dims.fmt_shape(x.shape) for x in ts) + " do not broadcast")
        out = b
    return out


# ------------------------------------------------------------------ comparisons
_COMPARE = {"less": (np.less, "Less"), "less_equal": (np.less_equal, "LessOrEqual"),
            "greater": (np.greater, "Greater"), "greater_equal": (np.greater_equal, "GreaterOrEqual"),
            "equal": (np.equal, "Equal"), "not_equal": (np.not_equal, None)}


@op(*_COMPARE,
    reference={n: (lambda f: lambda x, a, ev: f(x[0], x[1]))(f) for n, (f, _) in _COMPARE.items()},
    cost=per_element("elementwise", 1), saved=(), traits=("elementwise",))
def _compare(t, a):
    """Elementwise comparison of two tensors of one dtype (numbers, or bool for equal/not_equal): a bool tensor."""
    x, y = t
    common.same_dtype(x, y, "comparison")
    return [TensorType("bool", _broadcast(x, y))]


# ------------------------------------------------------------------ logic on bool tensors
_LOGIC = {"logical_and": (np.logical_and, "And"), "logical_or": (np.logical_or, "Or")}


@op(*_LOGIC,
    reference={n: (lambda f: lambda x, a, ev: f(x[0], x[1]))(f) for n, (f, _) in _LOGIC.items()},
    cost=per_element("elementwise", 1), saved=(), traits=("elementwise",))
def _logic(t, a):
    """Elementwise and / or of two bool tensors."""
    for x in t:
        if x.dtype != "bool":
            raise ShapeError(f"'and' and 'or' on tensors need bool tensors, got {x} (compare first, e.g. x > 0)")
    return [TensorType("bool", _broadcast(*t))]


@op("logical_not", reference=lambda x, a, ev: np.logical_not(x[0]),
    cost=per_element("elementwise", 1), saved=(), traits=("elementwise",))
def _logical_not(t, a):
    """Elementwise not of a bool tensor."""
    if t[0].dtype != "bool":
        raise ShapeError(f"'not' on a tensor needs a bool tensor, got {t[0]} (compare first, e.g. x == 0)")
    return [t[0]]


# ------------------------------------------------------------------ selection
@op("where", reference=lambda x, a, ev: np.where(x[0], x[1], x[2]),
    cost=per_element("elementwise", 1), saved=(0,), traits=("elementwise",))
def _where(t, a):
    """where(cond, a, b): a where the bool cond holds, else b; a and b share a dtype; all three broadcast."""
    c, x, y = t
    if c.dtype != "bool":
        raise ShapeError(f"where's condition must be a bool tensor, got {c} (compare first, e.g. x > 0)")
    common.same_dtype(x, y, "where")
    return [TensorType(x.dtype, _broadcast(c, x, y))]
