"""The attention contract: a score-path op added by a ScoreRule alone is computed exactly by every
kernel that lowers it, or the site is refused with a reason naming the feature; never a wrong result.

The case is issue 20's: a clamp of the scores (``clamp(s, hi=c)``, the IR's ``minimum`` with a
constant) added as one ScoreRule fused, and the block and portable kernels returned results 0.019
away from the unfused graph. Here the rule is added in the test (monkeypatching the rules table),
first alone (refused, whatever it claims), then with its feature added to both score epilogues
(fused, and equal to the unfused graph in onnxruntime for every kernel that takes it; the contrib
kernels refuse it by their allow-lists). Expected values come from the unfused graph run by
onnxruntime and from numpy written here. Also: the fused node's attribute schema.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler import ops
from tessera.compiler.backends.onnx import attention as onnx_attention
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.backends.onnx import score_epilogue as onnx_epilogue
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, SymbolSource, TensorType
from tessera.compiler.ops import attention as attention_ops
from tessera.compiler.ops.registry import ShapeError
from tessera.compiler.passes.attention_kernels import KERNELS, Target
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.patterns import attention as pattern
from tessera.compiler.ops import interpret
from tessera.compiler.reference import score_epilogue as ref_epilogue
from tessera.runtime.io.weights import init_weights

HI = 0.5  # the clamp's upper bound: small enough that it bites (scores here reach about 3)

CLAMPED = """
model ScoreClamp(d = 16, heads = 2, padded = false) {
  in x: f32[B, T, d]
  in mask: i64[B, T]
  out y: f32[B, T, d]
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  s = clamp(matmul(q, transpose(k)) / sqrt(d / heads), hi=%s)
  if padded { s = padding_mask(s, mask) }
  y = linear(merge_heads(matmul(softmax(causal_mask(s), axis=-1), v)), d, name="o")
}
""" % HI


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "clamp.tsr"
    path.write_text(CLAMPED)
    return str(path)


def _feeds(rng, b=2, t=19):
    mask = np.ones((b, t), np.int64)
    mask[1, -4:] = 0
    return {"x": rng.standard_normal((b, t, 16)).astype(np.float32) * 2, "mask": mask}


def _check_clamp(g, n, m):
    c = pattern._scalar_const(g, n.inputs[1])
    return None if c is not None else "the scores are clamped by a tensor"


def _absorb_clamp(g, n, m):
    m.attrs["clamp_hi"] = pattern._scalar_const(g, n.inputs[1])


def _absorb_nothing(g, n, m):
    return None


def _rule(monkeypatch, feature, absorb=_absorb_clamp):
    monkeypatch.setitem(pattern.SCORE_RULES, "minimum",
                        pattern.ScoreRule(_check_clamp, absorb, pattern._first, feature))


def _add_to_reference(monkeypatch):
    """The clamp as a feature of the numpy epilogue: one FEATURES row and one step (after the soft-cap)."""
    feature = ref_epilogue.Feature("clamp", 1, {"clamp_hi": ref_epilogue.Attr((float,), "upper bound of the "
                                                                             "scores", ref_epilogue.finite)},
                                   lambda a: a.get("clamp_hi") is not None, "clamp", elementwise=True)
    monkeypatch.setitem(ref_epilogue.FEATURES, "clamp", feature)
    monkeypatch.setattr(ref_epilogue, "STEPS", ref_epilogue.STEPS + [
        (("clamp",), lambda s, a, w: np.minimum(s, np.asarray(a["clamp_hi"], s.dtype)))])


def _add_to_onnx(monkeypatch):
    def clamp(b, a, s, p, blk):
        return b.node("Min", [s, b.const(np.array(a["clamp_hi"], dtype=p.np_dtype), "clamp_hi")])[0]
    monkeypatch.setattr(onnx_epilogue, "STEPS", onnx_epilogue.STEPS + [(("clamp",), clamp)])


def _weights(g):
    """Initial weights made larger, so the scores reach well past HI (init_weights' are about 0.015,
    which gives scores near 0 that no clamp touches) and the outputs are about 1."""
    gain = {"q": 40.0, "k": 40.0, "v": 10.0, "o": 10.0}
    return {name: arr * gain[name.split(".")[0]] for name, arr in init_weights(g, 5).items()}


def _unfused(spec, rng, **sets):
    g = build(spec, **sets)
    w = _weights(g)
    feeds = _feeds(rng)
    return g, w, feeds, ort_run(g, w, feeds)["y"]


def _site(spec, kernel=None, **sets):
    g = build(spec, **sets)
    (site,) = optimize(g, Target("cpu"), kernel)
    return g, site


# ------------------------------------------------------------------ without the rule: not attention
def test_a_clamp_without_a_rule_is_not_attention(spec):
    g, site = _site(spec)
    assert not site.fused and "minimum" in site.reason


# ------------------------------------------------------------------ the rule alone: refused, with the feature named
def test_a_rule_whose_feature_the_epilogue_does_not_know_is_refused(spec, monkeypatch, rng):
    _rule(monkeypatch, "clamp")
    g, w, feeds, want = _unfused(spec, rng)
    for kernel in (None, "block", "portable"):
        g, site = _site(spec, kernel)
        assert not site.fused
        assert "clamp, which the score epilogue" in site.reason and "does not compute" in site.reason
        np.testing.assert_array_equal(ort_run(g, w, feeds)["y"], want)


def test_a_rule_that_names_no_feature_is_refused(spec, monkeypatch):
    _rule(monkeypatch, None)
    g, site = _site(spec)
    assert not site.fused and "no feature of the score epilogue" in site.reason


@pytest.mark.parametrize("claimed", ["scale", "bias", "softcap", "padding"])
def test_a_rule_claiming_a_known_feature_but_recording_nothing_is_refused(spec, monkeypatch, claimed):
    """The issue's miscompile: the rule absorbed the clamp into nothing. Whatever feature it claims,
    the fused node would not carry it, so the site stays unfused."""
    _rule(monkeypatch, claimed, _absorb_nothing)
    g, site = _site(spec)
    assert not site.fused and "records nothing" in site.reason


def test_a_feature_only_the_numpy_epilogue_knows_is_refused_by_every_kernel(spec, monkeypatch, rng):
    _rule(monkeypatch, "clamp")
    _add_to_reference(monkeypatch)
    g, w, feeds, want = _unfused(spec, rng)
    g, site = _site(spec)
    assert not site.fused
    assert "no attention kernel computes the clamp" in site.reason
    for kernel in ("GroupQueryAttention", "MultiHeadAttention", "the block kernel", "the portable kernel"):
        assert f"{kernel} computes no clamp" in site.reason
    np.testing.assert_array_equal(ort_run(g, w, feeds)["y"], want)


# ------------------------------------------------------------------ rule + both epilogues: computed exactly
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kernel", [None, "block", "portable"])
def test_a_feature_both_epilogues_compute_is_fused_and_exact(spec, monkeypatch, rng, kernel, padded):
    _rule(monkeypatch, "clamp")
    _add_to_reference(monkeypatch)
    _add_to_onnx(monkeypatch)
    g, w, feeds, want = _unfused(spec, rng, padded=padded)
    fused, site = _site(spec, kernel, padded=padded)
    assert site.fused
    node = fused.nodes[site.node]
    assert node.attrs["clamp_hi"] == HI and not any(n.op == "minimum" for n in fused.nodes.values())
    ops.check_graph(fused)  # the schema knows the new attribute
    got = ort_run(fused, w, feeds)["y"]
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the clamp bites: without it the output differs by far more than the tolerance
    monkeypatch.setattr(onnx_epilogue, "STEPS", [s for s in onnx_epilogue.STEPS if s[0] != ("clamp",)])
    monkeypatch.setitem(onnx_attention.KERNEL_FEATURES, "block", frozenset(ref_epilogue.FEATURES))
    monkeypatch.setitem(onnx_attention.KERNEL_FEATURES, "portable", frozenset(ref_epilogue.FEATURES))
    with pytest.raises(ValueError, match="does not compute clamp"):
        ort_run(fused, w, feeds)  # the epilogue refuses to drop a feature even when a kernel claims it
    # and the numpy interpreter of the fused graph agrees with onnxruntime's unfused run
    np.testing.assert_allclose(interpret.run(fused, w, feeds)["y"], want, atol=1e-5)


@pytest.mark.parametrize("kernel, name", [("gqa", "GroupQueryAttention"), ("mha", "MultiHeadAttention")])
def test_contrib_kernels_refuse_the_new_feature_by_their_allow_lists(spec, monkeypatch, kernel, name):
    _rule(monkeypatch, "clamp")
    _add_to_reference(monkeypatch)
    _add_to_onnx(monkeypatch)
    with pytest.raises(PassError, match=f"{name} computes no clamp"):
        _site(spec, kernel)


def test_the_clamp_changes_the_result(tmp_path, rng):
    """The feature is not a no-op on these inputs (else the exactness tests would prove nothing)."""
    loose = tmp_path / "loose.tsr"
    loose.write_text(CLAMPED.replace(f"hi={HI}", "hi=1e9"))
    clamped = tmp_path / "clamp.tsr"
    clamped.write_text(CLAMPED)
    _, _, _, want = _unfused(str(clamped), np.random.default_rng(7))
    _, _, _, other = _unfused(str(loose), np.random.default_rng(7))
    assert np.abs(want - other).max() > 0.1 and np.abs(want).max() > 0.5


# ------------------------------------------------------------------ the cached kernels, through the same epilogue
def _cached_graph(impl, heads=4, kv_heads=2, hd=8, **extra):
    """One KV-cached attention as passes/kv_cache.py leaves it: q [B, H, T, hd], keys and values
    [B, G, N, hd] (N = P + T: past and new), the attention mask [B, N]; lengths known at run time."""
    g = Graph("cached")
    b, t, n = dims.symbol("B"), dims.symbol("T"), dims.symbol("N")
    for name, shape, dtype in (("q", (b, heads, t, hd), "f32"), ("k", (b, kv_heads, n, hd), "f32"),
                               ("v", (b, kv_heads, n, hd), "f32"), ("mask", (b, n), "i64")):
        g.add_input(name, TensorType(dtype, tuple(dims.dim(d) for d in shape)))
    g.symbols.update(B=SymbolSource("q", 0), T=SymbolSource("q", 2), N=SymbolSource("k", 2))
    attrs = {"scale": 0.4, "causal": True, "window": 0, "padding": True, "bias": False, "heads": heads,
             "kv_heads": kv_heads, "impl": impl, "q_tile": 16, "k_tile": 16, **extra}
    types = ops.infer("fused_attention", [g.type_of(x) for x in ("q", "k", "v", "mask")], attrs)
    node = g.add_node("fused_attention", ["q", "k", "v", "mask"], types, attrs, "", None)
    g.outputs.append(node.outputs[0])
    return g


def _numpy_attention(q, k, v, mask, scale, hi, heads, kv_heads):
    """Written here: softmax(causal(padding(min(q·kᵀ·scale, hi))))·v with grouped heads."""
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    s = np.minimum(q @ k.transpose(0, 1, 3, 2) * scale, hi)
    t, n = q.shape[2], k.shape[2]
    hide = np.arange(n)[None, :] > np.arange(t)[:, None] + (n - t)
    hide = hide[None, None] | (mask == 0)[:, None, None, :]
    s = np.where(hide, np.finfo(np.float32).min, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("impl, t", [("cached", 1), ("cached", 3), ("phased", 1), ("phased", 6)])
def test_cached_kernels_compute_the_new_feature_exactly(monkeypatch, rng, impl, t):
    _add_to_reference(monkeypatch)
    _add_to_onnx(monkeypatch)
    p = 9
    g = _cached_graph(impl, clamp_hi=HI)
    ops.check_graph(g)
    feeds = {"q": rng.standard_normal((2, 4, t, 8)).astype(np.float32) * 2,
             "k": rng.standard_normal((2, 2, p + t, 8)).astype(np.float32) * 2,
             "v": rng.standard_normal((2, 2, p + t, 8)).astype(np.float32)}
    feeds["mask"] = np.ones((2, p + t), np.int64)
    feeds["mask"][1, :3] = 0  # left padding
    want = _numpy_attention(feeds["q"], feeds["k"], feeds["v"], feeds["mask"], 0.4, HI, 4, 2)
    got = ort_run(g, {}, feeds)[g.outputs[0]]
    np.testing.assert_allclose(got, want, atol=1e-5)
    unclamped = _numpy_attention(feeds["q"], feeds["k"], feeds["v"], feeds["mask"], 0.4, np.inf, 4, 2)
    assert np.abs(unclamped - want).max() > 1e-2  # the clamp bites


# ------------------------------------------------------------------ the tables agree
def test_every_feature_has_one_step_in_each_epilogue():
    for steps in (ref_epilogue.STEPS, onnx_epilogue.STEPS):
        covered = [f for feats, _ in steps for f in feats]
        assert sorted(covered) == sorted(ref_epilogue.FEATURES)


def test_every_kernel_declares_its_features_and_the_schema_knows_every_lowering():
    assert set(onnx_attention.KERNEL_FEATURES) == set(attention_ops.IMPLS) >= set(KERNELS)
    for impl in attention_ops.IMPLS:
        assert onnx_attention.kernel_features(impl) <= set(ref_epilogue.FEATURES)
    assert onnx_attention.kernel_features("gqa") == {"scale", "softcap", "causal", "window", "sinks"}  # head_sink
    assert onnx_attention.kernel_features("attn23") == {"scale", "softcap", "causal", "window", "local_window", "padding",
                                                        "bias", "sinks"}  # sinks: one more key
    assert onnx_attention.kernel_features("portable") == set(ref_epilogue.FEATURES)


def test_every_score_rule_names_a_feature_the_epilogue_knows_or_none():
    for op, rule in pattern.SCORE_RULES.items():
        assert rule.feature is None or rule.feature in ref_epilogue.FEATURES, op


# ------------------------------------------------------------------ the schema
GOOD = {"scale": 0.5, "causal": True, "window": 0, "padding": False, "bias": False, "heads": 4, "kv_heads": 2}
TYPES = [TensorType("f32", tuple(dims.dim(d) for d in s)) for s in ((1, 4, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))]


def test_good_attributes_pass():
    (out,) = ops.infer("fused_attention", TYPES, dict(GOOD, impl="portable", q_tile=16, k_tile=64, softcap=30.0))
    assert out.shape == TYPES[0].shape


@pytest.mark.parametrize("change, message", [
    ({"clamp": 1.0}, "unknown attribute clamp"),
    ({"causal": "yes"}, "attribute causal (hide keys after each query) must be bool, got str 'yes'"),
    ({"causal": 1}, "attribute causal (hide keys after each query) must be bool, got int 1"),
    ({"window": -2}, "attribute window"),
    ({"window": 2.5}, "must be int, got float"),
    ({"scale": float("nan")}, "attribute scale (multiplies the scores) must be finite"),
    ({"softcap": 0.0}, "attribute softcap"),
    ({"impl": "fast"}, "attribute impl"),
    ({"heads": 0}, "attribute heads"),
    ({"heads": 3}, "3 query heads do not divide into 2 groups"),
    ({"causal": False, "window": 4}, "a sliding window (window > 0) needs causal"),
    ({"padding": True}, "3 inputs, its attributes (padding, bias, sinks) say 4"),
    ({"sinks": True}, "3 inputs, its attributes (padding, bias, sinks) say 4"),
])
def test_bad_attributes_are_a_clear_error(change, message):
    with pytest.raises(ShapeError) as e:
        ops.infer("fused_attention", TYPES, dict(GOOD, **change))
    assert message in str(e.value)


def test_a_missing_attribute_is_an_error():
    attrs = dict(GOOD)
    del attrs["kv_heads"]
    with pytest.raises(ShapeError, match="attribute kv_heads .* is missing"):
        ops.infer("fused_attention", TYPES, attrs)


def test_check_graph_names_the_node_with_a_bad_attribute():
    g = build("gpt2", "small", layers=1)
    optimize(g)
    node = next(n for n in g.nodes.values() if n.op == "fused_attention")
    ops.check_graph(g)
    node.attrs["clam_hi"] = 0.5  # a typo: before the schema, every kernel ignored it
    with pytest.raises(ShapeError, match=f"node {node.name}: fused_attention: unknown attribute clam_hi"):
        ops.check_graph(g)


def test_export_checks_the_schema(spec, monkeypatch):
    """An exported graph whose fused node carries an attribute nothing declares is refused."""
    g = build("gpt2", "small", layers=1)
    optimize(g)
    node = next(n for n in g.nodes.values() if n.op == "fused_attention")
    node.attrs["clamp_hi"] = 0.5
    with pytest.raises(ShapeError, match="unknown attribute clamp_hi"):
        onnx_export.to_onnx(g, init_weights(g, 1))


# ------------------------------------------------------------------ --explain names the spec line
def test_a_refused_site_names_the_spec_line_of_the_node_it_failed_at(spec):
    """The clamp is on line 9 of the spec, the softmax on line 11: --explain says both."""
    lines = CLAMPED.splitlines()
    clamp_line = next(i for i, text in enumerate(lines, 1) if "clamp(" in text)
    softmax_line = next(i for i, text in enumerate(lines, 1) if "softmax(" in text)
    g, site = _site(spec)
    assert not site.fused
    assert site.at is not None and site.at.line == clamp_line and site.pos.line == softmax_line
    assert site.describe().endswith(f"(at {site.at})")
