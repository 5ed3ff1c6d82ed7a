"""The directed graph under the IR (``Graph.nx``): the part of networkx's ``DiGraph`` the compiler
uses, with the same behaviour and orders, in a page of Python.

Why not networkx itself: importing it costs ~0.1 s of CPU (~0.3 s on a loaded machine), the largest
import of ``tessera ir`` after sympy, for a dozen methods (issue 21's start-up goal). The semantics
are networkx's and tests/test_digraph.py checks them against networkx on random graphs: vertices and
each vertex's neighbours are kept in insertion order (a removed and re-added one goes last), adding
an existing edge keeps its place, and ``lexicographical_topological_sort`` is Kahn's algorithm with a
heap keyed by (key, insertion index), as networkx's is.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterable, Iterator


class GraphError(KeyError):
    """A vertex or edge that is not in the graph (networkx raises NetworkXError for these)."""


class Unfeasible(ValueError):
    """A topological order of a graph with a cycle was asked for."""


class DiGraph:
    """Vertices and directed edges, no attributes; neighbours in insertion order."""

    def __init__(self):
        self._succ: dict[Hashable, dict[Hashable, None]] = {}
        self._pred: dict[Hashable, dict[Hashable, None]] = {}

    # ---------------------------------------------------------------- building
    def add_node(self, n: Hashable) -> None:
        if n not in self._succ:
            self._succ[n] = {}
            self._pred[n] = {}

    def add_edge(self, u: Hashable, v: Hashable) -> None:
        self.add_node(u)
        self.add_node(v)
        self._succ[u][v] = None
        self._pred[v][u] = None

    def remove_node(self, n: Hashable) -> None:
        try:
            succ = self._succ.pop(n)
        except KeyError:
            raise GraphError(f"the vertex {n!r} is not in the graph") from None
        for s in succ:
            del self._pred[s][n]
        for p in self._pred.pop(n):
            if p != n:  # a self-loop went with succ
                del self._succ[p][n]

    def remove_edge(self, u: Hashable, v: Hashable) -> None:
        try:
            del self._succ[u][v]
            del self._pred[v][u]
        except KeyError:
            raise GraphError(f"the edge {u!r} -> {v!r} is not in the graph") from None

    def remove_edges_from(self, edges: Iterable[tuple[Hashable, Hashable]]) -> None:
        """Remove the edges that are there (missing ones are skipped, as networkx does)."""
        for u, v in edges:
            if u in self._succ and v in self._succ[u]:
                del self._succ[u][v]
                del self._pred[v][u]

    def copy(self) -> "DiGraph":
        g = DiGraph()
        g._succ = {n: dict(s) for n, s in self._succ.items()}
        g._pred = {n: dict(p) for n, p in self._pred.items()}
        return g

    # ---------------------------------------------------------------- queries
    def __contains__(self, n) -> bool:
        return n in self._succ

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._succ)

    def __len__(self) -> int:
        return len(self._succ)

    def successors(self, n: Hashable) -> Iterator[Hashable]:
        try:
            return iter(self._succ[n])
        except KeyError:
            raise GraphError(f"the vertex {n!r} is not in the graph") from None

    def predecessors(self, n: Hashable) -> Iterator[Hashable]:
        try:
            return iter(self._pred[n])
        except KeyError:
            raise GraphError(f"the vertex {n!r} is not in the graph") from None

    def out_degree(self, n: Hashable) -> int:
        return len(self._succ[n])

    def in_degree(self, n: Hashable) -> int:
        return len(self._pred[n])

    def edges(self) -> Iterator[tuple[Hashable, Hashable]]:
        return ((u, v) for u, succ in self._succ.items() for v in succ)


def lexicographical_topological_sort(g: DiGraph, key: Callable | None = None) -> Iterator[Hashable]:
    """The vertices in a topological order; of the vertices ready at each point, the one with the
    smallest ``key`` (then the earliest added) comes first. Raises Unfeasible on a cycle."""
    key = key or (lambda n: n)
    index = {n: i for i, n in enumerate(g._succ)}
    indegree = {n: len(p) for n, p in g._pred.items() if p}
    ready = [(key(n), index[n], n) for n, p in g._pred.items() if not p]
    heapq.heapify(ready)
    while ready:
        _, _, n = heapq.heappop(ready)
        for child in g._succ[n]:
            indegree[child] -= 1
            if indegree[child] == 0:
                del indegree[child]
                heapq.heappush(ready, (key(child), index[child], child))
        yield n
    if indegree:
        raise Unfeasible("the graph has a cycle: it has no topological order")


def is_directed_acyclic_graph(g: DiGraph) -> bool:
    try:
        for _ in lexicographical_topological_sort(g, key=lambda n: 0):
            pass
    except Unfeasible:
        return False
    return True


def find_cycle(g: DiGraph) -> list[tuple[Hashable, Hashable]]:
    """The edges of one cycle (u -> v, ..., -> u), or [] when there is none (an iterative DFS, so
    a long chain cannot overflow Python's recursion limit)."""
    done: set = set()
    for root in g._succ:
        if root in done:
            continue
        path: list[Hashable] = [root]
        on_path = {root: 0}
        stack = [iter(g._succ[root])]
        while stack:
            for child in stack[-1]:
                if child in on_path:
                    cyc = path[on_path[child]:] + [child]
                    return list(zip(cyc, cyc[1:]))
                if child not in done:
                    on_path[child] = len(path)
                    path.append(child)
                    stack.append(iter(g._succ[child]))
                    break
            else:
                stack.pop()
                n = path.pop()
                del on_path[n]
                done.add(n)
    return []


def ancestors(g: DiGraph, n: Hashable) -> set[Hashable]:
    """Every vertex with a path to ``n`` (not ``n`` itself)."""
    if n not in g._pred:
        raise GraphError(f"the vertex {n!r} is not in the graph")
    seen: set = set()
    stack = [n]
    while stack:
        for p in g._pred[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    seen.discard(n)
    return seen
