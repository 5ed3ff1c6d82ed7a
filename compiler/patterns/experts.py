"""The dense mixture of experts, recognised once for the report and for the sparse pass.

The standard library's ``moe`` block (spec/stdlib/nn.tsr) is written densely: ``topk_gates`` of the
router logits, and for each expert ``e`` its output times ``slice(gates, -1, e, e+1)``, summed.

- ``weighs_experts(graph, gate)``: whether a topk_gates node weighs experts at all (one slice per
  expert); a topk_gates used as a mask or a group choice is a routing step, not a mixture.
- ``routing(graph, gate)``: the gates sliced once per expert, each slice weighting one expert's
  output by a ``mul``. analysis/structure.py reports every block this matches (its experts,
  whatever they compute), so the report and the pass agree on what is a mixture of experts.
- ``sparse_block(graph, gate)``: that, with SwiGLU experts (``SWIGLU``: bias-free float linears,
  every expert reading the same ``x``) summed by one tree of adds: what passes/sparse_moe.py
  replaces with one ``sparse_moe`` node. A failure keeps its reason and node (``--explain``).

Recognised from the dataflow, not from names.
"""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.patterns.matcher import MatchResult, Pat, match

_OUTSIDE = "{value} is used outside the expert block"


def _linear(what: str):
    """A bias-free float linear with a parameter weight, or the reason it is not (the expert's ``what``)."""
    def check(graph: Graph, value: str, node: Node | None) -> str | None:
        if node is None or node.op != "linear":
            op = node.op if node is not None else "an input"
            if op in ("linear_nbits", "linear_int8"):
                return f"the experts are quantised ({op}): sparse_moe takes float weights"
            return f"an expert's {what} is {op}, not a linear (only SwiGLU experts are made sparse)"
        if len(node.inputs) != 2:
            return f"an expert's {what} linear has a bias (only bias-free SwiGLU experts are made sparse)"
        if node.inputs[1] not in graph.params:
            return f"an expert's {what} weight is computed, not a parameter"
        return None
    return check


def _proj(what: str, weight: str, private: bool = True) -> Pat:
    return Pat("linear", (Pat(name="x", differs="an expert's gate and up read different inputs"), Pat(name=weight)),
               check=_linear(what), private=private, outside=_OUTSIDE)


# down(silu(gate(x)) * up(x)): an expert the sparse_moe op computes
SWIGLU = Pat("linear", (
    Pat("mul", (
        Pat("silu", (_proj("gate", "w_gate"),), private=True, outside=_OUTSIDE,
            why="an expert is not a SwiGLU (no silu before its down projection)"),
        _proj("up", "w_up"),
    ), commutative=True, private=True, outside=_OUTSIDE,
        why="an expert is not a SwiGLU (down(silu(gate(x)) * up(x)))"),
    Pat(name="w_down"),
), check=_linear("output"), private=True, outside=_OUTSIDE)


def weighs_experts(graph: Graph, gate: Node) -> bool:
    """Whether any one expert's gate is sliced out of this topk_gates node's output (width 1 on the last
    axis): a mixture, recognised or not. Without such a slice it is a routing step of some other use (a
    mask, ``topk_gates(s, k) > 0.0``, or a choice among groups), which neither the report nor --explain
    counts as a mixture of experts."""
    last = graph.type_of(gate.inputs[0]).rank - 1
    return any(s.op == "slice" and s.attrs.get("axis") in (-1, last)
               and s.attrs.get("end") == s.attrs.get("start", 0) + 1 for s in graph.consumers(gate.outputs[0]))


