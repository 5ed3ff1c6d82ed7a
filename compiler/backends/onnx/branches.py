"""If branches as graphs of their own: a lowering emitted into a subgraph instead of the main graph.

Shared by the fused attention kernels (backends/onnx/attention.py: the block kernel in front of a
long-sequence kernel) and the cached ones (backends/onnx/cached_attention.py: a decoding step and a
prompt); kept apart so that neither kernel module imports the other for it.
"""

from __future__ import annotations

from onnx import helper


def branch_outputs(b, lower, node, hint: str, elems: list[int]):
    """An If branch: ``lower(b, node, outs)`` emitted into a graph of its own, one output per element
    type in ``elems``. Run-time dimensions computed inside stay inside (the builder's cache of them is
    restored), so nothing outside reads a branch value."""
    saved_nodes, saved_dims = b.nodes, dict(b._dims)
    b.nodes = []
    outs = [b.fresh(hint) for _ in elems]
    try:
        lower(b, node, outs)
        return helper.make_graph(b.nodes, b.fresh(f"{hint}_branch"), [],
                                 [helper.make_tensor_value_info(o, e, None) for o, e in zip(outs, elems)])
    finally:
        b.nodes, b._dims = saved_nodes, saved_dims


def branch(b, lower, node, hint: str, elem: int):
    """An If branch with one output: ``lower(b, node, out)`` emitted into a graph of its own."""
    return branch_outputs(b, lambda b, n, outs: lower(b, n, outs[0]), node, hint, [elem])
