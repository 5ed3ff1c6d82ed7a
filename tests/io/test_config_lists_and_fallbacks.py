"""A checkpoint's config.json keys that are lists (Gemma 3's ``layer_types``, Llama 4's
``no_rope_layers``) and keys whose "unset" value means another key (DeBERTa's
``max_relative_positions = -1``: the context), and null keys with a value of their own
(DeepSeek's ``q_lora_rank``: null, no query bottleneck) reach the spec's hyperparameters through the mapping
file's ``[config]`` table (runtime/io/checkpoint_config.py); ``--set`` takes lists as the spec writes
them. The expected outputs are worked out by hand in each test from the config written there."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.compiler.ops import interpret
from tessera.runtime import pipeline
from tessera.runtime.io.weights import WeightsError

SPEC = """
model L(d = 4, layers = 3, kinds = ["full", "full", "full"], reach = 8) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  h = x
  repeat layers as i {
    if kinds[i] == "sliding" { h = h * 2.0 } else { h = h + 1.0 }
  }
  y = h + reach
}
"""

MAPPING = """
[config]
num_hidden_layers = "layers"
layer_types = "kinds"
"max_relative_positions" = { name = "reach", fallback = "max_position_embeddings", unset = -1 }
"""


def _folder(tmp_path, config: dict, mapping: str = MAPPING):
    spec = tmp_path / "l.tsr"
    spec.write_text(SPEC)
    (tmp_path / "l.hf.toml").write_text(mapping)
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return spec, folder


def _run(built) -> float:
    x = np.zeros((1, 1, 4), dtype=np.float32)
    return float(interpret.run(built.graph, {}, {"x": x})["y"][0, 0, 0])


def test_a_list_valued_key_chooses_each_layer(tmp_path):
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3, "layer_types": ["full", "sliding", "sliding"],
                                      "max_relative_positions": 5})
    built = pipeline.build(spec, weights=folder)
    assert built.info.hyperparams["kinds"] == ["full", "sliding", "sliding"]
    assert _run(built) == (0 + 1) * 2 * 2 + 5   # full adds 1, sliding doubles; then reach


def test_the_unset_value_reads_the_fallback_key(tmp_path):
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3, "layer_types": ["full"] * 3,
                                      "max_relative_positions": -1, "max_position_embeddings": 512})
    assert _run(pipeline.build(spec, weights=folder)) == 3 + 512
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3, "layer_types": ["full"] * 3,
                                      "max_position_embeddings": 64})   # absent: the fallback too
    assert _run(pipeline.build(spec, weights=folder)) == 3 + 64


def test_a_set_list_equal_to_the_config_passes_and_a_different_one_is_named(tmp_path):
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3, "layer_types": ["full", "sliding", "full"],
                                      "max_relative_positions": 2})
    built = pipeline.build(spec, sets=['kinds=["full", "sliding", "full"]'], weights=folder)
    assert _run(built) == ((0 + 1) * 2 + 1) + 2 and built.info.hyperparams["kinds"][1] == "sliding"
    with pytest.raises(WeightsError, match=r"--set kinds=\['full', 'full', 'full'\] contradicts layer_types"):
        pipeline.build(spec, sets=['kinds=["full","full","full"]'], weights=folder)


def test_nested_lists_and_bad_fallback_tables_are_refused(tmp_path):
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3, "layer_types": [["full"], "x", "y"]})
    with pytest.raises(WeightsError, match="layer_types is a JSON list, not a number, bool, string or flat list of those"):
        pipeline.build(spec, weights=folder)
    spec, folder = _folder(tmp_path, {"num_hidden_layers": 3},
                           mapping='[config]\nmax_relative_positions = { name = "reach", unset = -1 }\n')
    with pytest.raises(WeightsError, match=r"\{ name = \"hyperparameter\", fallback = \"config key\", unset = value \}"):
        pipeline.build(spec, weights=folder)
    with pytest.raises(pipeline.UsageError, match="not lists"):
        pipeline.build(spec, sets=['kinds=[["a"]]'])


NULL_MAPPING = '[config]\nnum_hidden_layers = "layers"\nlayer_types = "kinds"\nq_lora_rank = { name = "reach", null = 0 }\n'


def test_a_null_table_gives_its_value_for_a_null_key_only(tmp_path):
    """DeepSeek's q_lora_rank: null means no query bottleneck (0), which a plain entry would leave at the
    spec's default (here reach = 8)."""
    config = {"num_hidden_layers": 3, "layer_types": ["full"] * 3}
    spec, folder = _folder(tmp_path, {**config, "q_lora_rank": None}, NULL_MAPPING)
    assert _run(pipeline.build(spec, weights=folder)) == 3 + 0
    spec, folder = _folder(tmp_path, {**config, "q_lora_rank": 24}, NULL_MAPPING)
    assert _run(pipeline.build(spec, weights=folder)) == 3 + 24
    spec, folder = _folder(tmp_path, config, NULL_MAPPING)   # absent: the spec's default
    assert _run(pipeline.build(spec, weights=folder)) == 3 + 8
    spec, folder = _folder(tmp_path, config, '[config]\nq_lora_rank = { name = "1x", null = 0 }\n')
    with pytest.raises(WeightsError, match="'1x' is not a hyperparameter name"):
        pipeline.build(spec, weights=folder)
