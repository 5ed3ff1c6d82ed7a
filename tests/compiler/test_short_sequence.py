"""Short sequences (issue 26, item 5): the fused model's per-site If (block kernel while the scores
fit, else the tiled Loop) reads masks built once in the main graph, and gives exactly what the
unfused (--no-fuse) graph gives at N = 32 and 128.

The reference is the unfused graph of the same spec with the same seeded weights, run in
onnxruntime: the block kernel computes the unfused graph's ops in its order (MatMul, scale, Where
with the dtype's minimum, Softmax, MatMul), so the logits are compared bit for bit, not to a tolerance.
"""

import numpy as np
import pytest

from conftest import build, feeds_for, ort_run
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.passes import attention_kernels
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime.io.weights import init_weights

SPECS = [
    ("gpt2", dict(layers=3, d=64, heads=4, vocab=50, ctx=256)),
    ("llama", dict(layers=3, d=64, heads=4, kv_heads=2, vocab=50, d_ff=96)),  # grouped K/V heads
]


def _fused(spec, sets):
    g = build(spec, **sets)
    sites = optimize(g, Target("cpu"), "auto")
    assert sites and all(s.fused for s in sites), [s.describe() for s in sites]
    node = next(n for n in g.nodes.values() if n.op == "fused_attention")
    assert node.attrs.get("block_bytes"), "the CPU auto kernel at a run-time length is the If"
    return g


@pytest.mark.parametrize("spec,sets", SPECS, ids=[s for s, _ in SPECS])
@pytest.mark.parametrize("n", [32, 128])
def test_fused_equals_unfused_bit_for_bit(spec, sets, n):
    unfused = build(spec, **sets)
    weights = init_weights(unfused, seed=26)
    feeds = feeds_for(unfused, np.random.default_rng(n), b=2, t=n)
    want = ort_run(unfused, weights, feeds)
    got = ort_run(_fused(spec, sets), weights, feeds)
    assert want.keys() == got.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), (name, float(np.abs(got[name] - want[name]).max()))


@pytest.mark.parametrize("spec,sets", SPECS, ids=[s for s, _ in SPECS])
def test_long_branch_with_its_empty_mask_still_matches(spec, sets, monkeypatch):
    """BLOCK_BYTES = 1: every site takes the tiled branch; the shared mask is then [0, 0], and
    the tiled kernel builds its own (the Loop sums in another order: fp32 tolerance)."""
    monkeypatch.setattr(attention_kernels, "BLOCK_BYTES", 1)
    unfused = build(spec, **sets)
    weights = init_weights(unfused, seed=26)
    feeds = feeds_for(unfused, np.random.default_rng(0), b=2, t=40)
    want = ort_run(unfused, weights, feeds)
    got = ort_run(_fused(spec, sets), weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def _ops(graph) -> list[str]:
    return [n.op_type for n in graph.node]


@pytest.mark.parametrize("spec,sets", SPECS, ids=[s for s, _ in SPECS])
def test_masks_are_built_once_outside_the_ifs(spec, sets):
    """Each layer's If: its short (block) branch builds no mask (no Range, Greater, Or, Not), and the
    main graph holds one mask, one fits test, however many layers there are."""
    counts = {}
    for layers in (2, 4):
        s = dict(sets, layers=layers)
        g = _fused(spec, s)
        model = onnx_export.to_onnx(g, init_weights(build(spec, **s), seed=0))
        ifs = [n for n in model.graph.node if n.op_type == "If"]
        assert len(ifs) == layers
        for node in ifs:
            then = next(a.g for a in node.attribute if a.name == "then_branch")
            assert not {"Range", "Greater", "LessOrEqual", "Or", "Not"} & set(_ops(then)), _ops(then)
            assert _ops(then).count("Where") == 1  # the one select with the shared mask
        masks = [n for n in model.graph.node if any(o.endswith("block_masks") for o in n.output)]
        fits = [n for n in model.graph.node if any(o.endswith("block_fits") for o in n.output)]
        assert len(masks) == 1 and len(fits) == 1
        assert all(node.input[0] == fits[0].output[0] for node in ifs)
        counts[layers] = _ops(model.graph).count("Greater")
    assert counts[2] == counts[4] == 1  # the causal mask's one comparison, whatever the depth
