"""Lower the IR to an ONNX model (standard ops, opset 21, IR version 10).

Names follow the spec: an initializer is named by its parameter path
(``layers.0.attn.q.weight``) and every ONNX node by the IR node it lowers
(``layers.0.attn.q/MatMul``), so a graph viewer shows the spec's structure.
Symbolic dimensions become named dynamic dims (``B``, ``T``); where a lowering
needs a size at run time it reads it from the input it came from (Shape ->
arithmetic), so one file serves every batch and sequence length.

Each op's ONNX nodes come from its ``lower`` facet (``tessera.compiler.ops``); this module
holds the builder those facets write through and assembles the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import sympy
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler import ops
from tessera.compiler.backends.atomic import OutputError, check_target, fsync_dir, fsync_file, staging
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph
from tessera.compiler.ir.signature import InputLimits, input_limits

OPSET = 21
IR_VERSION = 10  # onnxruntime 1.31 loads IR versions up to 13; onnx 1.23 writes 14 unless told
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2  # leave headroom below protobuf's 2 GiB limit

ONNX_DTYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
               "i64": TensorProto.INT64, "i32": TensorProto.INT32, "bool": TensorProto.BOOL}


class _Builder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set(graph.values)
        self._consts: dict[tuple, str] = {}
        self._dims: dict[sympy.Expr, str] = {}
        self.current = ""  # IR node being lowered, for node names

    def fresh(self, hint: str) -> str:
        base = f"{self.current}/{hint}" if self.current else hint
        name, i = base, 1
        while name in self._names:
            name = f"{base}_{i}"
            i += 1
        self._names.add(name)
        return name

    def node(self, op_type: str, inputs: list[str], outputs: list[str] | int = 1, domain: str = "",
             **attrs) -> list[str]:
        if isinstance(outputs, int):
            outputs = [self.fresh(op_type) for _ in range(outputs)]
        name = self.fresh(op_type) if self.current else None
        n = helper.make_node(op_type, inputs, outputs, name=name, domain=domain or None, **attrs)
        self.nodes.append(n)
        return outputs

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key in self._consts:
            return self._consts[key]
        name = self._const_name(hint)  # every constant's name has a '/'; parameter paths never do
        self.initializers.append(numpy_helper.from_array(array, name))
        self._consts[key] = name
        return name

    def _const_name(self, hint: str) -> str:
        saved, self.current = self.current, ""
        try:
            return self.fresh(f"const/{hint}")
        finally:
            self.current = saved

    def i64(self, values) -> str:
        return self.const(np.array(values, dtype=np.int64), "i64")

    @staticmethod
    def onnx_type(dtype: str) -> int:
        """The ONNX element type of an IR dtype (for Cast's ``to``)."""
        return ONNX_DTYPES[dtype]

    @staticmethod
    def tensor_value(array: np.ndarray) -> onnx.TensorProto:
        """A tensor for a node attribute (e.g. ConstantOfShape's ``value``)."""
        return numpy_helper.from_array(np.asarray(array))

    # ---------------------------------------------------------------- symbolic dims at run time
    def dim(self, d) -> str:
        """A 1-element int64 tensor holding the dimension's value at run time."""
        d = dims.dim(d)
        if dims.is_static(d):
            return self.i64([int(d)])
        if d in self._dims:
            return self._dims[d]
        saved, self.current = self.current, ""
        try:
            out = self._lower_dim(d)
        finally:
            self.current = saved
        self._dims[d] = out
        return out

    def _lower_dim(self, d: sympy.Expr) -> str:
        if d.is_Symbol:
            src = self.graph.symbols.get(str(d))
            if src is None:
                raise ValueError(f"symbolic dimension {d} has no input to read it from")
            return self.node("Shape", [src.input], [self.fresh(f"dim/{d}")], start=src.axis, end=src.axis + 1)[0]
        if d.is_Add or d.is_Mul:
            op = "Add" if d.is_Add else "Mul"
            terms = [self.dim(t) if not t.is_Number else self.i64([int(t)]) for t in d.args]
            acc = terms[0]
            for t in terms[1:]:
                acc = self.node(op, [acc, t], [self.fresh(f"dim/{op.lower()}")])[0]
            return acc
        if d.is_Pow and d.exp.is_Integer and int(d.exp) > 0:
            base = self.dim(d.base)
            acc = base
            for _ in range(int(d.exp) - 1):
                acc = self.node("Mul", [acc, base], [self.fresh("dim/pow")])[0]
            return acc
        raise ValueError(f"cannot compute dimension {d} at run time")

    def dim_scalar(self, d) -> str:
        d = dims.dim(d)
        if dims.is_static(d):
            return self.const(np.array(int(d), dtype=np.int64), "i64")
        return self.node("Squeeze", [self.dim(d), self.i64([0])])[0]

    def shape_vec(self, shape) -> str:
        shape = [dims.dim(s) for s in shape]
        if all(dims.is_static(s) for s in shape):
            return self.i64([int(s) for s in shape])
        return self.node("Concat", [self.dim(s) for s in shape], axis=0)[0]


class Lowering:
    """What an op's ``lower`` facet gets: the builder ``b``, the IR node, its inputs ``x``,
    attributes ``a``, input and output types, and ``emit`` to write the node's result."""

    def __init__(self, b: _Builder, node, out: str):
        self.b, self.node, self.out = b, node, out
        self.x = node.inputs
        self.a = node.attrs
        self.t_in = [b.graph.type_of(v) for v in node.inputs]
        self.t_out = b.graph.type_of(out)

    def emit(self, op_type: str, inputs: list[str], **attrs) -> list[str]:
        return self.b.node(op_type, inputs, [self.out], **attrs)


def _lower(b: _Builder, node, out: str) -> None:
    """Emit the ONNX nodes for one IR node, writing its result to ``out`` (the op's lowering facet)."""
    ops.get(node.op).lower(Lowering(b, node, out))


def _names_read(nodes) -> set[str]:
    """Every value name read by these nodes or by nodes of their subgraphs (Loop bodies)."""
    used: set[str] = set()
    for n in nodes:
        used.update(n.input)
        for attr in n.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                used |= _names_read(attr.g.node)
    return used


def _value_info(name: str, t) -> onnx.ValueInfoProto:
    shape = [int(d) if dims.is_static(d) else dims.fmt(d) for d in t.shape]
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], shape)


