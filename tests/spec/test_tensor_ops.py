"""The tensor ops of issue 12 (comparisons, logic, where, cumsum, log, abs, minimum/maximum,
clamp, floor/ceil/round, floor division) and int()/float() on numbers: each checked through
the numpy interpreter and onnxruntime against numpy written here and against PyTorch, with
their type-rule errors (positioned) and their cost."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler import ops
from tessera.compiler.analysis import cost
from tessera.compiler.ops import interpret
from tessera.spec.diagnostics import SpecError

torch = pytest.importorskip("torch")


def _spec(tmp_path, text, name="ops.tsr"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _both(g, feeds):
    """(interpreter outputs, onnxruntime outputs)."""
    return interpret.run(g, {}, feeds), ort_run(g, {}, feeds)


@pytest.fixture
def feeds(rng):
    x = (rng.standard_normal((2, 9)) * 3).astype(np.float32)
    x[0, :4] = [0.5, 1.5, 2.5, -2.5]  # halves: round to even
    ids = rng.integers(-20, 20, (2, 9)).astype(np.int64)
    ids[0, :3] = [-7, 7, 0]
    return {"x": x, "y": rng.standard_normal((2, 9)).astype(np.float32), "ids": ids}


OPS_SPEC = """
model M() {
  in x: f32[B, T]
  in y: f32[B, T]
  in ids: i64[B, T]
  out lt: bool[B, T]
  out le: bool[B, T]
  out gt: bool[B, T]
  out ge: bool[B, T]
  out eq: bool[B, T]
  out ne: bool[B, T]
  out both: bool[B, T]
  out either: bool[B, T]
  out neither: bool[B, T]
  out sel: f32[B, T]
  out sel_num: f32[B, T]
  out cs: f32[B, T]
  out cs_int: i64[B, T]
  out lg: f32[B, T]
  out ab: f32[B, T]
  out ab_int: i64[B, T]
  out mn: f32[B, T]
  out mx: f32[B, T]
  out cl: f32[B, T]
  out cl_lo: f32[B, T]
  out fl: f32[B, T]
  out ce: f32[B, T]
  out rd: f32[B, T]
  out fdiv: f32[B, T]
  out idiv: i64[B, T]
  lt = x < y
  le = x <= 0.5
  gt = 1.5 > x
  ge = ids >= 3
  eq = ids == 7
  ne = ids != 0
  both = x > 0.0 and ids > 0
  either = x > 1.0 or ids < -5
  neither = not (x > 0.0)
  sel = where(x > y, x, y * 2.0)
  sel_num = where(ids > 0, 1.0, -1.0)
  cs = cumsum(x, 1)
  cs_int = cumsum(ids, -1)
  lg = log(abs(x) + 0.1)
  ab = abs(x)
  ab_int = abs(ids)
  mn = minimum(x, y)
  mx = maximum(x, 0.25)
  cl = clamp(x, lo=-1.0, hi=2.0)
  cl_lo = clamp(x, lo=0.0)
  fl = floor(x)
  ce = ceil(x)
  rd = round(x)
  fdiv = x // 0.7
  idiv = ids // -3 + ids // 4
}
"""


@pytest.fixture(scope="module")
def ops_graph(tmp_path_factory):
    return build(_spec(tmp_path_factory.mktemp("ops"), OPS_SPEC))


def test_every_op_matches_numpy_and_torch_in_the_interpreter_and_onnxruntime(ops_graph, feeds):
    x, y, ids = feeds["x"], feeds["y"], feeds["ids"]
    tx, ty, ti = (torch.from_numpy(v) for v in (x, y, ids))
    numpy_ref = {
        "lt": x < y, "le": x <= 0.5, "gt": 1.5 > x, "ge": ids >= 3, "eq": ids == 7, "ne": ids != 0,
        "both": (x > 0) & (ids > 0), "either": (x > 1) | (ids < -5), "neither": ~(x > 0),
        "sel": np.where(x > y, x, y * 2), "sel_num": np.where(ids > 0, 1.0, -1.0).astype(np.float32),
        "cs": np.cumsum(x, 1), "cs_int": np.cumsum(ids, 1), "lg": np.log(np.abs(x) + np.float32(0.1)),
        "ab": np.abs(x), "ab_int": np.abs(ids), "mn": np.minimum(x, y), "mx": np.maximum(x, 0.25),
        "cl": np.clip(x, -1, 2), "cl_lo": np.maximum(x, 0), "fl": np.floor(x), "ce": np.ceil(x),
        "rd": np.round(x), "fdiv": np.floor(x / np.float32(0.7)),
        "idiv": ids // -3 + ids // 4,
    }
    torch_ref = {
        "lt": tx < ty, "le": tx <= 0.5, "gt": 1.5 > tx, "ge": ti >= 3, "eq": ti == 7, "ne": ti != 0,
        "both": torch.logical_and(tx > 0, ti > 0), "either": torch.logical_or(tx > 1, ti < -5),
        "neither": torch.logical_not(tx > 0), "sel": torch.where(tx > ty, tx, ty * 2),
        "sel_num": torch.where(ti > 0, 1.0, -1.0), "cs": torch.cumsum(tx, 1), "cs_int": torch.cumsum(ti, -1),
        "lg": torch.log(torch.abs(tx) + 0.1), "ab": torch.abs(tx), "ab_int": torch.abs(ti),
        "mn": torch.minimum(tx, ty), "mx": torch.clamp(tx, min=0.25), "cl": torch.clamp(tx, -1.0, 2.0),
        "cl_lo": torch.clamp(tx, min=0.0), "fl": torch.floor(tx), "ce": torch.ceil(tx), "rd": torch.round(tx),
        "fdiv": torch.floor(tx / 0.7), "idiv": torch.div(ti, -3, rounding_mode="floor") + torch.div(ti, 4, rounding_mode="floor"),
    }
    ours, ort = _both(ops_graph, feeds)
    assert set(ours) == set(numpy_ref) == set(torch_ref)
    for name in numpy_ref:
        want, t = numpy_ref[name], torch_ref[name].numpy()
        np.testing.assert_allclose(want, t, rtol=1e-6, atol=1e-6, err_msg=f"{name}: numpy vs torch")
        for got, where in ((ours[name], "interpreter"), (ort[name], "onnxruntime")):
            assert got.dtype == want.dtype, (name, where, got.dtype)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{name}: {where}")
    # the halves round to even, as torch.round and ONNX Round do
    assert list(ort["rd"][0, :4]) == [0.0, 2.0, 2.0, -2.0]
    # floor division rounds toward minus infinity for integers (ONNX's Div alone would give -2 for -7 // 3)
    assert ort["idiv"][0, 0] == (-7 // -3) + (-7 // 4) == 2 + -2


def test_int_and_float_on_compile_time_numbers(tmp_path):
    g = build(_spec(tmp_path, """
