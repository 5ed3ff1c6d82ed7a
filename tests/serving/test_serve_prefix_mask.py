"""The serving engine's CUDA decoder derives its attention mask in the graph (compiler/backends/onnx/prefix_mask.py),
checked on the CPU.

The CUDA-target engine model (prefix_keys: GroupQueryAttention decoding with seqlens_k alone, the prompt through
onnx's Attention) has no ``attention_mask`` input: the mask is computed from cache_length and the shapes, so a
decoding step copies no mask to the device (bounded under the CUDA stub in tests/cuda/test_cuda_stub.py). Run by
onnxruntime's CPU kernels, it must give what the same graph gives with the mask fed by the engine from its slot
mask (the pass left out): the same tokens, token for token, and the same cache columns, bit for bit, over
concurrent requests with joins, leaves, widening, chunked prefill, the prefix cache, speculation (whose padding
follows each row's tokens) and the device cache's path on CPU OrtValues.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_engines_agree
from tessera.runtime import pipeline
from tessera.runtime.generation import cached as gen
from tessera.runtime.options import EngineOptions
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.prefix_cache import PrefixCache
from tessera.runtime.serving.speculation import Speculation

SETS = {"gpt2": ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=192"],
        "llama": ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=192"]}


def _cuda_model(family: str, derive: bool, last_only: bool = True, dtype: str = "fp16", monkeypatch=None):
    """The engine's CUDA-target decoder (EngineOptions.engine_pipeline_options on CUDA), opened on the CPU; with
    ``derive`` False the mask pass is disabled, so the mask stays an input the engine feeds."""
    from tessera.compiler.backends.onnx import prefix_mask

    o = EngineOptions(spec=family, sets=SETS[family], provider="cuda", dtype=dtype, max_batch=4, max_context=192)
    built = pipeline.build(family, None, SETS[family], None)
    weights = pipeline.weights_for(built, None, 0, False)
    with monkeypatch.context() as m:
        if not derive:
            m.setattr(prefix_mask, "derive_prefix_mask", lambda *a, **k: False)
        proto, info = gen.compile_cached(built, weights, o.engine_pipeline_options(last_only=last_only))
    model = gen.CachedModel(proto.SerializeToString(), info, provider="cpu", threads=1)
    assert ("attention_mask" in model.input_names) != derive
    assert ("decode_span" in model.input_names) == (dtype != "fp32")  # fp32: the plain branch, no cache_length
    return model


def _requests(seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50, 40).tolist()
    out = []
    for i in range(10):
        prompt = rng.integers(0, 50, int(rng.integers(1, 50))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        if i % 2:
            prompt = (prompt[:5] * 8)[:int(rng.integers(8, 40))]  # repeats: prompt lookup drafts
        sampling = gen.Sampling(temperature=0.8, top_k=10, seed=i) if i % 4 == 3 else gen.Sampling()
        out.append(Request(prompt, int(rng.integers(1, 60)), sampling))
    out[2] = Request([7], 70)  # a one-token prompt: the decoding branch for its only chunk
    return out


@pytest.mark.parametrize("family, speculative, dtype", [("gpt2", False, "fp16"), ("llama", False, "fp16"),
                                                       ("llama", True, "fp16"), ("gpt2", False, "fp32"),
                                                       ("llama", True, "fp32")])
def test_the_derived_mask_gives_the_fed_masks_tokens_and_cache(family, speculative, dtype, monkeypatch):
    """fp16: GroupQueryAttention decoding, the mask from cache_length; fp32: the plain branch (no fp32 CUDA
    GroupQueryAttention), the mask from the first position ids, the cache on the device's path as well."""
    fed = _cuda_model(family, False, last_only=not speculative, dtype=dtype, monkeypatch=monkeypatch)
    derived = _cuda_model(family, True, last_only=not speculative, dtype=dtype, monkeypatch=monkeypatch)
    engines = []
    for model in (fed, derived):
        for device in (False, True):
            e = Engine(model, device_cache=device, max_batch=4, max_queue=16, prefill_chunk=16)
            assert e.feeds_mask == (model is fed) and not e.combined
            PrefixCache.for_engine(e, 1)
            if speculative:
                Speculation(adaptive=False).attach(e)
            e.handles = [e.submit(Request(list(r.prompt), r.max_tokens, r.sampling)) for r in _requests(5)]
            engines.append(e)
    want = engines[0]
    while any(not h.finished for h in want.handles):
        for e in engines:
            assert e.step()
        for e in engines[1:]:
            assert_engines_agree(want, e)
    for e in engines[1:]:
        assert [(h.tokens, h.finish_reason) for h in e.handles] == [(h.tokens, h.finish_reason) for h in want.handles]
    assert all(h.finish_reason == "length" for h in want.handles), [h.error for h in want.handles]
    assert want.relayouts > 0 and want.prefix_cache.hits > 0
    if speculative:
        assert all(e.speculation.accepted == want.speculation.accepted > 0 for e in engines)


def test_only_the_engines_cuda_variant_loses_its_mask_input(monkeypatch):
    """The CPU engine model (its combined call marks a chunk's row in the mask) and the CUDA one with the masked
    decoding step (prefix_keys=False) keep the input; --explain's notes say where it was derived."""
    o = EngineOptions(spec="gpt2", sets=SETS["gpt2"], provider="cuda", dtype="fp16", max_batch=2, max_context=192)
    built = pipeline.build("gpt2", None, SETS["gpt2"], None)
    weights = pipeline.weights_for(built, None, 0, False)
    names = {}
    for label, options in (("cuda", o.engine_pipeline_options()),
                           ("cuda-masked", o.engine_pipeline_options(prefix_keys=False))):
        proto, info = gen.compile_cached(pipeline.build("gpt2", None, SETS["gpt2"], None), weights, options)
        names[label] = ({i.name for i in proto.graph.input}, info.notes)
    cpu = EngineOptions(spec="gpt2", sets=SETS["gpt2"], provider="cpu", max_batch=2, max_context=192)
    proto, info = gen.compile_cached(built, weights, cpu.engine_pipeline_options(prefix_keys=True))
    names["cpu"] = ({i.name for i in proto.graph.input}, info.notes)
    assert "attention_mask" not in names["cuda"][0] and any("attention mask derived" in n for n in names["cuda"][1])
    for label in ("cuda-masked", "cpu"):
        assert "attention_mask" in names[label][0] and not any("attention mask derived" in n for n in names[label][1])
