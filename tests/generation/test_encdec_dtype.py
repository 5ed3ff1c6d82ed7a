"""An encoder-decoder compiled for generation at ``--dtype fp16`` on the CPU is fp16 (it used to compile fp32
there whatever --dtype said: nothing may be silently ignored), and bf16 on the CPU is refused with the reason.
What is checked is what onnxruntime itself reports of the sessions (their input element types), and the fp16
decoder's logits against the fp32 decoder's on the same seeded weights: close (fp16's rounding), not equal
(it really is a different precision), with the same greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tessera.compiler.passes.attention_kernels import Target
from tessera.runtime import pipeline
from tessera.runtime.errors import UsageError
from tessera.runtime.generation import cached as gen
from tessera.runtime.generation.loop import EncoderDecoder, target_input

SETS = ["layers=2", "dec_layers=2", "d=64", "heads=4", "dec_heads=4", "vocab=60", "d_ff=96", "dec_d_ff=96", "ctx=64"]
SRC = np.array([[5, 9, 14, 3, 22, 7], [11, 4, 30, 0, 0, 0]], dtype=np.int64)


def _load(dtype: str) -> EncoderDecoder:
    built = pipeline.build("bart", None, SETS, None)
    weights = pipeline.weights_for(built, None, 3)
    options = dataclasses.replace(gen.cached_options(), target=Target("cpu", dtype))
    return EncoderDecoder(built, weights, target_input(built.graph), 1, options)


def _run(loaded: EncoderDecoder):
    ids = [s for s in loaded.sources if "mask" not in s][0]
    masks = [s for s in loaded.sources if "mask" in s]
    fixed = loaded.fixed_feeds({ids: SRC, **({masks[0]: (SRC != 0).astype(np.int64)} if masks else {})}, 2)
    logits = []
    tokens = list(gen.stream(loaded.s2s.decoder, [[2], [2, 8]], 8, extra_feeds=fixed,
                             on_logits=lambda step, x: logits.append(np.asarray(x, dtype=np.float32).copy())))
    return tokens, np.stack(logits)


def test_fp16_on_the_cpu_is_fp16():
    half, full = _load("fp16"), _load("fp32")
    types = {i.name: i.type for i in half.s2s.decoder.session.get_inputs()}
    assert any(t == "tensor(float16)" for t in types.values()), types  # the cache crosses at fp16
    assert not any(t == "tensor(float16)" for i in full.s2s.decoder.session.get_inputs() for t in [i.type])
    (tokens16, logits16), (tokens32, logits32) = _run(half), _run(full)
    assert tokens16 == tokens32
    scale = np.abs(logits32).max()
    assert 0 < np.abs(logits16 - logits32).max() < 1e-2 * scale


def test_bf16_on_the_cpu_is_refused_with_the_reason():
    with pytest.raises(UsageError, match="bfloat16"):
        _load("bf16")
