"""A position table read at an affine function of the position: ``embedding(a * arange(T) + c, ...)``.

Why in ``ir``: two layers need it. The KV cache pass (passes/kv_cache.py, through
patterns/positions.py) replaces the index computation by the same function of ``position_ids``;
and the input checks (ir/signature.py ``input_limits``), which sit below the patterns, bound ``T``
by the positions such a table serves, so BART's ``arange(T) + 2`` over 1026 rows refuses a source
of 1025 tokens with a clear error instead of an onnxruntime failure inside a Gather. The function
is found from a chain of ``add``/``sub``/``mul`` by integer scalar constants between the
``arange`` and the table's ``embedding``; any other use says why it is something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.compiler.ir.graph import Graph, Node

AFFINE_OPS = ("add", "sub", "mul")


@dataclass(frozen=True)
class AffineRead:
    """A position table read at ``a * position + c``; ``chain``: the nodes between the ``arange``
    and the ``embedding`` that computed the index (to be dropped once it reads the positions)."""

    embedding: Node
    a: int
    c: int
    chain: tuple[str, ...]


class NotAffine(Exception):
    """A use of the positions that is not a position table read at an affine index (the reason)."""


def _scalar_int(g: Graph, value: str) -> int | None:
    """An integer constant holding one value (a literal in the spec), else None."""
    arr = g.consts.get(value)
    if arr is None or np.size(arr) != 1 or np.asarray(arr).dtype.kind not in "iu":
        return None
    return int(np.asarray(arr).reshape(()))


def _step(g: Graph, node: Node, value: str, a: int, c: int) -> tuple[int, int]:
    """(a, c) after ``node`` applies its op to ``value`` (= a * p + c) and a scalar integer constant."""
    other = [i for i in node.inputs if i != value]
    k = _scalar_int(g, other[0]) if len(node.inputs) == 2 and len(other) == 1 else None
    if k is None:
        raise NotAffine(f"it is combined by {node.op} at {node.scope or '<model>'} with something other than an "
                        f"integer constant")
    if node.op == "add":
        return a, c + k
    if node.op == "mul":
        return a * k, c * k
    if node.inputs[0] == value:  # sub: (a p + c) - k
        return a, c - k
    return -a, k - c  # k - (a p + c)


def affine_reads(g: Graph, arange: Node) -> list[AffineRead]:
    """Every position table ``arange``'s output reaches through add/sub/mul by integer constants.
    Raises NotAffine (with the reason) when any use is something else: an op other than those, a
    non-constant operand, or a value of the chain read outside it."""
    reads: list[AffineRead] = []

    def walk(value: str, a: int, c: int, chain: tuple[str, ...]) -> None:
        users = g.consumers(value)
        if not users or value in g.outputs:
            raise NotAffine("it is a model output" if value in g.outputs else "nothing reads it")
        for u in users:
            if u.op == "embedding" and u.inputs[0] == value:
                reads.append(AffineRead(u, a, c, chain))
            elif u.op in AFFINE_OPS:
                walk(u.outputs[0], *_step(g, u, value, a, c), chain + (u.name,))
            else:
                raise NotAffine(f"it is read by {u.op} at {u.scope or '<model>'} (not a position table's "
                                f"embedding, nor add/sub/mul by an integer constant)")

    walk(arange.outputs[0], 1, 0, ())
    return reads


def positions_reached(rows: int, a: int, c: int) -> int:
    """How many positions 0, 1, ... a table of ``rows`` rows serves at index ``a * p + c`` (a >= 1, c >= 0)."""
    return max((rows - 1 - c) // a + 1, 0)
