"""Walking an ONNX graph's nodes through its subgraphs (If branches, Loop and Scan bodies).

One walk for every question asked of a lowered graph at any depth (which op domains it uses, which
names its subgraphs read from outside), so that a new kind of subgraph is handled in one place."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def all_nodes(nodes: Iterable) -> Iterator:
    """These nodes and, depth first, the nodes of every graph attribute they hold, at any depth."""
    for n in nodes:
        yield n
        for attr in n.attribute:
            if attr.type == attr.GRAPH:
                yield from all_nodes(attr.g.node)
