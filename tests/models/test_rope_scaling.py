"""Rope scaling types beyond Llama 3.1's (issue 24; longrope: issue 39): linear, dynamic NTK, YaRN and
Phi-3's longrope (its short and long factor lists, the switch past original_ctx, its cos/sin factor), each equal to
transformers' own rotary embedding (LlamaRotaryEmbedding with that rope_parameters, whose inverse
frequencies come from transformers.modeling_rope_utils) and apply_rotary_pos_emb, in the numpy
interpreter and in onnxruntime; YaRN also through the KV-cached decoder's RotaryEmbedding; dynamic
NTK refused there (its frequencies follow the whole length)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops import interpret
from tessera.spec.diagnostics import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HD = 16
SPEC = """
model R(theta = 10000.0, factor = 1.0, kind = "llama3", ctx = 16, fast = 32.0, slow = 1.0, af = 0.0,
        trunc = true, dims = 0, low = 1.0, high = 4.0, short = [], long = []) {
  in x: f32[B, 2, T, 16]
  out y: f32[B, 2, T, 16]
  y = rope(x, theta, factor, original_ctx=ctx, scaling=kind, beta_fast=fast, beta_slow=slow,
           attention_factor=af, truncate=trunc, dims=dims, low_freq=low, high_freq=high,
           short_factor=short, long_factor=long)
}
"""


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("rope") / "rope.tsr"
    p.write_text(SPEC)
    return str(p)


@torch.no_grad()
def transformers_rope(x: np.ndarray, rope_parameters: dict, max_positions: int, dims: int = HD) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = dict(rope_parameters)
    if dims != HD:
        params["partial_rotary_factor"] = dims / HD
    cfg = LlamaConfig(hidden_size=HD * 2, num_attention_heads=2, head_dim=HD, max_position_embeddings=max_positions,
                      rope_parameters=params)
    emb = LlamaRotaryEmbedding(cfg)  # a fresh one per call: dynamic NTK's state starts at max_positions
    t = x.shape[-2]
    xt = torch.from_numpy(x)
    cos, sin = emb(xt, torch.arange(t)[None].expand(x.shape[0], t))
    xr = xt[..., :dims]
    out, _ = apply_rotary_pos_emb(xr, xr, cos, sin)
    return torch.cat([out, xt[..., dims:]], -1).numpy()


SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]  # longrope's factors, one per frequency (hd / 2 = 8)
LONG = [1.2, 1.9, 2.7, 4.0, 6.5, 9.0, 14.0, 20.0]

CASES = {
    "llama3": (dict(factor=8.0, kind="llama3", ctx=16, low=1.0, high=4.0),
               {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, 128),
    # Llama 4 Scout's bounds: equal, so no frequency is smoothed
    "llama3_equal_bounds": (dict(factor=16.0, kind="llama3", ctx=8, low=1.0, high=1.0),
                            {"rope_type": "llama3", "factor": 16.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8}, 128),
    "linear": (dict(factor=4.0, kind="linear"), {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 64),
    "dynamic_short": (dict(factor=2.0, kind="dynamic", ctx=16), {"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0}, 16),
    "dynamic_long": (dict(factor=3.0, kind="dynamic", ctx=16, theta=500.0),
                     {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0}, 16),
    "yarn": (dict(factor=8.0, kind="yarn", ctx=16, theta=1000.0),
             {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1000.0, "original_max_position_embeddings": 16}, 128),
    "yarn_betas_given_factor_untruncated": (
        dict(factor=4.0, kind="yarn", ctx=32, fast=16.0, slow=2.0, af=1.3, trunc=False),
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32,
         "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False}, 128),
    # Phi-3's: a factor per frequency, the long ones past original_ctx (t = 40 > 16; t = 10 the short ones),
    # cos and sin times sqrt(1 + ln(factor) / ln(original_ctx)), factor = max_position_embeddings / ctx
    "longrope": (dict(kind="longrope", ctx=16, factor=8.0, short=SHORT, long=LONG),
                 {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                  "short_factor": SHORT, "long_factor": LONG}, 128),
    "longrope_factor_given_partial": (
        dict(kind="longrope", ctx=16, factor=4.0, dims=8, short=SHORT[:4], long=LONG[:4]),
        {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16, "factor": 4.0,
         "short_factor": SHORT[:4], "long_factor": LONG[:4]}, 128),
    "longrope_attention_factor_given": (
        dict(kind="longrope", ctx=16, factor=8.0, af=1.5, short=SHORT, long=LONG),
        {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
         "attention_factor": 1.5, "short_factor": SHORT, "long_factor": LONG}, 128),
    "yarn_partial": (dict(factor=4.0, kind="yarn", ctx=16, dims=8),
                     {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                      "original_max_position_embeddings": 16}, 64),
}


@pytest.mark.parametrize("t", [10, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_scaling_equals_transformers_rotary_embedding(spec_path, case, t, rng):
    sets, params, max_positions = CASES[case]
    x = rng.standard_normal((2, 2, t, HD)).astype(np.float32)
    want = transformers_rope(x, params, max_positions, sets.get("dims") or HD)
    g = build(spec_path, **sets)
    np.testing.assert_allclose(interpret.run(g, {}, {"x": x})["y"], want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ort_run(g, {}, {"x": x})["y"], want, atol=2e-5, rtol=1e-5)
    plain = transformers_rope(x, {"rope_type": "default", "rope_theta": params["rope_theta"]}, max_positions)
    if not (sets["kind"] == "dynamic" and t <= sets["ctx"]):
        assert np.abs(want - plain).max() > 1e-3  # the scaling changes the result here
    else:  # dynamic NTK is plain rope up to its original length
        np.testing.assert_allclose(want, plain, atol=1e-6)


def test_bad_scaling_options_are_positioned_errors(spec_path):
    with pytest.raises(SpecError, match="'scaling' must be one of 'llama3', 'linear', 'dynamic', 'yarn'"):
        build(spec_path, factor=2.0, kind="ntk")
    with pytest.raises(SpecError, match=r"rope scaling needs 0 < low_freq <= high_freq, got low_freq=2.0, high_freq=1.0"):
        build(spec_path, factor=2.0, kind="llama3", low=2.0, high=1.0)
    with pytest.raises(SpecError, match="yarn needs 0 < beta_slow < beta_fast"):
        build(spec_path, factor=2.0, kind="yarn", fast=1.0, slow=4.0)
    with pytest.raises(SpecError, match=r"longrope needs 'short_factor': a list of 8 numbers > 0 \(one per frequency "
                                        r"of the 16 rotated features\), got 0 values"):
        build(spec_path, kind="longrope", long=LONG)
    with pytest.raises(SpecError, match="longrope needs 'long_factor': a list of 4 numbers > 0 .*, got 8 values"):
        build(spec_path, kind="longrope", dims=8, short=SHORT[:4], long=LONG)
    with pytest.raises(SpecError, match="longrope needs 'long_factor': a list of 8 numbers > 0"):
        build(spec_path, kind="longrope", short=SHORT, long=LONG[:7] + [0.0])
    with pytest.raises(SpecError, match="'original_ctx' must be at least 2, got 1"):
        build(spec_path, kind="longrope", ctx=1, short=SHORT, long=LONG)


DECODER = """
model Dec(vocab = 97, d = 32, heads = 4, layers = 2, scaling = "yarn") {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="wte")
  repeat layers as i {
    h += attention(rmsnorm(h, name="ln"), heads, causal=true, rope_theta=10000.0, rope_factor=4.0,
                   rope_scaling=scaling, rope_original_ctx=8, name="attn")
  }
  logits = linear(rmsnorm(h, name="ln_f"), vocab, bias=false, name="head")
}
"""


def test_yarn_in_the_cached_decoder_equals_recomputation_and_dynamic_is_refused(tmp_path):
    import onnxruntime as ort

    from conftest import Recomputation
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime import pipeline
    from tessera.runtime.errors import UsageError
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate
    from tessera.runtime.io.weights import init_weights

    p = tmp_path / "dec.tsr"
    p.write_text(DECODER)
    built = pipeline.build(p)
    rng = np.random.default_rng(0)
    weights = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.2
               for k, v in init_weights(built.graph, 7).items()}
    full = ort.InferenceSession(onnx_export.to_onnx(built.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    model, info = compile_cached(pipeline.build(p), weights)
    prompts = [[5, 9, 13, 2, 40, 41, 7, 8, 90], [3, 4]]
    check = Recomputation(full, prompts)
    out = generate(CachedModel(model.SerializeToString(), info), prompts, 16, on_logits=check).tokens
    assert check.worst <= 1e-4
    assert len({t for row in out for t in row}) > 3
    with pytest.raises(UsageError, match="dynamic NTK: its frequencies follow the whole sequence's length"):
        compile_cached(pipeline.build(p, sets=["scaling=dynamic"]), weights)
