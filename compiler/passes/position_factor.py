"""The KV cache's form of a factor computed from the query positions (Llama 4's attention temperature).

Why: the spec computes such a factor from ``arange(T)`` and applies it to the activations
pointwise along their token axis (patterns/position_factor.py finds it, or says why a use of the
positions is something else). In the cached graph the T new tokens of each row are at that
row's ``position_ids`` [B, T] (its real tokens counted: right past a left padding, and at P + t
when P are cached), so the factor is computed there instead.

The rewrite lifts the factor's nodes by one leading batch axis (passes/position_bias.py ``Lift``,
the same lift as a score bias's): each ``arange`` use reads ``position_ids`` [B, T] where it read
[T], a pointwise op's position operands of lower rank get unit axes after the batch axis, a
transpose keeps the batch axis first, a reshape adding or dropping unit axes keeps it too. Where
the factor meets the activations, its lifted value [B, ...] is reshaped to the meeting's rank with
the batch axis first and the spec's axes right-aligned as numpy broadcasting put them (the spec's
leading size-1 axis that met the batch axis dropped), so every row reads its own positions. Each
lifted node is placed right after the spec node it replaces (a factor computed per layer stays in
its layer); the spec's position nodes are left unread (dropped), and an ``arange`` nothing else
reads with them. Exact by construction: for each row the lifted factor at token t is the spec's
factor at that row's position of t (the pattern refuses anything else, and the pass refuses with
its reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.passes.cache_parts import CacheError
from tessera.compiler.passes.position_bias import Lift
from tessera.compiler.patterns.position_factor import NotPositionFactor, PositionFactor, position_factor

POSITIONS = "position_ids"  # the cache's input (passes/kv_cache.py)


@dataclass(frozen=True)
class CachedPositionFactor:
    """The pass's note: a position value now computed at ``position_ids``, read by the activations' ``node``."""

    value: str
    node: str


def factor_or_refuse(g: Graph, b_dim, t_dim) -> PositionFactor | None:
    """The graph's position factors (patterns/position_factor.py), its refusal as a CacheError."""
    try:
        return position_factor(g, b_dim, t_dim)
    except NotPositionFactor as e:
        raise CacheError(f"arange({dims.fmt(t_dim)}) is used for something other than a position table, a score "
                         f"bias or a factor of the query positions: {e}; its cached form is not known") from None


def _as_meeting_rank(lift: Lift, g: Graph, spec_value: str, lifted: str, node) -> str:
    """The lifted value [B] + spec shape, reshaped to [B, ...] of the meeting's rank: the spec's axes
    right-aligned, the one (of size 1) that met the batch axis dropped."""
    spec, rank = g.type_of(spec_value).shape, g.type_of(node.outputs[0]).rank
    batch = g.type_of(lifted).shape[0]
    rest = list(spec[1:]) if len(spec) == rank else [dims.dim(1)] * (rank - 1 - len(spec)) + list(spec)
    return lift.node("reshape", [lifted], {"shape": [batch] + rest}, node, f"{spec_value}/cached")


def lift_factor(g: Graph, factor: PositionFactor) -> list[CachedPositionFactor]:
    """Rewrite every factor to read ``position_ids`` (the module's docstring)."""
    lift = Lift(g)
    positions = {leaf: POSITIONS for leaf in factor.leaves}
    after: dict[str, list[str]] = {}  # spec node -> the lifted nodes to place right after it
    for name in factor.nodes:
        start = len(lift.added)
        lift.spec_node(g.nodes[name], positions)
        after.setdefault(name, []).extend(lift.added[start:])
    notes, read = [], {}
    for m in factor.meetings:
        node = g.nodes[m.node]
        if m.value not in read:
            start = len(lift.added)
            lifted = lift.lifted[m.value] if m.value in lift.lifted else POSITIONS  # an arange read directly
            read[m.value] = _as_meeting_rank(lift, g, m.value, lifted, node)
            producer = g.producer(m.value)
            after.setdefault(producer.name, []).extend(lift.added[start:])
        g.set_inputs(node, [read[m.value] if k == m.index else v for k, v in enumerate(node.inputs)])
        notes.append(CachedPositionFactor(read[m.value], m.node))
    order = []
    for k in [k for k in g.nodes if k not in lift.added]:
        order += [k] + after.get(k, [])
    g.nodes = {k: g.nodes[k] for k in order}
    g.reindex()
    spent = set(factor.nodes)
    aranges = {leaf.arange for leaf in factor.leaves}
    spent |= {a for a in aranges if all(u.name in spent for u in g.consumers(g.nodes[a].outputs[0]))}
    g.remove_nodes(spent)
    return notes


class CachedPositionFactorPass(Pass):
    """Factors computed from the query positions ``arange(T)`` and applied to the activations along their
    token axis (Llama 4's attention temperature) read ``position_ids``. Notes: a CachedPositionFactor each."""

    name = "kv-cache-position-factor"

    def requires(self, g: Graph) -> None:
        if POSITIONS not in g.inputs:
            raise PassError(f"{self.name} needs the input {POSITIONS}: run kv-cache-inputs first")

    def run(self, g: Graph) -> PassResult:
        b_dim, t_dim = g.type_of(POSITIONS).shape
        factor = factor_or_refuse(g, b_dim, t_dim)
        if factor is None:
            return PassResult(g, False, [])
        return PassResult(g, True, lift_factor(g, factor))
