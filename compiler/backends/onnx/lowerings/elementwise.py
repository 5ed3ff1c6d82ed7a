"""ONNX lowerings of the pointwise ops (compiler/ops/elementwise.py): arithmetic, unary math and
activations, cast, softmax and the reductions. Most are one ONNX op; floor division and silu are
written out."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir.graph import DTYPES, FLOAT_DTYPES


# Unary ops onnxruntime 1.31's CUDA provider has no bfloat16 kernel for (tests/cuda_stub: a bf16 T5 placed its
# relative buckets' Log on the CPU): in a bf16 graph they run in fp32 between two casts (on the device)
NO_BF16_KERNEL = {"Log", "Sin", "Cos", "Softplus", "Round", "Floor", "Ceil"}


def _one(onnx_op: str):
    """The lowering of an op that is exactly one ONNX op on the same inputs."""
    def lower(L):
        if onnx_op in NO_BF16_KERNEL and L.t_in[0].dtype == "bf16":
            b = L.b
            wide = b.node(onnx_op, [b.node("Cast", [x], to=b.onnx_type("f32"))[0] for x in L.x])[0]
            return L.emit("Cast", [wide], to=b.onnx_type("bf16"))
        return L.emit(onnx_op, L.x)
    return lower


def _floordiv(L):
    b, (p, q) = L.b, L.x
    if L.t_in[0].dtype in FLOAT_DTYPES:
        return L.emit("Floor", [b.node("Div", [p, q])[0]])
    # ONNX's integer Div truncates toward zero; floor division is one less when the remainder is
    # non-zero and its sign differs from the divisor's
    t = b.node("Div", [p, q])[0]
    r = b.node("Sub", [p, b.node("Mul", [t, q])[0]])[0]
    zero = b.const(np.array(0, dtype=DTYPES[L.t_in[0].dtype]), "zero")
    inexact = b.node("Not", [b.node("Equal", [r, zero])[0]])[0]
    signs = b.node("Xor", [b.node("Less", [r, zero])[0], b.node("Less", [q, zero])[0]])[0]
    fix = b.node("Cast", [b.node("And", [inexact, signs])[0]], to=b.onnx_type(L.t_in[0].dtype))[0]
    L.emit("Sub", [t, fix])


def _silu(L):
    s = L.b.node("Sigmoid", L.x)[0]
    L.emit("Mul", [L.x[0], s])


def _reduce(onnx_op: str):
    return lambda L: L.emit(onnx_op, [L.x[0], L.b.i64(L.a["axes"])], keepdims=int(L.a["keepdims"]))


LOWERINGS = {
    **{n: _one(t) for n, t in {"add": "Add", "sub": "Sub", "mul": "Mul", "pow": "Pow", "minimum": "Min",
                               "maximum": "Max", "div": "Div"}.items()},
    "floordiv": _floordiv,
    **{n: _one(t) for n, t in {"neg": "Neg", "sqrt": "Sqrt", "exp": "Exp", "relu": "Relu", "sigmoid": "Sigmoid",
                               "tanh": "Tanh", "identity": "Identity", "sin": "Sin", "cos": "Cos",
                               "log": "Log", "abs": "Abs", "sign": "Sign", "floor": "Floor", "ceil": "Ceil",
                               "round": "Round", "softplus": "Softplus"}.items()},
    "gelu": lambda L: L.emit("Gelu", L.x, approximate=L.a["approx"]),
    "silu": _silu,
    "cast": lambda L: L.emit("Cast", L.x, to=L.b.onnx_type(L.a["dtype"])),
    "softmax": lambda L: L.emit("Softmax", L.x, axis=L.a["axis"]),
    "mean": _reduce("ReduceMean"),
    "sum": _reduce("ReduceSum"),
    "cumsum": lambda L: L.emit("CumSum", [L.x[0], L.b.const(np.array(L.a["axis"], dtype=np.int64), "axis")]),
}
