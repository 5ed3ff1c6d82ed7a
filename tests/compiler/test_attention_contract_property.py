"""The attention contract, held by properties (issue 36 item 1).

Three kinds of check:

1. **The table's claims** (compiler/reference/score_epilogue.py): every feature declared
   ``elementwise`` gives the same scores computed whole or tile by tile; every feature declared
   ``keeps_hidden`` leaves a hidden score weighing exactly 0; every pair declared in ``COMMUTING``
   gives the same weights in either order. Drawn with hypothesis over scores, lengths, offsets and
   tiles, and computed with numpy written here (the softmax) around the table's own steps.
2. **Every kernel against the unfused graph**: hypothesis draws a score path from every feature the
   recogniser accepts (soft-cap, bias before or after the masks, causal with or without a window, a
   two-sided window, padding before or after the causal mask, grouped heads) and a length on either
   side of a switch point (the portable kernel's tile boundaries with MAX_TILE made small, the
   block budget in front of the Loop with BLOCK_BYTES made small, the windows); each kernel that
   accepts the site (and ``auto``) is run in onnxruntime and compared with the unfused graph, also
   run in onnxruntime.
3. **The reviewer's floor** (issue 36): ``max(causal_mask(s), -0.5)`` added by the documented recipe
   (a ScoreRule, a FEATURES row, a step in each epilogue). With a stage of its own after the masks it
   breaks the "hidden keys weigh 0" shortcut, so every kernel taking that shortcut refuses it and
   ``auto`` picks the block kernel at every length (exact at T = 19, 300 and 600, where the old
   run-time If switched to the portable kernel and was 0.6 off). Given the masks' stage instead, it
   is not declared to commute with the causal mask, and the site stays unfused (exact).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import build, ort_run
from tessera.compiler.backends.onnx import attention as onnx_attention
from tessera.compiler.backends.onnx import score_epilogue as onnx_epilogue
from tessera.compiler.passes import attention_kernels
from tessera.compiler.passes.attention_kernels import KERNELS, Target, why_not
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.patterns import attention as pattern
from tessera.compiler.reference import score_epilogue as ref
from tessera.runtime.io.weights import init_weights

FILL = np.finfo(np.float32).min


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _step(feature):
    """The numpy epilogue's step that computes ``feature``."""
    return next(step for feats, step in ref.STEPS if feature in feats)


def _one(s, feature, attrs, where):
    """``feature``'s step alone on scores ``s`` (every other feature turned off)."""
    return _step(feature)(s, ref.only(attrs, [feature]), where)


# Attributes turning every feature on (each test turns off what it does not apply); a feature added
# later (by the recipe in docs/architecture.md) gets a value of its attributes' type.
KNOWN_ON = {"scale": 0.7, "softcap": 3.0, "bias": True, "causal": True, "window": 3, "local_window": 4,
            "padding": True}


def all_on() -> dict:
    a = dict(KNOWN_ON)
    for f in ref.FEATURES.values():
        for name, attr in f.attrs.items():
            if name not in a:
                a[name] = True if bool in attr.types else 3 if int in attr.types else 0.5
    return a


@st.composite
def blocks(draw):
    """Scores [B=2, H=2, Tq, Tk] with Tk >= Tq, a key mask with a real key in every row, and a bias."""
    tq = draw(st.integers(1, 9))
    tk = tq + draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((2, 2, tq, tk)) * 4).astype(np.float32)
    mask = (rng.random((2, tk)) > 0.3).astype(np.int64)
    mask[:, -1] = 1  # the last key is visible to every query (causal or not)
    bias = (rng.standard_normal((2, 2, tq, tk)) * 3).astype(np.float32)
    return s, mask, bias


def _where(s, mask, bias, row0=0, col0=0, rows=None, cols=None):
    tq, tk = s.shape[-2:]
    r = slice(row0, row0 + (rows or tq))
    c = slice(col0, col0 + (cols or tk))
    return ref.Where(tq, tk, row0, col0, key_mask=mask[:, c], bias=bias[..., r, c])


