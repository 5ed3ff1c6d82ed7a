"""Chunked (block-local) causal attention (Llama 4; issue 39 item 2): ``causal_mask(s, chunk=C)``
hides every key in another block of C positions than its query. Checked against numpy written
here, and each kernel that takes it (block, portable) against the unfused graph at lengths on both
sides of the chunk and tile boundaries; the kernels without a chunked mask refuse it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.backends.onnx import attention as onnx_attention
from tessera.compiler.passes import attention_kernels
from tessera.compiler.passes.attention_kernels import Target, why_not
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime.io.weights import init_weights

SPEC = """
model C(d = 16, heads = 2, chunk = 5, window = 0) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  hd = d / heads
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  s = causal_mask(matmul(q, transpose(k)) / sqrt(hd), window=window, chunk=chunk)
  y = linear(merge_heads(matmul(softmax(s, axis=-1), v)), d, name="o")
}
"""


@pytest.fixture
def spec(tmp_path):
    p = tmp_path / "c.tsr"
    p.write_text(SPEC)
    return str(p)


def _numpy(x, w, chunk, window=0, heads=2):
    """The model written out in numpy: chunked causal attention by its definition."""
    lin = lambda t, n: t @ w[f"{n}.weight"].T + (w[f"{n}.bias"] if f"{n}.bias" in w else 0)  # noqa: E731
    b, t, d = x.shape
    hd = d // heads
    split = lambda z: z.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(lin(x, "q")), split(lin(x, "k")), split(lin(x, "v"))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (j <= i) & (j // chunk == i // chunk)
    if window:
        visible &= j > i - window
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return lin((p @ v).transpose(0, 2, 1, 3).reshape(b, t, d), "o")


def _weights(g):
    return {n: a * 4.0 for n, a in init_weights(g, 3).items()}


@pytest.mark.parametrize("t", [1, 4, 5, 6, 9, 10, 11, 16, 17, 33])
def test_the_unfused_chunked_mask_equals_numpy(spec, t):
    g = build(spec)
    w = _weights(g)
    x = np.random.default_rng(t).standard_normal((2, t, 16)).astype(np.float32)
    np.testing.assert_allclose(ort_run(g, w, {"x": x})["y"], _numpy(x, w, 5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk,window", [(5, 0), (8, 0), (8, 3), (1, 0)])
def test_each_kernel_that_takes_the_chunk_equals_the_unfused_graph(spec, monkeypatch, chunk, window):
    monkeypatch.setattr(onnx_attention, "MAX_TILE", 8)  # tiles of 8: the chunks 5 and 8 cross and meet them
    ran = set()
    for t in (1, 4, 5, 6, 7, 8, 9, 15, 16, 17, 24, 25, 40):
        g = build(spec, chunk=chunk, window=window)
        w = _weights(g)
        x = np.random.default_rng(t).standard_normal((2, t, 16)).astype(np.float32)
        want = ort_run(g, w, {"x": x})["y"]
        np.testing.assert_allclose(want, _numpy(x, w, chunk, window), atol=2e-5, rtol=1e-4)
        for kernel in (None, "block", "portable"):
            fused = build(spec, chunk=chunk, window=window)
            (site,) = optimize(fused, Target("cpu"), kernel)
            assert site.fused, site.reason
            node = fused.nodes[site.node]
            assert node.attrs["chunk"] == chunk
            got = ort_run(fused, w, {"x": x})["y"]
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4,
                                       err_msg=f"{kernel or 'auto'} ({node.attrs['impl']}) at T = {t}")
            ran.add(node.attrs["impl"])
    assert {"block", "portable"} <= ran


@pytest.mark.parametrize("kernel", ["gqa", "mha", "attn23"])
def test_kernels_without_a_chunked_mask_refuse_it(spec, kernel):
    g = build(spec)
    optimize(g, Target("cpu"), "block")
    (node,) = [n for n in g.nodes.values() if n.op == "fused_attention"]
    assert "chunked attention" in why_not(kernel, node, g, Target("cpu"))


DECODER = """
model ChunkedLlama(vocab = 50, d = 32, layers = 2, heads = 4, kv_heads = 2, chunk = 4) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  repeat layers as i {
    h += attention(rmsnorm(h, 1e-5, name="attn_norm"), heads, kv_heads, causal=true, rope_theta=10000.0,
                   bias=false, chunk=chunk, name="attn")
    h += swiglu(rmsnorm(h, 1e-5, name="mlp_norm"), 48, name="mlp")
  }
  logits = linear(rmsnorm(h, 1e-5, name="norm"), vocab, bias=false, name="head")
}
"""


@pytest.mark.parametrize("cache", ["auto", "concat"])
def test_chunked_generation_with_the_cache_equals_recomputing_the_whole_sequence(tmp_path, cache):
    """Prompts of 7 and 2 tokens (left-padded to one batch), then 9 greedy steps across chunk boundaries
    (chunk 4): at each, the cached decoder's logits equal the unfused graph over the row's whole sequence,
    so the cache's chunks count from each row's first real token, not from its left padding."""
    from conftest import cached_equals_recomputation
    from tessera.compiler import build as compiler_build
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline as rt

    path = tmp_path / "chunked.tsr"
    path.write_text(DECODER)
    built = rt.build(str(path), None, [])
    weights = rt.weights_for(built, None, 0)
    done = compiler_build.compile_cached(built.graph, weights, built.info, PipelineOptions(cache=cache))
    assert [s.fused for s in done.sites] == [True, True]
    assert all(layer.window == 0 for layer in done.info.layers)
    cached_equals_recomputation(path, weights, done, 9)


def test_the_buffer_cache_refuses_chunked_attention(tmp_path):
    from tessera.compiler import build as compiler_build
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline as rt

    path = tmp_path / "chunked.tsr"
    path.write_text(DECODER)
    built = rt.build(str(path), None, [])
    with pytest.raises(PassError, match="chunked attention cannot use the buffer cache"):
        compiler_build.compile_cached(built.graph, rt.weights_for(built, None, 0), built.info,
                                      PipelineOptions(cache="buffer"))
