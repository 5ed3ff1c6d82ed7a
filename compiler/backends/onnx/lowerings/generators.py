"""ONNX lowerings of the ops without inputs (compiler/ops/generators.py): positions and the
sinusoidal table (a constant when n is fixed, computed from the run-time length otherwise)."""

from __future__ import annotations

import numpy as np

from tessera.compiler.backends.onnx.lowerings.common import np_float
from tessera.compiler.ir import dims
from tessera.compiler.reference.numerics import sinusoidal_div, sinusoidal_table


def _arange(L):
    b = L.b
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    L.emit("Range", [zero, b.dim_scalar(L.a["n"]), one])


def _sinusoidal(L):
    b, t_out = L.b, L.t_out
    d = L.a["d"]
    n = L.a["n"]
    if dims.is_static(dims.dim(n)):
        L.emit("Identity", [b.const(sinusoidal_table(int(n), d).astype(np_float(t_out.dtype)), "sinusoidal")])
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


LOWERINGS = {"arange": _arange, "sinusoidal": _sinusoidal}