# ------------------------------------------------------------------ 1. the table's claims
@settings(max_examples=60, deadline=None)
@given(blocks(), st.data())
def test_elementwise_features_give_the_same_scores_tile_by_tile(block, data):
    s, mask, bias = block
    tq, tk = s.shape[-2:]
    r_cut = data.draw(st.integers(0, tq))
    c_cut = data.draw(st.integers(0, tk))
    for f in (f for f in ref.FEATURES.values() if f.elementwise):
        a = ref.only(all_on(), [f.name])
        if f.name == "local_window":
            a["causal"] = False
        whole = _step(f.name)(s, a, _where(s, mask, bias))
        tiles = np.empty_like(s)
        for r0, r1 in ((0, r_cut), (r_cut, tq)):
            for c0, c1 in ((0, c_cut), (c_cut, tk)):
                if r1 > r0 and c1 > c0:
                    where = ref.Where(tq, tk, r0, c0, key_mask=mask[:, c0:c1], bias=bias[..., r0:r1, c0:c1])
                    tiles[..., r0:r1, c0:c1] = _step(f.name)(s[..., r0:r1, c0:c1], a, where)
        np.testing.assert_array_equal(tiles, whole, err_msg=f.name)


@settings(max_examples=40, deadline=None)
@given(blocks())
def test_a_hidden_score_stays_hidden_through_every_feature_declared_to_keep_it(block):
    """A score the masks hid (the dtype's minimum) still weighs exactly 0 after the feature's step,
    next to any visible score down to -10⁴."""
    s, mask, bias = block
    hidden = np.zeros(s.shape, bool)
    hidden[..., ::2] = True
    hidden[..., -1] = False
    masked = np.where(hidden, FILL, s).astype(np.float32)
    for f in (f for f in ref.FEATURES.values() if f.keeps_hidden):
        a = ref.only(all_on(), [f.name])
        if f.name == "local_window":
            a["causal"] = False
        out = _step(f.name)(masked, a, _where(s, mask, bias))
        assert np.all(np.exp(out[hidden].astype(np.float64) + 1e4) == 0.0), f.name


@settings(max_examples=60, deadline=None)
@given(blocks())
def test_every_declared_pair_commutes(block):
    s, mask, bias = block
    for pair in ref.COMMUTING:
        f, g = sorted(pair)
        a = ref.only(all_on(), [f, g])
        if "local_window" in pair:
            a["causal"] = "causal" in pair or "window" in pair
        w = _where(s, mask, bias)
        fg = _one(_one(s, f, a, w), g, a, w)
        gf = _one(_one(s, g, a, w), f, a, w)
        np.testing.assert_allclose(_softmax(fg.astype(np.float64)), _softmax(gf.astype(np.float64)),
                                   atol=1e-12, err_msg=f"{f}, {g}")


def test_every_pair_of_one_stage_is_either_declared_or_refused_by_the_recogniser():
    """``not_commuting`` is the recogniser's verdict: a pair of one stage not in COMMUTING is refused."""
    for f in ref.FEATURES.values():
        for g in ref.FEATURES.values():
            if f.name < g.name and f.stage == g.stage:
                declared = frozenset((f.name, g.name)) in ref.COMMUTING
                assert (ref.not_commuting([f.name, g.name]) is None) == declared, (f.name, g.name)


