"""The report labels norms by their computation (issue 12): an RMSNorm or a layer norm written
from primitives with parameter() weights is "norm", as the builtins' are, Gemma's (1 + w) scale
included; parameters that only look alike (a scale on an unnormalised value) are not."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build
from tessera.compiler.analysis.params import parameter_report, role
from tessera.compiler.analysis.structure import analyse
from tessera.compiler.patterns.norm import norm_parameters
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights

SPEC = """
block hand_rms(x: [B, T, d], eps = 1e-6, plus_one = false) -> [B, T, d] {
  w = parameter([d], init="ones", name="weight")
  if plus_one { w = 1.0 + w }
  return x / sqrt(mean(x * x, -1, keepdims=true) + eps) * w
}

block hand_ln(x: [B, T, d], eps = 1e-5) -> [B, T, d] {
  c = x - mean(x, -1, keepdims=true)
  n = c * (1.0 / sqrt(mean(c * c, -1, keepdims=true) + eps))
  return n * parameter([d], init="ones", name="weight") + parameter([d], init="zeros", name="bias")
}

block not_a_norm(x: [B, T, d]) -> [B, T, d] {
  return x * parameter([d], init="ones", name="weight")
}

model M(d = 16) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = hand_rms(x, name="rms") + hand_rms(x, plus_one=true, name="gemma") + hand_ln(x, name="ln")
  y = not_a_norm(y, name="gain") + linear(rmsnorm(y, name="builtin_rms"), d, name="proj")
}
"""


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    p = tmp_path_factory.mktemp("norm") / "norm.tsr"
    p.write_text(SPEC)
    return build(str(p))


def test_hand_written_norms_are_found_by_their_pattern(graph):
    assert norm_parameters(graph) == {"rms.weight", "gemma.weight", "ln.weight", "ln.bias"}


def test_the_report_labels_them_norm_and_leaves_lookalikes_alone(graph):
    st = analyse(graph)
    assert {p: role(graph, st, p) for p in ("rms", "gemma", "ln", "builtin_rms", "gain", "proj")} == {
        "rms": "norm", "gemma": "norm", "ln": "norm", "builtin_rms": "norm", "gain": "parameter", "proj": "linear"}
    labels = [r["label"] for r in parameter_report(graph)["table"]]
    assert any(lab.startswith("rms (norm)") or lab == "rms (norm)" for lab in labels), labels
    assert not any(lab.startswith("rms (parameter)") for lab in labels), labels


def test_the_hand_written_norms_compute_rmsnorm_and_layernorm(graph, rng):
    torch = pytest.importorskip("torch")
    w = init_weights(graph, 0)
    for k in w:
        w[k] = w[k] + rng.standard_normal(w[k].shape).astype(np.float32) * 0.1
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    tx = torch.from_numpy(x)
    rms = torch.nn.functional.rms_norm(tx, (16,), torch.from_numpy(w["rms.weight"]), 1e-6)
    gemma = torch.nn.functional.rms_norm(tx, (16,), 1 + torch.from_numpy(w["gemma.weight"]), 1e-6)
    ln = torch.nn.functional.layer_norm(tx, (16,), torch.from_numpy(w["ln.weight"]), torch.from_numpy(w["ln.bias"]), 1e-5)
    y = (rms + gemma + ln) * torch.from_numpy(w["gain.weight"])
    y = y + torch.nn.functional.linear(torch.nn.functional.rms_norm(rms + gemma + ln, (16,),
                                                                    torch.from_numpy(w["builtin_rms.weight"]), 1e-6),
                                       torch.from_numpy(w["proj.weight"]), torch.from_numpy(w["proj.bias"]))
    np.testing.assert_allclose(interpret.run(graph, w, {"x": x})["y"], y.numpy(), atol=1e-5, rtol=1e-5)