def routing(graph: Graph, gate: Node) -> MatchResult:
    """The dense routing of one topk_gates node; captured ``experts``: (slice, mul, the expert's
    output value) per expert, in expert order, and ``outside``: (reason, node) for each use of the
    gates beyond that (still a mixture of experts for the report; not one the pass may replace)."""
    shape = graph.type_of(gate.inputs[0]).shape
    count = int(shape[-1])
    slices: dict[int, Node] = {}
    outside: list[tuple[str, Node]] = []
    for s in graph.consumers(gate.outputs[0]):
        a = s.attrs
        if s.op != "slice" or a.get("axis") not in (-1, len(shape) - 1) or a.get("end") != a.get("start", 0) + 1 \
                or a.get("step", 1) != 1 or int(a["start"]) in slices:
            outside.append((f"the gates are also read by {s.op} {s.name}, not only by one slice per expert", s))
            continue
        slices[int(a["start"])] = s
    if sorted(slices) != list(range(count)):
        return MatchResult.fail(f"the gates are sliced for experts {sorted(slices)}, not each of 0..{count - 1}", gate)
    if gate.outputs[0] in graph.outputs:
        outside.append(("the gates are a graph output", gate))
    experts = []
    for e in range(count):
        s = slices[e]
        users = graph.consumers(s.outputs[0])
        if len(users) != 1 or s.outputs[0] in graph.outputs:
            return MatchResult.fail(_OUTSIDE.format(value=s.outputs[0]), s)
        m = users[0]
        if m.op != "mul" or len(m.inputs) != 2:
            return MatchResult.fail(f"expert {e}'s gate feeds {m.op}, not a product with the expert's output", m)
        experts.append((s, m, m.inputs[1] if m.inputs[0] == s.outputs[0] else m.inputs[0]))
    return MatchResult(True, {"experts": experts, "outside": outside},
                       [gate] + [n for s, m, _ in experts for n in (s, m)])


def sparse_block(graph: Graph, gate: Node) -> MatchResult:
    """The block ``sparse_moe`` replaces; captured ``x``, ``logits``, ``weights`` (gate, up, down of
    each expert, in expert order), ``root`` (the node whose output is the block's sum) and
    ``covered`` (the nodes it replaces, root excluded)."""
    r = routing(graph, gate)
    if not r:
        return r
    if r["outside"]:
        return MatchResult.fail(*r["outside"][0])
    x = None
    weights: list[str] = []
    covered = [gate.name]
    leaves: dict[str, int] = {}
    for e, (s, m, branch) in enumerate(r["experts"]):
        expert = match(graph, SWIGLU, branch)
        if not expert:
            return expert
        if x is not None and expert["x"] != x:
            return MatchResult.fail("the experts read different inputs", expert["x.node"] if "x.node" in expert.captured
                                    else m)
        x = expert["x"]
        weights += [expert["w_gate"], expert["w_up"], expert["w_down"]]
        covered += [s.name] + [n.name for n in _swiglu_order(expert)]
        leaves[m.outputs[0]] = e
        covered.append(m.name)
    if len(leaves) == 1:
        return MatchResult(True, {"x": x, "logits": gate.inputs[0], "weights": weights, "root": covered.pop(),
                                  "covered": covered})
    return _sum_tree(graph, gate, x, weights, covered, set(leaves))


def _swiglu_order(expert: MatchResult) -> list[Node]:
    """The expert's nodes as the block lists them: gate, silu, up, mul, down."""
    down, mul, silu, gate, up = expert.nodes
    return [gate, silu, up, mul, down]


def _sum_tree(graph: Graph, gate: Node, x: str, weights: list[str], covered: list[str], tree: set[str]) -> MatchResult:
    """The weighted experts summed by one tree of adds whose leaves are exactly those products."""
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
        return MatchResult.fail("the weighted experts are not summed by one tree of adds", gate)
    root = roots[0]
    for v in tree - {root}:
        if v in graph.outputs or len(graph.consumers(v)) != 1:
            return MatchResult.fail("a partial sum of the experts is used outside the block", graph.producer(v))
    root_node = graph.producer(root)
    covered += sorted(a for a in adds if a != root_node.name)
    return MatchResult(True, {"x": x, "logits": gate.inputs[0], "weights": weights, "root": root_node.name,
                              "covered": covered})
