"""The residual Add before a norm fused into the norm: onnxruntime's SkipSimplifiedLayerNormalization
(Add + RMSNorm) and SkipLayerNormalization (Add + LayerNorm), com.microsoft, as an ONNX-level pass
after export.

Why: in a decoding step every layer runs ``s = x + f(x)`` then ``norm(s)`` twice, and at one token
each of those 24 Adds (12 layers) costs an executor dispatch (~7 us) for 768 additions;
onnxruntime's own fusion (SkipLayerNormFusion) does not fire on them because the sum is read again
by the next residual Add. The fused kernels give the sum as their fourth output
(``input_skip_bias_sum``), so the Add goes and the next layer reads the sum from the norm.
onnxruntime-genai's builder writes the same ops.

Patterns (top-level nodes; ``s = Add(a, b)``, a and b non-constant values of one shape [B, T, D]):

- ``rms``: ``Mul(Div(s, Sqrt(Add(ReduceMean(Pow(s, 2), [-1], keepdims=1), eps))), gamma)``: the
  RMSNorm lowering of backends/onnx/lowerings/norm.py (which onnxruntime fuses into
  SimplifiedLayerNormalization), gamma a 1-D initializer of D;
- ``layernorm``: ``LayerNormalization(s, gamma, beta, axis=-1)``.

Checks: the nodes inside the chain are read by the chain alone; a, b and the sum are float32 and
rank 3 of equal shape (the CPU kernels take [B, T, D] with a skip of the same shape), as the IR's
types say. Each candidate norm that does not fit keeps the reason (``fuse_skip_norms``'s result),
so a test or ``--explain`` can say why a norm kept its Add.

Numerics: the kernels add in float32 and normalise the sum as the unfused nodes do (the same
formula; the order of the reduction may differ in the last bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from onnx import helper, numpy_helper

from tessera.compiler.backends.onnx.walk import all_nodes

# the IR's view of a value: (element type, shape as strings) or None when unknown
Types = Callable[[str], "tuple[str, tuple[str, ...]] | None"]


@dataclass
class SkipNormReport:
    """What the pass did: how many norms it fused per pattern, and for each norm it left alone (by
    its output name) the reason."""

    fused: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


class _Graph:
    """Producers and readers of the top-level values (readers at any depth: a branch reading a value
    from outside counts as its If node reading it)."""

    def __init__(self, graph):
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.readers: dict[str, list] = {}
        for n in graph.node:
            for name in {x for m in all_nodes([n]) for x in m.input}:
                self.readers.setdefault(name, []).append(n)
        self.outputs = {o.name for o in graph.output}

    def op(self, name: str, op_type: str):
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op_type and n.domain in ("", "ai.onnx") else None

    def private(self, name: str, allowed) -> bool:
        """Read only by the nodes in ``allowed`` and not a graph output."""
        return name not in self.outputs and all(any(r is a for a in allowed) for r in self.readers.get(name, []))

    def const(self, name: str):
        return numpy_helper.to_array(self.inits[name]) if name in self.inits else None


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _match_rms(g: _Graph, mul) -> "dict | str":
    """The RMSNorm chain ending at ``mul``, or why it is not one."""
    div = next((g.op(x, "Div") for x in mul.input if g.op(x, "Div") is not None), None)
    if mul.op_type != "Mul" or div is None:
        return "not Mul(Div(...), gamma)"
    gamma = next((x for x in mul.input if x != div.output[0]), None)
    if gamma is None:
        return "not Mul(Div(...), gamma): the Div is multiplied by itself"
    sqrt = g.op(div.input[1], "Sqrt")
    add_eps = sqrt and g.op(sqrt.input[0], "Add")
    if add_eps is None:
        return "the divisor is not Sqrt(Add(mean, eps))"
    eps_name = next((x for x in add_eps.input if x in g.inits), None)
    mean = next((g.op(x, "ReduceMean") for x in add_eps.input if x != eps_name), None)
    if eps_name is None or mean is None:
        return "the divisor is not Sqrt(ReduceMean(...) + constant eps)"
    pow_ = g.op(mean.input[0], "Pow")
    s = div.input[0]
    if pow_ is None or pow_.input[0] != s:
        return "the mean is not of Pow(x, 2) of the divided value"
    two = g.const(pow_.input[1])
    if two is None or two.size != 1 or float(two.reshape(())) != 2.0:
        return "the power is not the constant 2"
    axes = g.const(mean.input[1]) if len(mean.input) > 1 and mean.input[1] else _attr(mean, "axes")
    if axes is None or list(np.asarray(axes).reshape(-1)) != [-1] or _attr(mean, "keepdims", 1) != 1:
        return "the mean is not over the last axis (axes [-1], keepdims)"
    eps = g.const(eps_name)
    if eps.size != 1:
        return "eps is not a scalar"
    chain = [pow_, mean, add_eps, sqrt, div]
    for n in chain:
        if not g.private(n.output[0], chain + [mul]):
            return f"{n.output[0]} is read outside the norm"
    w = g.const(gamma)
    if w is None or w.ndim != 1:
        return "gamma is not a 1-D initializer"
    return {"sum": s, "gamma": gamma, "beta": None, "eps": float(eps.reshape(())), "nodes": chain + [mul],
            "op": "SkipSimplifiedLayerNormalization", "width": w.shape[0]}


def _match_layernorm(g: _Graph, ln) -> "dict | str":
    """LayerNormalization over the last axis with an initializer gamma (and beta), or why not."""
    axis = _attr(ln, "axis", -1)
    if axis != -1:
        return f"LayerNormalization over axis {axis} (the fused kernel normalises the last)"
    if len(ln.output) > 1 and any(ln.output[1:]):
        return "its mean or inverse deviation is read"
    w = g.const(ln.input[1])
    if w is None or w.ndim != 1:
        return "gamma is not a 1-D initializer"
    beta = ln.input[2] if len(ln.input) > 2 and ln.input[2] else None
    if beta is not None and g.const(beta) is None:
        return "beta is not an initializer"
    return {"sum": ln.input[0], "gamma": ln.input[1], "beta": beta, "eps": float(_attr(ln, "epsilon", 1e-5)),
            "nodes": [ln], "op": "SkipLayerNormalization", "width": w.shape[0]}


# (name, the op type a candidate norm ends with, its match): a match gives the chain or a reason
PATTERNS = (("rms", "Mul", _match_rms), ("layernorm", "LayerNormalization", _match_layernorm))


def _check_sum(g: _Graph, m: dict, types: Types) -> "tuple | str":
    """(the residual Add, a, b) when the norm's input is a fusable residual sum, else why not."""
    add = g.op(m["sum"], "Add")
    if add is None:
        return "its input is not an Add (no residual to fuse)"
    a, b = add.input
    if a in g.inits or b in g.inits or a == b:
        return "the Add has a constant or the same value twice (not a residual sum)"
    ts = [types(x) for x in (a, b, m["sum"])]
    if any(t is None for t in ts):
        return "the shapes of the Add's inputs are not known"
    if any(t[0] != "f32" for t in ts):
        return f"element type {ts[0][0]} (fused for float32 only)"
    if any(len(t[1]) != 3 for t in ts) or len({t[1] for t in ts}) != 1:
        return f"the Add's inputs are not of one [B, T, D] shape ({ts[0][1]}, {ts[1][1]})"
    if ts[0][1][-1] != str(m["width"]):
        return f"gamma's width {m['width']} is not the last dimension {ts[0][1][-1]}"
    return add, a, b


