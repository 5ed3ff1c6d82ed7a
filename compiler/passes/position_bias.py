"""The KV cache's form of a score bias computed from the positions (T5's relative position bias).

Why: the spec computes such a bias from ``arange(T)`` twice, the query positions 0..T-1 and the
key positions 0..T-1 (patterns/position_grid.py finds the subgraph and which ``arange`` use is
which). In the cached graph the T queries are the last T of P+T keys and each row has positions
of its own: the query positions are ``position_ids`` [B, T] (each row's real tokens counted, as
for a learned position table), and the key positions are the same count over the cache's slots,
``max(cumsum(attention_mask) - 1, 0)`` [B, P+T]: the buffer's filled slots, its unfilled ones
(hidden by the mask) and the new columns, in any layout the runtime feeds (left padding, a
buffer, concatenated presents), the key of each real token gets the position its query had.

The rewrite lifts the subgraph by one leading batch axis: each ``arange`` use reads those
positions ([B, N] where it read [N]), a pointwise op's position operands of lower rank get unit
axes after the batch axis, a transpose keeps the batch axis first, a reshape adding or dropping
unit axes keeps it too, an embedding is unchanged; the bias [1, heads, T, T] becomes
[B, heads, T, P+T]. The spec's nodes are left unread (dropped). Exact by construction: every
node the lift changes computes, for each row, what the spec's node computes at that row's
positions (the pattern refuses anything else, and the pass refuses with its reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.compiler import ops
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.passes.cache_parts import CacheError
from tessera.compiler.patterns.position_grid import QUERY, Leaf, NotPositionGrid, PositionGrid, bias_input, position_grid

MASK, POSITIONS = "attention_mask", "position_ids"  # the cache's inputs (passes/kv_cache.py)
KEY_POSITIONS = "cache/key_positions"


@dataclass(frozen=True)
class CachedPositionBias:
    """The pass's note: a bias now read at the cache's positions, and the attention nodes reading it."""

    bias: str
    sites: tuple[str, ...]


def grid_or_refuse(g: Graph, t_dim) -> PositionGrid | None:
    """The graph's position grid (patterns/position_grid.py), its refusal as a CacheError."""
    try:
        return position_grid(g, t_dim)
    except NotPositionGrid as e:
        raise CacheError(f"a score bias computed from arange({dims.fmt(t_dim)}) has no known cached form: {e}") \
            from None


class Lift:
    """Adds the lifted nodes (a leading batch axis on every position value) to the graph, in order (shared
    with passes/position_factor.py)."""

    def __init__(self, g: Graph):
        self.g, self.added, self.lifted = g, [], {}

    def node(self, op: str, inputs: list[str], attrs: dict, like: Node, name: str) -> str:
        t = ops.infer(op, [self.g.type_of(i) for i in inputs], attrs)
        n = self.g.add_node(op, inputs, t, attrs, like.scope, like.pos, name=self.g.unique_name(name),
                            origin=like.origin)
        self.added.append(n.name)
        return n.outputs[0]

    def const(self, base: str, value: int) -> str:
        return self.g.add_const(base, np.array(value, dtype=np.int64), "i64").name

    def with_rank(self, value: str, rank: int, like: Node) -> str:
        """A lifted value [Bx, ...] with unit axes after its batch axis up to ``rank`` (for broadcasting)."""
        shape = self.g.type_of(value).shape
        if len(shape) >= rank:
            return value
        new = (shape[0],) + (dims.dim(1),) * (rank - len(shape)) + tuple(shape[1:])
        return self.node("reshape", [value], {"shape": list(new)}, like, f"{like.name}/cached_rank")

    def reshape(self, n: Node, value: str) -> str:
        """The spec's reshape (only unit axes added or dropped) with the batch axis kept first."""
        src, dst = self.g.type_of(n.inputs[0]).shape, n.attrs["shape"]
        lifted = self.g.type_of(value).shape
        kept = iter(lifted[1 + i] for i, d in enumerate(src) if not _unit(d))
        new = [lifted[0]] + [dims.dim(1) if _unit(d) else next(kept) for d in dst]
        return self.node("reshape", [value], {"shape": new}, n, f"{n.name}/cached")

    def spec_node(self, n: Node, positions: dict[Leaf, str]) -> str:
        """Add ``n`` lifted (its output with a leading batch axis): an input it reads from a leaf (an
        ``arange`` use) reads that leaf's positions [B, N] instead, one it reads from an already lifted
        node that node's lifted output. Returns (and records in ``lifted``) the lifted output."""
        g = self.g
        ins, lifted_ins = [], set()
        for v in n.inputs:
            p = g.producer(v)
            leaf = Leaf(p.name, n.name) if p is not None else None
            ins.append(positions[leaf] if leaf in positions else self.lifted.get(v, v))
            if leaf in positions or v in self.lifted:
                lifted_ins.add(ins[-1])
        if n.op == "transpose":
            out = self.node("transpose", ins, {"perm": [0] + [p + 1 for p in n.attrs["perm"]]}, n, f"{n.name}/cached")
        elif n.op == "reshape":
            out = self.reshape(n, ins[0])
        elif n.op == "embedding":
            out = self.node("embedding", ins, dict(n.attrs), n, f"{n.name}/cached")
        else:  # pointwise: position operands brought to the output's rank plus the batch axis
            rank = g.type_of(n.outputs[0]).rank + 1
            ins = [self.with_rank(x, rank, n) if x in lifted_ins else x for x in ins]
            out = self.node(n.op, ins, dict(n.attrs), n, f"{n.name}/cached")
        self.lifted[n.outputs[0]] = out
        return out


