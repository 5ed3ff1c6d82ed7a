"""Multiply-adds and FLOPs of every node, as exact polynomials in the graph's symbols.

MACs count matmul-class work only (linear, matmul, convolutions, fused attention); a
gather is 0 MACs.
FLOPs are 2 per MAC plus an itemised per-element estimate for everything else
(softmax, norms, activations, elementwise arithmetic), kept apart so the two
are never confused. Each node is classified as ``dense`` (a product with
weights: projections, MLP, convolutions; the N·D² part), ``attention`` (a
product of two data-dependent tensors: scores and weighting; the N²·D part) or
``head`` (the output layer), so the report can show every split without
re-walking the graph.

Each op's counts come from its ``cost`` facet in ``tessera.compiler.ops``, which every
registered op must have. A node whose op is not registered at all (e.g. one a later
pass made up without defining it) costs 0 and is listed under ``uncounted``, so the
report says so instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from tessera.compiler import ops
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.analysis.poly import Poly, numel
from tessera.compiler.analysis.structure import Attention, Structure, analyse, node_layer

# Ops counted as multiply-adds and run at matmul peak (for roofline.py; this module asks the registry).
MATMUL_OPS = ops.with_trait("matmul_class")


class CostContext:
    """What an op's cost facet reads: the node, its attributes and input types, the number of
    output elements, polynomials of dimensions, and, for ``per_pair`` costs, the query-key
    pairs counted (``pairs``; None for all) and the MACs at that count (``macs``)."""

    def __init__(self, graph: Graph, node: Node, pairs: Poly | None = None, macs: Poly | None = None):
        self.graph, self.node, self.attrs = graph, node, node.attrs
        self.pairs, self.macs = pairs, macs

    def type(self, i: int):
        return self.graph.type_of(self.node.inputs[i])

    def out(self) -> Poly:
        return _out(self.graph, self.node)

    @staticmethod
    def dim(d) -> Poly:
        return _dim(d)

    @staticmethod
    def numel(shape) -> Poly:
        return numel(shape)

    @staticmethod
    def subgraph(graph: Graph) -> tuple[Poly, dict[str, Poly]]:
        """(MACs, FLOPs by category) of one run of a subgraph (a scan's step body), so that an op
        holding one can count it without importing this module (ops/ sits below analysis/)."""
        costs, _ = node_costs(graph)
        return total(costs, "macs"), flops_by_category(costs)


def _out(graph: Graph, node: Node) -> Poly:
    return numel(graph.type_of(node.outputs[0]).shape)


def _dim(d) -> Poly:
    return Poly.from_dim(d)


def _macs(graph: Graph, n: Node, pairs: Poly | None = None) -> Poly:
    rule = ops.get(n.op).cost.macs
    return rule(CostContext(graph, n, pairs)) if rule is not None else Poly()


def known_ops() -> set[str]:
    return set(ops.all_ops())


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
    # A scan (compiler/ops/recurrence.py) holds products of several kinds in its step: its MACs
    # by kind, {kind: (macs, macs_causal)}, which ``total`` reads instead of ``kind``.
    split: dict[str, tuple[Poly, Poly]] | None = None



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
        if n.op == "scan":
            out.append(_scan_cost(graph, n, layer))
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
        if ops.has_trait(n.op, "matmul_class"):
            kind = "head" if n.name in st.head else ("attention" if n.name in st.mixing else "dense")
        else:
            kind = "other"
        out.append(NodeCost(n.name, n.op, kind, layer, *got))
    return out, st


def _node_polys(graph: Graph, n: Node, a: Attention | None):
    cost = ops.get(n.op).cost
    macs = _macs(graph, n)
    if cost.per_pair:  # fused attention: its work scales with the pairs the mask lets through
        flops = cost.flops(CostContext(graph, n, None, macs))
        if a is None or not a.causal:
            return macs, macs, flops, flops
        pairs = score_pairs(a)
        macs_c = _macs(graph, n, pairs)
        return macs, macs_c, flops, cost.flops(CostContext(graph, n, pairs, macs_c))
    flops = _flops(graph, n, macs)
    if a is None or not a.causal:
        return macs, macs, flops, flops
    score = graph.nodes[a.score]
    rows = numel(graph.type_of(score.outputs[0]).shape[:-2])
    pairs = score_pairs(a)
    macs_c, flops_c = macs, flops
    if n.op == "matmul":  # the attention's score or weighting product
        inner = graph.type_of(n.inputs[0]).shape[-1] if n.name == a.score else graph.type_of(n.outputs[0]).shape[-1]
        macs_c = rows * pairs * _dim(inner)
        flops_c = _flops(graph, n, macs_c)
    elif n.outputs[0] in a.internal:
        flops_c = _flops(graph, n, macs, elems=rows * pairs)
    return macs, macs_c, flops, flops_c


def _flops(graph: Graph, n: Node, macs: Poly, elems: Poly | None = None) -> dict[str, Poly]:
    """FLOPs by category; ``elems`` replaces the output's element count (masked-in scores)."""
    d = ops.get(n.op)
    cost = d.cost
    f: dict[str, Poly] = {}
    if cost.kind == "product":
        f["matmul"] = macs * 2
        # a quantised linear's weight takes two inputs (three with zero points)
        bias = 3 + int(n.attrs.get("zero_points", 0)) if "quantized" in d.traits else 2
        if "dense" in d.traits and len(n.inputs) == bias + 1:
            f["bias"] = elems if elems is not None else _out(graph, n)
    elif cost.kind == "per_element":
        f[cost.category] = (elems if elems is not None else _out(graph, n)) * cost.per
    elif cost.kind == "custom":
        f = cost.flops(CostContext(graph, n, None, macs))
    return {k: v for k, v in f.items() if not v.is_zero()}


def _scan_cost(graph: Graph, n: Node, layer: str | None) -> NodeCost:
    """A scan costs its step's nodes once per step: every polynomial × T (the length of axis 1 of its
    per-step inputs). Products in the step between two data-dependent operands (the weighting of an
    attention decoder's context over the source) are attention; the rest are dense (weights)."""
    body = n.attrs["body"].graph
    length = _dim(graph.type_of(n.inputs[n.attrs["n_state"]]).shape[1])
    inner, _ = node_costs(body)
    params = set(body.inputs[len(body.inputs) - _n_params(graph, n):])
    data = set(body.inputs) - params
    for b in body.nodes.values():
        if any(v in data for v in b.inputs):
            data.update(b.outputs)
    split: dict[str, tuple[Poly, Poly]] = {}
    for c in inner:
        b = body.nodes.get(c.node)
        if c.split:
            parts = c.split.items()
        else:
            kind = "attention" if b is not None and b.op == "matmul" and all(v in data for v in b.inputs) else \
                ("dense" if c.kind in ("dense", "head", "attention") else c.kind)
            parts = [(kind, (c.macs, c.macs_causal))]
        for kind, (m, mc) in parts:
            old = split.get(kind, (Poly(), Poly()))
            split[kind] = (old[0] + m * length, old[1] + mc * length)
    flops: dict[str, list[Poly]] = {}
    for c in inner:
        for k, v in c.flops.items():
            flops.setdefault(k, []).append(v * length)
    f = {k: Poly.sum(v) for k, v in flops.items()}
    macs = Poly.sum(m for m, _ in split.values())
    macs_c = Poly.sum(mc for _, mc in split.values())
    return NodeCost(n.name, n.op, "dense", layer, macs, macs_c, f, dict(f), split=split)


def _n_params(graph: Graph, n: Node) -> int:
    """How many of a scan's trailing inputs are the model's parameters (captured by its step)."""
    count = 0
    for v in reversed(n.inputs):
        if graph.values[v].kind != "param":
            break
        count += 1
    return count


def total(costs: list[NodeCost], attr: str = "macs", kinds: set[str] | None = None,
          layer: str | None = None) -> Poly:
    parts = []
    for c in costs:
        if layer is not None and c.layer != layer:
            continue
        if c.split is not None and attr in ("macs", "macs_causal"):
            i = 0 if attr == "macs" else 1
            parts += [v[i] for k, v in c.split.items() if kinds is None or k in kinds]
        elif kinds is None or c.kind in kinds:
            parts.append(getattr(c, attr))
    return Poly.sum(parts)


def flops_by_category(costs: list[NodeCost], causal: bool = False) -> dict[str, Poly]:
    parts: dict[str, list[Poly]] = {}
    for c in costs:
        for k, v in (c.flops_causal if causal else c.flops).items():
            parts.setdefault(k, []).append(v)
    out = {k: Poly.sum(v) for k, v in parts.items()}
    order = ["matmul", "bias", "softmax", "norm", "activation", "elementwise", "mask", "position", "routing"]
    return {k: out[k] for k in sorted(out, key=lambda k: (order.index(k) if k in order else len(order), k))}
