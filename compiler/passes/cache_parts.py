"""What the cache passes share: their error, the recurrent state's record, a node moved into place.

Why a module of its own: passes/kv_cache.py (the cache passes) runs passes/recurrent_state.py (the
state over time), and both raise CacheError, record CacheState and insert nodes; kept here, neither
imports the other's module back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.passes.base import PassError


class CacheError(PassError):
    """The graph has no cached form: no causal attention nor recurrence over time to cache, or a part
    whose cached form is not known (the message says which)."""


@dataclass
class CacheState:
    """One piece of recurrent state the cache carries (passes/recurrent_state.py): a time scan's
    carried state (``kind`` "scan") or a causal conv1d's last kernel-1 inputs ("conv"); the input
    ``past`` and output ``present`` names, the shape without the batch, the dtype."""

    node: str
    kind: str
    past: str
    present: str
    shape: list[int]
    dtype: str = "f32"
    initial: str | None = None  # the input the state starts from (an encoder's output); None: zeros


def insert_before(g: Graph, new: Node, before: str) -> None:
    """Move the just-added node ``new`` to just before ``before`` (graph.nodes is kept topological)."""
    items = [(k, v) for k, v in g.nodes.items() if k != new.name]
    out = {}
    for k, v in items:
        if k == before:
            out[new.name] = new
        out[k] = v
    g.nodes = out
    g.reindex()
