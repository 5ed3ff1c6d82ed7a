"""Recognise the parts of a graph that the cost report reasons about.

The report must not trust names or hyperparameters (a spec may call its heads
anything), so it reads structure from the dataflow: attention is what the one
recogniser (compiler/patterns/attention.py) matches, the same sites the fusion
pass fuses or gives a reason for; its keys and values are what feeds the two
matmuls before any transpose or grouped-query repeat; a mixture of experts is a ``topk_gates``
node whose slices weigh the outputs of expert branches (dense), or one ``sparse_moe`` node; the output head is a
dense layer outside the repeated layers that follows all attention; a norm is a ``layernorm`` or
``rmsnorm`` node or the same computation written from primitives (compiler/patterns/norm.py).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

from tessera.compiler import ops
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.ops.experts import expert_inputs
from tessera.compiler.patterns.attention import AttentionMatch, recognise
from tessera.compiler.patterns.experts import routing
from tessera.compiler.patterns.norm import norm_parameters

# Ops that only move or relabel data: followed when tracing keys and values back.
_LAYOUT = {"transpose", "repeat_kv", "reshape", "identity", "cast"}
DENSE_OPS = ops.with_trait("dense")  # products with weights: linear, convolutions

_LAYER_RE = re.compile(r"^(.*?[A-Za-z_]\w*\.\d+)(?=[./]|$)")


def layer_key(name: str) -> str | None:
    """The repeated layer a scope or node belongs to: the shortest prefix ending in a number
    (``layers.3``, ``encoder.layers.0``), or None outside repeated layers."""
    m = _LAYER_RE.match(name)
    return m.group(1) if m else None


def node_layer(node: Node) -> str | None:
    return layer_key(node.scope) or layer_key(node.name)


@dataclass
class Attention:
    """One scaled-dot-product attention: scores = q @ k^T ..., softmax, @ v."""

    score: str                 # node name of the score matmul
    value: str | None          # node name of the weighting matmul (None if not found)
    internal: list[str]        # values shaped [..., Tq, Tk] between them (scores ... probabilities)
    core_nodes: list[str]      # score matmul, path to softmax, softmax, weighting matmul
    q: str                     # value feeding the score matmul as queries
    k: str                     # keys as they would be cached: before transpose and repeat_kv
    v: str | None              # values as they would be cached
    layout: list[str]          # transpose/repeat_kv nodes between k, v and the matmuls
    causal: bool
    window: int
    tq: object                 # sympy dims of the score matrix
    tk: object
    fusable: bool = False      # a fused kernel can replace it (False once fused: nothing left to fuse)
    reason: str = ""           # why not, as --explain says it ("" when fusable or already fused)

    @property
    def fused(self) -> bool:
        """One fused_attention node (score, weighting and everything between)."""
        return self.score == self.value

    @property
    def cross(self) -> bool:
        """Keys from another sequence than the queries (cross-attention)."""
        return self.tq != self.tk


@dataclass
class Experts:
    """A mixture of experts: ``gate`` (topk_gates) picks ``top`` of ``count`` expert branches."""

    gate: str
    top: int
    count: int
    branches: list[list[str]] = field(default_factory=list)  # node names of each expert branch
    params: list[list[str]] = field(default_factory=list)    # parameter paths of each branch
    sparse: bool = False  # one sparse_moe node (``gate``): only the top experts run, its cost says so


@dataclass
class Structure:
    data: set[str]                  # values that depend on a graph input
    mixing: set[str]                # matmul nodes of two data-dependent operands (the N²·D part)
    attention: list[Attention]
    experts: list[Experts]
    head: set[str]                  # dense nodes of the output head
    consumers: dict[str, list[Node]]
    core_of: dict[str, Attention]   # node name -> the attention it belongs to
    norm_params: set[str] = field(default_factory=set)  # parameters of norms written from primitives


def _consumers(graph: Graph) -> dict[str, list[Node]]:
    out: dict[str, list[Node]] = {}
    for n in graph.nodes.values():
        for v in n.inputs:
            out.setdefault(v, []).append(n)
    return out


def data_dependent(graph: Graph) -> set[str]:
    """Values computed from a graph input (not only from parameters, constants and shapes)."""
    data = set(graph.inputs)
    for n in graph.nodes.values():
        if any(v in data for v in n.inputs):
            data.update(n.outputs)
    return data


def _producer(graph: Graph, value: str) -> Node | None:
    p = graph.values[value].producer
    return graph.nodes[p] if p else None


def _trace_back(graph: Graph, value: str, through: set[str]) -> tuple[str, list[str]]:
    """Follow `value` back through layout ops; returns the source value and the ops passed."""
    path = []
    while True:
        n = _producer(graph, value)
        if n is None or n.op not in through:
            return value, path
        path.append(n.name)
        value = n.inputs[0]


def _fused(n: Node, graph: Graph) -> Attention:
    """A fused_attention node (made by compiler/passes/fuse_attention.py): q, k, v are its inputs,
    k and v already without the grouped-query repeat."""
    return Attention(score=n.name, value=n.name, internal=[], core_nodes=[n.name], q=n.inputs[0],
                     k=n.inputs[1], v=n.inputs[2], layout=[], causal=bool(n.attrs.get("causal")),
                     window=int(n.attrs.get("window") or 0), tq=graph.type_of(n.inputs[0]).shape[-2],
                     tk=graph.type_of(n.inputs[1]).shape[-2])


def _from_match(graph: Graph, m: AttentionMatch) -> Attention:
    """The report's view of one match: keys and values traced back to what a cache would hold."""
    score, weigh = graph.nodes[m.score], graph.nodes[m.value]
    t = graph.type_of(score.outputs[0])
    k, k_path = _trace_back(graph, score.inputs[1], _LAYOUT)
    v, v_path = _trace_back(graph, weigh.inputs[1], _LAYOUT)
    return Attention(score=m.score, value=m.value, internal=list(dict.fromkeys(m.internal)),
                     core_nodes=m.core_nodes, q=score.inputs[0], k=k, v=v, layout=k_path + v_path,
                     causal=m.causal, window=m.window, tq=t.shape[-2], tk=t.shape[-1],
                     fusable=m.fusable, reason=m.reason)


