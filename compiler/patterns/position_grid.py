"""A score bias computed from the positions alone: a function of (query position, key position).

Why: T5's relative position bias (and any bias written the same way: ALiBi from ``arange``, a
clipped distance, ...) is computed in the spec from ``arange(T)`` -- one ``arange`` reshaped to
[T, 1] (the query's position i), one to [1, T] (the key's position j), combined pointwise,
looked up in a learned table, laid out as [1, heads, T, T]. Without a cache the query and the
key positions are both 0..T-1. With a KV cache they are not: a decoding step's one query is at
position p, its keys at 0..p, and they are each row's own (left padding, a buffer's unfilled
slots). The KV cache pass (passes/position_bias.py) rewrites the bias to read the cache's
positions instead, which is exact only if the bias at (i, j) depends on i and j and nothing
else. This module finds that structure or says why it is something else:

- every node between the ``arange(T)`` uses and the attention's bias input is pointwise (the
  ``elementwise`` trait, numpy broadcasting), a ``transpose``, a ``reshape`` that only adds or
  drops axes of size 1, or an ``embedding`` whose table does not depend on the positions (a
  learned table);
- every other operand is fixed: a constant, a parameter, or computed from them (static shape);
- in the bias, the positions lie on its last two axes only, each ``arange`` use on one of them:
  the second-to-last is the query axis, the last the key axis.

Each use of an ``arange`` (an edge from it to a consumer) is a leaf of its own, so one
``arange(T)`` read as both ``reshape(p, [T, 1])`` and ``reshape(p, [1, T])`` gives a query
leaf and a key leaf. A use is part of a grid when the nodes it reaches, stopping at attention
nodes, include an attention's bias input; other uses (a position table's embedding) are
left to the position pass (passes/kv_cache.py ``ReadPositionIds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler import ops
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node

QUERY, KEY = "query", "key"
LAYOUT_OPS = ("transpose", "reshape", "embedding")


class NotPositionGrid(Exception):
    """A use of the positions on the way to a score bias that is not a function of the query and key
    positions the cache could substitute (the reason)."""


@dataclass(frozen=True)
class Leaf:
    """One use of an ``arange(T)``: the consumer ``node`` reads the positions ``arange`` gives."""

    arange: str
    node: str


@dataclass(frozen=True)
class PositionGrid:
    """The bias subgraph: ``nodes`` in graph order (from the leaves to the biases), each leaf's role
    (QUERY or KEY), and each bias value with the attention nodes reading it as their bias input."""

    nodes: tuple[str, ...]
    roles: dict[Leaf, str]
    biases: dict[str, tuple[str, ...]]

    def aranges(self) -> set[str]:
        return {leaf.arange for leaf in self.roles}


def bias_input(node: Node) -> str | None:
    """A fused attention's additive bias input (after q, k, v and the padding mask), or None."""
    if node.op != "fused_attention" or not node.attrs.get("bias"):
        return None
    return node.inputs[3 + int(bool(node.attrs.get("padding")))]


def _reached(g: Graph, start: Node) -> list[Node]:
    """``start`` and every node downstream of it, stopping at (and including) attention nodes."""
    seen, todo = {start.name: start}, [start]
    while todo:
        n = todo.pop()
        if n.op == "fused_attention":
            continue
        for o in n.outputs:
            for u in g.consumers(o):
                if u.name not in seen:
                    seen[u.name] = u
                    todo.append(u)
    return list(seen.values())


def _feeds_a_bias(g: Graph, nodes: list[Node]) -> bool:
    outs = {o for n in nodes if n.op != "fused_attention" for o in n.outputs}
    return any(bias_input(n) in outs for n in nodes if n.op == "fused_attention")


class FixedValues:
    """Whether a value is the same for every position and row: a constant, a parameter, or computed
    from them alone, with a static shape (memoised)."""

    def __init__(self, g: Graph):
        self.g, self.memo = g, {}

    def __call__(self, value: str) -> bool:
        if value not in self.memo:
            g = self.g
            p = g.producer(value)
            static = all(dims.is_static(d) for d in g.type_of(value).shape)
            self.memo[value] = static and (value in g.consts or value in g.params or (
                p is not None and p.op != "arange" and all(self(i) for i in p.inputs)))
        return self.memo[value]


def site_of(n: Node) -> str:
    return f"{n.op} at {n.scope or '<model>'}"


def _unit(d) -> bool:
    return dims.is_static(d) and int(d) == 1


def reshape_labels(g: Graph, n: Node, labels: tuple) -> tuple:
    """A reshape that adds or drops axes of size 1 only: the other axes keep their labels, in order."""
    src, dst = g.type_of(n.inputs[0]).shape, g.type_of(n.outputs[0]).shape
    kept = [i for i, d in enumerate(src) if not _unit(d)]
    into = [i for i, d in enumerate(dst) if not _unit(d)]
    if len(kept) != len(into) or not all(dims.equal(src[i], dst[j]) for i, j in zip(kept, into)):
        raise NotPositionGrid(f"the {site_of(n)} merges or splits axes ({dims.fmt_shape(src)} to "
                              f"{dims.fmt_shape(dst)}), not only adds or drops axes of size 1")
    out = [frozenset()] * len(dst)
    for i, j in zip(kept, into):
        out[j] = labels[i]
    return tuple(out)


