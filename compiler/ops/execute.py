"""Run a graph's nodes through their ``reference`` facets: the core of the numpy interpreter
(ops/interpret.py, which binds a model's inputs and weights around it). It lives with the
ops because one op, ``scan``, runs its step body with it once per step; the reference semantics
of the ops never need anything above ops/."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.ops.registry import get


def execute(graph: Graph, env: dict[str, np.ndarray], ev) -> list[np.ndarray]:
    """Run the nodes of a graph whose inputs (and parameters) ``env`` holds; the outputs, in order.
    Also runs a scan's step body (compiler/ops/recurrence.py) once per step, with the outer ``ev``."""
    env = dict(env)
    env.update(graph.consts)
    for node in graph.nodes.values():
        y = get(node.op).reference([env[i] for i in node.inputs], node.attrs, ev)
        ys = list(y) if len(node.outputs) > 1 else [y]  # a multi-output op (scan) returns a list
        for name, y in zip(node.outputs, ys):
            out_dtype = DTYPES.get(graph.type_of(name).dtype)
            y = np.asarray(y)
            if out_dtype is not None and y.dtype != out_dtype:
                y = y.astype(out_dtype)
            env[name] = y
    return [env[name] for name in graph.outputs]
