"""A numpy reference interpreter for the IR.

It executes the graph node by node with plain numpy, written for clarity
rather than speed. It is the ground truth the ONNX export is tested against,
so each op's reference semantics (its ``reference`` facet in ``tessera.compiler.ops``)
follows its textbook definition (and, where models differ, the convention of the
reference implementation named in the comment there). The node loop itself is
ops/execute.py's ``execute`` (a scan runs its step body with it).
"""

from __future__ import annotations

import numpy as np

from tessera.compiler import ops  # noqa: F401  (registers every op before a graph is run)
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph
from tessera.compiler.ir.signature import bind_inputs
from tessera.compiler.ops.execute import execute
from tessera.compiler.reference.quant import ParamValues


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

