"""`generate` with a decoder that steps with the plain MatMul/Softmax branch (fp32 on CUDA: onnxruntime has no
fp32 CUDA GroupQueryAttention) keeps its cache on the device (runtime/device_cache.py; generation/cached.py
``CachedDecoder``): the past bound from the device buffers, each step's new columns left on the device and
written into their rows by the cache's graphs. Checked on the CPU provider (``CachedModel.device_cache = True``
runs that path over CPU OrtValues) against the numpy cache: the same logits, bit for bit, and the same tokens,
for left-padded prompts. The copies under the CUDA stub: tests/cuda/test_cuda_stub.py."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model

SETS = {"gpt2": ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=64"],
        "llama": ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=64"]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_plain_branch_with_the_cache_on_the_device_gives_the_numpy_caches_logits(family, monkeypatch):
    from tessera.runtime.device_cache import DeviceCache

    puts = []
    real = DeviceCache.put
    monkeypatch.setattr(DeviceCache, "put", lambda self, *a: (puts.append(a[2]), real(self, *a))[1])
    model = serving_model.load(family, sets=SETS[family], threads=1, decode="plain")
    assert not model.info.length_input
    got = {}
    for device in (None, True):
        model.device_cache = device
        logits = []
        tokens = list(gen.stream(model, [[1, 2, 3, 4, 5], [6, 7, 8]], 12,
                                 on_logits=lambda step, x: logits.append(x.copy())))
        got[device] = tokens, np.stack(logits)
    model.device_cache = None
    assert len(puts) == 2 * 12  # each row's columns written in on the device: the prompt's, then 11 steps'
    assert got[True][0] == got[None][0]
    np.testing.assert_array_equal(got[True][1], got[None][1])