def test_a_feature_that_breaks_a_shortcut_is_refused_by_every_kernel_taking_it(monkeypatch):
    """The derivation itself: a feature after the masks that does not keep hidden scores hidden, or
    one not elementwise, is refused by exactly the kernels whose KERNEL_ASSUMES name that shortcut."""
    late = ref.Feature("late", 9, {"late_x": ref.Attr((float,), "x")}, lambda a: "late_x" in a,
                       elementwise=True)
    monkeypatch.setitem(ref.FEATURES, "late", late)
    monkeypatch.setattr(onnx_epilogue, "STEPS", onnx_epilogue.STEPS + [(("late",), None)])
    attrs = {"scale": 1.0, "causal": True, "window": 0, "padding": False, "bias": False, "heads": 2,
             "kv_heads": 2, "late_x": 1.0}
    for kernel in ("block", "portable", "cached", "phased"):
        reason = attention_kernels.unsupported(kernel, attrs)
        takes = "hidden_weigh_zero" in onnx_attention.KERNEL_ASSUMES[kernel]
        assert (reason is not None) == takes, (kernel, reason)
        if takes:
            assert "may give a hidden key weight" in reason
    monkeypatch.setitem(ref.FEATURES, "late", ref.Feature("late", 9, late.attrs, late.active,
                                                          keeps_hidden=True))
    for kernel in ("block", "portable", "cached", "phased"):
        reason = attention_kernels.unsupported(kernel, attrs)
        takes = "tiles_scores" in onnx_attention.KERNEL_ASSUMES[kernel]
        assert (reason is not None) == takes, (kernel, reason)
        if takes:
            assert "not declared elementwise" in reason


def test_the_fused_cost_is_the_sum_of_its_features():
    assert ref.flops_per_score({"scale": 1.0, "causal": True, "window": 4, "padding": True}) == \
        {"elementwise": 1, "mask": 2}
    assert ref.flops_per_score({"scale": 1.0, "softcap": 5.0, "bias": True}) == \
        {"elementwise": 4, "activation": 1}


# ------------------------------------------------------------------ 2. every kernel against the unfused graph
PATH = """
model P(d = 32, heads = 4, kv = 4, capped = false, causal = false, window = 0, chunk = 0, local = 0, padded = false,
        biased = false, bias_late = false, pad_late = false, sinked = false) {
  in x: f32[B, T, d]
  in mask: i64[B, T]
  in bias: f32[heads, T, T]
  out y: f32[B, T, d]
  hd = d / heads
  q = split_heads(linear(x, d, name="q"), heads)
  k = repeat_kv(split_heads(linear(x, kv * hd, name="k"), kv), heads / kv)
  v = repeat_kv(split_heads(linear(x, kv * hd, name="v"), kv), heads / kv)
  s = matmul(q, transpose(k)) / sqrt(hd)
  if capped { s = tanh(s / 2.0) * 2.0 }
  if biased and not bias_late { s = s + bias }
  if padded and not pad_late { s = padding_mask(s, mask) }
  if causal { s = causal_mask(s, window=window, chunk=chunk) }
  if local > 0 { s = local_window_mask(s, local) }
  if padded and pad_late { s = padding_mask(s, mask) }
  if biased and bias_late { s = s + bias }
  if sinked {
    sinks = parameter([heads], name="sinks")
    column = expand(reshape(sinks, [1, heads, 1, 1]), [B, heads, T, 1])
    w = slice(softmax(concat([s, column], -1), axis=-1), -1, 0, T)
  } else {
    w = softmax(s, axis=-1)
  }
  y = linear(merge_heads(matmul(w, v)), d, name="o")
}
"""

# attention sinks (sinked): gpt-oss's form, the sink column concatenated, softmax, the column sliced off.
# Switch points with the monkeypatched limits below: the portable kernel's tiles (q_tile 16, at most
# MAX_TILE = 32 rows; causal: a quarter of the queries), the block budget (B·H·T² fp32 scores of
# BLOCK_T), the sliding window (5), the chunks (7: inside a tile; 16: a tile's size) and the
# two-sided window (4).
BLOCK_T = 24
LENGTHS = (1, 3, 4, 5, 6, 15, 16, 17, 23, 24, 25, 31, 32, 33, 63, 64, 65, 66)


def _weights(g):
    gain = {"q": 30.0, "k": 30.0, "v": 10.0, "o": 10.0, "sinks": 300.0}  # sinks about ±6
    return {name: arr * gain[name.split(".")[0]] for name, arr in init_weights(g, 11).items()}


