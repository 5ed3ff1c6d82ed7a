"""Static analysis of a graph: parameter counts (total, by component, per layer).

Counts come from the graph's parameter table, so a tied weight (GPT-2's head
reusing the token embedding) is counted once, and the report says so.
"""

from __future__ import annotations

import re
from collections import defaultdict

from .ir import Graph


def tied_parameters(graph: Graph) -> dict[str, list[str]]:
    """Parameters used by more than one node: path -> the nodes that use it."""
    users: dict[str, list[str]] = defaultdict(list)
    for node in graph.nodes.values():
        for v in node.inputs:
            if v in graph.params:
                users[v].append(node.name)
    return {p: names for p, names in users.items() if len(names) > 1}


def parameter_report(graph: Graph) -> dict:
    """{'total', 'by_component', 'per_layer', 'tied'}; components are the first path segment."""
    by_component: dict[str, int] = {}
    per_layer: dict[str, dict[str, int]] = {}
    for path, p in graph.params.items():
        head = path.split(".")[0]
        by_component[head] = by_component.get(head, 0) + p.numel
        m = re.match(r"([A-Za-z_]\w*)\.(\d+)\.([^.]+)", path)
        if m:
            layer = f"{m.group(1)}.{m.group(2)}"
            inner = per_layer.setdefault(layer, {})
            inner[m.group(3)] = inner.get(m.group(3), 0) + p.numel
    return {
        "total": graph.param_count(),
        "by_component": by_component,
        "per_layer": {k: {"total": sum(v.values()), **v} for k, v in per_layer.items()},
        "tied": tied_parameters(graph),
    }