def broadcast_labels(shapes_labels: list[tuple[tuple, tuple]], rank: int) -> tuple:
    """Numpy broadcasting, right-aligned: each output axis gets the labels of the operands' axis there."""
    out = [frozenset()] * rank
    for _, labels in shapes_labels:
        for k, lab in enumerate(labels):
            out[rank - len(labels) + k] = out[rank - len(labels) + k] | lab
    return tuple(out)


def _labels(g: Graph, n: Node, grid_in: dict[str, tuple], fixed: FixedValues) -> tuple:
    """The output's labels (per axis, the leaves whose positions vary along it), or NotPositionGrid."""
    for i, v in enumerate(n.inputs):
        if v not in grid_in and not fixed(v):
            raise NotPositionGrid(f"the {site_of(n)} combines the positions with {v}, which is not fixed (not a "
                                  f"constant, a parameter or computed from them alone)")
    out_t = g.type_of(n.outputs[0])
    if ops.has_trait(n.op, "elementwise"):
        return broadcast_labels([(g.type_of(v).shape, grid_in[v]) for v in n.inputs if v in grid_in], out_t.rank)
    if n.op == "transpose":
        return tuple(grid_in[n.inputs[0]][p] for p in n.attrs["perm"])
    if n.op == "reshape":
        return reshape_labels(g, n, grid_in[n.inputs[0]])
    if n.op == "embedding":
        if n.inputs[1] in grid_in:
            raise NotPositionGrid(f"the {site_of(n)} reads a table computed from the positions")
        return grid_in[n.inputs[0]] + (frozenset(),)
    raise NotPositionGrid(f"the positions are read by {site_of(n)} (not pointwise, a transpose, a reshape adding "
                          f"or dropping axes of size 1, or a learned table's embedding), so a score at (i, j) may "
                          f"depend on other positions than i and j")


def position_grid(g: Graph, t_dim) -> PositionGrid | None:
    """The score biases computed from ``arange(t_dim)`` (None if no attention's bias is), or NotPositionGrid."""
    leaves: list[Leaf] = []
    reached: dict[str, Node] = {}
    for a in [n for n in g.nodes.values() if n.op == "arange" and dims.equal(dims.dim(n.attrs["n"]), t_dim)]:
        if a.outputs[0] in g.outputs:
            continue  # not read by a bias: the position pass says what it is
        for u in g.consumers(a.outputs[0]):
            nodes = _reached(g, u)
            if _feeds_a_bias(g, nodes):
                leaves.append(Leaf(a.name, u.name))
                reached.update((n.name, n) for n in nodes)
    if not leaves:
        return None
    order = {name: i for i, name in enumerate(g.nodes)}
    inner = sorted((n for n in reached.values() if n.op != "fused_attention"), key=lambda n: order[n.name])
    sites = [n for n in reached.values() if n.op == "fused_attention"]
    fixed = FixedValues(g)
    labels: dict[str, tuple] = {}
    for n in inner:
        grid_in = {}
        for v in n.inputs:
            p = g.producer(v)
            if p is not None and p.op == "arange" and Leaf(p.name, n.name) in leaves:
                grid_in[v] = (frozenset({Leaf(p.name, n.name)}),)
            elif v in labels:
                grid_in[v] = labels[v]
        labels[n.outputs[0]] = _labels(g, n, grid_in, fixed)
        if n.outputs[0] in g.outputs:
            raise NotPositionGrid(f"the {site_of(n)} on the way to a score bias is a model output")
    biases: dict[str, list[str]] = {}
    for s in sites:
        for k, v in enumerate(s.inputs):
            if v in labels and v != bias_input(s):
                raise NotPositionGrid(f"the positions reach the attention at {s.scope or '<model>'} as its input "
                                      f"{k}, not as its additive bias")
        if bias_input(s) in labels:
            biases.setdefault(bias_input(s), []).append(s.name)
    roles: dict[Leaf, str] = {}
    for v in biases:
        lab, shape = labels[v], g.type_of(v).shape
        if any(lab[:-2]) or (len(shape) == 4 and not _unit(shape[0])):
            raise NotPositionGrid(f"the score bias {v} {dims.fmt_shape(shape)} varies with the positions (or has a "
                                  f"batch axis of its own) on an axis other than its last two, the query and key axes")
        axes = ((QUERY, lab[-2]), (KEY, lab[-1])) if len(lab) >= 2 else ((KEY, lab[-1]),)
        for role, leaves_here in axes:
            for leaf in leaves_here:
                if roles.setdefault(leaf, role) != role:
                    raise NotPositionGrid(f"one use of arange at {g.nodes[leaf.arange].scope or '<model>'} gives "
                                          f"both the query and the key positions of the score bias {v}")
    missing = [leaf for leaf in leaves if leaf not in roles]
    if missing:
        raise NotPositionGrid(f"the positions read by {site_of(g.nodes[missing[0].node])} reach no axis of a score bias")
    return PositionGrid(tuple(n.name for n in inner), roles, {v: tuple(s) for v, s in biases.items()})
