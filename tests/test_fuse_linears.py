"""Linear weights written [in, out] (export.transposed_weights) and the fusion of linears sharing an
input (compiler/passes/fuse_linears.py), each against the graph before the rewrite."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from conftest import build, feeds_for
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.reference import interpret
from tessera.runtime.weights import SeededWeights

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