def _feeds(t, seed):
    rng = np.random.default_rng(seed)
    mask = np.ones((2, t), np.int64)
    pad = min(3, t - 1)  # right padding of the second row: every query still sees a real key (the
    if pad:              # kernels' stated assumption; a row hidden entirely has no defined weights)
        mask[1, -pad:] = 0
    return {"x": rng.standard_normal((2, t, 32)).astype(np.float32),
            "mask": mask, "bias": (rng.standard_normal((4, t, t)) * 2).astype(np.float32)}


@st.composite
def score_paths(draw):
    causal = draw(st.booleans())
    sets = {"causal": causal, "capped": draw(st.booleans()), "padded": draw(st.booleans()),
            "biased": draw(st.booleans()), "bias_late": draw(st.booleans()), "pad_late": draw(st.booleans()),
            "kv": draw(st.sampled_from([4, 2, 1])), "sinked": draw(st.booleans())}
    if causal:
        sets["window"] = draw(st.sampled_from([0, 0, 5]))
        sets["chunk"] = draw(st.sampled_from([0, 0, 7, 16]))
    else:
        sets["local"] = draw(st.sampled_from([0, 4]))
    return sets


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "path.tsr"
    path.write_text(PATH)
    return str(path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=score_paths(), t=st.sampled_from(LENGTHS), seed=st.integers(0, 1000))
def test_every_kernel_that_accepts_a_score_path_equals_the_unfused_graph(spec, monkeypatch, sets, t, seed):
    if sets.get("chunk") and sets["padded"]:  # a chunk starting in the padded tail would leave its first
        pad = min(3, t - 1)                   # query no key (no defined weights: outside the contract)
        assume(not any(p % sets["chunk"] == 0 for p in range(t - pad, t)))
    monkeypatch.setattr(onnx_attention, "MAX_TILE", 32)
    monkeypatch.setattr(attention_kernels, "BLOCK_BYTES", 2 * 4 * BLOCK_T * BLOCK_T * 4)
    g = build(spec, **sets)
    w, feeds = _weights(g), _feeds(t, seed)
    want = ort_run(g, w, feeds)["y"]
    assert np.isfinite(want).all()
    ran = []
    for kernel in (None, *KERNELS):
        fused = build(spec, **sets)
        try:
            (site,) = optimize(fused, Target("cpu"), kernel)
        except PassError as e:  # forced kernel refused: it must say why, and auto must not pick it
            assert "cannot lower the attention" in str(e)
            continue
        assert site.fused, site.reason  # every drawn path is one the recogniser accepts
        node = fused.nodes[site.node]
        assert why_not(node.attrs["impl"], node, fused, Target("cpu")) is None
        got = ort_run(fused, w, feeds)["y"]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4,
                                   err_msg=f"kernel {kernel or 'auto'} ({node.attrs['impl']}) at T = {t}, {sets}")
        ran.append(kernel)
    assert None in ran and "block" in ran and "portable" in ran  # auto and the two kernels of every path


# ------------------------------------------------------------------ 3. the reviewer's floor
LO = -0.5

FLOOR = """
model Floor(d = 16, heads = 2) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  s = clamp(causal_mask(matmul(q, transpose(k)) / sqrt(d / heads)), lo=%s)
  y = linear(merge_heads(matmul(softmax(s, axis=-1), v)), d, name="o")
}
""" % LO