def fuse_skip_norms(model, types: Types) -> SkipNormReport:
    """Fuse each residual Add + norm of the top-level graph (the module's patterns and checks), in
    place. Returns the report: the count fused per pattern and, per norm left alone, the reason."""
    graph = model.graph
    report = SkipNormReport()
    g = _Graph(graph)
    fused: dict[int, object] = {}  # id(Add) -> the fused node taking its place
    dropped: set[int] = set()
    for node in list(graph.node):
        for name, op_type, match in PATTERNS:
            if node.op_type != op_type or node.domain not in ("", "ai.onnx"):
                continue
            m = match(g, node)
            if isinstance(m, dict):
                m = (m, _check_sum(g, m, types))
                if isinstance(m[1], str):
                    m = m[1]
            if isinstance(m, str):
                if name == "layernorm" or not m.startswith("not Mul"):  # every Mul is no candidate
                    report.kept[node.output[0]] = m
                continue
            chain, (add, a, b) = m
            if id(add) in fused:
                report.kept[node.output[0]] = "its residual sum is fused into another norm"
                continue
            inputs = [a, b, chain["gamma"]] + ([chain["beta"]] if chain["beta"] else [])
            fused[id(add)] = helper.make_node(chain["op"], inputs, [node.output[0], "", "", add.output[0]],
                                              name=f"{node.output[0]}/skip_norm", domain="com.microsoft",
                                              epsilon=chain["eps"])
            dropped |= {id(n) for n in chain["nodes"]}
            report.fused[name] = report.fused.get(name, 0) + 1
    if fused:
        nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return report


def ir_types(graph) -> Types:
    """The IR graph's (dtype, shape as strings) of a value, None for a name the IR does not have."""
    def types(name: str):
        try:
            t = graph.type_of(name)
        except (KeyError, ValueError):
            return None
        if t is None or t.shape is None:
            return None
        return t.dtype, tuple(str(d) for d in t.shape)
    return types