def _unit(d) -> bool:
    return dims.is_static(d) and int(d) == 1


def lift_grid(g: Graph, grid: PositionGrid) -> list[CachedPositionBias]:
    """Rewrite every bias of ``grid`` to read the cache's positions (the module's docstring)."""
    lift = Lift(g)
    first = g.nodes[grid.biases[next(iter(grid.biases))][0]]
    one = lift.const("cache/one", 1)
    zero = lift.const("cache/zero", 0)
    running = lift.node("cumsum", [MASK], {"axis": 1}, first, f"{KEY_POSITIONS}/cumsum")
    keys = lift.node("maximum", [lift.node("sub", [running, one], {}, first, f"{KEY_POSITIONS}/sub"), zero], {},
                     first, KEY_POSITIONS)
    positions = {leaf: POSITIONS if role == QUERY else keys for leaf, role in grid.roles.items()}
    for name in grid.nodes:
        lift.spec_node(g.nodes[name], positions)
    notes = []
    for bias, sites in grid.biases.items():
        shape = g.type_of(lift.lifted[bias]).shape  # [B] + the spec's bias shape, whose batch axis (if any) is 1
        spec = list(shape[1:])
        rest = spec[1:] if len(spec) == 4 else [dims.dim(1)] * (3 - len(spec)) + spec  # [heads or 1, T, P+T]
        value = lift.node("reshape", [lift.lifted[bias]], {"shape": [shape[0]] + rest}, first, f"{bias}/cached")
        for s in sites:
            node = g.nodes[s]
            g.set_inputs(node, [value if v == bias_input(node) else v for v in node.inputs])
        notes.append(CachedPositionBias(value, sites))
    # the lifted nodes read inputs, each other and what the spec's grid nodes read (constants, parameters, values
    # computed from them): placed after the last of those nodes, before the attention reading the bias
    last = grid.nodes[-1]
    order = [k for k in g.nodes if k not in lift.added]
    at = order.index(last) + 1
    g.nodes = {k: g.nodes[k] for k in order[:at] + lift.added + order[at:]}
    g.reindex()
    spent = set(grid.nodes)
    spent |= {a for a in grid.aranges() if all(u.name in spent for u in g.consumers(g.nodes[a].outputs[0]))}
    g.remove_nodes(spent)
    return notes


class CachedPositionBiasPass(Pass):
    """Score biases computed from ``arange(T)`` (T5's relative position bias) read the cache's query and
    key positions (position_ids, and the attention mask's running count). Notes: a CachedPositionBias each."""

    name = "kv-cache-position-bias"

    def requires(self, g: Graph) -> None:
        if POSITIONS not in g.inputs:
            raise PassError(f"{self.name} needs the input {POSITIONS}: run kv-cache-inputs first")

    def run(self, g: Graph) -> PassResult:
        t_dim = g.type_of(POSITIONS).shape[1]
        grid = grid_or_refuse(g, t_dim)
        if grid is None:
            return PassResult(g, False, [])
        if MASK not in g.inputs:
            raise PassError(f"{self.name} needs the input {MASK}: run kv-cache-inputs first")
        notes = lift_grid(g, grid)
        return PassResult(g, True, notes)