def _add_floor(monkeypatch, stage):
    """The recipe of docs/architecture.md, as a newcomer follows it: a ScoreRule, a FEATURES row
    (elementwise, as a max is; not declared to keep hidden scores hidden, as it does not) and the same
    step in both epilogues."""
    def check(g, n, m):
        return None if pattern._scalar_const(g, n.inputs[1]) is not None else "floored by a tensor"

    def absorb(g, n, m):
        m.attrs["floor_lo"] = pattern._scalar_const(g, n.inputs[1])

    monkeypatch.setitem(pattern.SCORE_RULES, "maximum", pattern.ScoreRule(check, absorb, pattern._first, "floor"))
    monkeypatch.setitem(ref.FEATURES, "floor", ref.Feature(
        "floor", stage, {"floor_lo": ref.Attr((float,), "lower bound of the scores", ref.finite)},
        lambda a: a.get("floor_lo") is not None, "score floor", elementwise=True))
    monkeypatch.setattr(ref, "STEPS", ref.STEPS + [
        (("floor",), lambda s, a, w: np.maximum(s, np.asarray(a["floor_lo"], s.dtype)))])
    monkeypatch.setattr(onnx_epilogue, "STEPS", onnx_epilogue.STEPS + [
        (("floor",), lambda b, a, s, p, blk: b.node("Max", [s, b.const(np.array(a["floor_lo"], dtype=p.np_dtype),
                                                                        "floor_lo")])[0])])


@pytest.fixture
def floor_spec(tmp_path):
    path = tmp_path / "floor.tsr"
    path.write_text(FLOOR)
    return str(path)


def _floor_case(spec, t):
    g = build(spec)
    gain = {"q": 40.0, "k": 40.0, "v": 10.0, "o": 10.0}
    w = {name: arr * gain[name.split(".")[0]] for name, arr in init_weights(g, 5).items()}
    feeds = {"x": np.random.default_rng(3).standard_normal((2, t, 16)).astype(np.float32) * 2}
    return w, feeds, ort_run(g, w, feeds)["y"]


def _numpy_floor(spec, w, feeds):
    """The floor written here in numpy: softmax(max(causal(q·kᵀ/√hd), lo))·v, through the model's linears."""
    x = feeds["x"]
    lin = lambda name, h: h @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # noqa: E731  (weights [out, in])
    split = lambda h: h.reshape(*h.shape[:2], 2, 8).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(lin("q", x)), split(lin("k", x)), split(lin("v", x))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8.0)
    t = s.shape[-1]
    s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], FILL, s)
    o = _softmax(np.maximum(s, LO).astype(np.float64)) @ v
    return lin("o", o.transpose(0, 2, 1, 3).reshape(x.shape[0], t, 16))


@pytest.mark.parametrize("t", [19, 300, 600])
def test_the_floor_after_the_masks_is_exact_on_the_block_kernel_at_every_length(floor_spec, monkeypatch, t):
    _add_floor(monkeypatch, stage=3)
    w, feeds, want = _floor_case(floor_spec, t)
    if t == 19:  # the unfused graph is the floor written in numpy (hidden keys weigh e^-0.5 there)
        np.testing.assert_allclose(want, _numpy_floor(floor_spec, w, feeds), atol=1e-4)
    for kernel in (None, "block"):
        fused = build(floor_spec)
        (site,) = optimize(fused, Target("cpu"), kernel)
        node = fused.nodes[site.node]
        assert site.fused and node.attrs["floor_lo"] == LO
        assert node.attrs["impl"] == "block" and not node.attrs.get("block_bytes")  # no If to a Loop
        np.testing.assert_allclose(ort_run(fused, w, feeds)["y"], want, atol=1e-5)


@pytest.mark.parametrize("kernel, shortcut", [("portable", "may give a hidden key weight"),
                                              ("gqa", "GroupQueryAttention computes no score floor"),
                                              ("mha", "MultiHeadAttention computes no causal mask, score floor")])
def test_the_floor_after_the_masks_is_refused_by_every_kernel_taking_a_shortcut(floor_spec, monkeypatch, kernel,
                                                                                shortcut):
    _add_floor(monkeypatch, stage=3)
    with pytest.raises(PassError, match=shortcut):
        optimize(build(floor_spec), Target("cpu"), kernel)
    node_attrs = {"scale": 1.0, "causal": True, "window": 0, "padding": False, "bias": False, "floor_lo": LO}
    for cached in ("cached", "phased"):  # the KV cache's kernels read hidden slots past the positions
        assert "may give a hidden key weight" in attention_kernels.unsupported(cached, node_attrs)


