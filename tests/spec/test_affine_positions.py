"""The KV cache's form of a position table read at an affine function of the position (issue 24):
``embedding(a * arange(T) + c, ...)`` (BART/OPT: a = 1, c = 2) reads ``a * position_ids + c`` in the
cached graph. Every step's logits of a batch of uneven prompts (left-padded) are compared with a
numpy forward pass written here, each row alone and uncached; forms that have no cached form keep
a clear error with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build
from tessera.compiler.passes.kv_cache import CacheError
from tessera.compiler.patterns.positions import positions_reached
from tessera.runtime import pipeline
from tessera.runtime.generation import cached as gen
from tessera.runtime.io.weights import init_weights

HEADS, D, VOCAB = 2, 8, 23


def _spec(index: str, rows: str = "ctx * 2 + 3") -> str:
    return f"""
model P(vocab = {VOCAB}, d = {D}, ctx = 16) {{
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed") + embedding({index}, {rows}, d, name="pos")
  h = h + attention(layernorm(h, name="ln"), {HEADS}, causal=true, name="attn")
  logits = linear(h, vocab, bias=false, name="head")
}}
"""


def _numpy_logits(w: dict, ids: list[int], a: int, c: int) -> np.ndarray:
    """The model above on one unpadded row, uncached, in numpy: [T, vocab]."""
    t = len(ids)
    h = w["embed.weight"][ids] + w["pos.weight"][a * np.arange(t) + c]
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    x = (h - mu) / np.sqrt(var + 1e-5) * w["ln.weight"] + w["ln.bias"]

    def proj(name):
        return x @ w[f"attn.{name}.weight"].T + w[f"attn.{name}.bias"]

    hd = D // HEADS
    q, k, v = (proj(n).reshape(t, HEADS, hd).transpose(1, 0, 2) for n in "qkv")
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(1, 0, 2).reshape(t, D) @ w["attn.o.weight"].T + w["attn.o.bias"]
    return (h + o) @ w["head.weight"].T


@pytest.mark.parametrize("index,a,c", [("arange(T) + 2", 1, 2), ("arange(T) * 2 + 3", 2, 3),
                                       ("3 + 2 * arange(T)", 2, 3), ("(arange(T) + 4) * 2 - 5", 2, 3)])
@pytest.mark.parametrize("mode", ["buffer", "concat"])
def test_an_affine_position_table_is_cached_as_numpy_computes_it(tmp_path, index, a, c, mode):
    spec = tmp_path / "p.tsr"
    spec.write_text(_spec(index))
    w = {k: np.asarray(v) for k, v in init_weights(build(str(spec)), seed=3).items()}
    prompts, new = [[5, 17, 4, 9, 11], [7, 2]], 6
    built = pipeline.build(str(spec))
    model, info = gen.compile_cached(built, w, mode=mode)
    assert info.context == positions_reached(16 * 2 + 3, a, c) == (16 * 2 + 3 - 1 - c) // a + 1
    steps = []
    out = gen.generate(gen.CachedModel(model.SerializeToString(), info), prompts, new,
                       on_logits=lambda i, logits: steps.append(logits.copy()))
    for r, p in enumerate(prompts):
        seq = p + out.tokens[r]
        want = _numpy_logits(w, seq, a, c)
        for i, logits in enumerate(steps):  # step i chose token len(p) + i from position len(p) + i - 1
            np.testing.assert_allclose(logits[r], want[len(p) + i - 1], atol=1e-4, rtol=1e-4)
        assert out.tokens[r] == [int(np.argmax(want[len(p) + i - 1])) for i in range(new)]


@pytest.mark.parametrize("index,why", [
    ("arange(T) * arange(T)", "with something other than an integer constant"),
    ("arange(T) * 2 - 1", "negative at the first positions"),
    ("5 - arange(T)", "does not grow with the position"),
])
def test_position_reads_with_no_cached_form_keep_the_error_and_its_reason(tmp_path, index, why):
    spec = tmp_path / "p.tsr"
    spec.write_text(_spec(index))
    g = build(str(spec))
    from tessera.compiler.passes.pipeline import PipelineOptions, pipeline

    with pytest.raises(CacheError) as e:
        pipeline("cached_decoder", PipelineOptions())(g)
    assert why in str(e.value) and "cached form is not known" in str(e.value)


def test_an_arange_read_by_something_else_is_refused_with_the_op(tmp_path):
    """A running sum of the positions is neither a table's index nor a factor of each token's own position
    (a pointwise factor such as ``reshape(cast(arange(T), "f32"), [T, 1])`` has a cached form:
    tests/generation/test_generate_position_factor.py)."""
    spec = tmp_path / "p.tsr"
    spec.write_text(_spec("arange(T) + 2").replace('name="head")', 'name="head") '
                                                    '* reshape(cumsum(cast(arange(T), "f32"), 0), [T, 1])'))
    g = build(str(spec))
    from tessera.compiler.passes.pipeline import PipelineOptions, pipeline

    with pytest.raises(CacheError, match="read by cumsum at .*cached form is not known"):
        pipeline("cached_decoder", PipelineOptions())(g)


def test_positions_reached_counts_by_hand():
    assert positions_reached(1026, 1, 2) == 1024  # BART: max_position_embeddings + 2 rows, offset 2
    assert positions_reached(35, 2, 3) == 16      # rows 3, 5, ..., 33
    assert positions_reached(3, 1, 5) == 0
