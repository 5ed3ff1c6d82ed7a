"""Static analysis of a graph: parameter counts (total, by component, per layer, active per token).

Counts come from the graph's parameter table, so a tied weight (GPT-2's head
reusing the token embedding) is counted once, and the report says so. Layers
are the scopes of ``repeat`` (``layers.3``, ``encoder.layers.0``); what each
part of a layer is (attention, MLP, norm, mixture of experts) is read from the
ops that use its parameters, not from its name.
"""

from __future__ import annotations

import math
from collections import defaultdict

from tessera.compiler import ops
from tessera.compiler.ir.graph import Graph
from tessera.compiler.analysis.structure import Structure, analyse, layer_key

_NORMS = {"layernorm", "rmsnorm"}


def tied_parameters(graph: Graph) -> dict[str, list[str]]:
    """Parameters used by more than one node: path -> the nodes that use it."""
    users: dict[str, list[str]] = defaultdict(list)
    for node in graph.nodes.values():
        for v in node.inputs:
            if v in graph.params:
                users[v].append(node.name)
    return {p: names for p, names in users.items() if len(names) > 1}


def _split_layer(path: str) -> tuple[str, str] | None:
    """'layers.3.attn.q.weight' -> ('layers.3', 'attn'); None outside repeated layers."""
    key = layer_key(path)
    if key is None or len(path) <= len(key) + 1:
        return None
    return key, path[len(key) + 1:].split(".")[0]


def _counted(graph: Graph) -> dict:
    """The parameters a count includes: not the checkpoint buffers (Param.buffer), which transformers'
    sum(p.numel()) does not count either."""
    return {path: p for path, p in graph.params.items() if not p.buffer}


def parameter_report(graph: Graph, st: Structure | None = None) -> dict:
    """{'total', 'by_component', 'per_layer', 'tied', 'active_per_token', 'moe', 'table'}.

    Components are the first path segment; per_layer breaks each repeated layer down by the
    segment after its number; table is the readable breakdown (seed-style) the report prints."""
    st = st or analyse(graph)
    by_component: dict[str, int] = {}
    per_layer: dict[str, dict[str, int]] = {}
    for path, p in _counted(graph).items():
        head = path.split(".")[0]
        by_component[head] = by_component.get(head, 0) + math.prod(p.shape)
        split = _split_layer(path)
        if split:
            inner = per_layer.setdefault(split[0], {})
            inner[split[1]] = inner.get(split[1], 0) + math.prod(p.shape)
    total = sum(math.prod(p.shape) for p in _counted(graph).values())
    moe = moe_parameters(graph, st)
    return {
        "total": total,
        "by_component": by_component,
        "per_layer": {k: {"total": sum(v.values()), **v} for k, v in per_layer.items()},
        "tied": tied_parameters(graph),
        "active_per_token": total - (moe["inactive_per_token"] if moe else 0),
        "moe": moe,
        "table": parameter_table(graph, st, per_layer),
    }


# ------------------------------------------------------------------ mixture of experts
def moe_parameters(graph: Graph, st: Structure) -> dict | None:
    """Total vs active parameters when each token runs only `top` of `experts` branches.

    Active per token is the total minus the unselected experts' share: sum over MoE blocks of
    (1 - top/experts) x the parameters of all its expert branches. ``dense_in_graph``: some block
    is written densely (the stdlib `moe` block as elaborated, or --no-sparse-moe) and computes every
    expert; a sparse_moe node (compiler/passes/sparse_moe.py) computes the top ones only."""
    if not st.experts:
        return None
    inactive = 0
    expert_params = 0
    for e in st.experts:
        sizes = [sum(math.prod(graph.params[p].shape) for p in ps) for ps in e.params]
        branch_total = sum(sizes)
        expert_params += branch_total
        share = branch_total * (e.count - e.top)
        inactive += share // e.count if share % e.count == 0 else round(share / e.count)
    first = st.experts[0]
    return {
        "blocks": len(st.experts),
        "experts": first.count,
        "top": first.top,
        "branches_found": len(first.params),
        "params_per_expert": sum(math.prod(graph.params[p].shape) for p in first.params[0]),
        "expert_params_total": expert_params,
        "inactive_per_token": inactive,
        "dense_in_graph": any(not e.sparse for e in st.experts),
    }


# ------------------------------------------------------------------ readable breakdown
def _scope_index(graph: Graph, prefixes: list[str]) -> dict[str, list]:
    """prefix -> nodes created inside that scope or named under it, for the prefixes asked."""
    index: dict[str, list] = {p: [] for p in prefixes}
    for n in graph.nodes.values():
        scope, name = n.scope, n.name.split("/")[0]
        for p in prefixes:
            if (scope == p or scope.startswith(p + ".") or name == p or name.startswith(p + ".")):
                index[p].append(n)
    return index


