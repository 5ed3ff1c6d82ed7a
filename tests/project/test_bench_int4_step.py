"""bench/int4_step.py's graph surgery and naming: ``unwrap_bound_step`` lifts the else branch of a
graph's last If into a model of its own (the bench's measure of what the If costs), and ``_role``
names each MatMulNBits of Tessera's and genai's graphs by the linear it is.

The If model is built here by hand (a top-level node the branch reads, an initializer of the main
graph, a branch initializer, an output the branch passes through); the unwrapped model's outputs are
checked against numpy written in the test, and against the If model run with the condition False.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import load_bench

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def bench():
    return load_bench("int4_step")


def _if_model(path: Path) -> np.ndarray:
    """y = If(cond, then: x + 1, else: (x * w + b) * n) with n = Shape(x)[1] made at the top level; the
    else branch's second output is an initializer of its own (as the bound step's empty cache
    columns: no node of it makes that one)."""
    from onnx import TensorProto as TP, helper as h, numpy_helper as nh

    w = np.array([[2.0, -1.0, 0.5]], np.float32)
    b = np.array([0.25], np.float32)
    then = h.make_graph([h.make_node("Add", ["x", "one"], ["t_y"]), h.make_node("Identity", ["x"], ["t_x"])], "then", [],
                        [h.make_tensor_value_info("t_y", TP.FLOAT, None), h.make_tensor_value_info("t_x", TP.FLOAT, None)],
                        [nh.from_array(np.array([1.0], np.float32), "one")])
    other = h.make_graph([h.make_node("Mul", ["x", "w"], ["xw"]), h.make_node("Add", ["xw", "b"], ["xwb"]),
                          h.make_node("Cast", ["n"], ["nf"], to=TP.FLOAT), h.make_node("Mul", ["xwb", "nf"], ["e_y"])],
                         "else", [], [h.make_tensor_value_info("e_y", TP.FLOAT, None),
                                      h.make_tensor_value_info("empty", TP.FLOAT, None)],
                         [nh.from_array(b, "b"), nh.from_array(np.zeros((1, 0), np.float32), "empty")])
    top = [h.make_node("Shape", ["x"], ["shape"]), h.make_node("Gather", ["shape", "i1"], ["n"], axis=0),
           h.make_node("If", ["cond"], ["y", "x_out"], then_branch=then, else_branch=other)]
    graph = h.make_graph(top, "m", [h.make_tensor_value_info("x", TP.FLOAT, [1, 3]),
                                    h.make_tensor_value_info("cond", TP.BOOL, [])],
                         [h.make_tensor_value_info("y", TP.FLOAT, None), h.make_tensor_value_info("x_out", TP.FLOAT, None)],
                         [nh.from_array(w, "w"), nh.from_array(np.array(1, np.int64), "i1")])
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), str(path))
    return w, b


def test_unwrap_bound_step_runs_the_else_branch_alone(bench, tmp_path):
    w, b = _if_model(tmp_path / "if.onnx")
    bench.unwrap_bound_step(tmp_path / "if.onnx", tmp_path / "bound.onnx")
    model = onnx.load(str(tmp_path / "bound.onnx"))
    assert [n.op_type for n in model.graph.node] == ["Shape", "Gather", "Mul", "Add", "Cast", "Mul"]  # no If
    assert [o.name for o in model.graph.output] == ["y"]  # the initializer output is dropped
    assert [i.name for i in model.graph.input] == ["x"]  # not the If's condition
    x = np.array([[1.0, 2.0, -4.0]], np.float32)
    want = (x * w + b) * 3.0  # numpy: n = x.shape[1]
    got = ort.InferenceSession(str(tmp_path / "bound.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    full = ort.InferenceSession(str(tmp_path / "if.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(full.run(["y"], {"x": x, "cond": np.array(False)})[0], got)


def test_unwrap_refuses_a_graph_whose_last_node_is_not_an_if(bench, tmp_path):
    from onnx import TensorProto as TP, helper as h

    graph = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "m", [h.make_tensor_value_info("x", TP.FLOAT, [1])],
                         [h.make_tensor_value_info("y", TP.FLOAT, [1])])
    onnx.save(h.make_model(graph), str(tmp_path / "plain.onnx"))
    with pytest.raises(SystemExit, match="not the bound step's If"):
        bench.unwrap_bound_step(tmp_path / "plain.onnx", tmp_path / "out.onnx")


@pytest.mark.parametrize("node, role", [
    ("layers.3.attn.q+k+v", "qkv"), ("/model/layers.3/attn/qkv_proj/MatMul_Q4", "qkv"),
    ("layers.3.attn.o", "o"), ("/model/layers.3/attn/o_proj/MatMul_Q4", "o"),
    ("layers.3.mlp.gate+up", "gate+up"), ("/model/layers.3/mlp/gate_proj/MatMul_Q4", "gate"),
    ("layers.3.mlp.gate", "gate"), ("layers.3.mlp.up", "up"), ("/model/layers.3/mlp/up_proj/MatMul_Q4", "up"),
    ("layers.3.mlp.down", "down"), ("/model/layers.3/mlp/down_proj/MatMul_Q4", "down"),
    ("head", "head"), ("/lm_head/MatMul_Q4", "head"), ("something else", "other"),
])
def test_matmulnbits_roles(bench, node, role):
    assert bench._role(node) == role