def test_the_floor_in_the_masks_stage_is_not_declared_to_commute_and_stays_unfused(floor_spec, monkeypatch):
    _add_floor(monkeypatch, stage=ref.FEATURES["causal"].stage)
    w, feeds, want = _floor_case(floor_spec, 40)
    for kernel in (None, "block", "portable"):
        g = build(floor_spec)
        (site,) = optimize(g, Target("cpu"), kernel)
        assert not site.fused and "not declared to commute" in site.reason
        np.testing.assert_array_equal(ort_run(g, w, feeds)["y"], want)


def test_the_floor_bites(tmp_path):
    """Without the floor the outputs differ by far more than the tolerance (else the checks prove nothing)."""
    floored, loose = tmp_path / "floor.tsr", tmp_path / "loose.tsr"
    floored.write_text(FLOOR)
    loose.write_text(FLOOR.replace(f"lo={LO}", "lo=-1e30"))
    w, feeds, want = _floor_case(str(floored), 40)
    _, _, other = _floor_case(str(loose), 40)
    assert np.abs(other - want).max() > 0.1 and np.abs(want).max() > 0.5


# ------------------------------------------------------------------ 4. a feature of the softmax: attention sinks
@settings(max_examples=40, deadline=None)
@given(blocks(), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_sinks_in_an_online_softmax_over_key_tiles_equal_the_plain_softmax(block, q_tile, k_tile, seed):
    """The sinks' claim: their effect is the normaliser alone, so any kernel that adds exp(sink - m) to
    the sum over whole rows, or seeds an online softmax's running max and sum with the sink
    (reference/flash.py), gives numpy's concat-softmax-slice; rows whose keys are all hidden weigh only
    the sink (output 0)."""
    s, mask, _ = block
    rng = np.random.default_rng(seed)
    b, h, tq, tk = s.shape
    q = rng.standard_normal((b, h, tq, 4)).astype(np.float32)
    k = rng.standard_normal((b, h, tk, 4)).astype(np.float32)
    v = rng.standard_normal((b, h, tk, 3)).astype(np.float32)
    sinks = (rng.standard_normal(h) * 3).astype(np.float32)
    mask = mask.copy()
    mask[1] = 0  # every key of the second batch row hidden
    scores = np.where((mask != 0)[:, None, None, :], q @ np.swapaxes(k, -1, -2) * 0.5, FILL)
    col = np.broadcast_to(sinks.reshape(1, h, 1, 1), (b, h, tq, 1))
    want = _softmax(np.concatenate([scores, col], -1).astype(np.float64))[..., :-1] @ v
    assert np.abs(want[1]).max() < 1e-6
    got = ref.softmax(scores, {"sinks": True}, ref.Where(tq, tk, sinks=sinks.reshape(1, h, 1, 1))) @ v
    np.testing.assert_allclose(got, want, atol=1e-5)
    from tessera.compiler.reference import flash
    tiled = flash.tiled_attention(q, k, v, 0.5, key_mask=mask, q_tile=q_tile, k_tile=k_tile, sinks=sinks)
    np.testing.assert_allclose(tiled, want, atol=1e-5)


def test_a_softmax_feature_is_refused_by_exactly_the_kernels_whose_softmax_takes_the_keys_alone():
    attrs = {"scale": 1.0, "causal": False, "window": 0, "padding": False, "bias": False, "heads": 2,
             "kv_heads": 2, "sinks": True}
    for kernel in KERNELS:
        takes = "keys_only_softmax" in onnx_attention.KERNEL_ASSUMES[kernel]
        reason = attention_kernels.unsupported(kernel, attrs)
        if takes:
            assert reason is not None and "attention sinks" in reason, kernel
    assert attention_kernels.unsupported("block", attrs) is None
    assert attention_kernels.unsupported("portable", attrs) is None
    assert attention_kernels.unsupported("gqa", {**attrs, "causal": True}) is None  # its head_sink
