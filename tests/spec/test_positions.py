"""Position schemes of the standard library, computed in the graph (issue 12): ALiBi slopes and
bias (head counts that are not powers of two too), T5's relative-position buckets (bidirectional
and causal), positions from the cumulative sum of a padding mask and a learned table with an
offset. Each runs in the numpy interpreter and onnxruntime and is compared with transformers'
own functions (BLOOM's _get_alibi_slopes / build_alibi_tensor, T5Attention's
_relative_position_bucket, OPTLearnedPositionalEmbedding), at lengths past any table a spec
would have baked: nothing here has a length cap."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPEC = """
model P(heads = 12, buckets = 32, max_distance = 128) {
  in mask: i64[B, T]
  out slopes: f32[heads]
  out causal_alibi: f32[1, heads, 1, T]
  out padded_alibi: f32[B, heads, 1, T]
  out positions: i64[B, T]
  out bidirectional: i64[T, T]
  out causal: i64[T, T]
  out bias: f32[1, heads, T, T]
  slopes = alibi_slopes(heads)
  causal_alibi = alibi(heads, T)
  padded_alibi = alibi_padded(mask, heads)
  positions = mask_positions(mask)
  bidirectional = relative_buckets(T, T, buckets=buckets, max_distance=max_distance)
  causal = relative_buckets(T, T, bidirectional=false, buckets=buckets, max_distance=max_distance)
  bias = relative_position_bias(heads, T, T, buckets=buckets, max_distance=max_distance, name="rel")
}
"""


# A learned table is the one scheme with a length cap: its rows (ctx, plus OPT's offset of 2).
LEARNED = """
model L(ctx = 16, d = 8) {
  in mask: i64[B, T]
  out positions: i64[B, T]
  out learned: f32[B, T, d]
  positions = mask_positions(mask)
  learned = embedding(positions + 2, ctx + 2, d, name="embed_positions")
}
"""


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    p = tmp_path_factory.mktemp("pos") / "pos.tsr"
    p.write_text(SPEC)
    return str(p)


def _run_both(g, weights, feeds):
    return interpret.run(g, weights, feeds), ort_run(g, weights, feeds)


def test_alibi_slopes_match_the_paper_and_bloom_for_every_head_count(spec):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    g = build(spec, heads=8)
    mask = np.ones((1, 3), np.int64)
    ours, ort = _run_both(g, init_weights(g, 0), {"mask": mask})
    # Press et al. (2022), section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256
    np.testing.assert_array_equal(ours["slopes"], [2.0 ** -i for i in range(1, 9)])
    for heads in list(range(1, 41)) + [64, 71, 112]:
        g = build(spec, heads=heads)
        want = _get_alibi_slopes(heads, torch.device("cpu")).numpy()
        got = interpret.run(g, init_weights(g, 0), {"mask": mask})["slopes"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"heads={heads}")


@pytest.mark.parametrize("heads", [12, 16, 5])
def test_alibi_bias_with_padding_matches_bloom_past_any_table(spec, heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    t = 700
    mask = np.ones((3, t), np.int64)
    mask[1, :45] = 0       # left padding
    mask[2, -9:] = 0       # right padding
    g = build(spec, heads=heads)
    want = build_alibi_tensor(torch.from_numpy(mask), heads, torch.float32).numpy().reshape(3, heads, 1, t)
    for got in _run_both(g, init_weights(g, 0), {"mask": mask}):
        np.testing.assert_allclose(got["padded_alibi"], want, rtol=1e-6, atol=1e-6)
        # without padding, the causal form is the same bias
        np.testing.assert_allclose(got["causal_alibi"][0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (16, 64), (8, 20)])
def test_t5_relative_buckets_match_transformers_at_long_lengths(spec, buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    t = 1500  # ten times max_distance and more: the last bucket holds every farther key
    g = build(spec, buckets=buckets, max_distance=max_distance)
    rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
    want_bi = T5Attention._relative_position_bucket(rel, True, buckets, max_distance).numpy()
    want_causal = T5Attention._relative_position_bucket(rel, False, buckets, max_distance).numpy()
    w = init_weights(g, 0)
    for got in _run_both(g, w, {"mask": np.ones((1, t), np.int64)}):
        np.testing.assert_array_equal(got["bidirectional"], want_bi)
        np.testing.assert_array_equal(got["causal"], want_causal)
    assert want_bi.max() == buckets - 1 and want_causal.max() == buckets - 1


def test_t5_relative_position_bias_matches_t5_attention(spec):
    """The bias of T5's first self-attention layer, with its learned table, from T5Attention itself."""
    from transformers.models.t5.modeling_t5 import T5Attention

    cfg = transformers.T5Config(d_model=8, d_kv=4, num_heads=12, relative_attention_num_buckets=32,
                                relative_attention_max_distance=128, is_decoder=False)
    torch.manual_seed(0)
    attn = T5Attention(cfg, has_relative_attention_bias=True).eval()
    g = build(spec)
    w = init_weights(g, 0)
    w["rel.relative_attention_bias.weight"] = attn.relative_attention_bias.weight.detach().numpy()
    t = 300
    with torch.no_grad():
        want = attn.compute_bias(t, t).numpy()
    for got in _run_both(g, w, {"mask": np.ones((1, t), np.int64)}):
        np.testing.assert_allclose(got["bias"], want, rtol=0, atol=1e-7)


def test_positions_from_the_mask_and_an_offset_table_match_opt(tmp_path):
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    p = tmp_path / "learned.tsr"
    p.write_text(LEARNED)
    g = build(str(p))
    w = init_weights(g, 0)
    table = OPTLearnedPositionalEmbedding(16, 8)
    table.weight.data = torch.from_numpy(w["embed_positions.weight"])
    mask = np.ones((3, 11), np.int64)
    mask[0, :4] = 0   # left padding
    mask[2, 7:] = 0   # right padding
    with torch.no_grad():
        want = table(torch.from_numpy(mask)).numpy()
    want_positions = np.cumsum(mask, 1) * mask - 1
    assert list(want_positions[0]) == [-1] * 4 + list(range(7))
    for got in _run_both(g, w, {"mask": mask}):
        np.testing.assert_array_equal(got["positions"], want_positions)
        np.testing.assert_allclose(got["learned"], want, atol=0)
