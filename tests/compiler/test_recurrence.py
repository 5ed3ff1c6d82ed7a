"""Recurrence (scan, the rnn/gru/lstm cells of the standard library) against PyTorch.

Each cell, unidirectional and bidirectional, with PyTorch's own weights, through the numpy
interpreter and onnxruntime, for both ONNX lowerings: onnx's RNN/GRU/LSTM op and the Scan of the
body (forced with ChooseRecurrenceLowering("scan")). MACs of the report against a hand count.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import ort_run
from tessera.compiler.analysis import cost
from tessera.compiler.frontend.elaborate import elaborate
from tessera.compiler.analysis.poly import Poly
from tessera.compiler.passes.recurrence import ChooseRecurrenceLowering
from tessera.compiler.patterns.recurrence import CELL_OPS
from tessera.compiler.ops import interpret
from tessera.spec import SpecError, load_program

torch = pytest.importorskip("torch")

D, H = 5, 7
SPEC = """
model R(kind = "gru", bidir = false, d = 5, n = 7) {{
  in x: f32[B, T, d]
  out y: f32[B, T, {width}]
  layer = gru
  if kind == "rnn" {{ layer = rnn }}
  if kind == "lstm" {{ layer = lstm }}
  if bidir {{ y = bidirectional(x, n, layer=layer, name="l") }} else {{ y = layer(x, n, name="l") }}
}}
"""


def _graph(tmp_path, kind, bidir):
    p = tmp_path / f"r_{kind}_{bidir}.tsr"
    p.write_text(SPEC.format(width="2 * n" if bidir else "n"))
    g, _ = elaborate(load_program(p), None, {"kind": kind, "bidir": bidir})
    return g


def _torch(kind, bidir, seed=0):
    torch.manual_seed(seed)
    cls = {"rnn": torch.nn.RNN, "gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[kind]
    return cls(D, H, batch_first=True, bidirectional=bidir)


def _weights(module, bidir):
    """PyTorch's names -> the spec's parameter paths (written out here, not taken from Tessera)."""
    out = {}
    for suffix, seg in [("", "l.fwd" if bidir else "l"), ("_reverse", "l.bwd")]:
        if suffix and not bidir:
            continue
        for a, b in [("weight_ih", "ih.weight"), ("bias_ih", "ih.bias"), ("weight_hh", "hh.weight"),
                     ("bias_hh", "hh.bias")]:
            out[f"{seg}.cell.{b}"] = getattr(module, f"{a}_l0{suffix}").detach().numpy().astype(np.float32)
    return out


@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
@pytest.mark.parametrize("bidir", [False, True])
def test_cells_equal_pytorch_in_numpy_and_both_onnx_lowerings(tmp_path, rng, kind, bidir):
    g = _graph(tmp_path, kind, bidir)
    m = _torch(kind, bidir)
    w = _weights(m, bidir)
    assert set(w) == set(g.params)
    x = rng.standard_normal((3, 6, D)).astype(np.float32)
    with torch.no_grad():
        want = m(torch.from_numpy(x))[0].numpy()
    got = interpret.run(g, w, {"x": x})["y"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for mode, op_type in [("auto", kind.upper()), ("scan", "Scan")]:
        gg = g.copy()
        notes = ChooseRecurrenceLowering(mode)(gg).notes
        assert [n.lowering for n in notes] == [kind if mode == "auto" else "scan"] * (2 if bidir else 1)
        from tessera.compiler.backends.onnx.export import to_onnx
        model = to_onnx(gg, w)
        assert op_type in {n.op_type for n in model.graph.node}
        y = ort_run(gg, w, {"x": x})["y"]
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=0, err_msg=f"{mode} lowering")


@pytest.mark.parametrize("kind,gates", [("rnn", 1), ("gru", 3), ("lstm", 4)])
@pytest.mark.parametrize("bidir", [False, True])
def test_report_macs_are_per_step_macs_times_T(tmp_path, kind, gates, bidir):
    """A hand count: each step multiplies x_t [D] by W_ih [g·H, D] and h [H] by W_hh [g·H, H]."""
    g = _graph(tmp_path, kind, bidir)
    costs, _ = cost.node_costs(g)
    macs = cost.total(costs, "macs")
    per_step = gates * H * D + gates * H * H
    want = Poly.symbol("B") * Poly.symbol("T") * (per_step * (2 if bidir else 1))
    assert macs == want, macs
    assert macs.evaluate({"B": 3, "T": 500}) == 3 * 500 * per_step * (2 if bidir else 1)


def test_the_cell_op_tables_match_the_stdlib_cells(tmp_path):
    """CELL_OPS (what the fused-op lowering accepts) is what the standard library's cells elaborate to."""
    for kind in ("rnn", "gru", "lstm"):
        g = _graph(tmp_path, kind, False)
        (node,) = [n for n in g.nodes.values() if n.op == "scan"]
        assert Counter(n.op for n in node.attrs["body"].graph.nodes.values()) == CELL_OPS[kind]


def _spec_error(tmp_path, text, name="bad.tsr"):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        elaborate(load_program(p))
    return e.value.render().replace(str(p), name)


def test_a_state_that_changes_shape_is_an_error_at_the_scan_call(tmp_path):
    text = """block grow(h: [B, n], x: [B, d]) {
  return concat([h, x], -1)
}
model M() {
  in x: f32[B, T, 3]
  out y: f32[B, T, 7]
  y = scan(grow, zero_state(x, 4), x)[0]
}
"""
    r = _spec_error(tmp_path, text)
    lines = r.splitlines()
    assert lines[0].startswith("bad.tsr:7:7: error: scan: the step block grow returns state 0 as f32[B, 7], "
                               "but it carries f32[B, 4]"), r
    assert lines[1] == "    7 |   y = scan(grow, zero_state(x, 4), x)[0]" and "^" in lines[2], r


