"""A numpy reference interpreter for the IR.

It executes the graph node by node with plain numpy, written for clarity
rather than speed. It is the ground truth the ONNX export is tested against,
so each op's reference semantics (its ``reference`` facet in ``tessera.compiler.ops``)
follows its textbook definition (and, where models differ, the convention of the
reference implementation named in the comment there).
"""

from __future__ import annotations

import numpy as np

from tessera.compiler import ops
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.ir.signature import bind_inputs
# Helpers of the reference semantics, re-exported under the names callers and tests use.
from tessera.compiler.ops.attention import causal as _causal, rope as _rope, topk_gates as _topk_gates  # noqa: F401
from tessera.compiler.ops.norm import layernorm as _layernorm  # noqa: F401
from tessera.compiler.reference.quant import ParamValues
from tessera.compiler.reference.numerics import (erf, min_value as _min_value, rope_inv_freq,  # noqa: F401
                                                 rope_tables, sinusoidal_table, softmax as _softmax)


def run(graph: Graph, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the graph on concrete inputs; returns {output name: array}."""
    bind = bind_inputs(graph, feeds)

    def ev(d):
        return dims.evaluate(dims.dim(d), bind)

    env: dict[str, np.ndarray] = dict(feeds)
    values = ParamValues(graph, weights)  # derived parameters (quantised weights) from their sources
    for path in graph.params:
        env[path] = values[path]
    return dict(zip(graph.outputs, execute(graph, env, ev)))


def execute(graph: Graph, env: dict[str, np.ndarray], ev) -> list[np.ndarray]:
    """Run the nodes of a graph whose inputs (and parameters) ``env`` holds; the outputs, in order.
    Also runs a scan's step body (compiler/ops/recurrence.py) once per step, with the outer ``ev``."""
    env = dict(env)
    env.update(graph.consts)
    for node in graph.nodes.values():
        y = ops.get(node.op).reference([env[i] for i in node.inputs], node.attrs, ev)
        ys = list(y) if len(node.outputs) > 1 else [y]  # a multi-output op (scan) returns a list
        for name, y in zip(node.outputs, ys):
            out_dtype = DTYPES.get(graph.type_of(name).dtype)
            y = np.asarray(y)
            if out_dtype is not None and y.dtype != out_dtype:
                y = y.astype(out_dtype)
            env[name] = y
    return [env[name] for name in graph.outputs]
