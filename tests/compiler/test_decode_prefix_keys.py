"""The serving engine's gqa decoding step without its mask (passes/kv_cache.py CacheOptions.prefix_keys) under
the attention contract: the shortcut it takes ("keys_by_length", compiler/reference/score_epilogue.py
ASSUMPTIONS: each row's keys are its columns 0..seqlens_k, none hidden), which features break it (a step
of the masks' stage not declared ``by_length``), the numpy meaning of ``by_length``, and the ONNX it lowers
to (no attention_bias; on CUDA decode_span's width, no decode_mask). Its numerics in the engine:
tests/serving/test_serve_device_cache.py; its kernel under the CUDA stub: tests/cuda/test_cuda_stub.py."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.compiler.backends.onnx import attention as onnx_attention
from tessera.compiler.passes.attention_kernels import unsupported
from tessera.compiler.reference import score_epilogue

# a cached site as kv-cache-layers leaves it, decoding with GroupQueryAttention
SITE = {"scale": 0.25, "causal": True, "window": 0, "padding": True, "bias": False, "heads": 4, "kv_heads": 2,
        "decode": "gqa"}


def test_the_variant_takes_keys_by_length_only_with_a_gqa_decoding_step():
    assert "keys_by_length" in onnx_attention.kernel_assumes("phased", {**SITE, "prefix_keys": True})
    assert "keys_by_length" not in onnx_attention.kernel_assumes("phased", SITE)
    assert "keys_by_length" not in onnx_attention.kernel_assumes("phased", {**SITE, "decode": None, "prefix_keys": True})
    assert all("keys_by_length" not in a for a in onnx_attention.KERNEL_ASSUMES.values())


@pytest.mark.parametrize("extra", [{}, {"softcap": 30.0}])
def test_a_causal_padded_site_takes_the_variant(extra):
    """Scale, soft-cap (GroupQueryAttention's attributes), causal and the cache's padding: nothing breaks it."""
    assert unsupported("phased", {**SITE, **extra, "prefix_keys": True}) is None
    assert not score_epilogue.broken({"keys_by_length"}, {**SITE, **extra})


@pytest.mark.parametrize("extra, words", [({"window": 8}, "sliding window"), ({"chunk": 16}, "chunked attention"),
                                          ({"bias": True}, "additive bias"),
                                          ({"causal": False, "local_window": 4}, "two-sided local window")])
def test_features_no_length_says_break_the_shortcut(extra, words):
    """A sliding window or chunk hides keys at a row's start, a two-sided window by distance, a bias is a value
    per score: none is given by a length, so the shortcut is refused with the reason (and the variant with it;
    passes/kv_cache.py then keeps the masked step and says why)."""
    why = score_epilogue.broken({"keys_by_length"}, {**SITE, **extra})
    assert len(why) == 1 and words in why[0] and "not given by each row's length" in why[0], why
    assert unsupported("phased", {**SITE, **extra, "prefix_keys": True})


def test_by_length_features_hide_only_keys_past_the_length_at_a_decoding_step():
    """The numpy meaning of ``by_length`` (Feature): at a decoding step (one query, the last of P + 1 positions)
    with a padding mask that is a prefix (the engine's layout: a row's L filled keys at columns 0..L-1, its new
    one at column L, every later column hidden), the epilogue's causal and padding steps hide exactly the
    columns past L -- what seqlens_k = L alone says. With left padding (generate's layout) they hide columns inside the length:
    why generate keeps the mask."""
    rng = np.random.default_rng(0)
    declared = {f.name for f in score_epilogue.FEATURES.values() if f.by_length}
    assert declared == {"causal", "padding"}
    low = np.finfo(np.float32).min
    for _ in range(20):
        p = int(rng.integers(1, 40))
        lengths = rng.integers(0, p, 3)  # filled slots per row; the new key goes at column `length`
        s = rng.standard_normal((3, 2, 1, p + 1)).astype(np.float32)
        cols = np.arange(p + 1)
        mask = (cols[None, :] <= lengths[:, None]).astype(np.int64)  # filled slots and the new one
        got = score_epilogue.apply(s, {**SITE, "scale": 1.0}, score_epilogue.Where(1, p + 1, key_mask=mask))
        want = np.where((cols[None, :] > lengths[:, None])[:, None, None, :], low, s)
        np.testing.assert_array_equal(got, want)
    left = np.ones((1, 6), np.int64)
    left[0, :2] = 0  # a left-padded row of 4 keys: its first two columns hidden, inside its length
    s = rng.standard_normal((1, 1, 1, 6)).astype(np.float32)
    got = score_epilogue.apply(s, {**SITE, "scale": 1.0}, score_epilogue.Where(1, 6, key_mask=left))
    assert (got[..., :2] == low).all()


def _compile(family: str, device: str, dtype: str, prefix_keys: bool):
    from tessera.runtime import pipeline
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.options import EngineOptions

    sets = ["layers=2", "d=64", "heads=4", "vocab=128", "ctx=64"] + (["kv_heads=2", "d_ff=96"] if family == "llama"
                                                                     else [])
    o = EngineOptions(spec=family, sets=sets, provider=device, dtype=dtype)
    built = pipeline.build(family, None, sets, None)
    return gen.compile_cached(built, pipeline.weights_for(built, None, 0, False),
                              o.engine_pipeline_options(prefix_keys=prefix_keys))


@pytest.mark.parametrize("device, dtype", [("cpu", "fp32"), ("cuda", "fp16")])
def test_the_variant_lowers_to_groupqueryattention_without_attention_bias(device, dtype):
    """Every GroupQueryAttention (decoding branch and the combined call's rows) has no attention_bias input
    (its 11th); on CUDA the total length is decode_span's width ([0, W]: no values) and decode_mask is gone;
    --explain's kernel note says which decoding step and why; the file records prefix_keys."""
    import onnx  # noqa: F401

    from tessera.compiler.backends.onnx.walk import all_nodes
    from tessera.compiler.passes.kv_cache import CacheInfo

    for prefix in (False, True):
        proto, info = _compile("llama", device, dtype, prefix)
        gqa = [n for n in all_nodes(proto.graph.node) if n.op_type == "GroupQueryAttention"]
        assert gqa and all((len(n.input) < 11) == prefix for n in gqa), [len(n.input) for n in gqa]
        inputs = {i.name: i for i in proto.graph.input}
        if device == "cuda":
            assert ("decode_span" in inputs, "decode_mask" in inputs) == (prefix, not prefix)
            if prefix:
                assert inputs["decode_span"].type.tensor_type.shape.dim[0].dim_value == 0
        assert info.prefix_keys == prefix
        meta = {p.key: p.value for p in proto.metadata_props}
        assert CacheInfo.from_json(__import__("json").loads(meta[CacheInfo.METADATA_KEY])).prefix_keys == prefix
        assert ("decode without its mask" in info.explain()) == prefix
