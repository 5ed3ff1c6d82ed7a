"""The builder a lowering writes ONNX nodes through, and ``Lowering``, what each lowering receives.

Kept apart from export.py (which assembles the model) and from the lowering table
(lowerings/), so that a lowering which builds a subgraph of its own (a scan's body,
backends/onnx/recurrence.py) can make a second builder without importing the exporter: the
recursion goes through ``Lowering.lower_node``, the dispatch the exporter hands in.
"""

from __future__ import annotations

import numpy as np
import onnx
import sympy
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph

ONNX_DTYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
               "i64": TensorProto.INT64, "i32": TensorProto.INT32, "bool": TensorProto.BOOL,
               "u8": TensorProto.UINT8, "i8": TensorProto.INT8}


# the ops whose weight (input 1, [out, in] in the IR) the ONNX op takes as [in, out]
TRANSPOSED_BY = ("linear", "linear_int8")


def transposed_weights(graph: Graph) -> frozenset[str]:
    """The parameters written to ONNX transposed, [in, out] where the IR has [out, in]: every 2-d
    parameter that only ``linear`` (or ``linear_int8``) nodes read, and only as their weight. ONNX's MatMul takes B as
    [in, out]; exporting the IR's layout behind a Transpose made onnxruntime fold the Transpose into
    a second copy of every weight (the session held about 2.2x the weights). A parameter read by
    anything else (GPT-2's head tied to the token table, which the embedding gathers rows of) keeps
    its layout and its linear transposes it in the graph."""
    out = set()
    for path, p in graph.params.items():
        if len(p.shape) != 2 or path not in graph.values:
            continue
        users = graph.consumers(path)
        if users and all(u.op in TRANSPOSED_BY and u.inputs.index(path) == 1 and u.inputs.count(path) == 1
                         for u in users):
            out.add(path)
    return frozenset(out)


class Builder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set(graph.values)
        self._consts: dict[tuple, str] = {}
        self._dims: dict[sympy.Expr, str] = {}
        self.current = ""  # IR node being lowered, for node names
        self.transposed = transposed_weights(graph)  # parameters written [in, out]
        self.shared: dict = {}  # values a lowering builds once for every node that needs them (a decode mask)
        # graph outputs only the ONNX interface has, (name, IR type): the cache buffers a decoding
        # step's GroupQueryAttention writes in place (backends/onnx/cached_attention.py)
        self.extra_outputs: list[tuple[str, object]] = []

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
    """What a lowering (backends/onnx/lowerings/) gets: the builder ``b``, the IR node, its inputs
    ``x``, attributes ``a``, input and output types, ``emit`` to write the node's result, and
    ``lower_node(b, node, out)``, the exporter's dispatch, for a lowering that lowers the nodes of a
    subgraph (a scan's body) in turn."""

    def __init__(self, b: Builder, node, out: str, lower_node):
        self.b, self.node, self.out = b, node, out
        self.lower_node = lower_node
        self.outs = list(node.outputs)  # every output, for a multi-output op (scan); ``out`` is the first
        self.x = node.inputs
        self.a = node.attrs
        self.t_in = [b.graph.type_of(v) for v in node.inputs]
        self.t_out = b.graph.type_of(out)

    def emit(self, op_type: str, inputs: list[str], **attrs) -> list[str]:
        return self.b.node(op_type, inputs, [self.out], **attrs)


def value_info(name: str, t) -> onnx.ValueInfoProto:
    """The ONNX declaration of a value of IR type ``t`` (symbolic dims become named dims)."""
    shape = [int(d) if dims.is_static(d) else dims.fmt(d) for d in t.shape]
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], shape)
