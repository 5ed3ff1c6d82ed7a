"""The residual Add + norm fusion (compiler/backends/onnx/skip_norm.py): onnxruntime's
SkipSimplifiedLayerNormalization / SkipLayerNormalization in place of Add + the RMSNorm lowering or
Add + LayerNormalization.

References: numpy written here (the residual sum, RMSNorm x / sqrt(mean(x^2) + eps) * g, LayerNorm)
on small hand-built graphs run by onnxruntime; on the compiled decoders, the fused graph against the
same graph compiled with the pass off, and the transformers greedy tokens the packed-step tests check
(tests/generation/test_packed_gqa_decode.py runs the fused graph)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import MODELS

from tessera.compiler.backends.onnx.bound_step import general_graph
from tessera.compiler.backends.onnx.skip_norm import fuse_skip_norms
from tessera.runtime import pipeline
from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

B, T, D, EPS = 2, 3, 16, 1e-5
F = TensorProto.FLOAT


def _types(shapes: dict):
    return lambda name: ("f32", tuple(str(d) for d in shapes[name])) if name in shapes else None


def _rms_graph(add_inputs=("x", "y"), rank3=True):
    """s = x + y; out = rmsnorm(s) * g (the lowering's six nodes); again = s + z (the sum read twice)."""
    nodes = [helper.make_node("Add", list(add_inputs), ["s"]),
             helper.make_node("Pow", ["s", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["s", "rms"], ["normed"]),
             helper.make_node("Mul", ["normed", "g"], ["out"]),
             helper.make_node("Add", ["s", "z"], ["again"])]
    shape = [B, T, D] if rank3 else [B * T, D]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps"),
             numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "g")]
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info(n, F, shape) for n in ("x", "y", "z")],
                          [helper.make_tensor_value_info(n, F, shape) for n in ("out", "again")], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return model, {n: shape for n in ("x", "y", "z", "s")}


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def test_add_and_rmsnorm_become_one_skip_simplified_layer_norm_equal_to_numpy():
    model, shapes = _rms_graph()
    report = fuse_skip_norms(model, _types(shapes))
    assert report.fused == {"rms": 1} and not report.kept
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["SkipSimplifiedLayerNormalization", "Add"]  # the chain and its Add are gone
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    x, y, z = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(3))
    g = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "g"))
    out, again = _run(model, {"x": x, "y": y, "z": z})
    s = x.astype(np.float64) + y
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * g
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again, s + z, rtol=1e-6, atol=1e-6)  # the sum, given by the fused node


def test_add_and_layernorm_become_skip_layer_norm_equal_to_numpy():
    rng = np.random.default_rng(2)
    gamma, beta = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["out"], axis=-1, epsilon=EPS),
             helper.make_node("Add", ["s", "z"], ["again"])]
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info(n, F, [B, T, D]) for n in ("x", "y", "z")],
                          [helper.make_tensor_value_info(n, F, [B, T, D]) for n in ("out", "again")],
                          [numpy_helper.from_array(gamma, "g"), numpy_helper.from_array(beta, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    report = fuse_skip_norms(model, _types({n: [B, T, D] for n in ("x", "y", "z", "s")}))
    assert report.fused == {"layernorm": 1}
    assert [n.op_type for n in model.graph.node] == ["SkipLayerNormalization", "Add"]
    x, y, z = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(3))
    out, again = _run(model, {"x": x, "y": y, "z": z})
    s = x.astype(np.float64) + y
    ref = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + EPS) * gamma + beta
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again, s + z, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case, reason", [
    ("constant", "constant or the same value twice"),
    ("rank2", "not of one [B, T, D] shape"),
    ("unknown", "shapes of the Add's inputs are not known"),
])
def test_a_norm_that_does_not_fit_keeps_its_add_and_says_why(case, reason):
    model, shapes = _rms_graph(add_inputs=("x", "g") if case == "constant" else ("x", "y"), rank3=case != "rank2")
    before = [n.op_type for n in model.graph.node]
    report = fuse_skip_norms(model, _types({} if case == "unknown" else shapes))
    assert not report.fused and reason in report.kept["out"]
    assert [n.op_type for n in model.graph.node] == before


def _compile(family: str, sets: list[str], monkeypatch, on: bool):
    built = pipeline.build(MODELS / f"{family}.tsr", None, sets)
    return compile_cached(built, pipeline.weights_for(built, None, 0), skip_norm=on)


@pytest.mark.parametrize("family, sets, op, count", [
    ("llama", ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=100", "d_ff=96"], "SkipSimplifiedLayerNormalization", 4),
    ("gpt2", ["layers=2", "d=64", "heads=4", "vocab=100", "ctx=64"], "SkipLayerNormalization", 5),
])
def test_compiled_decoder_fuses_every_residual_norm_and_decodes_as_before(monkeypatch, family, sets, op, count):
    """Per layer two norms read a residual sum (after attention; the next layer's first or the final
    norm after the MLP): 2 x layers fused; Llama's first norm reads the embedding alone (left as it
    is), GPT-2's the sum of the token and position embeddings (fused too). The fused decoder's logits
    at every step match the unfused one's; its greedy tokens are the same."""
    fused, info = _compile(family, sets, monkeypatch, True)
    plain, info0 = _compile(family, sets, monkeypatch, False)
    ops = [n.op_type for n in general_graph(fused).node]
    assert ops.count(op) == count
    assert f"residual Add + norm fused (Skip(Simplified)LayerNormalization): {count}" in info.explain()
    if family == "llama":  # --explain says why the first norm kept no Add
        assert "layers.0.attn_norm: its input is not an Add" in info.explain()
    assert ops.count("Add") < [n.op_type for n in general_graph(plain).node].count("Add") - 3
    prompts = [[5, 9, 13, 2, 7], [3, 1]]
    steps_a, steps_b = [], []
    a = generate(CachedModel(fused.SerializeToString(), info), prompts, 12,
                 on_logits=lambda i, x: steps_a.append(np.array(x)))
    b = generate(CachedModel(plain.SerializeToString(), info0), prompts, 12,
                 on_logits=lambda i, x: steps_b.append(np.array(x)))
    assert a.tokens == b.tokens
    assert max(float(np.abs(x - y).max()) for x, y in zip(steps_a, steps_b)) < 1e-4
