"""`tessera generate` and the serving engine's mask-less decoder (CacheInfo.prefix_keys): seqlens_k alone would
show a left-padded row its padding, so generate lays such a decoder's prompts as the engine does (each row from
column 0, generation/cached.py CachedDecoder.by_row) and gives the masked decoder's tokens, for prompts of one
length and of different lengths (the engine's model, with its combined call)."""

from __future__ import annotations

from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model

LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=192"]


def test_generate_lays_the_mask_less_decoder_s_rows_from_column_zero():
    masked = serving_model.load("llama", sets=LLAMA, threads=1)
    unmasked = serving_model.load("llama", sets=LLAMA, threads=1, prefix_keys=True)
    assert unmasked.info.prefix_keys and not masked.info.prefix_keys
    for prompts in ([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[1, 2, 3, 4, 5], [6, 7, 8]], [[9], [1, 2, 3, 4, 5, 6, 7]]):
        assert list(gen.stream(unmasked, prompts, 12)) == list(gen.stream(masked, prompts, 12)), prompts
