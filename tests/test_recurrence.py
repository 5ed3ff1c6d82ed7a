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
from tessera.compiler.reference import interpret
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