def find_attention(graph: Graph, data: set[str] | None = None, consumers=None) -> list[Attention]:
    """Every attention the recogniser (compiler/patterns/attention.py) matches, fused or not, in graph
    order: the same sites the fusion pass sees. ``data`` and ``consumers`` are accepted for callers of
    the old signature and not needed."""
    found = []
    for cand in recognise(graph):
        if cand.match is None:
            continue
        found.append(_fused(cand.node, graph) if cand.match.fused else _from_match(graph, cand.match))
    return found


def _exclusive_upstream(graph: Graph, pos: dict[str, int], reference: str, sources: list[str]) -> list[set[str]]:
    """For each source value, the nodes upstream of it (its producer included) that are not
    upstream of the `reference` value.

    Sweeps nodes in decreasing graph position, carrying a bit per source (bit 0: reference);
    it stops as soon as every pending node is also upstream of the reference, so the cost is
    the size of the branches, not of the graph before them."""
    mark: dict[str, int] = {}
    heap: list[tuple[int, str]] = []
    pending = 0  # queued nodes without the reference bit

    def push(value: str, bits: int) -> None:
        nonlocal pending
        p = graph.values[value].producer
        if p is None:
            return
        old = mark.get(p)
        if old is None:
            mark[p] = bits
            heapq.heappush(heap, (-pos[p], p))
            pending += not bits & 1
        elif old | bits != old:
            mark[p] = old | bits
            pending -= (not old & 1) and bool(bits & 1)

    push(reference, 1)
    for i, v in enumerate(sources):
        push(v, 1 << (i + 1))
    out: list[set[str]] = [set() for _ in sources]
    while heap and pending:
        _, name = heapq.heappop(heap)
        bits = mark[name]
        if not bits & 1:
            pending -= 1
            for i in range(len(sources)):
                if bits >> (i + 1) & 1:
                    out[i].add(name)
        for v in graph.nodes[name].inputs:
            push(v, bits)
    return out


def find_experts(graph: Graph, consumers) -> list[Experts]:
    out = []
    pos = {name: i for i, name in enumerate(graph.nodes)}
    for g in graph.nodes.values():
        if g.op == "sparse_moe":  # compiler/passes/sparse_moe.py: weights gate, up, down (biases) per expert
            out.append(Experts(gate=g.name, top=int(g.attrs["k"]), count=int(g.attrs["experts"]),
                               params=[sorted(ws) for ws in expert_inputs(g.inputs, g.attrs)], sparse=True))
            continue
        if g.op != "topk_gates":
            continue
        e = Experts(gate=g.name, top=int(g.attrs["k"]), count=int(graph.type_of(g.inputs[0]).shape[-1]))
        routed = routing(graph, g)  # the recogniser passes/sparse_moe.py builds on
        branch_outputs = [out for _, _, out in routed["experts"]] if routed else []
        for branch in _exclusive_upstream(graph, pos, g.outputs[0], branch_outputs):
            order = sorted(branch, key=pos.__getitem__)
            e.branches.append(order)
            e.params.append(sorted({v for n in order for v in graph.nodes[n].inputs if v in graph.params}))
        if e.branches:
            out.append(e)
    return out


def find_head(graph: Graph, mixing: set[str], consumers) -> set[str]:
    """Dense nodes outside the repeated layers that follow some attention and precede none."""
    if not mixing:
        return set()
    after: set[str] = set()      # values downstream of a mixing matmul
    for n in graph.nodes.values():
        if n.name in mixing or any(v in after for v in n.inputs):
            after.update(n.outputs)
    before: set[str] = set()     # node names upstream of (or at) a mixing matmul
    for n in reversed(list(graph.nodes.values())):
        if n.name in mixing or any(c.name in before for v in n.outputs for c in consumers.get(v, [])):
            before.add(n.name)
    head = set()
    for n in graph.nodes.values():
        dense = n.op in DENSE_OPS or (n.op == "matmul" and n.name not in mixing)
        if dense and node_layer(n) is None and n.name not in before and any(v in after for v in n.inputs):
            head.add(n.name)
    return head


def analyse(graph: Graph) -> Structure:
    consumers = _consumers(graph)
    data = data_dependent(graph)
    mixing = {n.name for n in graph.nodes.values()
              if (n.op == "matmul" and all(v in data for v in n.inputs)) or n.op == "fused_attention"}
    attention = find_attention(graph, data, consumers)
    experts = find_experts(graph, consumers)
    head = find_head(graph, mixing, consumers)
    core_of = {name: a for a in attention for name in a.core_nodes}
    return Structure(data, mixing, attention, experts, head, consumers, core_of, norm_parameters(graph))
