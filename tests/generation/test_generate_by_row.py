"""`generate` with the mask-less decoder (issue 37): a cached decoder compiled with the serving engine's variant
(``prefix_keys``: GroupQueryAttention's decoding step reads each row's columns 0..cache_length, no attention_bias,
so onnxruntime's CUDA kernel may choose flash decoding) runs prompts of different lengths in the engine's layout
(runtime/generation/cached.py ``CachedDecoder._step_by_row``: each prompt from column 0, run row by row, then every
row's token at its own column). Held here, on onnxruntime's CPU kernels, to the unfused graph recomputed over each
row's whole sequence at every step, for the CPU variant and the CUDA-target fp16 one; and to the left-padded
decoder's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Recomputation
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import PipelineOptions, pipeline
from tessera.runtime import pipeline as rt
from tessera.runtime.generation import cached as gen

SETS = {"llama": ["layers=2", "d=64", "heads=4", "kv_heads=2", "vocab=128", "d_ff=96"],
        "gpt2": ["layers=2", "d=64", "heads=4", "vocab=128", "ctx=64"]}
PROMPTS = [[5, 9, 2, 31, 7, 5, 9, 2, 31, 7, 5], [3, 4, 5], [7]]


def _decoder(family: str, target: Target, prefix_keys: bool) -> gen.CachedModel:
    built = rt.build(family, None, SETS[family])
    model, info = gen.compile_cached(built, rt.weights_for(built, None, 0),
                                     PipelineOptions(target, cache="buffer", prefix_keys=prefix_keys))
    assert info.prefix_keys == prefix_keys
    return gen.CachedModel(model.SerializeToString(), info, threads=1)


def _unfused(family: str):
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export

    built = rt.build(family, None, SETS[family])
    pipeline("full", PipelineOptions(attention="unfused"))(built.graph)
    return ort.InferenceSession(onnx_export.to_onnx(built.graph, rt.weights_for(built, None, 0)).SerializeToString(),
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("device, dtype, tolerance", [("cpu", "fp32", 1e-4), ("cuda", "fp16", 2e-2)])
def test_the_mask_less_decoder_generates_prompts_of_different_lengths(family, device, dtype, tolerance):
    model = _decoder(family, Target(device, dtype), prefix_keys=True)
    assert "decode_mask" not in model.input_names  # the generate variant's mask input is gone
    check = Recomputation(_unfused(family), PROMPTS, relative=dtype != "fp32")
    result = gen.generate(model, PROMPTS, 10, on_logits=check)
    assert [len(t) for t in result.tokens] == [10, 10, 10]
    assert check.worst <= tolerance, check.worst
    padded = gen.generate(_decoder(family, Target(device, dtype), prefix_keys=False), PROMPTS, 10).tokens
    assert result.tokens == padded


def test_the_by_row_layout_fills_each_row_from_column_zero():
    """The cache the loop keeps: row r's prompt in columns 0..len_r, then one column per step, no holes."""
    model = _decoder("llama", Target("cpu", "fp32"), prefix_keys=True)
    decoder = gen.CachedDecoder(model, PROMPTS, 4, 0, gen.Stats())
    decoder.step(None)
    assert decoder.lengths.tolist() == [11, 3, 1] and decoder.filled == 11
    for _ in range(3):
        decoder.step(np.array([1, 2, 3]))
    want = np.zeros_like(decoder.slots)
    for r, n in enumerate([14, 6, 4]):
        want[r, :n] = 1
    np.testing.assert_array_equal(decoder.slots, want)
    key = decoder.cache[model.info.layers[0].past_key]
    assert not key[2, :, 4:].any() and key[2, :, :4].any()  # nothing written past row 2's columns


def test_generate_compiles_the_mask_less_step_on_cuda_only_without_speculation():
    """`generate --provider cuda` compiles the mask-less decoding step (flash decoding); speculation's target and its
    draft model keep the left-padded layout, whose mask their rollback caches feed (runtime/options.py
    GenerateOptions.pipeline_options), and the rollback cache refuses a mask-less decoder with the reason."""
    import dataclasses

    from tessera.runtime.errors import UsageError
    from tessera.runtime.generation import rollback
    from tessera.runtime.options import GenerateOptions

    o = GenerateOptions(provider="cuda", dtype="fp16")
    assert o.pipeline_options().prefix_keys
    assert not dataclasses.replace(o, speculative="ngram").pipeline_options().prefix_keys
    draft = dataclasses.replace(o)
    draft.drafting = True  # as generation/loop.py load_drafter marks the draft model's options
    assert not draft.pipeline_options().prefix_keys
    assert not GenerateOptions(provider="cpu").pipeline_options().prefix_keys
    with pytest.raises(UsageError, match="serving engine's layout"):
        rollback.check(_decoder("llama", Target("cpu", "fp32"), prefix_keys=True), "the target model")


def test_a_longrope_model_keeps_the_masked_step():
    """A longrope rotary (Phi-3) switches its frequencies when the batch's longest row passes original_ctx, and generate
    then recomputes the whole left-padded batch together, as transformers does (runtime/generation/cached.py
    ``_restart``); run row by row, a shorter row would switch on its own length instead. So the kv-cache pass keeps the
    masked decoding step for it even when asked for the mask-less one, and the loop keeps the left-padded layout."""
    built = rt.build("phi3", None, ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=96", "vocab=128", "ctx=64",
                                    "rope_type=longrope", "original_ctx=16",
                                    "short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5]",
                                    "long_factor=[1.3, 2.2, 3.5, 5.0, 8.0, 12.0, 19.0, 30.0]"])
    _, info = gen.compile_cached(built, rt.weights_for(built, None, 0),
                                 PipelineOptions(Target("cuda", "fp16"), cache="buffer", prefix_keys=True))
    assert info.length_switch == 16 and not info.prefix_keys
    assert "longrope" in " ".join(k.reason for k in info.kernels)
