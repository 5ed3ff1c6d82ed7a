"""An independent counter of parameters and multiply-adds, reading only an exported ONNX model.

It shares no code with the report (compiler/analysis/cost.py): it binds the model's
dynamic dimensions to numbers, lets onnx's own shape inference (with data
propagation) give every tensor a concrete shape, and counts

- parameters: the elements of every initializer named like a parameter path
  (the exporter names constants with a '/', parameter paths never have one), less
  the checkpoint buffers the caller names (BART's final_logits_bias: ONNX has no
  notion of a buffer, an initializer is an initializer);
- multiply-adds: MatMul (one per output element and inner index), Gemm, Conv
  (one per output element, input channel of its group and kernel tap), and the
  fused attention ops of ONNX and onnxruntime (two products per query-key pair);
- the attention part: MatMuls whose two operands both depend on a graph input
  (activation x activation), as opposed to products with weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, shape_inference


@dataclass
class OnnxCounts:
    params: int
    macs: int
    attention_macs: int
    nodes: dict[str, int] = field(default_factory=dict)   # op type -> how many were counted
    uncounted: list[str] = field(default_factory=list)    # compute ops this counter cannot size


ATTENTION_OPS = {("", "Attention"), ("com.microsoft", "Attention"), ("com.microsoft", "MultiHeadAttention"),
                 ("com.microsoft", "GroupQueryAttention")}
SKIPPED_COMPUTE = {"Einsum", "ConvTranspose", "QLinearMatMul", "MatMulInteger", "ConvInteger"}


def stub_initializers(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """Give the named initializers their real dims without data (marked external), so a model
    exported with placeholder weights can be counted without allocating GPT-3's weights."""
    for init in model.graph.initializer:
        if init.name in shapes:
            init.ClearField("raw_data")
            init.ClearField("float_data")
            del init.dims[:]
            init.dims.extend(shapes[init.name])
            init.data_location = TensorProto.EXTERNAL
            entry = init.external_data.add()
            entry.key, entry.value = "location", "absent.bin"
    return model


def _bind_inputs(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for inp in m.graph.input:
        for d in inp.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                value = dims[d.dim_param]
                d.Clear()
                d.dim_value = value
    _fold_input_shapes(m)
    return m


def _fold_input_shapes(m: onnx.ModelProto) -> None:
    """The bound inputs' Shape nodes as constants: onnx's shape inference cannot size a Slice whose
    end is computed from a shape (Mamba's causal conv1d keeps its first T outputs), even with
    data_prop; with the dimensions bound, the end is a number."""
    import numpy as np
    from onnx import helper, numpy_helper

    sizes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    for n in m.graph.node:
        if n.op_type != "Shape" or n.domain or n.input[0] not in sizes or 0 in sizes[n.input[0]]:
            continue
        dims = sizes[n.input[0]]
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        value = np.array(dims[a.get("start", 0):a.get("end", len(dims))], dtype=np.int64)
        n.op_type = "Constant"
        del n.input[:]
        del n.attribute[:]
        n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))


def _shapes(model: onnx.ModelProto) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            out[vi.name] = None
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        out[vi.name] = None if None in dims else dims
    for init in model.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def count(model: onnx.ModelProto, dims: dict[str, int], buffers=frozenset()) -> OnnxCounts:
    """Parameters and multiply-adds of one run of `model` with its dynamic dims bound to `dims`
    (`buffers`: initializer names that are checkpoint buffers, not parameters)."""
    fixed = _bind_inputs(model, dims)
    bound = shape_inference.infer_shapes(fixed, data_prop=True)
    shape = _shapes(bound)
    while _type_contrib_outputs(fixed, shape):
        # onnx does not know onnxruntime's contrib ops; with their outputs typed, infer again
        # (once per layer at most: each layer's attention needs the previous layer's shapes)
        bound = shape_inference.infer_shapes(fixed, data_prop=True)
        shape = _shapes(bound)
    g = bound.graph
    params = sum(math.prod(i.dims) for i in g.initializer if "/" not in i.name and i.name not in buffers)

    data = {i.name for i in g.input}
    for n in g.node:
        if any(x in data for x in n.input):
            data.update(n.output)

    def need(name: str) -> list[int]:
        s = shape.get(name)
        if s is None:
            raise ValueError(f"shape of {name} is unknown after shape inference")
        return s

    macs = attention = 0
    counted: dict[str, int] = {}
    uncounted: list[str] = []
    for n in g.node:
        key = (n.domain or "", n.op_type)
        m = 0
        if n.op_type == "MatMul" and not n.domain:
            a, out = need(n.input[0]), need(n.output[0])
            m = math.prod(out) * a[-1]
            if n.input[0] in data and n.input[1] in data:
                attention += m
        elif n.op_type == "Gemm" and not n.domain:
            a, out = need(n.input[0]), need(n.output[0])
            trans_a = next((at.i for at in n.attribute if at.name == "transA"), 0)
            m = math.prod(out) * (a[0] if trans_a else a[1])
            if n.input[0] in data and n.input[1] in data:
                attention += m
        elif n.op_type == "Conv" and not n.domain:
            w, out = need(n.input[1]), need(n.output[0])
            m = math.prod(out) * math.prod(w[1:])  # w: [M, C/group, k...]
        elif key in ATTENTION_OPS:
            m = _attention_macs(n, need)
            attention += m
        elif n.op_type in ("RNN", "GRU", "LSTM") and not n.domain:
            x, w, r = need(n.input[0]), need(n.input[1]), need(n.input[2])  # X [T, B, I], W [dirs, g·H, I]
            m = x[0] * x[1] * w[0] * w[1] * (w[2] + r[2])                   # every step: W x_t and R h
        elif n.op_type == "Scan" and not n.domain and _has_products(n):
            inner = _scan_counts(n, shape, data, need, _elem_types(bound),
                                 {i.name: i for i in fixed.graph.initializer if "/" in i.name})
            m, attention = inner.macs, attention + inner.attention_macs
            uncounted += inner.uncounted
        elif n.op_type in SKIPPED_COMPUTE or (n.op_type in ("Loop", "Scan", "If") and _has_products(n)):
            uncounted.append(n.name or n.op_type)  # a product inside a loop body runs a data-dependent
            continue                               # number of times (e.g. tiles a causal kernel skips)
        else:
            continue
        macs += m
        counted[n.op_type] = counted.get(n.op_type, 0) + 1
    return OnnxCounts(params, macs, attention, counted, uncounted)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]}
    types.update({i.name: i.data_type for i in g.initializer})
    return types


