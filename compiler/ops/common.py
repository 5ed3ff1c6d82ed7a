"""Helpers shared by the op families: argument checks for type rules, what products keep
for backward, and small numpy pieces of reference semantics."""

from __future__ import annotations

from tessera.compiler.ir.graph import FLOAT_DTYPES, TensorType
from tessera.compiler.ops.registry import ShapeError


# ------------------------------------------------------------------ type rules
def axis(ax: int, rank: int) -> int:
    if not -rank <= ax < rank:
        raise ShapeError(f"axis {ax} is out of range for a tensor of rank {rank}")
    return ax % rank


def need_float(t: TensorType, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{what} needs a floating-point tensor, got {t}")


def same_dtype(a: TensorType, b: TensorType, what: str) -> None:
    if a.dtype != b.dtype:
        raise ShapeError(f"{what}: dtypes differ ({a} and {b})")


# ------------------------------------------------------------------ backward memory of products
# d(a·b)/da needs b, so a is kept when b needs a gradient (a parameter or an activation),
# and vice versa.
def saved_weight_product(node, needs_grad) -> list:
    """x·W (linear, convolutions): only the input is kept, when the weight needs a gradient."""
    return [node.inputs[0]] if needs_grad(node.inputs[1]) else []


def saved_product(node, needs_grad) -> list:
    """a·b of two activations (matmul, mul): each operand is kept if the other needs a gradient."""
    a, b = node.inputs[0], node.inputs[1]
    kept = []
    if needs_grad(b):
        kept.append(a)
    if needs_grad(a):
        kept.append(b)
    return kept


def saved_quotient(node, needs_grad) -> list:
    """a / b: like a product, and the divisor is kept too when b needs a gradient."""
    a, b = node.inputs[0], node.inputs[1]
    kept = []
    if needs_grad(b):
        kept.append(a)
    if needs_grad(a) or needs_grad(b):
        kept.append(b)
    return kept

