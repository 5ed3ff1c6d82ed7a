"""Pointwise ops: binary arithmetic, unary math and activations, cast; and softmax and the
mean/sum reductions, which work along axes but have no weights and no layout change."""

from __future__ import annotations

import math

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import DTYPES, TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, custom, free, op, per_element
from tessera.compiler.reference.numerics import erf, softmax

# ------------------------------------------------------------------ binary arithmetic
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power}


@op("add", "sub", "mul", "div", "pow",
    reference={n: (lambda f: lambda x, a, ev: f(x[0], x[1]))(f) for n, f in _BINARY.items()},
    lower={n: (lambda t: lambda L: L.emit(t, L.x))(n.capitalize()) for n in _BINARY},
    cost=per_element("elementwise", 1),
    saved={"add": (), "sub": (), "mul": common.saved_product, "div": common.saved_quotient, "pow": (0,)},
    traits=("elementwise",))
def _binary(t, a):
    """Elementwise arithmetic with numpy broadcasting; both operands have the same dtype."""
    x, y = t
    common.same_dtype(x, y, "elementwise op")
    out = dims.broadcast(x.shape, y.shape)
    if out is None:
        raise ShapeError(f"shapes {dims.fmt_shape(x.shape)} and {dims.fmt_shape(y.shape)} do not broadcast")
    return [TensorType(x.dtype, out)]


# ------------------------------------------------------------------ unary math and activations
def _silu(L):
    s = L.b.node("Sigmoid", L.x)[0]
    L.emit("Mul", [L.x[0], s])


def _gelu(x, a, ev):
    v = x[0]
    if a["approx"] == "tanh":  # GPT-2's approximation
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    return 0.5 * v * (1 + erf(v / math.sqrt(2)))


def _gelu_flops(c):
    # tanh form: x³ (2), ·0.044715, +x, ·sqrt(2/π), tanh, +1, ·x, ·0.5 = 9; erf form: /√2, erf, +1, ·x, ·0.5 = 5
    return {"activation": c.out() * (9 if c.attrs.get("approx") == "tanh" else 5)}


_UNARY_REF = {
    "neg": lambda x, a, ev: -x[0],
    "sqrt": lambda x, a, ev: np.sqrt(x[0]),
    "exp": lambda x, a, ev: np.exp(x[0]),
    "sin": lambda x, a, ev: np.sin(x[0]),
    "cos": lambda x, a, ev: np.cos(x[0]),
    "relu": lambda x, a, ev: np.maximum(x[0], 0),
    "gelu": _gelu,
    "silu": lambda x, a, ev: x[0] / (1 + np.exp(-x[0])),
    "sigmoid": lambda x, a, ev: 1 / (1 + np.exp(-x[0])),
    "tanh": lambda x, a, ev: np.tanh(x[0]),
    "identity": lambda x, a, ev: x[0],
}
_ONNX_UNARY = {"neg": "Neg", "sqrt": "Sqrt", "exp": "Exp", "relu": "Relu", "sigmoid": "Sigmoid",
               "tanh": "Tanh", "identity": "Identity", "sin": "Sin", "cos": "Cos"}
_UNARY_LOWER = {n: (lambda t: lambda L: L.emit(t, L.x))(t) for n, t in _ONNX_UNARY.items()}
_UNARY_LOWER["gelu"] = lambda L: L.emit("Gelu", L.x, approximate=L.a["approx"])
_UNARY_LOWER["silu"] = _silu

# A transcendental (exp, tanh, erf, sqrt) counts as one FLOP; docs/report.md lists the reasoning.
_UNARY_COST = {
    "neg": per_element("elementwise", 1), "sqrt": per_element("elementwise", 1),
    "exp": per_element("elementwise", 1), "sin": per_element("elementwise", 1),
    "cos": per_element("elementwise", 1),
    "relu": per_element("activation", 1), "tanh": per_element("activation", 1),
    "sigmoid": per_element("activation", 3),
    "silu": per_element("activation", 4),          # sigmoid (exp, add, divide) and a multiply
    "gelu": custom(_gelu_flops),
    "identity": free(),
}
# Activations whose derivative needs the input keep it; those whose derivative is a function of
# the output (sigmoid, tanh, exp, sqrt, relu) keep the output.
_UNARY_SAVED = {"neg": (), "identity": (), "gelu": (0,), "silu": (0,), "sin": (0,), "cos": (0,),
                "sigmoid": ("out",), "tanh": ("out",), "exp": ("out",), "sqrt": ("out",), "relu": ("out",)}


@op(*_UNARY_REF, reference=_UNARY_REF, lower=_UNARY_LOWER, cost=_UNARY_COST, saved=_UNARY_SAVED,
    traits={n: ("elementwise", "alias") if n == "identity" else ("elementwise",) for n in _UNARY_REF})
def _unary(t, a):
    """Unary math and activations (gelu: approx="none" is erf, "tanh" GPT-2's approximation)."""
    return [t[0]]


@op("cast",
    reference=lambda x, a, ev: x[0].astype(DTYPES[a["dtype"]]),
    lower=lambda L: L.emit("Cast", L.x, to=L.b.onnx_type(L.a["dtype"])),
    cost=free(), saved=(), traits=("elementwise",))
def _cast(t, a):
    """Convert the element type to attrs["dtype"]."""
    return [TensorType(a["dtype"], t[0].shape)]


# ------------------------------------------------------------------ softmax and reductions
@op("softmax",
    reference=lambda x, a, ev: softmax(x[0], a["axis"]),
    lower=lambda L: L.emit("Softmax", L.x, axis=L.a["axis"]),
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
    lower={n: (lambda t: lambda L: L.emit(t, [L.x[0], L.b.i64(L.a["axes"])], keepdims=int(L.a["keepdims"])))(t)
           for n, t in (("mean", "ReduceMean"), ("sum", "ReduceSum"))},
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
