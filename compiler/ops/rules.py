"""Compatibility entry point: the type rules now live with each op's definition
(ops/registry.py and the family modules); ``from tessera.compiler.ops import rules as ops``
keeps working for ``ops.infer``, ``ops.check_graph`` and ``ops.ShapeError``."""

from tessera.compiler.ops import ShapeError, check_graph, infer  # noqa: F401

__all__ = ["ShapeError", "check_graph", "infer"]
