"""A Llama checkpoint folder with each rope_scaling type of transformers (issue 24): config.json's
rope_type and its parameters reach models/llama.tsr through llama.hf.toml's [config] table, and the
logits equal transformers' LlamaForCausalLM within 1e-4, in both config layouts (transformers 5's
rope_parameters, and the older rope_scaling that checkpoints on disk still carry). The sequence is
longer than the original context, where every scaling differs from plain RoPE."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli_error  # noqa: E402

CTX, T = 16, 40
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CTX},
    "yarn_given": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CTX, "beta_fast": 16.0,
                   "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
}


def _llama(rope: dict | None, folder, max_positions: int):
    torch.manual_seed(0)
    params = {"rope_theta": 1000.0, **(rope or {"rope_type": "default"})}
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=max_positions,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=params)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _logits(folder, tokens):
    import tessera

    return tessera.load(str(folder)).run(tokens=tokens)["logits"]


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_a_llama_folder_with_each_rope_scaling_equals_transformers(tmp_path, kind, layout):
    rope = SCALINGS[kind]
    # dynamic NTK's original length is max_position_embeddings; the others run past it
    model = _llama(rope, tmp_path / "ckpt", CTX if kind == "dynamic" else 4 * CTX)
    if layout == "rope_scaling":  # the older layout: rope_theta apart, the scaling under rope_scaling
        path = tmp_path / "ckpt" / "config.json"
        cfg = json.loads(path.read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
        path.write_text(json.dumps(cfg))
    tokens = np.random.default_rng(1).integers(0, 64, (2, T)).tolist()
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = _logits(tmp_path / "ckpt", tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    plain = _llama(None, tmp_path / "plain", 4 * CTX)  # same weights (same seed), no scaling
    with torch.no_grad():
        assert np.abs(plain(torch.tensor(tokens)).logits.numpy() - want).max() > 1e-3  # the scaling mattered


def test_an_unimplemented_rope_type_is_refused(tmp_path, capsys):
    _llama({"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
            "original_max_position_embeddings": CTX}, tmp_path / "ckpt", 4 * CTX)
    capsys.readouterr()  # transformers' own progress output while saving
    err = cli_error(capsys, "run", tmp_path / "ckpt", "--input", "tokens=[[1,2]]")
    assert "rope_type longrope is not implemented" in err
