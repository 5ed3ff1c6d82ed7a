"""ONNX lowerings of comparisons, logic on bool tensors and ``where`` (compiler/ops/logic.py): one
ONNX op each, ``not_equal`` as Not(Equal)."""

from __future__ import annotations


def _one(onnx_op: str):
    return lambda L: L.emit(onnx_op, L.x)


def _not_equal(L):
    L.emit("Not", [L.b.node("Equal", L.x)[0]])


LOWERINGS = {
    **{n: _one(t) for n, t in {"less": "Less", "less_equal": "LessOrEqual", "greater": "Greater",
                               "greater_equal": "GreaterOrEqual", "equal": "Equal",
                               "logical_and": "And", "logical_or": "Or", "logical_not": "Not",
                               "where": "Where"}.items()},
    "not_equal": _not_equal,
}
