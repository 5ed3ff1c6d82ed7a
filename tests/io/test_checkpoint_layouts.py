"""Checkpoint layouts (issue 12): a fused qkv weight laid out per head (BLOOM, GPT-NeoX) or per
key/value group (Falcon's grouped-query layout) is split by a mapping rule with ``groups``, sizes
from the model's parameters; a naive split loads without error and gives other weights (the
issue's 0.61 off), which the tests show too. And a checkpoint folder's config.json supplies the
hyperparameters through the mapping file's [config] table: ``tessera compile models/llama.tsr
--weights DIR`` needs no --set, matches transformers on the same folder, and a config value that
contradicts --set or the variant is an error."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import MODELS, build, cli, cli_error
from tessera.runtime import pipeline
from tessera.runtime.io.weights import NameMap, WeightsError, load_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPEC = """
model A(d = 32, heads = 4, kv_heads = 4) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = attention(x, heads, kv_heads=kv_heads, causal=true, name="attn")
}
"""

MAP = """
[names]
"qkv.weight" = {{ split = ["attn.q.weight", "attn.k.weight", "attn.v.weight"], axis = 0{groups} }}
"qkv.bias" = {{ split = ["attn.q.bias", "attn.k.bias", "attn.v.bias"], axis = 0{groups} }}
"dense.weight" = "attn.o.weight"
"dense.bias" = "attn.o.bias"
"""


def _setup(tmp_path, groups, kv_heads=4):
    (tmp_path / "a.tsr").write_text(SPEC)
    (tmp_path / "a.hf.toml").write_text(MAP.format(groups=f", groups = {groups}" if groups else ""))
    return build(str(tmp_path / "a.tsr"), kv_heads=kv_heads)


def _per_head(rng, heads, kv_heads, hd=8, d=32):
    """q, k, v as Tessera stores them, and the fused tensor in the per-group layout
    [kv_heads, (heads/kv_heads) q heads + 1 k head + 1 v head, hd] (heads = kv_heads: BLOOM's [heads, 3, hd])."""
    rep = heads // kv_heads
    q = rng.standard_normal((heads * hd, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads * hd, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads * hd, d)).astype(np.float32)
    fused = np.concatenate([q.reshape(kv_heads, rep, hd, d), k.reshape(kv_heads, 1, hd, d),
                            v.reshape(kv_heads, 1, hd, d)], axis=1).reshape(-1, d)
    bq, bk, bv = (rng.standard_normal(n * hd).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    fused_b = np.concatenate([bq.reshape(kv_heads, rep, hd), bk.reshape(kv_heads, 1, hd),
                              bv.reshape(kv_heads, 1, hd)], axis=1).reshape(-1)
    return (q, k, v, bq, bk, bv), {"qkv.weight": fused, "qkv.bias": fused_b,
                                    "dense.weight": rng.standard_normal((d, heads * hd)).astype(np.float32),
                                    "dense.bias": rng.standard_normal(d).astype(np.float32)}


@pytest.mark.parametrize("groups,heads,kv_heads", [('"heads"', 4, 4), ("4", 4, 4), ('"kv_heads"', 4, 2),
                                                   ('"kv_heads"', 4, 1)],
                         ids=["per-head-by-name", "per-head-by-count", "grouped-query", "multi-query"])
def test_a_per_head_fused_qkv_is_split_into_the_heads(tmp_path, rng, groups, heads, kv_heads):
    g = _setup(tmp_path, groups, kv_heads)
    want, ckpt = _per_head(rng, heads, kv_heads)
    save_file(ckpt, str(tmp_path / "w.safetensors"))
    built = pipeline.build(tmp_path / "a.tsr", sets=[f"kv_heads={kv_heads}"])
    got = load_weights(built.graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "a.hf.toml"),
                       hyper=built.info.hyperparams)
    for name, arr in zip(("q.weight", "k.weight", "v.weight", "q.bias", "k.bias", "v.bias"), want):
        np.testing.assert_array_equal(got[f"attn.{name}"], arr, err_msg=name)
    assert g.params["attn.k.weight"].shape == (kv_heads * 8, 32)


def test_a_naive_split_of_a_per_head_layout_loads_but_is_wrong(tmp_path, rng):
    """Why the docs warn: side-by-side split of [heads, 3, hd] rows fits every shape and mixes heads."""
    _setup(tmp_path, None)
    want, ckpt = _per_head(rng, 4, 4)
    save_file(ckpt, str(tmp_path / "w.safetensors"))
    built = pipeline.build(tmp_path / "a.tsr")
    got = load_weights(built.graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "a.hf.toml"))
    assert not np.array_equal(got["attn.q.weight"], want[0])
    # the naive q holds head 0's q, k and v rows, then head 1's ...: rows 8-15 are head 0's keys
    np.testing.assert_array_equal(got["attn.q.weight"][8:16], want[1][:8])


