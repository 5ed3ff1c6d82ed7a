"""The pattern matcher (compiler/patterns/matcher.py) on graphs built here, and the recognisers
written on it: the mixture of experts the report and the sparse pass share, the recurrent cells,
the linear fusion's pattern. A failed match keeps its reason and the node that failed, whose spec
line --explain can show."""

from __future__ import annotations

from conftest import build
from tessera.compiler.analysis.structure import analyse
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Param, TensorType
from tessera.compiler.passes.sparse_moe import SparseExperts
from tessera.compiler.patterns import experts
from tessera.compiler.patterns.matcher import MatchResult, Pat, any_of, match

F = TensorType("f32", (dims.dim(2), dims.dim(4)))


def _graph():
    """y = mul(silu(a), b) with a = linear(x, w); an extra reader of a when asked."""
    g = Graph("g")
    g.add_input("x", F)
    g.add_param(Param("w", (4, 4), "f32", "normal"))
    a = g.add_node("linear", ["x", "w"], [F], {}, "", None, name="a")
    s = g.add_node("silu", [a.outputs[0]], [F], {}, "", None, name="s")
    g.add_input("b", F)
    y = g.add_node("mul", ["b", s.outputs[0]], [F], {}, "", None, name="y")
    g.outputs.append(y.outputs[0])
    return g, a, s, y


GATED = Pat("mul", (Pat("silu", (Pat("linear", (Pat(name="x"), Pat(name="w", param=True)), name="h"),),
                        why="no silu: {value} is {op}"),
                    Pat(name="other")), commutative=True)


def test_a_match_captures_values_and_nodes_in_either_operand_order():
    g, a, s, y = _graph()
    m = match(g, GATED, y.outputs[0])
    assert m and m["x"] == "x" and m["w"] == "w" and m["other"] == "b"
    assert m["h"] == a.outputs[0] and m["h.node"] is a
    assert [n.name for n in m.nodes] == ["y", "s", "a"]


def test_a_failure_names_the_reason_and_the_node_that_did_not_fit():
    g, a, s, y = _graph()
    g.nodes["s"].op = "relu"
    m = match(g, GATED, y.outputs[0])
    assert not m and isinstance(m, MatchResult)
    assert m.reason == f"no silu: {s.outputs[0]} is relu" and m.node is s
    # a graph input where a node was wanted: no node to point at
    m = match(g, Pat("linear"), "x")
    assert not m and m.node is None and m.reason == "x is an input"


def test_private_param_and_a_name_bound_twice():
    g, a, s, y = _graph()
    assert not match(g, Pat("linear", (Pat(name="x"), Pat(name="x"))), a.outputs[0])   # x and w differ
    assert not match(g, Pat("linear", (Pat(param=True, why="{value} is no parameter"), Pat())), a.outputs[0])
    g.outputs.append(a.outputs[0])           # now read outside the pattern too
    m = match(g, Pat("mul", (Pat(), Pat("silu", (Pat("linear", private=True),)))), y.outputs[0])
    assert not m and "used outside" in m.reason


def test_any_of_takes_the_first_option_that_fits_and_keeps_only_its_captures():
    g, a, s, y = _graph()
    either = any_of(Pat("relu", (Pat(name="r"),)), Pat("silu", (Pat(name="act_in"),)))
    m = match(g, Pat("mul", (Pat(name="other"), either)), y.outputs[0])
    assert m and m["act_in"] == a.outputs[0] and "r" not in m.captured
    assert [n.name for n in m.nodes] == ["y", "s"]
    # none fits: the first option's failure is the reason, at the node that did not fit
    m = match(g, Pat("mul", (Pat(), any_of(Pat("relu"), Pat("tanh")))), y.outputs[0])
    assert not m and m.reason == f"{s.outputs[0]} is silu" and m.node is s


def test_one_moe_recogniser_for_the_report_and_the_pass():
    graph = build("mixtral", None, layers=2, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48, experts=4, top=2)
    gates = [n for n in graph.nodes.values() if n.op == "topk_gates"]
    st = analyse(graph)
    assert len(st.experts) == len(gates) == 2
    for g, e in zip(gates, st.experts):
        r = experts.routing(graph, g)
        assert r and [i for i, _ in enumerate(r["experts"])] == [0, 1, 2, 3] and e.gate == g.name
        block = experts.sparse_block(graph, g)
        assert block and len(block["weights"]) == 12
        # the experts' weights, gate/up/down per expert in expert order: what the report counts per branch
        assert [sorted(block["weights"][3 * i: 3 * i + 3]) for i in range(4)] == e.params
    result = SparseExperts()(graph)
    assert all(site.sparse for site in result.notes) and len(result.notes) == 2


def test_a_quantised_or_shared_expert_fails_with_its_reason_and_node(tmp_path):
    path = tmp_path / "m.tsr"
    path.write_text("""
model M(d = 16) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  out gates: f32[B, T, 4]
  gates = topk_gates(linear(x, 4, bias=false, name="router"), 2)
  y = 0.0
  repeat 4 as e {
    y += swiglu(x, 20, name="expert") * slice(gates, -1, e, e + 1)
  }
}""")
    graph = build(str(path))
    (g,) = [n for n in graph.nodes.values() if n.op == "topk_gates"]
    assert experts.routing(graph, g)                # still a mixture of experts for the report
    m = experts.sparse_block(graph, g)              # but the pass may not replace it
    assert not m and "also read by identity" in m.reason and m.node.op == "identity"
    assert m.where is not None and m.where.line == 5   # `out gates: ...`, line 5 of the spec (line 1 is blank)
