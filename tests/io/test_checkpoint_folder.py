"""A Hugging Face checkpoint folder is a model: no spec, no --set.

Each family's tiny checkpoint is made here by transformers (``save_pretrained``) with a
tokenizer.json beside it; ``tessera generate FOLDER --prompt ...`` must give transformers' greedy
tokens (decoders) and ``tessera run FOLDER ...`` transformers' outputs within 1e-4 (encoders).
The folder's config.json picks the bundled spec (runtime/io/checkpoint.py) and gives every
hyperparameter (the [config] tables of models/*.hf.toml).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import cli, cli_error  # noqa: E402

VOCAB = 128
PROMPT = "w5 w17 w42 w99 w3"
PROMPT_IDS = [5, 17, 42, 99, 3]
NEW = 10


def _tokenizer(folder, vocab=VOCAB):
    """A word-piece tokenizer.json whose token 'wI' is id I, so a prompt's ids are known by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert tok.encode(PROMPT).ids == PROMPT_IDS


def _perturbed(model, scale):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _decoder(kind):
    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, **ids)
        return _perturbed(transformers.GPT2LMHeadModel(cfg), 0.2)
    if kind in ("llama", "llama_tied"):  # grouped-query attention: 4 query heads over 2 key/value heads
        # llama_tied: the head is the embedding (SmolLM2, Llama 3.2 1B/3B); the folder has no lm_head.weight
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=kind != "llama",
                                       **ids)
        return _perturbed(transformers.LlamaForCausalLM(cfg), 0.05)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, rope_theta=1e6,
                                     rms_norm_eps=1e-5, sliding_window=None, router_jitter_noise=0.0,
                                     tie_word_embeddings=False, **ids)
    return _perturbed(transformers.MixtralForCausalLM(cfg), 0.05)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied", "mixtral"])
def test_generate_from_a_checkpoint_folder_equals_transformers(kind, tmp_path, capsys):
    model = _decoder(kind)
    model.save_pretrained(tmp_path, safe_serialization=True)
    _tokenizer(tmp_path)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False)
    want = out[0, 5:].tolist()
    rc, printed, err = cli(capsys, "generate", tmp_path, "--prompt", PROMPT, "--max-new-tokens", NEW,
                           "--format", "json", "-q")
    assert rc == 0, err
    assert json.loads(printed)["outputs"][0]["tokens"] == want


def test_a_llama_folder_takes_its_context_from_max_position_embeddings(tmp_path, capsys):
    _decoder("llama").save_pretrained(tmp_path, safe_serialization=True)
    capsys.readouterr()  # transformers' progress bar
    err = cli_error(capsys, "generate", tmp_path, "--input", "tokens=[[5, 6]]", "--max-new-tokens", 63)
    assert "context" in err and "64" in err  # 2 + 63 > 64 positions: the checkpoint's, not the spec's 4096


def _run_saved(capsys, tmp_path, *args):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "run", tmp_path / "ckpt", *args, "--save", out)
    assert rc == 0, err
    return {p.stem: np.load(p) for p in out.glob("*.npy")}


