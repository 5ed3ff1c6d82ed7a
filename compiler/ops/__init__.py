"""Primitive ops: each op's definition (type rule, reference semantics, cost, backward memory,
traits), looked up by name by every consumer through ``registry.get``. Their ONNX lowerings are
the backend's table (backends/onnx/lowerings/).

Importing this package registers every op family; ``infer``, ``check_graph`` and ``ShapeError``
are the type-checking entry points the frontend and the passes use."""

from tessera.compiler.ops.registry import (ShapeError, UnknownOp, all_ops, check_graph, get, has_trait,  # noqa: F401
                                           infer, is_registered, with_trait)
from tessera.compiler.ops import attention, elementwise, experts, generators, layout, linalg, logic, norm, recurrence  # noqa: F401,E402

__all__ = ["ShapeError", "UnknownOp", "all_ops", "check_graph", "get", "has_trait", "infer", "is_registered", "with_trait"]
