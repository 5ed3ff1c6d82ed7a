"""Make every dense mixture of experts sparse: one ``sparse_moe`` node (compiler/ops/experts.py).

The standard library's ``moe`` block (spec/stdlib/nn.tsr) is written densely: ``topk_gates`` of the
router logits, and for each expert ``e`` its feed-forward output times ``slice(gates, -1, e, e+1)``,
summed. This pass recognises that form from the dataflow (not from names), with SwiGLU experts
(``linear(silu(linear(x, gate)) * linear(x, up), down)``, no biases, every expert reading the same
``x``), and replaces the sum with one ``sparse_moe`` node that runs each token's top-k experts only.
The router stays a ``linear`` (the quantiser and the report see it as before). A block the pattern
does not fit stays dense, and its note says why (``--explain`` prints it).

Run after weight quantisation: experts already quantised (``linear_nbits``) are left dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.ops.experts import IMPLS
from tessera.compiler.passes.base import Pass, PassError, PassResult

# Chosen by measurement (bench/moe.py, docs/BENCHMARKS.md): the standard-op gather/scatter form ran a
# 2-layer Mixtral-shaped model at N = 512 2.7x faster than dense, onnxruntime's MoE kernel 2.1x (its CPU
# kernel runs each expert's products on one thread).
DEFAULT_IMPL = "gather"
DISABLED = "sparse experts disabled (--no-sparse-moe)"


@dataclass
class ExpertSite:
    """One topk_gates node the pass looked at, and what became of it."""

    gate: str
    scope: str
    experts: int
    top: int
    sparse: bool
    reason: str = ""
    node: str | None = None
    impl: str | None = None

    def describe(self) -> str:
        where = self.scope or "<model>"
        head = f"{where}: top {self.top} of {self.experts} experts"
        return f"{head}: sparse ({self.impl})" if self.sparse else f"{head}: dense: {self.reason}"


class NoMatch(Exception):
    pass


@dataclass
class Match:
    x: str
    logits: str
    weights: list[str]     # gate, up, down of each expert, in expert order
    root: str              # node whose output is the block's sum
    covered: list[str]     # nodes the sparse node replaces (root excluded)


def _only_consumer(graph: Graph, value: str) -> Node:
    users = graph.consumers(value)
    if len(users) != 1 or value in graph.outputs:
        raise NoMatch(f"{value} is used outside the expert block")
    return users[0]


def _weight_of(graph: Graph, node: Node | None, what: str) -> tuple[str, str]:
    """(input, weight) of a bias-free float linear with a parameter weight."""
    if node is None or node.op != "linear":
        op = node.op if node is not None else "an input"
        if op == "linear_nbits":
            raise NoMatch("the experts are quantised (linear_nbits): sparse_moe takes float weights")
        raise NoMatch(f"an expert's {what} is {op}, not a linear (only SwiGLU experts are made sparse)")
    if len(node.inputs) != 2:
        raise NoMatch(f"an expert's {what} linear has a bias (only bias-free SwiGLU experts are made sparse)")
    if node.inputs[1] not in graph.params:
        raise NoMatch(f"an expert's {what} weight is computed, not a parameter")
    return node.inputs[0], node.inputs[1]


def _swiglu(graph: Graph, out: str) -> tuple[str, list[str], list[str]]:
    """(x, [gate, up, down] weights, nodes) of down(silu(gate(x)) * up(x))."""
    down = graph.producer(out)
    h, w_down = _weight_of(graph, down, "output")
    mul = graph.producer(h)
    if mul is None or mul.op != "mul" or len(mul.inputs) != 2:
        raise NoMatch("an expert is not a SwiGLU (down(silu(gate(x)) * up(x)))")
    a, b = (graph.producer(v) for v in mul.inputs)
    silu, up = (a, b) if a is not None and a.op == "silu" else (b, a)
    if silu is None or silu.op != "silu":
        raise NoMatch("an expert is not a SwiGLU (no silu before its down projection)")
    x_g, w_gate = _weight_of(graph, graph.producer(silu.inputs[0]), "gate")
    x_u, w_up = _weight_of(graph, up, "up")
    if x_g != x_u:
        raise NoMatch("an expert's gate and up read different inputs")
    nodes = [graph.producer(silu.inputs[0]).name, silu.name, up.name, mul.name, down.name]
    for n in nodes[:-1]:
        _only_consumer(graph, graph.nodes[n].outputs[0])
    return x_g, [w_gate, w_up, w_down], nodes


def match(graph: Graph, gate: Node) -> Match:
    """The dense block around one topk_gates node, or NoMatch with the reason."""
    shape = graph.type_of(gate.inputs[0]).shape
    e_count = int(shape[-1])
    slices: dict[int, Node] = {}
    for s in graph.consumers(gate.outputs[0]):
        a = s.attrs
        if s.op != "slice" or a.get("axis") not in (-1, len(shape) - 1) or a.get("end") != a.get("start", 0) + 1 \
                or a.get("step", 1) != 1:
            raise NoMatch(f"the gates are also read by {s.op} {s.name}, not only by one slice per expert")
        slices[int(a["start"])] = s
    if sorted(slices) != list(range(e_count)):
        raise NoMatch(f"the gates are sliced for experts {sorted(slices)}, not each of 0..{e_count - 1}")
    if gate.outputs[0] in graph.outputs:
        raise NoMatch("the gates are a graph output")
    x = None
    weights: list[str] = []
    covered = [gate.name]
    leaves: dict[str, int] = {}
    for e in range(e_count):
        s = slices[e]
        m = _only_consumer(graph, s.outputs[0])
        if m.op != "mul" or len(m.inputs) != 2:
            raise NoMatch(f"expert {e}'s gate feeds {m.op}, not a product with the expert's output")
        branch = m.inputs[1] if m.inputs[0] == s.outputs[0] else m.inputs[0]
        bx, w, nodes = _swiglu(graph, branch)
        _only_consumer(graph, branch)
        if x is None:
            x = bx
        elif bx != x:
            raise NoMatch("the experts read different inputs")
        weights += w
        covered += [s.name] + nodes
        leaves[m.outputs[0]] = e
        covered.append(m.name)
    # the sum: a tree of adds whose leaves are exactly the weighted experts
    if e_count == 1:
        return Match(x, gate.inputs[0], weights, covered.pop(), covered)
    tree = set(leaves)   # values that are sums of weighted experts only
    adds: set[str] = set()
    grew = True
    while grew:
        grew = False
        for v in list(tree):
            users = graph.consumers(v)
            if len(users) == 1 and users[0].op == "add" and users[0].name not in adds \
                    and len(set(users[0].inputs)) == 2 and all(i in tree for i in users[0].inputs):
                adds.add(users[0].name)
                tree.add(users[0].outputs[0])
                grew = True
    roots = [v for v in tree if not any(u.name in adds for u in graph.consumers(v))]
    if len(roots) != 1:
        raise NoMatch("the weighted experts are not summed by one tree of adds")
    root = roots[0]
    for v in tree - {root}:
        if v in graph.outputs or len(graph.consumers(v)) != 1:
            raise NoMatch("a partial sum of the experts is used outside the block")
    root_node = graph.producer(root)
    covered += sorted(a for a in adds if a != root_node.name)
    return Match(x, gate.inputs[0], weights, root_node.name, covered)


class SparseExperts(Pass):
    """Replace each dense mixture of experts with one sparse_moe node; notes: an ExpertSite each."""

    name = "sparse-experts"

    def __init__(self, enabled: bool = True, impl: str | None = None):
        impl = impl or DEFAULT_IMPL
        if impl not in IMPLS:
            raise PassError(f"sparse experts: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.enabled, self.impl = enabled, impl

    def run(self, graph: Graph) -> PassResult:
        sites = []
        changed = False
        for g in [n for n in graph.nodes.values() if n.op == "topk_gates"]:
            e, k = int(graph.type_of(g.inputs[0]).shape[-1]), int(g.attrs["k"])
            if not self.enabled:
                sites.append(ExpertSite(g.name, g.scope, e, k, False, DISABLED))
                continue
            try:
                m = match(graph, g)
            except NoMatch as why:
                sites.append(ExpertSite(g.name, g.scope, e, k, False, str(why)))
                continue
            node = graph.replace_node(m.root, "sparse_moe", [m.x, m.logits] + m.weights,
                                      {"k": k, "experts": e, "impl": self.impl})
            node.scope = g.scope  # the block's scope (the node keeps the last add's name and place)
            graph.remove_nodes(m.covered)
            changed = True
            sites.append(ExpertSite(g.name, g.scope, e, k, True, node=node.name, impl=self.impl))
        if changed:
            graph.prune_constants()
            graph.sort()
        return PassResult(graph, changed, sites)


__all__ = ["SparseExperts", "ExpertSite", "match", "NoMatch", "DEFAULT_IMPL", "DISABLED"]