def _scan_counts(n: onnx.NodeProto, shape: dict, data: set[str], need, types: dict[str, int],
                 consts: dict[str, onnx.TensorProto]) -> OnnxCounts:
    """A Scan runs its body once per position of its scan inputs: the body's products, counted as a
    model of their own (inputs of the one-step shapes, outer values it reads declared as inputs),
    times that length. A body product between two data-dependent operands is attention."""
    attrs = {a.name: a for a in n.attribute}
    body = attrs["body"].g
    m = int(attrs["num_scan_inputs"].i)
    axes = list(attrs["scan_input_axes"].ints) if "scan_input_axes" in attrs else [0] * m
    k = len(n.input) - m
    length = need(n.input[k])[axes[0]]
    g = onnx.GraphProto()
    g.CopyFrom(body)
    declared = {i.name for i in g.input} | {i.name for i in g.initializer}
    for i, vi in enumerate(g.input):
        dims = list(need(n.input[i]))
        if i >= k:
            del dims[axes[i - k]]
        vi.type.tensor_type.ClearField("shape")
        vi.type.tensor_type.shape.dim.extend([onnx.TensorShapeProto.Dimension(dim_value=d) for d in dims])
    produced = {o for node in g.node for o in node.output}
    outer = sorted({x for node in g.node for x in node.input if x and x not in declared and x not in produced})
    for name in outer:  # values of the enclosing graph the body reads (constants with their values)
        if name in consts:
            g.initializer.append(consts[name])
            continue
        g.input.append(onnx.helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT), need(name)))
    for o in g.output:
        o.type.tensor_type.ClearField("shape")
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 21)])
    inner = count(model, {})
    body_data = {i.name for i in g.input[:len(body.input)]} | {x for x in outer if x in data}
    # count() treats every declared input as data; recount the attention part with the real data set
    bound = shape_inference.infer_shapes(model, data_prop=True)
    sh = _shapes(bound)
    attention = 0
    for node in bound.graph.node:
        if any(x in body_data for x in node.input):
            body_data.update(node.output)
        if node.op_type == "MatMul" and not node.domain and all(x in body_data for x in node.input[:2]):
            attention += math.prod(sh[node.output[0]]) * sh[node.input[0]][-1]
    return OnnxCounts(0, inner.macs * length, attention * length, inner.nodes, inner.uncounted)


def _type_contrib_outputs(model: onnx.ModelProto, shape: dict) -> bool:
    """Declare the output shape of com.microsoft attention nodes, as their specification gives it:
    the query's [B, S, ...] with hidden size num_heads x (value width / kv_num_heads)."""
    added = False
    known = {vi.name for vi in model.graph.value_info}
    for n in model.graph.node:
        if n.domain != "com.microsoft" or (n.domain, n.op_type) not in ATTENTION_OPS:
            continue
        q, v = shape.get(n.input[0]), shape.get(n.input[2])
        if q is None or v is None or len(q) != 3 or n.output[0] in known:
            continue
        attrs = {a.name: a.i for a in n.attribute}
        heads = attrs.get("num_heads", 1)
        kv_heads = attrs.get("kv_num_heads") or heads
        out = [q[0], q[1], heads * (v[-1] // kv_heads)]
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, out))
        added = True
    return added


def _has_products(n: onnx.NodeProto) -> bool:
    for a in n.attribute:
        graphs = [a.g] if a.HasField("g") else list(a.graphs)
        for body in graphs:
            for inner in body.node:
                if inner.op_type in ("MatMul", "Gemm", "Conv", "Einsum") or _has_products(inner):
                    return True
    return False


def _attention_macs(n: onnx.NodeProto, need) -> int:
    """Q·K^T and P·V of a fused attention node, from Q [B, H, Tq, dq] or [B, Tq, H·dq] and K, V."""
    q, k, v = need(n.input[0]), need(n.input[1]), need(n.input[2])
    attrs = {a.name: a.i for a in n.attribute}
    if len(q) == 4:
        b, h, tq, dq = q
        tk, dv = k[-2], v[-1]
        return b * h * tq * tk * (dq + dv)
    heads = attrs.get("q_num_heads") or attrs.get("num_heads") or 1
    kv_heads = attrs.get("kv_num_heads") or heads
    b, tq, width = q
    tk = k[1]
    dv = v[2] // kv_heads if len(v) == 3 else v[3]
    return b * tq * tk * (width + heads * dv)  # Σ over query heads of tq·tk·(dq + dv)
