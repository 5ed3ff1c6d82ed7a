"""Lower the IR to an ONNX model (standard ops, opset 21, or 23 where an op of NEWER_OPS is used;
IR version 10) and write it.

Names follow the spec: an initializer is named by its parameter path
(``layers.0.attn.q.weight``) and every ONNX node by the IR node it lowers
(``layers.0.attn.q/MatMul``), so a graph viewer shows the spec's structure.
A weight that only linears read is written transposed, [in, out], as MatMul takes it
(``transposed_weights``); every other initializer has its parameter's shape.
Symbolic dimensions become named dynamic dims (``B``, ``T``); where a lowering
needs a size at run time it reads it from the input it came from (Shape ->
arithmetic), so one file serves every batch and sequence length.

Each op's ONNX nodes come from its entry in the lowering table (backends/onnx/lowerings/),
written through the builder of builder.py; this module dispatches each node to its lowering and
assembles the model.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from tessera.compiler.backends.atomic import OutputError, check_target, fsync_dir, staging
from tessera.compiler.backends.onnx.builder import ONNX_DTYPES, Builder, Lowering, transposed_weights, value_info
from tessera.compiler.backends.onnx.lowerings import lowering
from tessera.compiler.backends.onnx.walk import all_nodes
from tessera.compiler.ir.graph import Graph, numpy_dtype

from tessera.compiler.reference import quant

from . import stream
from tessera.compiler.ir.signature import InputLimits, input_limits

OPSET = 21
# Standard ops newer than OPSET, and the opset that brought each: a model using one is written at
# that opset (the others keep 21, so their files do not change). Between 21 and 23 the ops already
# in use only gained element types, and onnxruntime's fusions apply the same (checked on the
# Llama-shaped decoder: the same 437 nodes after its optimiser at either opset).
NEWER_OPS = {"RotaryEmbedding": 23, "Attention": 23}
IR_VERSION = 10  # onnxruntime 1.31 loads IR versions up to 13; onnx 1.23 writes 14 unless told
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2  # leave headroom below protobuf's 2 GiB limit


def _lower(b: Builder, node, out: str) -> None:
    """Emit the ONNX nodes for one IR node, writing its result to ``out`` (its op's entry in LOWERINGS)."""
    lowering(node.op)(Lowering(b, node, out, _lower))


def _names_read(nodes) -> set[str]:
    """Every value name read by these nodes or by nodes of their subgraphs (Loop bodies)."""
    used: set[str] = set()
    for n in nodes:
        used.update(n.input)
        for attr in n.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                used |= _names_read(attr.g.node)
    return used


def _domains(nodes) -> set[str]:
    """The op domains of these nodes and of the nodes of their subgraphs (If, Loop), at any depth."""
    return {n.domain for n in all_nodes(nodes)}


def model_opset(nodes) -> int:
    """The default-domain opset these nodes need: OPSET unless one of NEWER_OPS is used."""
    return max([OPSET] + [NEWER_OPS[n.op_type] for n in all_nodes(nodes)
                          if n.domain in ("", "ai.onnx") and n.op_type in NEWER_OPS])


def build_model(graph: Graph, metadata: dict | None = None) -> onnx.ModelProto:
    """The ONNX model of a graph without its parameters and graph constants (``tensors`` lists
    those): a skeleton of nodes, signature, metadata and the lowerings' small helper constants."""
    b = Builder(graph)
    for node in graph.nodes.values():
        b.current = node.name
        _lower(b, node, node.outputs[0])
    b.current = ""
    used = _names_read(b.nodes)
    onnx_graph = helper.make_graph(
        b.nodes, graph.name,
        inputs=[value_info(n, graph.type_of(n)) for n in graph.inputs],
        outputs=[value_info(n, graph.type_of(n)) for n in graph.outputs]
        + [value_info(n, t) for n, t in b.extra_outputs],
        initializer=[i for i in b.initializers if i.name in used],  # helper constants a lowering did not need
    )
    opsets = [helper.make_opsetid("", model_opset(b.nodes))]
    if "com.microsoft" in _domains(b.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(onnx_graph, opset_imports=opsets,
                              producer_name="tessera", producer_version="0.1.0")
    model.ir_version = IR_VERSION
    meta = dict(metadata or {})
    limits = input_limits(graph)
    if limits.ids or limits.dims:
        meta[InputLimits.METADATA_KEY] = limits.to_json()
    for k, v in sorted(meta.items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return model


def tensors(graph: Graph, weights) -> list[stream.Streamed]:
    """The parameters (values read from ``weights``, a mapping by path, only when written) and
    the graph's constants, in that order. A parameter whose weights are in another dtype (fp32
    values for an fp16 parameter) is converted one tensor at a time as it is written; a derived
    parameter (quantised weights) is computed from its source as it is written."""
    weights = quant.ParamValues(graph, weights)
    transposed = transposed_weights(graph)
    out = []
    for path, p in graph.params.items():
        dtype = np.dtype(numpy_dtype(p.dtype) or np.float32)
        shape = tuple(int(s) for s in p.shape)
        if path in transposed:  # written [in, out] (see transposed_weights); the copy is made as it is written
            out.append(stream.Streamed(path, shape[::-1], ONNX_DTYPES[p.dtype], dtype,
                                       lambda path=path: np.asarray(weights[path]).T))
            continue
        out.append(stream.Streamed(path, shape, ONNX_DTYPES[p.dtype], dtype,
                                   lambda path=path: weights[path]))
    for name, arr in graph.consts.items():
        out.append(stream.Streamed(name, tuple(arr.shape), helper.np_dtype_to_tensor_dtype(arr.dtype), arr.dtype,
                                   lambda arr=arr: arr))
    return out


def to_onnx(graph: Graph, weights, metadata: dict | None = None) -> onnx.ModelProto:
    """The whole ONNX model in memory, weights included (for tests and in-memory sessions of small
    models; files are written by ``write``, which never holds more than one weight at a time)."""
    model = build_model(graph, metadata)
    inits = []
    for t in tensors(graph, weights):
        arr = stream.contiguous(t.values(), t.dtype)  # the array's own shape: tests pass placeholders
        init = t.header()
        del init.dims[:]
        init.dims.extend(arr.shape)
        init.raw_data = arr.tobytes()
        inits.append(init)
    helpers = list(model.graph.initializer)
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(inits + helpers)
    return model


def to_bytes(graph: Graph, weights, metadata: dict | None = None) -> bytes:
    """The serialised model (what onnxruntime takes from memory), written by the streaming writer:
    the weights are copied once, into the bytes."""
    model = build_model(graph, metadata)
    ts = tensors(graph, weights)
    buf = io.BytesIO()
    stream.write_inline(model, ts, buf)
    return buf.getvalue()


def checkable(model: onnx.ModelProto, streamed: list[stream.Streamed]) -> onnx.ModelProto:
    """The skeleton as the checker takes it: each streamed tensor declared as a graph input of
    its type and shape (the checker would otherwise want the data, or open external files)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = {t.name for t in streamed}
    kept = [i for i in m.graph.initializer if i.name not in names]
    m.graph.ClearField("initializer")
    m.graph.initializer.extend(kept)
    inputs = {i.name for i in m.graph.input}  # an initializer that is also an input (a default) is one already
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.onnx_type, list(t.shape)) for t in streamed
                         if t.name not in inputs)
    return m


def write(graph: Graph, weights, path: str | Path, metadata: dict | None = None, verify=None,
          external: bool | None = None, progress: stream.Progress | None = None) -> list[Path]:
    """Export a graph with its weights (a mapping by parameter path, read one tensor at a time)
    to ``path`` atomically; returns the files written. ``verify(model)`` (e.g. ``check``) is given
    the model without its weights before anything is written. ``external``: None puts the weights
    in ``<path>.data`` when they pass EXTERNAL_DATA_THRESHOLD, True or False forces it. ``progress``
    (bytes written, bytes in all) is called after each weight (compiler/backends/onnx/stream.py)."""
    return _save(build_model(graph, metadata), tensors(graph, weights), path, verify, external, progress)


def save(model: onnx.ModelProto, path: str | Path, verify=None, external: bool | None = None,
         progress: stream.Progress | None = None) -> list[Path]:
    """Write a model built in memory (``to_onnx``) the way ``write`` does: its initializers are
    streamed from the proto's own bytes (no serialised copy of the whole model is made)."""
    skeleton = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _assign(skeleton, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _assign(skeleton.graph, field, value)
    streamed = []
    for i in model.graph.initializer:
        if not i.HasField("raw_data") or i.data_location == TensorProto.EXTERNAL:
            skeleton.graph.initializer.append(i)
            continue
        np_type = helper.tensor_dtype_to_np_dtype(i.data_type)
        streamed.append(stream.Streamed(i.name, tuple(i.dims), i.data_type, np.dtype(np_type),
                                        lambda i=i, t=np_type: np.frombuffer(i.raw_data, t).reshape(tuple(i.dims))))
    return _save(skeleton, streamed, path, verify, external, progress)


def _save(model: onnx.ModelProto, streamed: list[stream.Streamed], path: str | Path, verify,
          external: bool | None, progress: stream.Progress | None = None) -> list[Path]:
    """The atomic save. Everything is written into a hidden folder beside the target
    (compiler/backends/atomic.py), fsynced, and only then renamed into place: the data file first,
    then the model. A failure, Ctrl-C or SIGTERM before that leaves any previous output as it was
    and removes the partial files; a symlink at ``path`` is replaced, its target never written. A
    stale ``.data`` file from an earlier, larger export is removed once the new model is in place."""
    path = check_target(path)
    if verify is not None:
        verify(checkable(model, streamed))
    data_path = path.with_name(path.name + ".data")
    if external is None:
        external = sum(t.nbytes for t in streamed) > EXTERNAL_DATA_THRESHOLD
    with staging(path) as tmp:
        tmp_model, tmp_data = tmp / path.name, tmp / data_path.name
        try:
            if external:
                proto, placed = stream.external_layout(model, streamed, data_path.name)
                with stream.open_output(tmp_data) as f:
                    stream.write_external_data(placed, f, progress)
                    stream.fsync(f)
                with stream.open_output(tmp_model) as f:
                    f.write(proto.SerializeToString())
                    stream.fsync(f)
            else:
                with stream.open_output(tmp_model) as f:
                    stream.write_inline(model, streamed, f, progress)
                    stream.fsync(f)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
        if external:
            os.replace(tmp_data, data_path)
        os.replace(tmp_model, path)
        if not external and data_path.is_file():
            data_path.unlink()  # belonged to the model just replaced
        fsync_dir(path.parent)
    return [path, data_path] if external else [path]


def _assign(msg, field, value) -> None:
    """Set one field of ``msg`` (as listed by ListFields) to ``value``."""
    target = getattr(msg, field.name)
    if hasattr(target, "extend"):  # a repeated field
        target.extend(value)
    elif hasattr(target, "CopyFrom"):  # a message
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def check(model: onnx.ModelProto | str | Path) -> None:
    """onnx.checker's full check (with shape inference) on a model (``checkable``'s form of a
    skeleton, or a whole model) or a saved file."""
    onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model), full_check=True)
