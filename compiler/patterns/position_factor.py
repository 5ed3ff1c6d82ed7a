"""A factor computed from the query positions alone, applied to the activations pointwise.

Why: Llama 4 scales the queries of its NoPE layers by a function of each token's position
(attention temperature tuning: ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1``),
written in a spec from ``arange(T)`` -- computed pointwise, laid out as [T, 1] (or [1, T, 1], ...)
and multiplied into q [B, heads, T, hd]. Without a cache the positions are 0..T-1; with one they
are each row's own ``position_ids`` [B, T] (a decoding step's one token is at p, a left-padded
row starts later). The KV cache pass (passes/position_factor.py) computes the factor at those
positions instead, which is exact only if the factor at a token depends on that token's position
and nothing else, and meets the activations on their token axis. This module finds that structure
or says why it is something else:

- the position nodes (every node between an ``arange(T)`` use and the activations) are pointwise
  (the ``elementwise`` trait), a ``transpose`` or a ``reshape`` that only adds or drops axes of
  size 1, each of their other operands fixed (a constant, a parameter, or computed from them);
- where a position value meets the activations (a node with an operand that is neither a
  position value nor fixed: a meeting) that node is pointwise, the position value varies along
  one axis only, and numpy broadcasting puts that axis on the meeting's token axis (its size T,
  not its first axis, the batch axis) and nothing but size-1 axes on the batch axis.

Uses of ``arange(T)`` that reach an ``embedding`` (a position table: GPT-2's, BART's at
``arange(T) + 2``) are not factors: they are left to the positions pass (passes/kv_cache.py
``ReadPositionIds``), which also bounds the context by the table's rows. Score biases from the
positions are found before, by patterns/position_grid.py. Each use of an ``arange`` is a leaf of
its own (position_grid's ``Leaf``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler import ops
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.patterns.position_grid import (FixedValues, Leaf, NotPositionGrid, broadcast_labels,
                                                     reshape_labels, site_of)


class NotPositionFactor(Exception):
    """A use of the positions that is not a factor of the query positions the cache could substitute
    (the reason)."""


@dataclass(frozen=True)
class Meeting:
    """A node where a position value meets the activations: it reads ``value`` (a position value, to be
    read lifted) as its input ``index``."""

    node: str
    index: int
    value: str


@dataclass(frozen=True)
class PositionFactor:
    """The factor subgraphs: the ``leaves`` (uses of ``arange``), the position ``nodes`` in graph order,
    and every ``meetings`` with the activations."""

    leaves: tuple[Leaf, ...]
    nodes: tuple[str, ...]
    meetings: tuple[Meeting, ...]


def _reaches_a_table(g: Graph, start: Node, positions: set[str], fixed: FixedValues) -> bool:
    """Whether the use ``start`` of an ``arange`` reaches an ``embedding`` (a position table read at it)
    through position nodes (every other operand fixed or ``positions``, the ``arange(T)`` outputs), before
    meeting anything else."""
    seen, todo, values = {start.name}, [start], set(positions)
    while todo:
        n = todo.pop()
        if n.op == "embedding" and n.inputs[0] in values:
            return True
        if n.op == "fused_attention" or not all(i in values or fixed(i) for i in n.inputs):
            continue
        values.update(n.outputs)
        for o in n.outputs:
            for u in g.consumers(o):
                if u.name not in seen:
                    seen.add(u.name)
                    todo.append(u)
    return False


def factor_leaves(g: Graph, t_dim) -> list[Leaf]:
    """The uses of ``arange(t_dim)`` that reach no position table (candidates for a factor)."""
    fixed = FixedValues(g)
    aranges = [n for n in g.nodes.values() if n.op == "arange" and dims.equal(dims.dim(n.attrs["n"]), t_dim)]
    positions = {a.outputs[0] for a in aranges}
    leaves = []
    for a in aranges:
        for u in g.consumers(a.outputs[0]):
            if not _reaches_a_table(g, u, positions, fixed):
                leaves.append(Leaf(a.name, u.name))
    return leaves


def _position_labels(g: Graph, n: Node, pos_in: dict[str, tuple]) -> tuple:
    """A position node's output labels (per axis, the leaves whose positions vary along it)."""
    out_t = g.type_of(n.outputs[0])
    if ops.has_trait(n.op, "elementwise"):
        return broadcast_labels([(g.type_of(v).shape, lab) for v, lab in pos_in.items()], out_t.rank)
    if n.op == "transpose":
        return tuple(pos_in[n.inputs[0]][p] for p in n.attrs["perm"])
    if n.op == "reshape":
        try:
            return reshape_labels(g, n, pos_in[n.inputs[0]])
        except NotPositionGrid as e:
            raise NotPositionFactor(str(e)) from None
    raise NotPositionFactor(f"the positions are read by {site_of(n)} (not pointwise, a transpose or a reshape "
                            f"adding or dropping axes of size 1), so a token's factor may depend on other "
                            f"positions than its own")