def test_run_a_bert_folder_equals_transformers(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64)
    model = _perturbed(transformers.BertModel(cfg), 0.05)
    (tmp_path / "ckpt").mkdir()
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    _tokenizer(tmp_path / "ckpt")
    got = _run_saved(capsys, tmp_path, "--text", PROMPT)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT_IDS]))
    np.testing.assert_allclose(got["hidden"], ref.last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["pooled"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)


def test_a_bert_folder_without_its_pooler_runs_with_the_pooled_output_dropped(tmp_path, capsys):
    """transformers' add_pooling_layer=False (embedding models) saves no pooler weights: the hidden
    states run, equal to transformers', and the pooled output is dropped with a note."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64)
    model = _perturbed(transformers.BertModel(cfg, add_pooling_layer=False), 0.05)
    (tmp_path / "ckpt").mkdir()
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    _tokenizer(tmp_path / "ckpt")
    capsys.readouterr()
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "run", tmp_path / "ckpt", "--text", PROMPT, "--save", out)
    assert rc == 0, err
    assert "pooler.weight, pooler.bias" in err and "pooled dropped" in err
    assert sorted(p.stem for p in out.glob("*.npy")) == ["hidden"]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT_IDS]))
    np.testing.assert_allclose(np.load(out / "hidden.npy"), ref.last_hidden_state.numpy(), atol=1e-4, rtol=0)
    rc, _, err = cli(capsys, "run", tmp_path / "ckpt", "--text", PROMPT, "--pool", "mean")  # embeddings
    assert rc == 0, err


def test_run_a_vit_folder_equals_transformers(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=48)
    model = _perturbed(transformers.ViTModel(cfg), 0.05)
    (tmp_path / "ckpt").mkdir()
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    pixels = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "pixels.npy", pixels)
    got = _run_saved(capsys, tmp_path, "--input", f"pixels={tmp_path / 'pixels.npy'}")
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(pixels))
    np.testing.assert_allclose(got["hidden"], ref.last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["pooled"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)


def test_an_unknown_model_type_lists_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    err = cli_error(capsys, "generate", tmp_path, "--input", "tokens=[[1]]")
    assert "model_type 'falcon'" in err and "gpt2" in err and "mixtral" in err and "write a spec" in err


def test_a_spec_whose_variant_disagrees_with_the_folder_names_the_keys_and_the_sets(tmp_path, capsys):
    _decoder("gpt2").save_pretrained(tmp_path, safe_serialization=True)
    capsys.readouterr()
    err = cli_error(capsys, "compile", "gpt2", "-V", "medium", "--weights", tmp_path, "-o", tmp_path / "x.onnx")
    assert "n_embd = 32" in err and "n_layer = 2" in err and "--set d=32" in err


def test_the_folder_as_the_api_model_and_the_tokenizer_folder(tmp_path):
    import tessera

    model = _decoder("gpt2")
    model.save_pretrained(tmp_path, safe_serialization=True)
    _tokenizer(tmp_path)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False)
    m = tessera.load(tmp_path)
    assert m.generate(PROMPT_IDS, max_new_tokens=NEW) == out[0, 5:].tolist()
    # --tokenizer FOLDER (a folder holding tokenizer.json), on the spec + --weights path
    text = tessera.load("gpt2", weights=tmp_path).generate(PROMPT, max_new_tokens=NEW, tokenizer=tmp_path)
    assert text == " ".join(f"w{i}" for i in out[0, 5:].tolist())  # the word-piece tokenizer joins with spaces


def test_report_serve_and_genai_take_the_folder(tmp_path, capsys):
    from tessera.runtime.serving import model as serving_model

    model = _decoder("gpt2")
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt, safe_serialization=True)
    _tokenizer(ckpt)
    capsys.readouterr()
    rc, printed, err = cli(capsys, "report", ckpt, "--format", "json")
    assert rc == 0, err
    rep = json.loads(printed)
    assert rep["params"]["total"] == model.num_parameters()  # the head is tied to wte, as in transformers
    assert rep["hyperparams"]["ctx"] == 64 and rep["hyperparams"]["d"] == 32
    served = serving_model.load(str(ckpt))
    assert served.vocab == VOCAB
    assert serving_model.tokenizer_path(None, str(ckpt)) == str(ckpt / "tokenizer.json")
    assert serving_model.eos_ids(None, None, str(ckpt)) == [2]
    rc, _, err = cli(capsys, "compile", ckpt, "--genai", "-o", tmp_path / "genai")
    assert rc == 0, err
    cfg = json.loads((tmp_path / "genai" / "genai_config.json").read_text())["model"]
    assert cfg["eos_token_id"] == 2 and cfg["context_length"] == 64 and cfg["vocab_size"] == VOCAB
    assert (tmp_path / "genai" / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()


def test_a_folder_named_like_its_bundled_spec_in_the_working_directory(tmp_path, capsys, monkeypatch):
    """`tessera run llama` where ./llama is the checkpoint: the folder's bundled spec is its file, not the
    name `llama` (which, looked up as a path first, would find the folder again: "spec path llama is a folder")."""
    _decoder("llama").save_pretrained(tmp_path / "llama", safe_serialization=True)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    rc, printed, err = cli(capsys, "run", "llama", "--input", "tokens=[[5, 6, 7]]", "--format", "json")
    assert rc == 0, err
    rc, _, err = cli(capsys, "report", "llama")
    assert rc == 0, err


def test_a_folder_named_like_a_bundled_spec_that_is_no_model_does_not_shadow_it(tmp_path, capsys, monkeypatch):
    """A virtualenv called ``gpt2/`` in the working directory: no config.json, no .onnx, so the name
    is the bundled spec for generate, run, report and compile (before: 'an .onnx file is already
    compiled', or 'is a folder')."""
    (tmp_path / "gpt2" / "bin").mkdir(parents=True)
    (tmp_path / "gpt2" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.chdir(tmp_path)
    small = ["--set", "d=32", "--set", "layers=1", "--set", "heads=4", "--set", "vocab=64", "--set", "ctx=16"]
    rc, out, err = cli(capsys, "generate", "gpt2", *small, "--input", "tokens=[[1, 2]]", "--max-new-tokens", 2,
                       "--format", "json", "-q")
    assert rc == 0, err
    assert len(json.loads(out)["outputs"][0]["tokens"]) == 2
    rc, out, err = cli(capsys, "report", "gpt2", *small, "--format", "json")
    assert rc == 0, err
    rc, _, err = cli(capsys, "compile", "gpt2", *small, "-o", tmp_path / "g.onnx")
    assert rc == 0, err
    assert (tmp_path / "g.onnx").is_file()
