"""A decoder with attention sinks (gpt-oss's per-head extra softmax logit) in the serving engine: the
combined call (mixed_attention.py) computes no sinks, so the model gets the engine's other path (a prompt
chunk, then the decoding step: two calls) with the reason in --explain's kernel notes, rather than a
refusal. Greedy tokens of concurrent requests of different lengths, with the numpy cache and the device
cache's path on CPU OrtValues, masked and mask-less (prefix_keys) decoding, equal the uncached graph's
greedy continuation of each prompt alone, recomputed whole at every token in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tessera.compiler.backends.onnx import export as onnx_export
from tessera.runtime import pipeline
from tessera.runtime.generation.sampling import Sampling
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request

SPEC = """
model GptOssLike(vocab = 50, d = 32, layers = 2, heads = 4, kv_heads = 2) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  repeat layers as i {
    h += attention(rmsnorm(h, 1e-5, name="attn_norm"), heads, kv_heads, causal=true, rope_theta=10000.0,
                   bias=true, sinks=true, name="self_attn")
    h += swiglu(rmsnorm(h, 1e-5, name="mlp_norm"), 48, name="mlp")
  }
  logits = linear(rmsnorm(h, 1e-5, name="norm"), vocab, bias=false, name="head")
}
"""
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 11, 12], [30]]
NEW = 8


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    p = tmp_path_factory.mktemp("sinks") / "sinks.tsr"
    p.write_text(SPEC)
    return str(p)


@pytest.fixture(scope="module")
def want(spec):
    built = pipeline.build(spec)
    weights = pipeline.weights_for(built, None, 0)
    sess = ort.InferenceSession(onnx_export.to_onnx(built.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    out = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW):
            logits = sess.run(None, {"tokens": np.array([seq], dtype=np.int64)})[0]
            seq.append(int(logits[0, -1].argmax()))
        out.append(seq[len(prompt):])
    return out


@pytest.mark.parametrize("prefix_keys", [False, True])
@pytest.mark.parametrize("device_cache", [False, True])
def test_the_engine_serves_sinks_without_the_combined_call(spec, want, prefix_keys, device_cache):
    model = serving_model.load(spec, threads=1, prefix_keys=prefix_keys)
    assert not serving_model.has_combined_call(model)
    engine = Engine(model, max_batch=3, max_queue=8, prefill_chunk=4, capacity=64, device_cache=device_cache)
    handles = [engine.submit(Request(list(p), NEW, Sampling())) for p in PROMPTS]
    while any(not h.finished for h in handles):
        engine.step()
    assert engine.combined_calls == 0
    assert [h.tokens for h in handles] == want
    assert len({t for row in want for t in row}) > 4, "degenerate: the model repeats one token"
