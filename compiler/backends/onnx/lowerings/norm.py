"""ONNX lowerings of the normalisations (compiler/ops/norm.py)."""

from __future__ import annotations

import numpy as np

from tessera.compiler.backends.onnx.lowerings.common import np_float


def _rmsnorm(L):
    """x / sqrt(mean(x^2) + eps) * w in standard ops, written as Pow(x, 2) -> ReduceMean -> Add -> Sqrt
    -> Div -> Mul: the pattern onnxruntime fuses into one SimplifiedLayerNormalization kernel (with
    Mul(x, x) it does not, and the six nodes cost more than the norm's arithmetic when decoding)."""
    b, x = L.b, L.x
    two = b.const(np.array(2.0, dtype=np_float(L.t_in[0].dtype)), "two")
    sq = b.node("Pow", [x[0], two])[0]
    ms = b.node("ReduceMean", [sq, b.i64([-1])], keepdims=1)[0]
    eps = b.const(np.array(L.a["eps"], dtype=np_float(L.t_in[0].dtype)), "eps")
    rms = b.node("Sqrt", [b.node("Add", [ms, eps])[0]])[0]
    normed = b.node("Div", [x[0], rms])[0]
    L.emit("Mul", [normed, x[1]])


LOWERINGS = {
    "layernorm": lambda L: L.emit("LayerNormalization", L.x, axis=-1, epsilon=L.a["eps"]),
    "rmsnorm": _rmsnorm,
}
