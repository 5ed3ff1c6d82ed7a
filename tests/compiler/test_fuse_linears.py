"""Linear weights written [in, out] (export.transposed_weights) and the fusion of linears sharing an
input (compiler/passes/fuse_linears.py), each against the graph before the rewrite."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from conftest import build, feeds_for
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.passes.fuse_linears import FuseSharedInputLinears
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import SeededWeights

LLAMA = dict(layers=2, d=64, heads=4, kv_heads=2, vocab=300, d_ff=96)
GPT2 = dict(layers=2, d=64, heads=4, vocab=300, ctx=64)


def _ort(graph, weights, feeds):
    sess = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_linear_weights_are_written_in_out_and_the_tied_head_keeps_its_table(rng):
    graph = build("gpt2", **GPT2)
    weights = SeededWeights(graph, 0)
    model = onnx_export.to_onnx(graph, weights)
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    assert inits["layers.0.attn.q.weight"] == [64, 64] and inits["layers.0.mlp.fc.weight"] == [64, 256]  # [in, out]
    assert inits["wte.weight"] == [300, 64]  # gathered by the embedding and read by the tied head
    transposed = {n.input[0] for n in model.graph.node if n.op_type == "Transpose"}
    assert "wte.weight" in transposed and not any(t.startswith("layers.") and t.endswith(".weight") for t in transposed)
    feeds = feeds_for(graph, rng, t=9)
    ref = interpret.run(graph, weights, feeds)[graph.outputs[0]]
    np.testing.assert_allclose(_ort(graph, weights, feeds), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec, sizes, groups", [("llama", LLAMA, 4), ("gpt2", GPT2, 2)])
def test_fused_linears_equal_the_unfused_graph(spec, sizes, groups, rng):
    graph = build(spec, **sizes)
    weights = SeededWeights(graph, 0)
    feeds = feeds_for(graph, rng, t=9)
    ref = interpret.run(graph, weights, feeds)[graph.outputs[0]]
    ref_ort = _ort(graph, weights, feeds)
    n_linear = sum(n.op == "linear" for n in graph.nodes.values())
    res = FuseSharedInputLinears()(graph)
    # llama: q/k/v and gate/up per layer; gpt2: q/k/v per layer (its fc has no partner)
    assert len(res.notes) == groups
    assert sum(n.op == "linear" for n in graph.nodes.values()) == n_linear - sum(len(f.linears) - 1 for f in res.notes)
    note = res.notes[0]
    assert note.linears == ("layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v")
    assert note.weight == "layers.0.attn.q+k+v.weight"
    assert "layers.0.attn.q.weight" not in graph.params and graph.params[note.weight].derive[0] == "concat"
    assert "wte.weight" not in {p for f in res.notes for p in graph.params[f.weight].derive[1]}  # the tied head stays
    got = interpret.run(graph, weights, feeds)[graph.outputs[0]]
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_ort(graph, weights, feeds), ref_ort, atol=1e-5, rtol=1e-5)


def test_fusion_leaves_linears_with_other_readers_alone():
    graph = build("gpt2", **GPT2)
    before = {n.name for n in graph.nodes.values() if n.op == "linear"}
    FuseSharedInputLinears()(graph)
    after = {n.name for n in graph.nodes.values() if n.op == "linear"}
    assert "head" in after and "head" in before  # its weight is the embedding table too
    assert not FuseSharedInputLinears()(graph).changed  # nothing left to fuse


def test_fused_quantised_linears_equal_the_unfused_quantised_graph(rng):
    """Concatenating MatMulNBits' packed rows and scales along N quantises nothing differently."""
    graph = build("llama", **LLAMA)
    weights = SeededWeights(graph, 0)
    QuantizeWeights(QuantConfig("int4", activations="float"))(graph)
    feeds = feeds_for(graph, rng, t=9)
    ref = _ort(graph, weights, feeds)
    res = FuseSharedInputLinears()(graph)
    assert len(res.notes) == 4
    fused = graph.nodes[res.notes[0].node]
    assert fused.op == "linear_nbits" and fused.attrs["N"] == 64 + 32 + 32
    np.testing.assert_allclose(_ort(graph, weights, feeds), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(interpret.run(graph, weights, feeds)[graph.outputs[0]], ref, atol=1e-4, rtol=1e-4)
