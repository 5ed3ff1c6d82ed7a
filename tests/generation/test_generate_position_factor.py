"""A factor of the query positions in the KV cache (issue 39: Llama 4's attention temperature tuning).

Llama 4 scales the queries of its NoPE layers by ``log(floor((p + 1) / floor_scale) + 1) * attn_scale
+ 1`` at each token's position p (transformers' ``Llama4TextAttention``); a spec writes it from
``arange(T)``. The cached decoder computes it at ``position_ids`` (compiler/passes/position_factor.py).
The reference is Tessera's own uncached graph over each row's whole sequence
(conftest.cached_equals_recomputation: prompts of 7 and 2 tokens left-padded into one batch, then
greedy steps, logits compared at every step), in the buffer and the concatenated cache, with the
factor laid out on q's heads [T, 1] and on the flat q [1, T, 1]. Uses of the positions that are not
such a factor are refused with the reason, by the compiler and by ``tessera generate``.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, cached_equals_recomputation, cli_error, compile_written_cached, ort_run

DECODER = """
model Tuned(vocab = 50, d = 32, layers = 2, heads = 4, floor_scale = 2.0, attn_scale = 2.0) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  repeat layers as i {
    x = rmsnorm(h, 1e-5, name="attn_norm")
    p = cast(arange(T), "f32")
    tune = reshape(log(floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0, [T, 1])
    Q
    k = split_heads(linear(x, d, bias=false, name="k"), heads)
    v = split_heads(linear(x, d, bias=false, name="v"), heads)
    h += linear(merge_heads(sdpa(q, k, v, causal=true)), d, bias=false, name="o")
    EXTRA
    h += mlp(rmsnorm(h, 1e-5, name="mlp_norm"), 48, act="relu", bias=false, name="mlp")
  }
  logits = linear(rmsnorm(h, 1e-5, name="norm"), vocab, bias=false, name="head")
}
"""
QUERIES = {
    # q [B, heads, T, hd] times tune [T, 1] (transformers' layout: [B, T, heads, hd] times [1, T, 1, 1])
    "heads": 'q = split_heads(linear(x, d, bias=false, name="q"), heads) * tune',
    # the flat q [B, T, d] times tune [1, T, 1]
    "flat": 'q = split_heads(linear(x, d, bias=false, name="q") * reshape(tune, [1, T, 1]), heads)',
}
PLAIN_Q = QUERIES["heads"]


def _compile(tmp_path, q: str = PLAIN_Q, extra: str = "", cache: str = "auto", tune: str | None = None):
    spec = DECODER.replace("Q", q, 1).replace("EXTRA", extra)
    if tune is not None:
        spec = spec.replace("tune = reshape(log(floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0, [T, 1])",
                            tune)
    return compile_written_cached(tmp_path / "tuned.tsr", spec, cache)


@pytest.mark.parametrize("cache", ["auto", "concat"])
@pytest.mark.parametrize("layout", sorted(QUERIES))
def test_a_temperature_tuned_query_generates_as_it_recomputes(tmp_path, layout, cache):
    """Prompts of 7 and 2 tokens, left-padded, then 12 greedy steps (positions past 12: the floor steps at
    every multiple of floor_scale 2): at each, the cached decoder's logits equal the unfused graph over the
    row's whole sequence, so each row's factor is read at its own positions, at prefill and decoding."""
    path, weights, done = _compile(tmp_path, QUERIES[layout], cache=cache)
    assert not [n for n in done.model.graph.node if n.op_type == "Range"]  # every factor reads position_ids
    assert len(done.info.layers) == 2
    cached_equals_recomputation(path, weights, done, 12)


def test_the_spec_factor_is_transformers_formula(tmp_path):
    """The decoder's factor, made a model's output, is Llama 4's: log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1, written here in numpy from transformers' Llama4TextAttention, over 40 positions."""
    path = tmp_path / "factor.tsr"
    path.write_text("""
model Factor(floor_scale = 2.0, attn_scale = 2.0) {
  in tokens: i64[B, T]
  out f: f32[T, 1]
  p = cast(arange(T), "f32")
  f = reshape(log(floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0, [T, 1])
}
""")
    got = ort_run(build(str(path)), {}, {"tokens": np.zeros((1, 40), dtype=np.int64)})["f"]
    pos = np.arange(40, dtype=np.float32)
    want = np.log1p(np.floor((pos + 1.0) / 2.0)) * 2.0 + 1.0
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-6)


@pytest.mark.parametrize("tune, extra, reason", [
    # a running sum over the positions: a token's factor depends on every position before it
    ("tune = reshape(cumsum(p, 0) * 0.01 + 1.0, [T, 1])", "", "read by cumsum"),
    # the positions combined with the activations by a matrix product: every token's result reads them all
    (None, "h += matmul(reshape(p, [1, 1, T]), x) * 0.01", "meet the activations at matmul"),
])
def test_a_use_of_the_positions_that_is_no_factor_is_refused(tmp_path, capsys, tune, extra, reason):
    from tessera.compiler.passes.base import PassError

    with pytest.raises(PassError, match="its cached form is not known") as e:
        _compile(tmp_path, extra=extra, tune=tune)
    assert reason in str(e.value)
    err = cli_error(capsys, "generate", tmp_path / "tuned.tsr", "--input", "tokens=[[1, 2, 3]]",
                    "--max-new-tokens", 2)
    assert reason in err and "layers.0" in err
