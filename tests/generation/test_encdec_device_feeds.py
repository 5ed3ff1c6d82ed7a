"""An encoder-decoder's fixed inputs (each layer's cross-attention keys and values, the source mask) kept as
OrtValues where the decoder runs (generation/cached.py ``Seq2Seq``: on CUDA the encoder's outputs stay on the
device and every decoding step binds them, never copying them from the host again). Checked on the CPU provider
(``Seq2Seq.device_outputs = True`` runs that path over CPU OrtValues) against the numpy feeds the CPU path has
always used: the same logits, bit for bit, and the same tokens, for two sources of uneven length, through each
step path of generation/cached.py (the bound GroupQueryAttention step, the plain branch with its numpy cache and
with the device cache). The copies under the CUDA stub: tests/cuda/test_cuda_stub.py."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.runtime import pipeline
from tessera.runtime.generation import cached as gen
from tessera.runtime.generation.loop import EncoderDecoder, target_input

SETS = {"bart": ["layers=2", "dec_layers=2", "d=64", "heads=4", "dec_heads=4", "vocab=60", "d_ff=96", "dec_d_ff=96",
                 "ctx=64"],
        "transformer": ["layers=2", "d=64", "heads=4", "vocab=60", "d_ff=96"]}
SRC = np.array([[5, 9, 14, 3, 22, 7], [11, 4, 30, 0, 0, 0]], dtype=np.int64)
SRC_MASK = (SRC != 0).astype(np.int64)


def _load(family: str, decode: str) -> EncoderDecoder:
    built = pipeline.build(family, None, SETS[family], None)
    weights = pipeline.weights_for(built, None, 3)
    return EncoderDecoder(built, weights, target_input(built.graph), 1, gen.cached_options(decode=decode))


def _sources(loaded: EncoderDecoder) -> dict:
    names = loaded.sources  # the token ids first, then their mask (each spec's own names)
    ids = [s for s in names if "mask" not in s]
    masks = [s for s in names if "mask" in s]
    return {ids[0]: SRC, **({masks[0]: SRC_MASK} if masks else {})}


def _generate(loaded: EncoderDecoder, on_device: bool, device_cache: bool | None):
    loaded.s2s.device_outputs = on_device
    model = loaded.s2s.decoder
    model.device_cache = device_cache
    fixed = loaded.fixed_feeds(_sources(loaded), 2)
    assert all(gen.is_ortvalue(v) == on_device for v in fixed.values()), {k: type(v) for k, v in fixed.items()}
    logits = []
    tokens = list(gen.stream(model, [[2], [2, 8]], 10, extra_feeds=fixed,
                             on_logits=lambda step, x: logits.append(x.copy())))
    return tokens, np.stack(logits)


@pytest.mark.parametrize("family, decode, device_cache", [
    ("bart", "auto", None),        # the bound step (GroupQueryAttention writing the cache in place)
    ("bart", "plain", None),       # the plain branch, numpy cache
    ("bart", "plain", True),       # the plain branch over the device cache (CPU OrtValues here)
    ("transformer", "auto", None),
])
def test_fixed_inputs_as_ortvalues_give_the_numpy_feeds_logits(family, decode, device_cache):
    loaded = _load(family, decode)
    assert bool(loaded.s2s.decoder.info.length_input) == (decode == "auto")
    want = _generate(loaded, False, None)
    got = _generate(loaded, True, device_cache)
    # not degenerate: each step's scores depend on the target so far, each row's on its own source
    assert not np.allclose(want[1][1], want[1][-1]) and not np.allclose(want[1][:, 0], want[1][:, 1])
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


def test_the_cpu_provider_keeps_numpy_feeds_by_default():
    """On the CPU provider nothing changes: the encoder's outputs stay numpy arrays (``device_outputs`` None)."""
    loaded = _load("bart", "auto")
    assert not loaded.s2s.keeps_on_device()
    assert not any(gen.is_ortvalue(v) for v in loaded.fixed_feeds(_sources(loaded), 2).values())
