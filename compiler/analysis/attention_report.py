"""The report's attention section: every attention site, what the optimiser does with it, and the
memory traffic of the site with and without fusion.

Traffic is counted as bytes moved to and from main memory by ideal kernels at the report's B and N:

- unfused: read Q and K, write the N×N scores, read and write them once per elementwise step
  (scale, each mask, bias, softmax), read the weights and V, write the output;
- fused (FlashAttention's accounting): read Q once, write the output once, and read K and V once
  per query tile, only up to the last key a causal tile can see.
"""

from __future__ import annotations

import os

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph


def keys_read_by_tiles(tq: int, tk: int, br: int, causal: bool) -> int:
    """Keys a tiled kernel reads, summed over its query tiles of ``br`` rows, in closed form (the
    report answers for N = 10**12 at once; a loop over the tiles would take hours).

    Without a causal mask every tile reads all ``tk`` keys. With one, the query rows are the last
    ``tq`` of the ``tk`` positions (offset ``tk - tq``, 0 for self-attention, the past length for
    a cached decoder), and a tile whose last row is ``end`` reads keys up to ``end + tk - tq``,
    none when that is not positive."""
    tiles = -(-tq // br)
    if not causal:
        return tiles * tk
    offset = tk - tq
    full = tq // br  # tiles of br rows; their last rows are br, 2 br, ..., full * br
    first = max(1, -offset // br + 1)  # the first full tile that sees a key: k * br + offset > 0
    total = 0
    if first <= full:
        count = full - first + 1
        total += br * (first + full) * count // 2 + offset * count
    if tq % br:  # the last, partial tile ends at tq and sees tk > 0 keys
        total += tq + offset
    return total


def _traffic(graph: Graph, node, bindings: dict, e: int) -> tuple[int, int]:
    a = node.attrs
    q, k, v = (graph.type_of(x).shape for x in node.inputs[:3])
    ev = lambda d: dims.evaluate(dims.dim(d), bindings)  # noqa: E731
    b, h, tq, d = ev(q[0]), a["heads"], ev(q[2]), ev(q[3])
    g, tk, dv = a["kv_heads"], ev(k[2]), ev(v[3])
    passes = (a["scale"] != 1.0) + a["causal"] + a["padding"] + a["bias"] + 1
    scores = tq * tk
    unfused = e * b * h * (tq * d + tk * d + scores + 2 * scores * passes + scores + tk * dv + tq * dv)
    keys_read = keys_read_by_tiles(tq, tk, a.get("q_tile", 64), a["causal"])
    fused = e * b * (h * tq * d + h * tq * dv + g * keys_read * (d + dv))
    return unfused, fused


def _where(pos) -> str | None:
    """file:line:col, with the file relative to the working directory when it lies below it."""
    if pos is None:
        return None
    path = pos.file
    if os.path.isabs(path):
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    return f"{path}:{pos.line}:{pos.col}"


def describe_sites(graph: Graph, sites: list, bindings: dict, bytes_per_element: int, target: str) -> dict:
    """The section from the attention sites (passes' AttentionSite notes) of ``graph`` as the pipeline
    left it, fused. The passes are run by compiler/report.py (analysis/ imports no pass)."""
    rows, total_u, total_f = [], 0, 0
    for s in sites:
        row = {"site": s.scope or "<model>", "at": _where(s.pos), "fused": s.fused}
        if s.fused and s.node not in graph.nodes:  # fused, then removed: nothing reads its output
            row.update(fused=False, reason="its output is never used: removed as dead code after fusion")
        elif s.fused:
            node = graph.nodes[s.node]
            u, f = _traffic(graph, node, bindings, bytes_per_element)
            row.update(kernel=s.impl, why=s.impl_reason, traffic_bytes={"unfused": u, "fused": f},
                       q_tile=node.attrs["q_tile"], k_tile=node.attrs["k_tile"])
            total_u, total_f = total_u + u, total_f + f
        else:
            row.update(reason=s.reason)
        rows.append(row)
    return {"target": target, "sites": rows,
            "fused": sum(r["fused"] for r in rows), "not_fused": sum(not r["fused"] for r in rows),
            "traffic_bytes": {"unfused": total_u, "fused": total_f},
            "traffic_ratio": (total_u / total_f) if total_f else None}


def group_sites(section: dict) -> list[tuple[int, dict, list[str]]]:
    """Sites that share kernel and reason, with their names (96 identical layers read as one line)."""
    groups: dict[tuple, list] = {}
    for r in section["sites"]:
        key = (r["fused"], r.get("kernel"), r.get("why") or r.get("reason"))
        groups.setdefault(key, []).append(r)
    return [(len(v), v[0], [r["site"] for r in v]) for v in groups.values()]


__all__ = ["describe_sites", "group_sites", "keys_read_by_tiles"]
