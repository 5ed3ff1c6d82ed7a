"""Pointwise ops: binary arithmetic, unary math and activations, cast; and softmax and the
mean/sum reductions, which work along axes but have no weights and no layout change."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import DTYPES, FLOAT_DTYPES, TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import Cost, ShapeError, custom, free, op, per_element
from tessera.compiler.reference.numerics import erf, softmax

# ------------------------------------------------------------------ binary arithmetic
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "pow": np.power,
           "minimum": np.minimum, "maximum": np.maximum}


@op(*_BINARY,
    reference={n: (lambda f: lambda x, a, ev: f(x[0], x[1]))(f) for n, f in _BINARY.items()},
    cost=per_element("elementwise", 1),
    saved={"add": (), "sub": (), "mul": common.saved_product, "pow": (0,),
           "minimum": (0, 1), "maximum": (0, 1)},   # which operand won decides where the gradient goes
    traits=("elementwise",))
def _binary(t, a):
    """Elementwise arithmetic (and minimum/maximum) with numpy broadcasting; both operands share a
    numeric dtype (``div`` floats only: see ``_div``)."""
    x, y = t
    common.same_dtype(x, y, "elementwise op")
    if x.dtype == "bool":
        raise ShapeError(f"arithmetic on bool tensors ({x}): cast them first, e.g. cast(m, \"f32\")")
    out = dims.broadcast(x.shape, y.shape)
    if out is None:
        raise ShapeError(f"shapes {dims.fmt_shape(x.shape)} and {dims.fmt_shape(y.shape)} do not broadcast")
    return [TensorType(x.dtype, out)]


@op("div", reference=lambda x, a, ev: np.divide(x[0], x[1]),
    cost=per_element("elementwise", 1), saved=common.saved_quotient, traits=("elementwise",))
def _div(t, a):
    """a / b on floating-point tensors. Integer tensors are refused: ONNX's Div truncates them toward
    zero while numpy's gives floats, so the language asks for ``//`` (floor division) or a cast."""
    if t[0].dtype not in FLOAT_DTYPES and t[0].dtype == t[1].dtype:
        raise ShapeError(f"'/' on {t[0].dtype} tensors: write // for floor division, or cast to f32 first")
    return _binary(t, a)


def _floordiv_ref(x, a, ev):
    if np.issubdtype(x[0].dtype, np.integer):
        return np.floor_divide(x[0], x[1])
    return np.floor(x[0] / x[1])   # ONNX's Floor(Div), not numpy's fmod-based floor_divide


@op("floordiv", reference=_floordiv_ref,
    cost=per_element("elementwise", 2), saved=(), traits=("elementwise",))   # divide, floor
def _floordiv(t, a):
    """a // b: floor(a / b) for floats, division rounding toward minus infinity for integers (Python's //)."""
    return _binary(t, a)


# ------------------------------------------------------------------ unary math and activations
def _gelu(x, a, ev):
    v = x[0]
    if a["approx"] == "tanh":  # GPT-2's approximation
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    return 0.5 * v * (1 + erf(v / math.sqrt(2)))


def _gelu_flops(c):
    # tanh form: x³ (2), ·0.044715, +x, ·sqrt(2/π), tanh, +1, ·x, ·0.5 = 9; erf form: /√2, erf, +1, ·x, ·0.5 = 5
    return {"activation": c.out() * (9 if c.attrs.get("approx") == "tanh" else 5)}


@dataclass(frozen=True)
class Unary:
    """One unary op's row: its numpy reference, cost, what backward keeps, and whether integer
    tensors are allowed (the others need floats: ONNX defines them for floats only)."""

    name: str
    reference: Callable
    cost: Cost
    saved: tuple
    ints: bool = False


