"""Ops without inputs that make a tensor from their attributes: positions and the fixed
sinusoidal position table (n may be the symbolic sequence length)."""

from __future__ import annotations

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import free, op, per_element
from tessera.compiler.reference.numerics import sinusoidal_div, sinusoidal_table


def _arange_lower(L):
    b = L.b
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    L.emit("Range", [zero, b.dim_scalar(L.a["n"]), one])


@op("arange", reference=lambda x, a, ev: np.arange(ev(a["n"]), dtype=np.int64), lower=_arange_lower,
    cost=free(), saved=())
def _arange(t, a):
    """Positions 0..n-1 (i64)."""
    return [TensorType("i64", (dims.dim(a["n"]),))]


def _sinusoidal_lower(L):
    b, t_out = L.b, L.t_out
    d = L.a["d"]
    n = L.a["n"]
    if dims.is_static(dims.dim(n)):
        L.emit("Identity", [b.const(sinusoidal_table(int(n), d).astype(common.np_float(t_out.dtype)), "sinusoidal")])
        return
    div = sinusoidal_div(d).astype(np.float32)
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    pos = b.node("Cast", [b.node("Range", [zero, b.dim_scalar(n), one])[0]], to=b.onnx_type("f32"))[0]
    pos = b.node("Unsqueeze", [pos, b.i64([1])])[0]
    ang = b.node("Div", [pos, b.const(div[None, :], "div_term")])[0]
    s = b.node("Unsqueeze", [b.node("Sin", [ang])[0], b.i64([2])])[0]
    c = b.node("Unsqueeze", [b.node("Cos", [ang])[0], b.i64([2])])[0]
    both = b.node("Concat", [s, c], axis=2)[0]
    if t_out.dtype != "f32":
        both = b.node("Cast", [both], to=b.onnx_type(t_out.dtype))[0]
    L.emit("Reshape", [both, b.i64([-1, d])])


@op("sinusoidal", reference=lambda x, a, ev: sinusoidal_table(ev(a["n"]), a["d"]), lower=_sinusoidal_lower,
    cost=per_element("position", 2),   # divide, sin or cos
    saved=())
def _sinusoidal(t, a):
    """The fixed sinusoidal position table [n, d] (sin and cos interleaved)."""
    return [TensorType(a.get("dtype", "f32"), (dims.dim(a["n"]), sympy.Integer(a["d"])))]
