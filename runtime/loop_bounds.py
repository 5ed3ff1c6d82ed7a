"""How many steps a graph's recurrences take with the inputs of one run, checked before running.

A Scan, RNN, GRU or LSTM runs one step per position of its sequence axis, and that length comes from
a user number: an input's sequence length, a ``--set`` value that sized a tensor (``arange(n)``), a
shape in a compiled file. onnxruntime cannot be interrupted inside a run, so a Scan over 10^8 or
10^12 positions is a process that never returns (or runs for hours) -- issue 25, item 3. Before the
session runs, the graph's shapes are inferred with the run's concrete input shapes (onnx's shape
inference, without data propagation: it would materialise the very tensors that are too long) and
every recurrence whose length is then known is checked against session.MAX_LOOP_TRIPS, the bound
already applied to a Loop's constant trip count. A length the inference cannot see (after an op it
does not know) is not refused: the bound is for what can be known before running.
"""

from __future__ import annotations

import numpy as np
import onnx

from tessera.compiler.ir.signature import InputError
from tessera.runtime.session import MAX_LOOP_TRIPS

RECURRENT_OPS = ("Scan", "RNN", "GRU", "LSTM")


def _graphs(graph: onnx.GraphProto):
    """The graph and its subgraphs (Scan, Loop and If bodies), at any depth."""
    todo = [graph]
    while todo:
        g = todo.pop()
        yield g
        for n in g.node:
            todo.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
            todo.extend(sub for a in n.attribute if a.type == onnx.AttributeProto.GRAPHS for sub in a.graphs)


def has_recurrence(model: onnx.ModelProto) -> bool:
    return any(n.op_type in RECURRENT_OPS for g in _graphs(model.graph) for n in g.node)


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers keep their shapes but not their data: shape
    inference reads values only of small tensors (shapes, axes), and a copy of the weights would
    double a large model's memory for nothing."""
    slim = onnx.ModelProto()
    slim.CopyFrom(model)
    for t in slim.graph.initializer:
        if int(np.prod(t.dims, dtype=np.int64)) > 64:
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "external_data"):
                t.ClearField(field)
            t.data_location = onnx.TensorProto.DEFAULT
    return slim


def _steps(node: onnx.NodeProto, shapes: dict[str, list]) -> tuple[str, int | None]:
    """(the input that sets ``node``'s length, that length if known)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Scan":
        k = int(attrs.get("num_scan_inputs", 0))
        scanned = list(node.input[len(node.input) - k:]) if k else []
        axes = list(attrs.get("scan_input_axes", [])) or [0] * len(scanned)
        for name, axis in zip(scanned, axes):
            dims = shapes.get(name)
            if dims is not None and -len(dims) <= axis < len(dims) and dims[axis] is not None:
                return name, dims[axis]
        return (scanned[0] if scanned else ""), None
    dims = shapes.get(node.input[0]) if node.input else None  # RNN/GRU/LSTM: X is [T, B, ...] (layout 1: [B, T, ...])
    axis = 1 if attrs.get("layout", 0) == 1 else 0
    return node.input[0] if node.input else "", (dims[axis] if dims is not None and len(dims) > axis else None)


def check_steps(model: onnx.ModelProto, feeds: dict[str, np.ndarray], where: str) -> None:
    """Refuse the run when a recurrence of ``model`` would take more than MAX_LOOP_TRIPS steps with
    these ``feeds`` (an InputError naming the op, its length and the bound). ``model`` is best given
    without its weights (``without_weights``)."""
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    for vi in bound.graph.input:
        if vi.name in feeds:
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for n in feeds[vi.name].shape:
                shape.dim.add().dim_value = int(n)
    try:
        inferred = onnx.shape_inference.infer_shapes(bound, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - a graph onnx cannot infer is left to onnxruntime, which runs it or says why
        return
    for g in _graphs(inferred.graph):
        shapes = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None
                                   for d in vi.type.tensor_type.shape.dim]
        shapes.update({t.name: list(t.dims) for t in g.initializer})
        for node in g.node:
            if node.op_type not in RECURRENT_OPS:
                continue
            source, steps = _steps(node, shapes)
            if steps is not None and steps > MAX_LOOP_TRIPS:
                raise InputError(f"{where}: {node.op_type} {node.name or node.output[0]} would run {steps:,} steps "
                                 f"(the length of '{source}' with these inputs), more than the {MAX_LOOP_TRIPS:,} "
                                 f"that run allows: it would not finish. Shorten the sequence, or the --set value "
                                 f"that sizes it")
