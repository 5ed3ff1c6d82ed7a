"""The pass manager and the graph's networkx store: contracts checked, notes in results, graph queries."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build
from tessera.compiler.ir.graph import Graph, TensorType
from tessera.compiler.ir import dims
from tessera.compiler.passes import Pass, PassError, PassManager, PassResult
from tessera.compiler.passes.attention_kernels import ChooseAttentionKernels, Target
from tessera.compiler.passes.fuse_attention import FuseAttention
from tessera.compiler.passes.pipeline import attention_sites, build_pipeline, optimize
from tessera.compiler.passes.precision import LowerPrecision

SMALL_GPT2 = dict(layers=2, d=16, heads=2, vocab=10, ctx=8)


def _chain() -> Graph:
    """x -> a = relu(x) -> b = exp(a) -> out; and an unused c = sin(x)."""
    g = Graph("chain")
    t = TensorType("f32", dims.shape([3]))
    g.add_input("x", t)
    a = g.add_node("relu", ["x"], [t], {}, "", None, name="a")
    b = g.add_node("exp", [a.outputs[0]], [t], {}, "", None, name="b")
    g.add_node("sin", ["x"], [t], {}, "", None, name="c")
    g.outputs.append(b.outputs[0])
    return g


def test_pipeline_is_declared_once_with_precision_in_it():
    # stored-codes first: a checkpoint's own block-quantised weights (a GGUF file's), compiler/passes/stored_codes.py
    assert build_pipeline(Target("cpu", "fp16"), lower_precision=True).describe() == \
        "stored-codes -> fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
        "-> lower-precision -> choose-recurrence-lowering"
    assert build_pipeline(Target("cpu", "fp16")).describe() == \
        "stored-codes -> fuse-attention -> eliminate-dead-nodes -> choose-attention-kernels -> sparse-experts " \
        "-> choose-recurrence-lowering"
    assert build_pipeline(attention="unfused").describe() == \
        "stored-codes -> fuse-attention -> eliminate-dead-nodes -> sparse-experts -> choose-recurrence-lowering"


def test_notes_travel_in_the_pipeline_result():
    g = build("gpt2", **SMALL_GPT2)
    result = build_pipeline(Target("cpu"))(g)
    fused = result.notes(FuseAttention.name)
    chosen = result.notes(ChooseAttentionKernels.name)
    assert len(fused) == len(chosen) == 2  # one attention per layer
    assert {c.node for c in chosen} == {s.node for s in fused}
    assert all(s.impl is None for s in fused)  # fusion's own notes are not edited by the next pass
    assert [s.impl for s in attention_sites(result)] == [c.impl for c in chosen]


def test_precision_runs_in_the_pipeline_once():
    g = build("gpt2", **SMALL_GPT2)
    sites = optimize(g, Target("cpu", "fp16"), lower_precision=True)
    assert all(s.fused for s in sites)
    assert {p.dtype for p in g.params.values()} == {"f16"}
    with pytest.raises(PassError, match="already lowered"):
        LowerPrecision("fp16")(g)


def test_bf16_export_is_refused_on_the_cpu_when_the_pipeline_is_declared():
    with pytest.raises(PassError, match="--dtype bf16: onnxruntime's CPU kernels take no bfloat16"):
        build_pipeline(Target("cpu", "bf16"), lower_precision=True)
    build_pipeline(Target("cuda", "bf16"), lower_precision=True)  # exported for CUDA (tests/cuda/test_cuda_stub.py)


class _MakeCycle(Pass):
    name = "make-cycle"

    def run(self, graph):
        a = graph.nodes["a"]
        graph.replace_node("a", "add", ["x", graph.nodes["b"].outputs[0]], {})
        return PassResult(graph, True)


def test_ensures_catches_a_cycle():
    with pytest.raises(PassError, match="make-cycle left a cycle: "):
        PassManager([_MakeCycle()])(_chain())


def test_consumers_are_an_adjacency_kept_up_to_date():
    g = _chain()
    assert [n.name for n in g.consumers("x")] == ["a", "c"]
    t = g.type_of("x")
    n = g.add_node("neg", ["x"], [t], {}, "", None, name="n", first=True)
    g.replace_uses("x", n.outputs[0], [g.nodes["a"]])
    assert [u.name for u in g.consumers("x")] == ["n", "c"]
    assert [u.name for u in g.consumers("n")] == ["a"]
    assert g.topological_order() == ["n", "a", "b", "c"] == list(g.nodes)


def test_sort_restores_a_topological_order():
    g = _chain()
    t = g.type_of("x")
    late = g.add_node("neg", ["x"], [t], {}, "", None, name="late")
    g.replace_uses("x", late.outputs[0], [g.nodes["a"]])
    assert list(g.nodes) == ["a", "b", "c", "late"]
    g.sort()  # a and b must wait for late; c need not, and came first: ties keep the current order
    assert list(g.nodes) == ["c", "late", "a", "b"]


def test_dead_node_elimination_keeps_what_reaches_an_output():
    g = _chain()
    assert g.live_nodes() == {"a", "b"}
    assert g.eliminate_dead_nodes() == ["c"]
    assert list(g.nodes) == ["a", "b"] and "c" not in g.values and [n.name for n in g.consumers("x")] == ["a"]


def test_copy_is_independent():
    g = build("gpt2", **SMALL_GPT2)
    before = g.dump()
    c = g.copy()
    optimize(c, Target("cpu", "fp16"), lower_precision=True)
    assert g.dump() == before
    assert c.dump() != before
    assert {p.dtype for p in g.params.values()} == {"f32"}


def test_already_fused_sites_are_recognised_by_the_kernel_pass():
    """Kernel choice reads fused nodes through the recogniser: re-running it on a fused graph keeps the choices."""
    g = build("gpt2", **SMALL_GPT2)
    first = attention_sites(build_pipeline(Target("cpu"))(g))
    again = ChooseAttentionKernels(Target("cpu"))(g).notes
    assert [(c.node, c.impl) for c in again] == [(s.node, s.impl) for s in first]
    assert ChooseAttentionKernels(Target("cpu")).run(g).changed is False  # same choices again: no change
    assert ChooseAttentionKernels(Target("cuda", "fp16")).run(g).changed is True
    assert FuseAttention()(g).changed is False
    np.testing.assert_equal(sum(n.op == "fused_attention" for n in g.nodes.values()), 2)


def test_pipeline_drops_what_no_output_reads():
    """A value the spec computes and never uses does not reach the exported graph."""
    from conftest import ort_run

    g = _chain()
    result = build_pipeline()(g)
    assert result.notes("eliminate-dead-nodes") == ["c"]
    out = ort_run(g, {}, {"x": np.array([-1.0, 0.0, 2.0], np.float32)})
    np.testing.assert_allclose(out["b"], np.exp([0.0, 0.0, 2.0]), rtol=1e-6)
