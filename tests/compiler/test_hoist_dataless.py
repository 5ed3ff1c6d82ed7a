"""backends/onnx/hoist.py: an If branch's shape arithmetic moved into the main graph gives the same results.

The model is written here with onnx.helper: x [B, T] float; an If on (T > 2) whose then-branch builds
key positions from T (Squeeze of a main-graph Shape, Range, Less against a float-free threshold) and
masks x with them, and whose else-branch reads x alone. Checked on onnxruntime's CPU provider against
numpy written in the test, before and after the move, for both branches; what moved is the dimension
arithmetic, not the data (the Where over x and the float constant stay in the branch).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP, helper as h, numpy_helper

from tessera.compiler.backends.onnx.hoist import hoist_dataless


def _model() -> onnx.ModelProto:
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.int64), name)  # noqa: E731
    then = h.make_graph([
        h.make_node("Squeeze", ["dim_t", "axes0"], ["t_scalar"]),
        h.make_node("Sub", ["t_scalar", "two"], ["limit"]),
        h.make_node("Range", ["zero", "t_scalar", "one"], ["cols"]),
        h.make_node("Less", ["cols", "limit"], ["keep"]),
        h.make_node("Where", ["keep", "x", "minus"], ["y_then"]),
    ], "then", [], [h.make_tensor_value_info("y_then", TP.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(-1.0, dtype=np.float32), "minus")])
    other = h.make_graph([h.make_node("Neg", ["x"], ["y_else"])], "else", [],
                         [h.make_tensor_value_info("y_else", TP.FLOAT, None)])
    g = h.make_graph([
        h.make_node("Shape", ["x"], ["dim_t"], start=1, end=2),
        h.make_node("Greater", ["dim_t", "two_vec"], ["long"]),
        h.make_node("Squeeze", ["long", "axes0"], ["cond"]),
        h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ], "g", [h.make_tensor_value_info("x", TP.FLOAT, ["B", "T"])], [h.make_tensor_value_info("y", TP.FLOAT, None)],
        initializer=[i64("axes0", [0]), i64("two", 2), i64("two_vec", [2]), i64("zero", 0), i64("one", 1)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(m, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_branch_dimension_arithmetic_moves_and_the_results_stay():
    m = _model()
    before = [n.op_type for n in next(a.g for a in m.graph.node[3].attribute if a.name == "then_branch").node]
    moved = _model()
    assert hoist_dataless(moved) == 4  # Squeeze, Sub, Range, Less: dimensions and integer constants only
    then = next(a.g for a in moved.graph.node[-1].attribute if a.name == "then_branch")
    assert before == ["Squeeze", "Sub", "Range", "Less", "Where"] and [n.op_type for n in then.node] == ["Where"]
    assert [n.op_type for n in moved.graph.node][-5:] == ["Squeeze", "Sub", "Range", "Less", "If"]
    rng = np.random.default_rng(0)
    for t in (1, 2, 5):  # the else branch, then the then branch
        x = rng.standard_normal((2, t)).astype(np.float32)
        want = np.where(np.arange(t) < t - 2, x, np.float32(-1.0)) if t > 2 else -x
        np.testing.assert_array_equal(_run(m, x), want)
        np.testing.assert_array_equal(_run(moved, x), want)


def test_a_branch_that_reads_data_keeps_it():
    m = _model()
    else_branch = next(a.g for a in m.graph.node[-1].attribute if a.name == "else_branch")
    hoist_dataless(m)
    assert [n.op_type for n in else_branch.node] == ["Neg"]
