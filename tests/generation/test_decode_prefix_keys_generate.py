"""`tessera generate` and the serving engine's mask-less decoder (CacheInfo.prefix_keys): generate left-pads
prompts of different lengths, so a row's first columns are hidden and seqlens_k alone would show them; it
refuses such a decoder for them, and with prompts of one length (no padding: every row's keys from column 0)
gives the masked decoder's tokens."""

from __future__ import annotations

import pytest

from tessera.runtime.errors import UsageError
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model

LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=192"]


def test_generate_refuses_left_padding_with_the_mask_less_decoder():
    masked = serving_model.load("llama", sets=LLAMA, threads=1)
    unmasked = serving_model.load("llama", sets=LLAMA, threads=1, prefix_keys=True)
    assert unmasked.info.prefix_keys and not masked.info.prefix_keys
    with pytest.raises(UsageError, match="prompts of different lengths"):
        list(gen.stream(unmasked, [[1, 2, 3, 4, 5], [6, 7, 8]], 4))
    same = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert list(gen.stream(unmasked, same, 12)) == list(gen.stream(masked, same, 12))
    assert list(gen.stream(masked, [[1, 2, 3, 4, 5], [6, 7, 8]], 4))  # the masked decoder takes left padding