def _check_meeting(g: Graph, n: Node, value: str, labels: tuple, b_dim, t_dim) -> None:
    """``value`` (a position value) meets the activations at ``n``: pointwise, its one varying axis
    broadcast onto the token axis, nothing but size-1 axes onto the batch axis (the module's rules)."""
    if not ops.has_trait(n.op, "elementwise"):
        raise NotPositionFactor(f"the positions meet the activations at {site_of(n)}, which is not pointwise, so "
                                f"a token's result may depend on other tokens' positions")
    shape, out = g.type_of(value).shape, g.type_of(n.outputs[0]).shape
    varying = [k for k, lab in enumerate(labels) if lab]
    if len(varying) != 1:
        raise NotPositionFactor(f"the position value {value} {dims.fmt_shape(shape)} read by {site_of(n)} varies "
                                f"with the positions along {len(varying)} axes, not the token axis alone")
    at = len(out) - len(shape) + varying[0]  # its output axis (numpy broadcasting, right-aligned)
    if not out or not dims.equal(out[0], b_dim):
        raise NotPositionFactor(f"{site_of(n)} combines the positions into {dims.fmt_shape(out)}, whose first "
                                f"axis is not the batch axis {dims.fmt(b_dim)}")
    if at == 0 or not dims.equal(out[at], t_dim):
        raise NotPositionFactor(f"{site_of(n)} lays the positions of {value} {dims.fmt_shape(shape)} on axis {at} "
                                f"of {dims.fmt_shape(out)}, not on the token axis")
    if len(shape) == len(out) and not (dims.is_static(shape[0]) and int(shape[0]) == 1):
        raise NotPositionFactor(f"the position value {value} {dims.fmt_shape(shape)} read by {site_of(n)} has a "
                                f"batch axis of its own")


def position_factor(g: Graph, b_dim, t_dim) -> PositionFactor | None:
    """The factors of the query positions computed from ``arange(t_dim)`` (None if there are none), or
    NotPositionFactor with the reason."""
    leaves = factor_leaves(g, t_dim)
    if not leaves:
        return None
    fixed = FixedValues(g)
    labels: dict[str, tuple] = {}
    nodes, meetings = [], []
    for n in list(g.nodes.values()):
        pos_in = {}
        for v in n.inputs:
            p = g.producer(v)
            if p is not None and Leaf(p.name, n.name) in leaves:
                pos_in[v] = (frozenset({Leaf(p.name, n.name)}),)
            elif v in labels:
                pos_in[v] = labels[v]
        if not pos_in:
            continue
        others = [v for v in n.inputs if v not in pos_in and not fixed(v)]
        if others:
            for k, v in enumerate(n.inputs):
                if v in pos_in:
                    _check_meeting(g, n, v, pos_in[v], b_dim, t_dim)
                    meetings.append(Meeting(n.name, k, v))
            continue
        if n.op == "fused_attention":
            raise NotPositionFactor(f"the positions reach the attention at {site_of(n)} and nothing else reads it")
        labels[n.outputs[0]] = _position_labels(g, n, pos_in)
        nodes.append(n.name)
        if n.outputs[0] in g.outputs:
            raise NotPositionFactor(f"the position value of {site_of(n)} is a model output")
    for leaf in leaves:
        if g.nodes[leaf.arange].outputs[0] in g.outputs:
            raise NotPositionFactor(f"arange at {g.nodes[leaf.arange].scope or '<model>'} is a model output")
    if not meetings:
        raise NotPositionFactor("the positions meet no activation (a value computed from the positions alone is "
                                "not read by the model's computation)")
    return PositionFactor(tuple(leaves), tuple(nodes), tuple(meetings))
