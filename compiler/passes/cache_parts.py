"""What the cache passes share: their error, the recurrent state's record, a node moved into place.

Why a module of its own: passes/kv_cache.py (the cache passes) runs passes/recurrent_state.py (the
state over time), and both raise CacheError, record CacheState and insert nodes; kept here, neither
imports the other's module back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.cache_schema import Kind, json

CACHE_DTYPES = ("f32", "f16", "bf16")  # the precisions a cache (and a carried state) crosses the interface at (bf16: CUDA)


class CacheError(PassError):
    """The graph has no cached form: no causal attention nor recurrence over time to cache, or a part
    whose cached form is not known (the message says which)."""


@dataclass
class CacheState:
    """One piece of recurrent state the cache carries (passes/recurrent_state.py): a time scan's
    carried state (``kind`` "scan") or a causal conv1d's last kernel-1 inputs ("conv"); the input
    ``past`` and output ``present`` names, the shape without the batch, the dtype."""

    node: str = json(Kind("name"))
    kind: str = json(Kind("choice", choices=("scan", "conv")))
    past: str = json(Kind("input"))
    present: str = json(Kind("output"))
    shape: list[int] = json(Kind("ints", 1, nonempty=True))
    dtype: str = json(Kind("choice", choices=CACHE_DTYPES), default="f32")
    # the input the state starts from (an encoder's output); None: zeros
    initial: str | None = json(Kind("input", optional=True), default=None)


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
