"""weight("./NAME") and weight("../NAME"): a block's own parameters by a path relative to its
instance, so a block applies its projection to a second input (DeBERTa's relative positions through
its key projection) whatever path the block is instantiated at; linear's bias= takes a shared
tensor too. Values checked against numpy written here with the model's own weights."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights
from tessera.spec.diagnostics import SpecError

SPEC = """
block disentangled(x: [B, T, d], rel: [B, T, d]) -> [B, T, d] {
  k = linear(x, d, name="k")
  k_rel = linear(rel, d, weight=weight("./k.weight"), bias=weight("./k.bias"), name="k_rel")
  return k + k_rel * parameter([d], init="ones", name="gain")
}

block outer(x: [B, T, d], rel: [B, T, d]) -> [B, T, d] {
  h = disentangled(x, rel, name="attn")
  return h + linear(rel, d, bias=false, weight=weight("./attn.k.weight"), name="again")
}

model M(d = 8, layers = 2) {
  in x: f32[B, T, d]
  in rel: f32[B, T, d]
  out y: f32[B, T, d]
  h = x
  repeat layers as i {
    h = outer(h, rel, name="block")
  }
  y = h
}
"""


@pytest.fixture
def spec(tmp_path):
    p = tmp_path / "rel.tsr"
    p.write_text(SPEC)
    return p


def test_relative_paths_name_each_instance_own_parameters(spec, rng):
    g = build(str(spec))
    w = init_weights(g, seed=3)
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    rel = rng.standard_normal((1, 3, 8)).astype(np.float32)
    h = x
    for i in range(2):
        p = f"layers.{i}.block.attn."
        wk, bk, gain = w[p + "k.weight"], w[p + "k.bias"], w[p + "gain"]
        h = (h @ wk.T + bk) + (rel @ wk.T + bk) * gain + rel @ wk.T
    np.testing.assert_allclose(interpret.run(g, w, {"x": x, "rel": rel})["y"], h, rtol=1e-5, atol=1e-5)
    # shared, not copied: per layer only k (8x8 + 8) and gain (8)
    assert parameter_report(g)["total"] == 2 * (8 * 8 + 8 + 8)


def test_a_relative_path_above_the_top_or_to_nothing_is_a_positioned_error(spec, tmp_path):
    bad = tmp_path / "bad.tsr"
    bad.write_text(SPEC.replace('weight("./attn.k.weight")', 'weight("../../../../x.weight")'))
    with pytest.raises(SpecError, match=r"'../../../../x.weight' goes above the model's top scope"):
        build(str(bad))
    bad.write_text(SPEC.replace('weight("./k.bias")', 'weight("./q.bias")'))
    with pytest.raises(SpecError, match=r"no parameter 'layers.0.block.attn.q.bias'"):
        build(str(bad))