def to_onnx(graph: Graph, weights: dict[str, np.ndarray], metadata: dict | None = None) -> onnx.ModelProto:
    """Build the ONNX model for a graph with the given parameter values."""
    b = _Builder(graph)
    for node in graph.nodes.values():
        b.current = node.name
        _lower(b, node, node.outputs[0])
    b.current = ""
    inits = []
    for path, p in graph.params.items():
        arr = np.ascontiguousarray(weights[path])
        if p.dtype == "f16" and arr.dtype != np.float16:
            arr = arr.astype(np.float16)
        inits.append(numpy_helper.from_array(arr, path))
    for name, arr in graph.consts.items():
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
    used = _names_read(b.nodes)
    inits.extend(i for i in b.initializers if i.name in used)  # helper constants a lowering did not need
    onnx_graph = helper.make_graph(
        b.nodes, graph.name,
        inputs=[_value_info(n, graph.type_of(n)) for n in graph.inputs],
        outputs=[_value_info(n, graph.type_of(n)) for n in graph.outputs],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", OPSET)]
    if any(n.domain == "com.microsoft" for n in b.nodes):
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


def save(model: onnx.ModelProto, path: str | Path, verify=None) -> list[Path]:
    """Write the model (with external data past 2 GiB) atomically; returns the files written.

    Everything is written into a hidden folder beside the target (compiler/backends/atomic.py),
    fsynced, checked by ``verify(tmp_model_path)`` if given, and only then renamed into place: the
    data file first, then the model. A failure, Ctrl-C or SIGTERM before that leaves any previous
    output as it was and removes the partial files; a symlink at ``path`` is replaced, its target
    never written. A stale ``.data`` file from an earlier, larger export is removed once the new
    model is in place."""
    path = check_target(path)
    data_path = path.with_name(path.name + ".data")
    with staging(path) as tmp:
        tmp_model, tmp_data = tmp / path.name, tmp / data_path.name
        external = sum(t.ByteSize() for t in model.graph.initializer) > EXTERNAL_DATA_THRESHOLD
        try:
            if external:
                onnx.save_model(model, os.fspath(tmp_model), save_as_external_data=True,
                                all_tensors_to_one_file=True, location=data_path.name, size_threshold=1024)
            else:
                onnx.save_model(model, os.fspath(tmp_model))
            for f in (tmp_model, tmp_data) if external else (tmp_model,):
                fsync_file(f)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
        if verify is not None:
            verify(tmp_model)
        if external:
            os.replace(tmp_data, data_path)
        os.replace(tmp_model, path)
        if not external and data_path.is_file():
            data_path.unlink()  # belonged to the model just replaced
        fsync_dir(path.parent)
    return [path, data_path] if external else [path]


def check(path: str | Path) -> None:
    """onnx.checker's full check (with shape inference) on a saved model."""
    onnx.checker.check_model(os.fspath(path), full_check=True)
