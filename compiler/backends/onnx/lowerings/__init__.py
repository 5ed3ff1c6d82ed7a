"""The ONNX lowering of every primitive op: ``LOWERINGS``, op name -> ``lower(L)``.

The op registry (compiler/ops/) says what an op means (type rule, numpy reference, cost, what it
keeps for backward); how it becomes ONNX nodes is the backend's business and lives here, one
module per op family, so ops/ never imports a backend. ``L`` is builder.Lowering: the builder
``L.b``, the node, its inputs ``L.x``, attrs ``L.a``, input/output types and
``L.emit(op_type, inputs, **attrs)`` that writes the result. tests/spec/test_op_registry.py checks that
this table covers every registered op and names none that is not.
"""

from __future__ import annotations

from typing import Callable

from tessera.compiler.backends.onnx import recurrence
from tessera.compiler.backends.onnx.lowerings import (attention, elementwise, experts, generators, layout, linalg,
                                                      logic, norm)


def _table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for family in (elementwise, logic, layout, linalg, norm, generators, attention, experts):
        twice = set(table) & set(family.LOWERINGS)
        if twice:
            raise ValueError(f"ops lowered twice: {sorted(twice)} (again in {family.__name__})")
        table.update(family.LOWERINGS)
    table["scan"] = recurrence.lower_scan
    return table


LOWERINGS: dict[str, Callable] = _table()


def lowering(op_name: str) -> Callable:
    """The lowering of an op; a KeyError names an op the ONNX backend cannot write."""
    try:
        return LOWERINGS[op_name]
    except KeyError:
        raise KeyError(f"op '{op_name}' has no ONNX lowering (backends/onnx/lowerings/)") from None
