"""compiler/ir/digraph.py against networkx (the library it stands in for) on random graphs and random
edits: vertices, neighbours and their orders, degrees, the lexicographical topological sort with a
key, acyclicity, ancestors, and that find_cycle's edges form a real cycle."""

from __future__ import annotations

import random

import pytest

from tessera.compiler.ir import digraph

nx = pytest.importorskip("networkx")


def _both(seed: int, n: int = 30, edges: int = 60, acyclic: bool = True):
    """The same random graph built with both libraries, then edited the same way (vertices removed
    and added again, edges removed, missing edges in remove_edges_from)."""
    rnd = random.Random(seed)
    ours, ref = digraph.DiGraph(), nx.DiGraph()
    verts = [("v", i) if i % 2 else ("n", i) for i in range(n)]
    for v in rnd.sample(verts, n):
        ours.add_node(v)
        ref.add_node(v)
    for _ in range(edges):
        a, b = rnd.sample(range(n), 2)
        if acyclic and a > b:
            a, b = b, a
        ours.add_edge(verts[a], verts[b])
        ref.add_edge(verts[a], verts[b])
    for _ in range(5):
        v = rnd.choice(list(ref))
        ours.remove_node(v)
        ref.remove_node(v)
        ours.add_node(v)
        ref.add_node(v)
        e = rnd.choice(list(ref.edges())) if ref.number_of_edges() else None
        if e is not None:
            ours.remove_edge(*e)
            ref.remove_edge(*e)
        missing = [(verts[0], verts[0]), e] if e is not None else [(verts[0], verts[0])]
        ours.remove_edges_from(missing)
        ref.remove_edges_from(missing)
    return ours, ref, rnd


@pytest.mark.parametrize("seed", range(12))
def test_structure_and_orders_equal_networkx(seed):
    ours, ref, _ = _both(seed)
    assert list(ours) == list(ref)
    for v in ref:
        assert list(ours.successors(v)) == list(ref.successors(v))
        assert list(ours.predecessors(v)) == list(ref.predecessors(v))
        assert ours.out_degree(v) == ref.out_degree(v) and ours.in_degree(v) == ref.in_degree(v)
        assert digraph.ancestors(ours, v) == nx.ancestors(ref, v)
    assert list(ours.edges()) == list(ref.edges())
    copied = ours.copy()
    copied.add_edge(("x", 0), ("x", 1))
    assert ("x", 0) not in ours and list(copied.edges())[:-1] == list(ref.edges())


@pytest.mark.parametrize("seed", range(12))
def test_lexicographical_topological_sort_equals_networkx(seed):
    ours, ref, rnd = _both(seed)
    keys = {v: rnd.randrange(5) for v in ref}  # ties: the insertion order decides, as in networkx
    key = keys.__getitem__
    assert list(digraph.lexicographical_topological_sort(ours, key=key)) == \
        list(nx.lexicographical_topological_sort(ref, key=key))
    assert digraph.is_directed_acyclic_graph(ours) and nx.is_directed_acyclic_graph(ref)
    assert digraph.find_cycle(ours) == []


@pytest.mark.parametrize("seed", range(12))
def test_cycles_are_found_as_networkx_finds_them(seed):
    ours, ref, _ = _both(seed, n=12, edges=30, acyclic=False)
    acyclic = nx.is_directed_acyclic_graph(ref)
    assert digraph.is_directed_acyclic_graph(ours) == acyclic
    cycle = digraph.find_cycle(ours)
    if acyclic:
        assert cycle == []
        return
    assert cycle and all(ref.has_edge(u, v) for u, v in cycle)
    assert all(cycle[i][1] == cycle[(i + 1) % len(cycle)][0] for i in range(len(cycle)))
    with pytest.raises(digraph.Unfeasible):
        list(digraph.lexicographical_topological_sort(ours))


def test_missing_vertices_and_edges_are_errors():
    g = digraph.DiGraph()
    g.add_edge("a", "b")
    for call in (lambda: g.remove_node("c"), lambda: g.remove_edge("b", "a"), lambda: list(g.successors("c")),
                 lambda: digraph.ancestors(g, "c")):
        with pytest.raises(digraph.GraphError):
            call()
    g.add_edge("a", "a")  # a self-loop goes with its vertex
    g.remove_node("a")
    assert list(g) == ["b"] and list(g.predecessors("b")) == []
