"""Multiply-adds and FLOPs of every node, as exact polynomials in the graph's symbols.

MACs count matmul-class work only (linear, matmul, conv2d); a gather is 0 MACs.
FLOPs are 2 per MAC plus an itemised per-element estimate for everything else
(softmax, norms, activations, elementwise arithmetic), kept apart so the two
are never confused. Each node is classified as ``dense`` (a product with
weights: projections, MLP, convolutions; the N·D² part), ``attention`` (a
product of two data-dependent tensors: scores and weighting; the N²·D part) or
``head`` (the output layer), so the report can show every split without
re-walking the graph.

An op this module does not know (e.g. one added by a later pass) costs 0 and
is listed under ``uncounted``, so the report stays honest instead of failing.
Add a rule to ``MACS``/``FLOPS`` to count it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.analysis.poly import Poly, numel
from tessera.compiler.analysis.structure import Attention, Structure, analyse, node_layer

# ------------------------------------------------------------------ FLOPs per output element
# A transcendental (exp, tanh, erf, sqrt) counts as one FLOP. The numbers are the
# arithmetic of a straightforward implementation; docs/report.md lists the reasoning.
ELEMENTWISE: dict[str, tuple[str, int]] = {
    "add": ("elementwise", 1), "sub": ("elementwise", 1), "mul": ("elementwise", 1),
    "div": ("elementwise", 1), "pow": ("elementwise", 1), "neg": ("elementwise", 1),
    "sqrt": ("elementwise", 1), "exp": ("elementwise", 1), "sin": ("elementwise", 1),
    "cos": ("elementwise", 1),
    "relu": ("activation", 1), "tanh": ("activation", 1), "sigmoid": ("activation", 3),
    "silu": ("activation", 4),                     # sigmoid (exp, add, divide) and a multiply
    "softmax": ("softmax", 5),                     # max, subtract, exp, sum, divide
    "rmsnorm": ("norm", 4),                        # square, sum, scale by 1/rms, weight
    "causal_mask": ("mask", 1), "padding_mask": ("mask", 1),  # one select per score
    "rope": ("position", 3),                       # x·cos + rotate(x)·sin
    "sinusoidal": ("position", 2),                 # divide, sin or cos
}
# Ops that only move data (or read a table): no arithmetic.
NO_FLOPS = {"identity", "cast", "reshape", "transpose", "split_heads", "merge_heads", "repeat_kv", "concat",
            "slice", "select", "expand", "arange", "embedding"}
MATMUL_OPS = {"linear", "matmul", "conv2d", "fused_attention"}

MacRule = Callable[[Graph, Node], Poly]
FlopRule = Callable[[Graph, Node], dict[str, Poly]]


def _out(graph: Graph, node: Node) -> Poly:
    return numel(graph.type_of(node.outputs[0]).shape)


def _dim(d) -> Poly:
    return Poly.from_dim(d)


MACS: dict[str, MacRule] = {
    # y[..., out] = x[..., in] W^T: one multiply-add per output element and input feature
    "linear": lambda g, n: _out(g, n) * _dim(g.type_of(n.inputs[1]).shape[1]),
    # [..., m, k] @ [..., k, n]: one per output element and inner index
    "matmul": lambda g, n: _out(g, n) * _dim(g.type_of(n.inputs[0]).shape[-1]),
    # one per output element, input channel and kernel tap
    "conv2d": lambda g, n: _out(g, n) * _dim(g.type_of(n.inputs[1]).shape[1])
    * (n.attrs["kernel"] * n.attrs["kernel"]),
}


def _layernorm_flops(g, n):
    # mean, subtract, square, sum, normalise, scale (+ shift): 7 or 8 per element
    return {"norm": _out(g, n) * (8 if len(n.inputs) == 3 else 7)}


def _gelu_flops(g, n):
    # tanh form: x³ (2), ·0.044715, +x, ·sqrt(2/π), tanh, +1, ·x, ·0.5 = 9; erf form: /√2, erf, +1, ·x, ·0.5 = 5
    return {"activation": _out(g, n) * (9 if n.attrs.get("approx") == "tanh" else 5)}


def _reduce_flops(g, n):
    return {"elementwise": numel(g.type_of(n.inputs[0]).shape)}


def _topk_flops(g, n):
    # top-k selection (k compares per logit) and a softmax over the k chosen (5 each)
    x = numel(g.type_of(n.inputs[0]).shape)
    e = int(g.type_of(n.inputs[0]).shape[-1])
    k = int(n.attrs["k"])
    return {"routing": x * k + x * Fraction(5 * k, e)}


FLOPS: dict[str, FlopRule] = {
    "layernorm": _layernorm_flops, "gelu": _gelu_flops, "mean": _reduce_flops, "sum": _reduce_flops,
    "topk_gates": _topk_flops,
}


def _fused_attention_macs(g: Graph, n: Node, pairs: Poly | None = None) -> Poly:
    """q·kᵀ and p·v of a fused_attention node over `pairs` query-key pairs per head (all Tq·Tk
    by default): (hd + hd_v) per pair, for each batch row and query head."""
    q, k, v = (g.type_of(x) for x in n.inputs[:3])
    if pairs is None:
        pairs = _dim(q.shape[-2]) * _dim(k.shape[-2])
    return numel(q.shape[:-2]) * pairs * (_dim(q.shape[-1]) + _dim(v.shape[-1]))


def _fused_attention_flops(g: Graph, n: Node, macs: Poly, pairs: Poly) -> dict[str, Poly]:
    """The products, and per score: scale, masks, bias, softmax (as the unfused ops would count)."""
    rows = numel(g.type_of(n.inputs[0]).shape[:-2])
    scores = rows * pairs
    masks = int(bool(n.attrs.get("causal"))) + int(bool(n.attrs.get("padding")))
    f = {"matmul": macs * 2, "softmax": scores * 5,
         "elementwise": scores * (1 + int(bool(n.attrs.get("bias"))))}
    if masks:
        f["mask"] = scores * masks
    return f


MACS["fused_attention"] = _fused_attention_macs


def known_ops() -> set[str]:
    return set(MACS) | set(FLOPS) | set(ELEMENTWISE) | NO_FLOPS


@dataclass
class NodeCost:
    node: str
    op: str
    kind: str                      # dense | attention | head | other | uncounted
    layer: str | None
    macs: Poly                     # full attention (every score pair)
    macs_causal: Poly              # the causal mask exploited (only masked-in pairs)
    flops: dict[str, Poly] = field(default_factory=dict)         # by category, full
    flops_causal: dict[str, Poly] = field(default_factory=dict)  # by category, causal

    def flops_total(self, causal: bool = False) -> Poly:
        key = "_total_causal" if causal else "_total"
        cached = self.__dict__.get(key)
        if cached is None:
            cached = self.__dict__[key] = Poly.sum((self.flops_causal if causal else self.flops).values())
        return cached


def score_pairs(a: Attention) -> Poly:
    """Query-key pairs per head that the mask lets through (Tq·Tk without a causal mask)."""
    tq, tk = _dim(a.tq), _dim(a.tk)
    if not a.causal:
        return tq * tk
    if a.window:
        w = a.window  # each query sees at most `window` keys; exact once Tq >= window
        return tq * w - Fraction(w * (w - 1), 2)
    return tq * (tk - tq) + (tq * tq + tq) * Fraction(1, 2)


def node_costs(graph: Graph, st: Structure | None = None) -> tuple[list[NodeCost], Structure]:
    """The cost of every node, in graph order. Nodes with the same op, types, attributes and
    attention role (every layer repeats them) share one set of polynomials."""
    st = st or analyse(graph)
    known = known_ops()
    memo: dict[tuple, tuple] = {}
    out: list[NodeCost] = []
    for n in graph.nodes.values():
        layer = node_layer(n)
        if n.op not in known:
            out.append(NodeCost(n.name, n.op, "uncounted", layer, Poly(), Poly()))
            continue
        a = st.core_of.get(n.name)
        role = None
        if a is not None and a.causal:
            role = ("score" if n.name == a.score else "internal" if n.outputs[0] in a.internal else "other",
                    a.window, a.tq, a.tk, graph.type_of(a.q).shape)
        key = (n.op, tuple(graph.type_of(v) for v in n.inputs), graph.type_of(n.outputs[0]),
               repr(sorted(n.attrs.items())), role)
        got = memo.get(key)
        if got is None:
            got = memo[key] = _node_polys(graph, n, a)
        if n.op in MATMUL_OPS:
            kind = "head" if n.name in st.head else ("attention" if n.name in st.mixing else "dense")
        else:
            kind = "other"
        out.append(NodeCost(n.name, n.op, kind, layer, *got))
    return out, st


def _node_polys(graph: Graph, n: Node, a: Attention | None):
    macs = MACS[n.op](graph, n) if n.op in MACS else Poly()
    if n.op == "fused_attention":
        q, k = graph.type_of(n.inputs[0]), graph.type_of(n.inputs[1])
        full = _dim(q.shape[-2]) * _dim(k.shape[-2])
        flops = _fused_attention_flops(graph, n, macs, full)
        if a is None or not a.causal:
            return macs, macs, flops, flops
        pairs = score_pairs(a)
        macs_c = _fused_attention_macs(graph, n, pairs)
        return macs, macs_c, flops, _fused_attention_flops(graph, n, macs_c, pairs)
    flops = _flops(graph, n, macs)
    if a is None or not a.causal:
        return macs, macs, flops, flops
    score = graph.nodes[a.score]
    rows = numel(graph.type_of(score.outputs[0]).shape[:-2])
    pairs = score_pairs(a)
    macs_c, flops_c = macs, flops
    if n.op == "matmul":
        inner = graph.type_of(n.inputs[0]).shape[-1] if n.name == a.score else graph.type_of(n.outputs[0]).shape[-1]
        macs_c = rows * pairs * _dim(inner)
        flops_c = _flops(graph, n, macs_c)
    elif n.outputs[0] in a.internal:
        flops_c = _flops(graph, n, macs, elems=rows * pairs)
    return macs, macs_c, flops, flops_c


def _flops(graph: Graph, n: Node, macs: Poly, elems: Poly | None = None) -> dict[str, Poly]:
    f: dict[str, Poly] = {}
    if n.op in MATMUL_OPS:
        f["matmul"] = macs * 2
        if (n.op == "linear" and len(n.inputs) == 3) or (n.op == "conv2d" and len(n.inputs) == 3):
            f["bias"] = elems if elems is not None else _out(graph, n)
    elif n.op in ELEMENTWISE:
        cat, per = ELEMENTWISE[n.op]
        f[cat] = (elems if elems is not None else _out(graph, n)) * per
    elif n.op in FLOPS:
        f = FLOPS[n.op](graph, n)
    return {k: v for k, v in f.items() if not v.is_zero()}


def total(costs: list[NodeCost], attr: str = "macs", kinds: set[str] | None = None,
          layer: str | None = None) -> Poly:
    return Poly.sum(getattr(c, attr) for c in costs
                    if (kinds is None or c.kind in kinds) and (layer is None or c.layer == layer))


def flops_by_category(costs: list[NodeCost], causal: bool = False) -> dict[str, Poly]:
    parts: dict[str, list[Poly]] = {}
    for c in costs:
        for k, v in (c.flops_causal if causal else c.flops).items():
            parts.setdefault(k, []).append(v)
    out = {k: Poly.sum(v) for k, v in parts.items()}
    order = ["matmul", "bias", "softmax", "norm", "activation", "elementwise", "mask", "position", "routing"]
    return {k: out[k] for k in sorted(out, key=lambda k: (order.index(k) if k in order else len(order), k))}