def _nodes_under(graph: Graph, prefix: str, index: dict | None = None):
    if index is not None and prefix in index:
        return index[prefix]
    return _scope_index(graph, [prefix])[prefix]


def role(graph: Graph, st: Structure, prefix: str, index: dict | None = None) -> str:
    """What the parameters under a scope do, from the ops that use them and the ops inside it."""
    nodes = list(_nodes_under(graph, prefix, index))
    names = {n.name for n in nodes}
    for e in st.experts:
        if e.gate in names:
            return f"mixture of experts: {e.count} experts, top {e.top}"
    for a in st.attention:
        if a.score in names:
            if a.cross:
                return "cross-attention"
            return "causal self-attention" if a.causal else "self-attention"
    def owned(v: str) -> bool:
        return v in graph.params and (v == prefix or v.startswith(prefix + "."))

    users = {n.op for n in nodes if any(owned(v) for v in n.inputs)}
    if not users:  # parameters used only from elsewhere (e.g. a free-standing table)
        users = {n.op for n in graph.nodes.values() if any(owned(v) for v in n.inputs)}
    if not users:
        return "parameter"
    if users <= _NORMS:
        return "norm"
    mine = {v for v in graph.params if owned(v)}
    if mine and mine <= st.norm_params:  # a norm written from primitives (patterns/norm.py)
        return "norm"
    if users == {"embedding"}:
        return "embedding"
    if users <= ops.with_trait("conv"):
        return "convolution"
    if users <= {"linear"}:
        return "MLP" if len({n.name for n in nodes if n.op == "linear"}) > 1 else "linear"
    return "parameter"


def _shape_text(graph: Graph, prefix: str) -> str:
    ps = [p for path, p in graph.params.items() if path == prefix or path.startswith(prefix + ".")]
    big = [p for p in ps if len(p.shape) >= 2]
    if len(big) == 1:
        return " × ".join(f"{d:,}" for d in big[0].shape)
    return ""


def parameter_table(graph: Graph, st: Structure, per_layer: dict[str, dict[str, int]]) -> list[dict]:
    """Rows: each stack's first layer by part (norms merged), one layer, all its layers; then the
    other components in spec order; then the total. Each row: {'label', 'params', 'kind'}."""
    rows: list[dict] = []
    stacks: dict[str, list[str]] = {}
    for key in per_layer:
        stacks.setdefault(key.rsplit(".", 1)[0], []).append(key)
    others: dict[str, int] = {}
    for path, p in _counted(graph).items():
        if _split_layer(path):
            continue
        comp = path.rsplit(".", 1)[0] if "." in path else path
        others[comp] = others.get(comp, 0) + math.prod(p.shape)
    index = _scope_index(graph, [f"{keys[0]}.{part}" for keys in stacks.values() for part in per_layer[keys[0]]]
                         + list(others))
    for stack, keys in stacks.items():
        first = keys[0]
        parts = per_layer[first]
        norms = [p for p in parts if role(graph, st, f"{first}.{p}", index) == "norm"]
        for part, n in parts.items():
            if part not in norms:
                rows.append({"label": f"{first}.{part} ({role(graph, st, f'{first}.{part}', index)})", "params": n,
                             "kind": "layer_part"})
        if norms:  # the norms of a layer on one line, after its other parts (the seed's table)
            what = f"{len(norms)} norms" if len(norms) > 1 else "norm"
            rows.append({"label": f"{first}.{' + '.join(norms)} ({what})", "params": sum(parts[x] for x in norms),
                         "kind": "layer_part"})
        rows.append({"label": f"one layer ({first})", "params": sum(parts.values()), "kind": "layer"})
        first_i, last_i = keys[0].rsplit(".", 1)[1], keys[-1].rsplit(".", 1)[1]
        rows.append({"label": f"{len(keys)} layers ({stack}.{first_i}–{last_i})",
                     "params": sum(sum(per_layer[k].values()) for k in keys), "kind": "stack"})
    for comp, n in others.items():
        what = role(graph, st, comp, index)
        shape = _shape_text(graph, comp)
        rows.append({"label": f"{comp} ({what}{' ' + shape if shape else ''})", "params": n, "kind": "component"})
    rows.append({"label": "total", "params": sum(math.prod(p.shape) for p in _counted(graph).values()),
                 "kind": "total"})
    return rows


__all__ = ["parameter_report", "tied_parameters", "moe_parameters", "parameter_table", "role"]
