"""The report against an independent counter that reads only the exported ONNX graph.

For every variant of every spec in models/ (GPT-3 and Mixtral included), the
parameters and multiply-adds that tests/onnx_counter.py finds in the ONNX model
must equal the report's exactly, at sequence lengths that differ between the
encoder and the decoder (S != T) so that no symbol can hide behind another.
Big models are exported with placeholder weights whose initializers carry the
real shapes but no data; a small model is also exported with real weights to
show the two exports count the same.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnx_counter
from conftest import MODELS, build
from tessera.compiler.analysis import cost, costreport
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.runtime.io.weights import init_weights
from tessera.spec import load_program

# Specs written with the `experts` builtin (one sparse_moe node: qwen3_moe, gpt_oss, deepseek_v3, llama4) are left out: the node's
# ONNX lowering sizes its Gathers by the routing at run time (NonZero), which a static counter cannot size; its
# MACs (the active experts only) are checked by hand in tests/compiler/test_sparse_moe.py, gpt-oss's parameter
# counts against transformers in tests/models/test_gpt_oss.py (llama4's in tests/models/test_llama4.py).
# Jamba's variants with experts are left out the same way (its dense `tiny` stays); their parameter counts are
# checked against transformers in tests/models/test_jamba.py.
SPARSE_AS_WRITTEN = {"qwen3_moe", "gpt_oss", "deepseek_v3", "llama4"}
SPARSE_VARIANTS = {("jamba", "v0_1"), ("jamba", "tiny_moe")}
VARIANTS = [(path.stem, v) for path in sorted(MODELS.glob("*.tsr")) if path.stem not in SPARSE_AS_WRITTEN
            for v in (list(load_program(path).variants) or [None]) if (path.stem, v) not in SPARSE_VARIANTS]
BINDINGS = [{"B": 2, "T": 7, "S": 5}, {"B": 3, "T": 16, "S": 9}]


def shapes_only_onnx(graph):
    """Export with 1-element placeholder weights, then give each parameter initializer its shape."""
    placeholders = {p: np.zeros((1,) * len(v.shape), np.float32) for p, v in graph.params.items()}
    model = onnx_export.to_onnx(graph, placeholders)
    transposed = onnx_export.transposed_weights(graph)  # linear weights are written [in, out]
    return onnx_counter.stub_initializers(model, {p: tuple(v.shape)[::-1] if p in transposed else v.shape
                                                  for p, v in graph.params.items()})


@pytest.mark.parametrize("spec,variant", VARIANTS, ids=[f"{s}-{v}" for s, v in VARIANTS])
def test_onnx_counter_agrees_with_the_report(spec, variant):
    graph = build(spec, variant)
    model = shapes_only_onnx(graph)
    costs, _ = cost.node_costs(graph)
    assert not [c.op for c in costs if c.kind == "uncounted"]
    total, attention = cost.total(costs), cost.total(costs, kinds={"attention"})
    for b in BINDINGS:
        b = {k: v for k, v in b.items() if k in graph.symbols}
        counted = onnx_counter.count(model, b, buffers={p for p, v in graph.params.items() if v.buffer})
        assert counted.uncounted == []
        assert counted.params == graph.param_count()
        assert counted.macs == total.evaluate(b)
        assert counted.attention_macs == attention.evaluate(b)


@pytest.mark.parametrize("spec", ["gpt2", "transformer", "vit"])
def test_the_report_json_matches_the_counter(spec):
    """Through the report itself: params.total and macs.total at B=2, N=9 (every sequence symbol 9)."""
    graph = build(spec, {"gpt2": "small", "transformer": "base", "vit": "b16"}[spec])
    rep = costreport.build_report(graph, graph.name, None, {}, batch=2, seq=9)
    counted = onnx_counter.count(shapes_only_onnx(graph), {s: 2 if s == "B" else 9 for s in graph.symbols})
    assert counted.params == rep["params"]["total"]
    assert counted.macs == rep["macs"]["total"]
    assert counted.attention_macs == rep["macs"]["attention"]


def test_placeholder_export_counts_like_a_real_one():
    graph = build("mixtral", None, layers=2, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48, experts=4, top=2)
    real = onnx_export.to_onnx(graph, init_weights(graph, 0))
    b = {"B": 2, "T": 5}
    got_real, got_stub = onnx_counter.count(real, b), onnx_counter.count(shapes_only_onnx(graph), b)
    assert (got_real.params, got_real.macs, got_real.attention_macs) == \
        (got_stub.params, got_stub.macs, got_stub.attention_macs)
    assert got_real.params == graph.param_count()


def test_counter_sizes_fused_attention_nodes():
    """ONNX's Attention op (opset 23) with Q [B, H, Tq, dq], K, V [B, Hkv, Tk, d]: two products per pair."""
    from onnx import TensorProto, helper

    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", 8, "T", 16])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, ["B", 2, "T", 16])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, ["B", 2, "T", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8, "T", 16])
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    model = helper.make_model(helper.make_graph([node], "a", [q, k, v], [y]),
                              opset_imports=[helper.make_opsetid("", 23)])
    counted = onnx_counter.count(model, {"B": 2, "T": 10})
    assert counted.macs == counted.attention_macs == 2 * 8 * 10 * 10 * (16 + 16)


def test_counter_agrees_on_a_fused_export():
    """A fused export with onnxruntime's GroupQueryAttention (the CUDA target's choice for causal
    attention; here 4 query heads over 2 key/value heads): the counter sizes it as two products
    per query-key pair."""
    from tessera.compiler.passes.pipeline import optimize
    from tessera.compiler.passes.attention_kernels import Target

    overrides = dict(layers=2, d=64, heads=4, kv_heads=2, vocab=100, d_ff=96)
    graph = build("llama", None, **overrides)
    costs, _ = cost.node_costs(graph)
    total, attention = cost.total(costs), cost.total(costs, kinds={"attention"})
    assert all(s.impl == "gqa" for s in optimize(graph, Target("cpu"), attention="gqa"))
    model = onnx_export.to_onnx(graph, init_weights(graph, 0))
    counted = onnx_counter.count(model, {"B": 2, "T": 7})
    assert counted.nodes.get("GroupQueryAttention") == overrides["layers"]
    assert (counted.params, counted.macs, counted.attention_macs, counted.uncounted) == \
        (graph.param_count(), total.evaluate({"B": 2, "T": 7}), attention.evaluate({"B": 2, "T": 7}), [])
