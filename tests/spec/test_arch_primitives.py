"""Primitives issue 24 asked for, each against PyTorch in the numpy interpreter and in onnxruntime:
softplus (Mamba's time step) and conv1d with groups (Mamba's depthwise causal convolution)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops import interpret
from tessera.spec.diagnostics import SpecError

torch = pytest.importorskip("torch")


def _spec(tmp_path, text: str) -> str:
    p = tmp_path / "m.tsr"
    p.write_text(text)
    return str(p)


def test_softplus_equals_torch_over_a_wide_range(tmp_path):
    g = build(_spec(tmp_path, """
model M() {
  in x: f32[B, T]
  out y: f32[B, T]
  y = softplus(x)
}
"""))
    x = np.concatenate([np.linspace(-100, 100, 401, dtype=np.float32), np.float32([-1e-3, 0.0, 1e-3, 19.9, 20.1])])
    x = np.stack([x, -x])
    want = torch.nn.functional.softplus(torch.from_numpy(x)).numpy()
    got = interpret.run(g, {}, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.isfinite(got).all()  # exp(100) would overflow a naive log(1 + exp(x))
    np.testing.assert_allclose(ort_run(g, {}, {"x": x})["y"], want, rtol=1e-6, atol=1e-7)


CONV = """
model M(c = 6, out = 6, groups = 6, k = 4, pad = 3) {
  in x: f32[B, c, L]
  out y: f32[B, out, L + 2 * pad - k + 1]
  y = conv1d(x, out, k, padding=pad, groups=groups, name="conv")
}
"""


@pytest.mark.parametrize("sets", [dict(), dict(c=6, out=4, groups=2, k=3, pad=1), dict(groups=1, k=2, pad=0),
                                  dict(c=4, out=8, groups=4, k=3, pad=0)])
def test_grouped_conv1d_equals_torch(tmp_path, rng, sets):
    o = {**dict(c=6, out=6, groups=6, k=4, pad=3), **sets}
    g = build(_spec(tmp_path, CONV), **sets)
    conv = torch.nn.Conv1d(o["c"], o["out"], o["k"], padding=o["pad"], groups=o["groups"])
    w = {"conv.weight": conv.weight.detach().numpy(), "conv.bias": conv.bias.detach().numpy()}
    assert {k: v.shape for k, v in g.params.items()} == {k: v.shape for k, v in w.items()}
    x = rng.standard_normal((2, o["c"], 11)).astype(np.float32)
    with torch.no_grad():
        want = conv(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(interpret.run(g, w, {"x": x})["y"], want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ort_run(g, w, {"x": x})["y"], want, atol=1e-5, rtol=1e-5)
    # parameters: torch's own count
    assert sum(int(np.prod(v.shape)) for v in g.params.values()) == sum(p.numel() for p in conv.parameters())


def test_grouped_conv1d_macs_are_a_hand_count(tmp_path):
    from tessera.compiler.analysis import cost

    g = build(_spec(tmp_path, CONV))  # depthwise: 6 channels, kernel 4, L' = L + 3
    total = sum(c.macs for c in cost.node_costs(g)[0] if c.op == "conv1d")
    assert total.evaluate({"B": 2, "L": 11}) == 2 * 6 * 14 * 4  # one multiply-add per output and tap


def test_groups_that_do_not_divide_are_positioned_errors(tmp_path):
    with pytest.raises(SpecError, match="groups=4 must divide the input channels") as err:
        build(_spec(tmp_path, CONV), groups=4)
    assert "m.tsr:5:" in str(err.value)