@pytest.mark.parametrize("call,message", [
    ("scan(relu, h, x)", "'step' must be a block (the step function), got builtin relu"),
    ("scan(step, h, 3.0)", "'xs' must be a tensor or a list of tensors, got float 3.0"),
    ("scan(step, h, x, reverse=1)", "'reverse' must be true or false, got int 1"),
    ("scan(step, h, x, args=3)", "'args' must be a list, got int 3"),
    ("scan(step, h, x, revers=true)", "unknown argument 'revers' for scan; did you mean 'reverse'?"),
    ("scan(pair, h, x)", "the step block pair returns 1 tensor(s) but carries"),
])
def test_bad_scan_calls_are_spec_errors(tmp_path, call, message):
    text = f"""block step(h: [B, n], x: [B, d]) -> [B, n] {{
  return h
}}
block pair(h: [B, n], g: [B, n], x: [B, d]) {{
  return h
}}
model M() {{
  in x: f32[B, T, 3]
  out y: f32[B, T, 4]
  h = zero_state(x, 4)
  if false {{ h = [h, h] }}
  y = {call}[0]
}}
"""
    if "pair" in call:
        text = text.replace("scan(pair, h, x)", "scan(pair, [h, h], x)")
    r = _spec_error(tmp_path, text)
    assert r.startswith("bad.tsr:12:") and message in r.splitlines()[0], r


def test_fp16_export_lowers_the_step_and_falls_back_to_scan(tmp_path, rng):
    """onnxruntime's cell kernels are fp32: at --dtype fp16 the body is lowered too and runs as a Scan."""
    from tessera.compiler.passes.attention_kernels import Target
    from tessera.compiler.passes.pipeline import build_pipeline

    g = _graph(tmp_path, "gru", True)
    m = _torch("gru", True)
    w = _weights(m, True)
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    with torch.no_grad():
        want = m(torch.from_numpy(x))[0].numpy()
    result = build_pipeline(Target("cpu", "fp16"), lower_precision=True)(g)
    assert {n.lowering for n in result.notes(ChooseRecurrenceLowering.name)} == {"scan"}
    np.testing.assert_allclose(ort_run(g, w, {"x": x})["y"], want, atol=5e-3, rtol=0)


def test_a_custom_step_with_two_inputs_an_argument_and_two_outputs(tmp_path, rng):
    """scan's general form through the Scan lowering, against numpy written here: carried
    h_t = h_{t-1} * g + a_t * b_t (g an argument), per-step outputs h_t and a_t - h_t, both directions."""
    text = """block step(h: [B, d], a: [B, d], b: [B, d], g: [B, d], k: int) {
  h2 = h * g + a * b
  return [h2, h2, a - h2 * k]
}
model M(d = 3, reverse = false) {
  in a: f32[B, T, d]
  in b: f32[B, T, d]
  in g: f32[B, d]
  out hs: f32[B, T, d]
  out ds: f32[B, T, d]
  out last: f32[B, d]
  r = scan(step, zero_state(a, d), [a, b], args=[g, 1], reverse=reverse)
  hs = r[0]
  ds = r[1]
  last = r[2]
}
"""
    p = tmp_path / "custom.tsr"
    p.write_text(text)
    a, b = rng.standard_normal((2, 2, 5, 3)).astype(np.float32)
    gate = rng.standard_normal((2, 3)).astype(np.float32)
    for reverse in (False, True):
        g, _ = elaborate(load_program(p), None, {"reverse": reverse})
        h = np.zeros((2, 3), np.float32)
        hs = np.zeros_like(a)
        for t in (range(4, -1, -1) if reverse else range(5)):
            h = h * gate + a[:, t] * b[:, t]
            hs[:, t] = h
        want = {"hs": hs, "ds": a - hs, "last": h}
        got = interpret.run(g, {}, {"a": a, "b": b, "g": gate})
        ChooseRecurrenceLowering()(g)
        ort = ort_run(g, {}, {"a": a, "b": b, "g": gate})
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, atol=1e-5, rtol=0)
            np.testing.assert_allclose(ort[name], w, atol=1e-5, rtol=0)


def test_a_scan_inside_a_step(tmp_path, rng):
    """A step that runs its own scan (over a tensor passed in args) exports as a Scan in a Scan;
    numpy and onnxruntime agree with numpy written here."""
    text = """block inner(c: [B, d], m: [B, d]) -> [B, d] {
  return c * 0.5 + m
}
block outer(h: [B, d], x: [B, d], mem: [B, S, d]) -> [B, d] {
  return h + x * scan(inner, h, mem)[1]
}
model M(d = 3) {
  in x: f32[B, T, d]
  in mem: f32[B, S, d]
  out y: f32[B, T, d]
  y = scan(outer, zero_state(x, d), x, args=[mem])[0]
}
"""
    p = tmp_path / "nested.tsr"
    p.write_text(text)
    g, _ = elaborate(load_program(p))
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    mem = rng.standard_normal((2, 5, 3)).astype(np.float32)
    h = np.zeros((2, 3), np.float32)
    want = np.zeros_like(x)
    for t in range(4):
        c = h
        for s in range(5):
            c = c * 0.5 + mem[:, s]
        h = h + x[:, t] * c
        want[:, t] = h
    np.testing.assert_allclose(interpret.run(g, {}, {"x": x, "mem": mem})["y"], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ort_run(g, {}, {"x": x, "mem": mem})["y"], want, atol=1e-5, rtol=0)