def test_unequal_parts_side_by_side_are_sized_from_the_model(tmp_path, rng):
    """A grouped-query qkv concatenated [q; k; v] (Phi-3's qkv_proj): q is larger than k and v."""
    (tmp_path / "a.tsr").write_text(SPEC)
    (tmp_path / "a.hf.toml").write_text(MAP.format(groups=""))
    built = pipeline.build(tmp_path / "a.tsr", sets=["kv_heads=2"])
    q, k, v = (rng.standard_normal((n, 32)).astype(np.float32) for n in (32, 16, 16))
    bq, bk, bv = (rng.standard_normal(n).astype(np.float32) for n in (32, 16, 16))
    save_file({"qkv.weight": np.concatenate([q, k, v]), "qkv.bias": np.concatenate([bq, bk, bv]),
               "dense.weight": np.zeros((32, 32), np.float32), "dense.bias": np.zeros(32, np.float32)},
              str(tmp_path / "w.safetensors"))
    got = load_weights(built.graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "a.hf.toml"))
    for name, arr in (("q.weight", q), ("k.weight", k), ("v.weight", v), ("k.bias", bk)):
        np.testing.assert_array_equal(got[f"attn.{name}"], arr)


@pytest.mark.parametrize("rule,message", [
    ('"qkv.weight" = { to = "attn.q.weight", groups = 4 }', "'groups' only applies to 'split'"),
    ('"qkv.weight" = { split = ["attn.q.weight", "attn.k.weight"], groups = 0 }', "'groups' must be a positive"),
    ('"qkv.weight" = { split = ["attn.q.weight", "attn.k.weight"], groups = "4 heads" }', "'groups' must be"),
])
def test_bad_groups_are_refused(tmp_path, rule, message):
    (tmp_path / "m.hf.toml").write_text(f"[names]\n{rule}\n")
    with pytest.raises(WeightsError, match=message):
        NameMap.load(tmp_path / "m.hf.toml")


def test_groups_naming_no_hyperparameter_is_an_error(tmp_path, rng):
    _setup(tmp_path, '"n_head"')
    _, ckpt = _per_head(rng, 4, 4)
    save_file(ckpt, str(tmp_path / "w.safetensors"))
    built = pipeline.build(tmp_path / "a.tsr")
    with pytest.raises(WeightsError, match='groups = "n_head", which is not a hyperparameter'):
        load_weights(built.graph, tmp_path / "w.safetensors", NameMap.load(tmp_path / "a.hf.toml"),
                     hyper=built.info.hyperparams)


# ------------------------------------------------------------------ config.json -> hyperparameters
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_ckpt")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                                   num_key_value_heads=2, intermediate_size=80, rope_theta=50000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=False,
                                   mlp_bias=False, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_compile_with_a_checkpoint_folder_needs_no_set_and_matches_transformers(llama_dir, tmp_path, capsys):
    import onnxruntime as ort

    folder, model = llama_dir
    out = tmp_path / "llama.onnx"
    rc, stdout, err = cli(capsys, "compile", MODELS / "llama.tsr", "--weights", folder, "-o", out)
    assert rc == 0, err
    n = sum(p.numel() for p in model.parameters())
    assert f"{n:,} parameters" in stdout
    tokens = np.random.default_rng(0).integers(0, 96, (2, 40)).astype(np.int64)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ours = sess.run(None, {"tokens": tokens})[0]
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(ours - want).max() <= 1e-4
    built = pipeline.build(MODELS / "llama.tsr", weights=str(folder))
    assert {k: built.info.hyperparams[k] for k in ("vocab", "d", "layers", "heads", "kv_heads", "d_ff", "theta",
                                                    "rope_factor", "rope_original_ctx", "eps")} == \
        dict(vocab=96, d=48, layers=3, heads=6, kv_heads=2, d_ff=80, theta=50000.0, rope_factor=4.0,
             rope_original_ctx=32, eps=1e-5)


def test_an_agreeing_set_is_fine_and_a_contradicting_one_is_an_error(llama_dir, tmp_path, capsys):
    folder, _ = llama_dir
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", "--weights", folder, "--set", "d=48",
                     "-o", tmp_path / "a.onnx")
    assert rc == 0, err
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", "--weights", folder, "--set", "layers=2",
                    "-o", tmp_path / "b.onnx")
    assert "--set layers=2 contradicts" in err and "num_hidden_layers = 3" in err


def test_a_config_contradicting_the_variant_is_an_error(llama_dir, tmp_path, capsys):
    folder, _ = llama_dir
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", "-V", "llama3_8b", "--weights", folder,
                    "-o", tmp_path / "c.onnx")
    assert "variant llama3_8b has vocab = 128256" in err and "vocab_size = 96" in err


@pytest.mark.parametrize("edit,message", [
    (dict(attention_bias=True), "attention_bias = true is not supported"),
    # issue 24 made yarn (and linear, dynamic) supported (tests/models/test_llama_rope_config.py): longrope is not
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}),
     "rope_type longrope is not implemented"),
    (dict(num_hidden_layers="three"), "must be int"),
    (dict(hidden_size=[48]), "is a JSON list"),
])
def test_a_config_the_spec_cannot_follow_is_refused(llama_dir, tmp_path, capsys, edit, message):
    import shutil

    folder, _ = llama_dir
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(edit)
    (copy / "config.json").write_text(json.dumps(cfg))
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", "--weights", copy, "-o", tmp_path / "d.onnx")
    assert message in err, err


def test_bad_config_tables_are_refused(tmp_path):
    for body, message in (('[config]\nhidden_size = 3\n', "must be a hyperparameter name"),
                          ('[config]\nhidden_size = "d model"\n', "is not a hyperparameter name"),
                          ('[config]\nx = { allow = [1] }\n', "expect = [allowed values]"),
                          ('config = 3\n', "'config' must be a table")):
        (tmp_path / "m.hf.toml").write_text(body)
        with pytest.raises(WeightsError, match=re.escape(message)):
            NameMap.load(tmp_path / "m.hf.toml")