# A transcendental (exp, tanh, erf, sqrt) counts as one FLOP; docs/report.md lists the reasoning.
# Activations whose derivative needs the input keep it (0,); those whose derivative is a function of
# the output (sigmoid, tanh, exp, sqrt, relu) keep the output; steps (floor, ceil, round) have a zero
# gradient and keep nothing.
_E1 = per_element("elementwise", 1)
UNARY = [
    Unary("neg", lambda x, a, ev: -x[0], _E1, (), ints=True),
    Unary("sqrt", lambda x, a, ev: np.sqrt(x[0]), _E1, ("out",)),
    Unary("exp", lambda x, a, ev: np.exp(x[0]), _E1, ("out",)),
    Unary("sin", lambda x, a, ev: np.sin(x[0]), _E1, (0,)),
    Unary("cos", lambda x, a, ev: np.cos(x[0]), _E1, (0,)),
    Unary("relu", lambda x, a, ev: np.maximum(x[0], 0), per_element("activation", 1), ("out",), ints=True),
    Unary("gelu", _gelu, custom(_gelu_flops), (0,)),
    Unary("silu", lambda x, a, ev: x[0] / (1 + np.exp(-x[0])),
          per_element("activation", 4), (0,)),           # sigmoid (exp, add, divide) and a multiply
    Unary("sigmoid", lambda x, a, ev: 1 / (1 + np.exp(-x[0])), per_element("activation", 3), ("out",)),
    Unary("tanh", lambda x, a, ev: np.tanh(x[0]), per_element("activation", 1), ("out",)),
    Unary("softplus", lambda x, a, ev: np.logaddexp(np.zeros((), x[0].dtype), x[0]).astype(x[0].dtype),
          per_element("activation", 3), (0,)),           # exp, add, log; its derivative is sigmoid(x)
    Unary("identity", lambda x, a, ev: x[0], free(), (), ints=True),
    Unary("log", lambda x, a, ev: np.log(x[0]), _E1, (0,)),
    Unary("abs", lambda x, a, ev: np.abs(x[0]), _E1, (0,), ints=True),
    Unary("sign", lambda x, a, ev: np.sign(x[0]), _E1, (), ints=True),   # -1, 0 or 1 (DeBERTa's relative buckets)
    Unary("floor", lambda x, a, ev: np.floor(x[0]), _E1, ()),
    Unary("ceil", lambda x, a, ev: np.ceil(x[0]), _E1, ()),
    Unary("round", lambda x, a, ev: np.round(x[0]), _E1, ()),   # halves to even, as ONNX Round and torch.round
]


def _unary_rule(row: Unary):
    def rule(t, a):
        x = t[0]
        if row.name == "identity":  # outputs and pass-throughs of every dtype
            return [x]
        if x.dtype == "bool" or (x.dtype not in FLOAT_DTYPES and not row.ints):
            raise ShapeError(f"{row.name} needs a {'number' if row.ints else 'floating-point'} tensor, "
                             f"got {x} (cast it first)")
        return [x]
    rule.__doc__ = ("Unary math and activations (gelu: approx=\"none\" is erf, \"tanh\" GPT-2's approximation); "
                    "neg, abs, sign, relu and identity also take integer tensors.")
    return rule


for _row in UNARY:
    op(_row.name, reference=_row.reference, cost=_row.cost, saved=_row.saved,
       traits=("elementwise", "alias") if _row.name == "identity" else ("elementwise",))(_unary_rule(_row))


@op("cast",
    reference=lambda x, a, ev: x[0].astype(DTYPES[a["dtype"]]),
    cost=free(), saved=(), traits=("elementwise",))
def _cast(t, a):
    """Convert the element type to attrs["dtype"]."""
    return [TensorType(a["dtype"], t[0].shape)]


# ------------------------------------------------------------------ softmax and reductions
@op("softmax",
    reference=lambda x, a, ev: softmax(x[0], a["axis"]),
    cost=per_element("softmax", 5),                # max, subtract, exp, sum, divide
    saved=("out",))
def _softmax(t, a):
    """Softmax over attrs["axis"]."""
    common.need_float(t[0], "softmax")
    common.axis(a["axis"], t[0].rank)
    return [t[0]]


def _reduce_flops(c):
    return {"elementwise": c.numel(c.type(0).shape)}


@op("mean", "sum",
    reference={"mean": lambda x, a, ev: np.mean(x[0], axis=tuple(a["axes"]), keepdims=a["keepdims"]),
               "sum": lambda x, a, ev: np.sum(x[0], axis=tuple(a["axes"]), keepdims=a["keepdims"])},
    cost=custom(_reduce_flops), saved=())
def _reduce(t, a):
    """Mean or sum over attrs["axes"], keeping them as size 1 with attrs["keepdims"]."""
    x = t[0]
    axes = [common.axis(ax, x.rank) for ax in a["axes"]]
    if a.get("keepdims"):
        shape = tuple(sympy.Integer(1) if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [TensorType(x.dtype, shape)]


@op("cumsum",
    reference=lambda x, a, ev: np.cumsum(x[0], axis=a["axis"]),
    cost=per_element("elementwise", 1), saved=())   # one add per element; the gradient is a reversed cumsum
def _cumsum(t, a):
    """Running sum along attrs["axis"] (inclusive: element i sums 0..i), for numbers, not bool."""
    x = t[0]
    if x.dtype == "bool":
        raise ShapeError(f"cumsum of a bool tensor ({x}): cast it to i64 or f32 first")
    common.axis(a["axis"], x.rank)
    return [x]
