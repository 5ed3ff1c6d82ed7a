"""Lower the IR to an ONNX model (standard ops, opset 21, IR version 10).

Names follow the spec: an initializer is named by its parameter path
(``layers.0.attn.q.weight``) and every ONNX node by the IR node it lowers
(``layers.0.attn.q/MatMul``), so a graph viewer shows the spec's structure.
Symbolic dimensions become named dynamic dims (``B``, ``T``); where a lowering
needs a size at run time it reads it from the input it came from (Shape ->
arithmetic), so one file serves every batch and sequence length.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import sympy
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler.ir import dims
from tessera.compiler.reference.interpret import rope_inv_freq, sinusoidal_table
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
        self._counter = 0

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


def _np_float(dtype: str):
    return np.float16 if dtype == "f16" else np.float32


def _min_const(b: _Builder, dtype: str) -> str:
    np_dtype = np.float16 if dtype == "f16" else np.float32
    return b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min")


def _lower(b: _Builder, node, out: str) -> None:
    """Emit the ONNX nodes for one IR node, writing its result to ``out``."""
    g = b.graph
    x = node.inputs
    a = node.attrs
    op = node.op
    t_in = [g.type_of(v) for v in x]
    t_out = g.type_of(out)

    def emit(op_type, inputs, **attrs):
        return b.node(op_type, inputs, [out], **attrs)

    if op == "linear":
        wt = b.node("Transpose", [x[1]], perm=[1, 0])[0]
        if len(x) == 3:
            mm = b.node("MatMul", [x[0], wt])[0]
            emit("Add", [mm, x[2]])
        else:
            emit("MatMul", [x[0], wt])
    elif op == "embedding":
        emit("Gather", [x[1], x[0]], axis=0)
    elif op == "matmul":
        emit("MatMul", x)
    elif op in ("add", "sub", "mul", "div", "pow"):
        emit(op.capitalize(), x)
    elif op in ("neg", "sqrt", "exp", "relu", "sigmoid", "tanh", "identity", "sin", "cos"):
        emit({"neg": "Neg", "sqrt": "Sqrt", "exp": "Exp", "relu": "Relu", "sigmoid": "Sigmoid",
              "tanh": "Tanh", "identity": "Identity", "sin": "Sin", "cos": "Cos"}[op], x)
    elif op == "gelu":
        emit("Gelu", x, approximate=a["approx"])
    elif op == "silu":
        s = b.node("Sigmoid", x)[0]
        emit("Mul", [x[0], s])
    elif op == "cast":
        emit("Cast", x, to=ONNX_DTYPES[a["dtype"]])
    elif op == "softmax":
        emit("Softmax", x, axis=a["axis"])
    elif op == "layernorm":
        emit("LayerNormalization", x, axis=-1, epsilon=a["eps"])
    elif op == "rmsnorm":
        sq = b.node("Mul", [x[0], x[0]])[0]
        ms = b.node("ReduceMean", [sq, b.i64([-1])], keepdims=1)[0]
        eps = b.const(np.array(a["eps"], dtype=_np_float(t_in[0].dtype)), "eps")
        rms = b.node("Sqrt", [b.node("Add", [ms, eps])[0]])[0]
        normed = b.node("Div", [x[0], rms])[0]
        emit("Mul", [normed, x[1]])
    elif op == "reshape":
        emit("Reshape", [x[0], b.shape_vec(a["shape"])])
    elif op == "transpose":
        emit("Transpose", x, perm=list(a["perm"]))
    elif op == "split_heads":
        r = t_in[0].rank
        hd = t_out.shape[-1]
        tail = [a["heads"], int(hd)] if dims.is_static(hd) else [a["heads"], -1]
        rs = b.node("Reshape", [x[0], b.i64([0] * (r - 1) + tail)])[0]
        perm = list(range(r + 1))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        emit("Transpose", [rs], perm=perm)
    elif op == "merge_heads":
        r = t_in[0].rank
        perm = list(range(r))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        tr = b.node("Transpose", x, perm=perm)[0]
        emit("Reshape", [tr, b.i64([0] * (r - 2) + [-1])])
    elif op == "repeat_kv":
        r = t_in[0].rank
        n = a["times"]
        un = b.node("Unsqueeze", [x[0], b.i64([r - 2])])[0]
        ex = b.node("Expand", [un, b.i64([1] * (r - 2) + [n, 1, 1])])[0]
        g_heads, hd = t_in[0].shape[-3], t_in[0].shape[-1]
        emit("Reshape", [ex, b.shape_vec(list(t_in[0].shape[:-3]) + [g_heads * n, t_in[0].shape[-2], hd])])
    elif op == "concat":
        emit("Concat", x, axis=a["axis"])
    elif op == "slice":
        emit("Slice", [x[0], b.dim(a["start"]), b.dim(a["end"]), b.i64([a["axis"]])])
    elif op == "select":
        emit("Gather", [x[0], b.const(np.array(a["index"], dtype=np.int64), "index")], axis=a["axis"])
    elif op == "expand":
        emit("Expand", [x[0], b.shape_vec(a["shape"])])
    elif op in ("mean", "sum"):
        emit("ReduceMean" if op == "mean" else "ReduceSum", [x[0], b.i64(a["axes"])],
             keepdims=int(a["keepdims"]))
    elif op == "causal_mask":
        tq, tk = t_in[0].shape[-2], t_in[0].shape[-1]
        zero = b.const(np.array(0, dtype=np.int64), "zero")
        one = b.const(np.array(1, dtype=np.int64), "one")
        rows = b.node("Range", [zero, b.dim_scalar(tq), one])[0]
        offset = tk - tq
        if not (dims.is_static(offset) and int(offset) == 0):
            rows = b.node("Add", [rows, b.dim_scalar(offset)])[0]
        rows = b.node("Unsqueeze", [rows, b.i64([1])])[0]
        cols = b.node("Range", [zero, b.dim_scalar(tk), one])[0]
        hide = b.node("Greater", [cols, rows])[0]
        if a["window"]:
            lim = b.node("Sub", [rows, b.const(np.array(a["window"], dtype=np.int64), "window")])[0]
            far = b.node("LessOrEqual", [cols, lim])[0]
            hide = b.node("Or", [hide, far])[0]
        emit("Where", [hide, _min_const(b, t_in[0].dtype), x[0]])
    elif op == "padding_mask":
        zero = b.const(np.array(0, dtype=np.int64 if t_in[1].dtype == "i64" else np.int32), "zero")
        keep = b.node("Not", [b.node("Equal", [x[1], zero])[0]])[0] if t_in[1].dtype != "bool" else x[1]
        keep = b.node("Unsqueeze", [keep, b.i64([1, 2])])[0]
        emit("Where", [keep, x[0], _min_const(b, t_in[0].dtype)])
    elif op == "rope":
        hd = int(t_in[0].shape[-1])
        n = t_in[0].shape[-2]
        inv_freq = rope_inv_freq(hd, a["theta"], a.get("scaling"))
        zero = b.const(np.array(0, dtype=np.int64), "zero")
        one = b.const(np.array(1, dtype=np.int64), "one")
        if len(x) > 1:  # explicit positions [B, T] (a KV-cached graph): tables [B, 1, T, hd]
            pos = b.node("Unsqueeze", [b.node("Cast", [x[1]], to=TensorProto.FLOAT)[0], b.i64([1, 3])])[0]
        else:
            pos = b.node("Cast", [b.node("Range", [zero, b.dim_scalar(n), one])[0]], to=TensorProto.FLOAT)[0]
            pos = b.node("Unsqueeze", [pos, b.i64([1])])[0]
        freqs = b.node("Mul", [pos, b.const(inv_freq[None, :], "inv_freq")])[0]
        emb = b.node("Concat", [freqs, freqs], axis=-1)[0]
        cos, sin = b.node("Cos", [emb])[0], b.node("Sin", [emb])[0]
        if t_in[0].dtype != "f32":  # tables in fp32, applied at the tensor's precision
            cos = b.node("Cast", [cos], to=ONNX_DTYPES[t_in[0].dtype])[0]
            sin = b.node("Cast", [sin], to=ONNX_DTYPES[t_in[0].dtype])[0]
        half = b.i64([hd // 2])
        x1 = b.node("Slice", [x[0], b.i64([0]), half, b.i64([-1])])[0]
        x2 = b.node("Slice", [x[0], half, b.i64([hd]), b.i64([-1])])[0]
        rot = b.node("Concat", [b.node("Neg", [x2])[0], x1], axis=-1)[0]
        emit("Add", [b.node("Mul", [x[0], cos])[0], b.node("Mul", [rot, sin])[0]])
    elif op == "topk_gates":
        vals, idx = b.node("TopK", [x[0], b.i64([a["k"]])], 2, axis=-1, largest=1, sorted=1)
        w = b.node("Softmax", [vals], axis=-1)[0]
        zeros = b.node("ConstantOfShape", [b.node("Shape", [x[0]])[0]],
                       value=numpy_helper.from_array(np.zeros(1, dtype=_np_float(t_in[0].dtype))))[0]
        emit("ScatterElements", [zeros, idx, w], axis=-1)
    elif op == "arange":
        zero = b.const(np.array(0, dtype=np.int64), "zero")
        one = b.const(np.array(1, dtype=np.int64), "one")
        emit("Range", [zero, b.dim_scalar(a["n"]), one])
    elif op == "sinusoidal":
        d = a["d"]
        n = a["n"]
        if dims.is_static(dims.dim(n)):
            emit("Identity", [b.const(sinusoidal_table(int(n), d).astype(_np_float(t_out.dtype)), "sinusoidal")])
            return
        div = np.power(np.float32(10000.0), np.arange(0, d, 2, dtype=np.float32) / np.float32(d)).astype(np.float32)
        zero = b.const(np.array(0, dtype=np.int64), "zero")
        one = b.const(np.array(1, dtype=np.int64), "one")
        pos = b.node("Cast", [b.node("Range", [zero, b.dim_scalar(n), one])[0]], to=TensorProto.FLOAT)[0]
        pos = b.node("Unsqueeze", [pos, b.i64([1])])[0]
        ang = b.node("Div", [pos, b.const(div[None, :], "div_term")])[0]
        s = b.node("Unsqueeze", [b.node("Sin", [ang])[0], b.i64([2])])[0]
        c = b.node("Unsqueeze", [b.node("Cos", [ang])[0], b.i64([2])])[0]
        both = b.node("Concat", [s, c], axis=2)[0]
        if t_out.dtype != "f32":
            both = b.node("Cast", [both], to=ONNX_DTYPES[t_out.dtype])[0]
        emit("Reshape", [both, b.i64([-1, d])])
    elif op == "fused_attention":
        from tessera.compiler.backends.onnx.attention import lower_fused_attention

        lower_fused_attention(b, node, out)
    elif op == "conv2d":
        k = a["kernel"]
        emit("Conv", x, kernel_shape=[k, k], strides=[a["stride"], a["stride"]])
    else:
        raise NotImplementedError(f"no ONNX lowering for op '{op}'")


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


def save(model: onnx.ModelProto, path: str | Path) -> list[Path]:
    """Write the model (with external data past 2 GiB); returns the files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.with_name(path.name + ".data")
    if data_path.exists():
        data_path.unlink()
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, os.fspath(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_path.name, size_threshold=1024)
        return [path, data_path]
    onnx.save_model(model, os.fspath(path))
    return [path]


def check(path: str | Path) -> None:
    """onnx.checker's full check (with shape inference) on a saved model."""
    onnx.checker.check_model(os.fspath(path), full_check=True)