model M(frac = 0.25, hd = 64) {
  in x: f32[B, T, hd]
  out y: f32[B, T, int(hd * frac)]
  let r = int(hd * frac)
  assert r == 16 and int(2.9) == 2 and int(-2.9) == -2 and int(7) == 7
  assert float(7) / 2 == 3.5 and float(3) == 3.0
  assert floor(2.5) == 2 and ceil(2.1) == 3 and round(2.5) == 2 and round(3.5) == 4 and abs(-3) == 3
  assert log(exp(2.0)) == 2.0
  y = slice(x, 2, 0, r)
}
"""))
    assert [int(d) for d in g.type_of("y").shape[2:]] == [16]


@pytest.mark.parametrize("body,message,col", [
    ("y = ids / 2", "'/' on i64 tensors: write // for floor division", 7),
    ("y = ids * 0.5", "a float with a i64 tensor would be truncated", 7),
    ("y = where(ids, x, x)", "where's condition must be a bool tensor", 7),
    ("y = where(x > 0.0, x, ids)", "where: dtypes differ", 7),
    ("y = log(ids)", "log needs a floating-point tensor", 7),
    ("y = cumsum(x > 0.0, 1)", "cumsum of a bool tensor", 7),
    ("y = cumsum(x, 2)", "axis 2 is out of range", 7),
    ("y = x + (x > 0.0)", "dtypes differ", 7),
    ("y = (x > 0.0) + (x > 1.0)", "arithmetic on bool tensors", 7),
    ("y = (x > 0.0) and x", "'and' and 'or' on tensors need bool tensors", 7),
    ("y = not x", "'not' on a tensor needs a bool tensor", 7),
    ("y = (x > 0.0) and true", "both sides must be bool tensors", 21),
    ("y = clamp(x, lo=2.0, hi=1.0)", "lo=2.0 is above hi=1.0", 16),
    ("y = clamp(x)", "give lo=, hi= or both", 7),
    ("y = minimum(1.0, 2.0)", "needs a tensor among a, b", 15),
    ("y = x % 2.0", "operator '%' is not defined on tensors", 7),
    ("let k = int(x)", "expected a compile-time number, got tensor", 15),
    ("let k = int(\"3\")", "expected a compile-time number, got string", 15),
    ("let k = float(true)", "expected a compile-time number, got bool", 17),
    ("let k = min(x, 1.0)", "for tensors use minimum, maximum or clamp", 15),
    ("let k = log(0.0)", "outside the function's domain", 15),
])
def test_type_rule_errors_are_positioned(tmp_path, body, message, col):
    path = _spec(tmp_path, f"""model M() {{
  in x: f32[B, T]
  in ids: i64[B, T]
  out y: f32[B, T]
  {body}
  y = x
}}
""")
    with pytest.raises(SpecError) as err:
        build(path)
    text = str(err.value)
    assert message in text, text
    assert f"ops.tsr:5:{col}:" in text, text


def test_cost_is_one_flop_per_element_and_floordiv_two(ops_graph):
    costs, _ = cost.node_costs(ops_graph)
    by_op = {}
    for c in costs:
        by_op.setdefault(ops_graph.nodes[c.node].op, []).append(c)
    bt = {"B": 3, "T": 11}
    for name in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal", "logical_and",
                 "logical_or", "logical_not", "where", "cumsum", "log", "abs", "minimum", "maximum", "floor",
                 "ceil", "round"):
        for c in by_op[name]:
            assert sum(f.evaluate(bt) for f in c.flops.values()) == 3 * 11, name
            assert c.macs.evaluate(bt) == 0, name
    for c in by_op["floordiv"]:
        assert sum(f.evaluate(bt) for f in c.flops.values()) == 2 * 3 * 11
    # clamp is two ops (maximum, then minimum): two FLOPs per element, no op of its own
    assert not ops.is_registered("clamp")


def test_comparisons_broadcast_and_keep_symbolic_shapes(tmp_path, rng):
    g = build(_spec(tmp_path, """
model M() {
  in x: f32[B, T]
  out m: bool[T, T]
  out c: f32[B, T]
  m = reshape(arange(T), [T, 1]) >= reshape(arange(T), [1, T])
  c = cumsum(where(x > 0.0, 1.0, 0.0), 1)
}
"""))
    x = rng.standard_normal((2, 6)).astype(np.float32)
    ours, ort = _both(g, {"x": x})
    want = np.tril(np.ones((6, 6), bool))
    np.testing.assert_array_equal(ours["m"], want)
    np.testing.assert_array_equal(ort["m"], want)
    np.testing.assert_array_equal(ort["c"], np.cumsum(x > 0, 1).astype(np.float32))
