"""bench/spec_target.py's widening keeps the small model's function.

The reference is the small model itself, run by transformers (independent of ``widen``): the
widened model's logits must equal the small one's to rounding, and with the near-silent extra
layers stay within a small distance and keep the greedy choices. Also through Tessera: the widened
checkpoint folder, loaded by ``tessera.load``, decodes greedily as transformers' small model does.
The parameter count of the benchmark's configuration is checked against the arithmetic of a Llama's
matrices, written here.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "bench"))
import spec_target  # noqa: E402


def _small(seed: int = 0, kv_heads: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, intermediate_size=48, rms_norm_eps=1e-5,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a wrong tiling of them would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


IDS = np.random.default_rng(3).integers(0, 97, 40).tolist()


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("factor", [2, 8])
def test_widening_is_function_preserving(kv_heads, factor):
    small = _small(kv_heads=kv_heads)
    big = spec_target.widen(small, factor=factor)
    assert big.config.hidden_size == 32 * factor and big.config.num_key_value_heads == kv_heads * factor
    a, b = _logits(small, IDS), _logits(big, IDS)
    np.testing.assert_allclose(b, a, atol=2e-5 * np.abs(a).max(), rtol=0)


def test_near_silent_layers_keep_the_behaviour():
    small = _small()
    big = spec_target.widen(small, factor=4, extra_layers=2, extra_scale=1e-3, seed=1)
    assert big.config.num_hidden_layers == 4
    a, b = _logits(small, IDS), _logits(big, IDS)
    assert np.abs(b - a).max() < 0.05 * np.abs(a).max()
    assert (b.argmax(-1) == a.argmax(-1)).mean() >= 0.95
    loud = spec_target.widen(small, factor=4, extra_layers=2, extra_scale=1.0, seed=1)
    assert np.abs(_logits(loud, IDS) - a).max() > np.abs(b - a).max()  # the scale is what keeps it


def test_tessera_decodes_the_widened_folder_as_the_small_model(tmp_path):
    import tessera

    small = _small(kv_heads=2)
    spec_target.widen(small, factor=2).save_pretrained(tmp_path, safe_serialization=True)
    prompt = IDS[:12]
    with torch.no_grad():
        ref = small.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, pad_token_id=0, eos_token_id=None)[0, 12:].tolist()
    assert tessera.load(tmp_path).generate([prompt], 20) == [ref]


def test_benchmark_configuration_size():
    s, f = spec_target.SMALL, spec_target.WIDEN
    d, mlp, v, hd = s["hidden"] * f, s["mlp"] * f, s["vocab"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * f * hd
    layer = d * d + 2 * d * kv + d * d + 3 * d * mlp + 2 * d  # q, k, v, o; gate, up, down; two norms
    total = 2 * v * d + d + (s["layers"] + spec_target.EXTRA_LAYERS) * layer
    assert total == 55_583_744  # 222 MB in fp32
    cfg = spec_target.small_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (s["hidden"], s["layers"], s["mlp"])
