"""``tessera compile --genai``: a folder onnxruntime-genai loads and generates with.

Two kinds of check:

- always: the written genai_config.json against the ONNX model's own inputs and outputs (read
  with onnx here, its name templates expanded per layer) and against the spec's hyperparameters
  and the tokenizer (the `tokenizers` package); the folder is written atomically; the
  combinations genai cannot run are clear errors;
- with onnxruntime-genai (TESSERA_GENAI_PYTHON names a Python that has it; it brings its own
  onnxruntime, so it is no test dependency and runs in a subprocess, tests/genai_runner.py):
  greedy generation through og.Generator on the folder gives exactly the tokens of
  `tessera generate FOLDER`, of `tessera generate SPEC` (the buffer cache, compiled on the fly)
  and of greedy decoding by full recomputation with the uncached model, for a tiny GPT-2 and a
  tiny Llama with grouped-query attention (seeded weights); its tokenizer encodes as `tokenizers`
  does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import tessera
from conftest import MODELS, cli, cli_error

HERE = Path(__file__).resolve().parents[1]
GENAI_PYTHON = os.environ.get("TESSERA_GENAI_PYTHON")
needs_genai = pytest.mark.skipif(
    not GENAI_PYTHON, reason="TESSERA_GENAI_PYTHON is not set (a Python with onnxruntime-genai installed; it brings "
                             "its own onnxruntime, so it is not a test dependency)")

VOCAB = 300
SPECS = {
    "gpt2": ("gpt2.tsr", dict(layers=2, d=64, heads=4, vocab=VOCAB, ctx=128), 4),
    "llama": ("llama.tsr", dict(layers=2, d=64, heads=4, kv_heads=2, d_ff=128, vocab=VOCAB, ctx=256,
                                theta=500000.0), 2),
}
EOS = "<|endoftext|>"


def _sets(hp: dict) -> list[str]:
    return [a for k, v in hp.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json (GPT-2's kind) of 300 ids, trained here, <|endoftext|> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, this is a small test of tokenizers"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == VOCAB
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module", params=list(SPECS))
def folder(request, tmp_path_factory, tokenizer_file):
    spec, hp, _ = SPECS[request.param]
    from tessera.runtime.cli import main

    out = tmp_path_factory.mktemp("genai") / request.param
    assert main([str(a) for a in ("compile", MODELS / spec, *_sets(hp), "--genai", "--tokenizer", tokenizer_file,
                                  "-o", out)]) == 0
    return request.param, out


def _dims(value) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def test_config_matches_the_model_and_the_spec(folder, tokenizer_file):
    name, out = folder
    _, hp, kv_heads = SPECS[name]
    from tokenizers import Tokenizer

    assert sorted(p.name for p in out.iterdir()) == ["genai_config.json", "model.onnx", "tokenizer.json",
                                                      "tokenizer_config.json"]
    cfg = json.loads((out / "genai_config.json").read_text())
    m, dec = cfg["model"], cfg["model"]["decoder"]
    model = onnx.load(str(out / dec["filename"]))
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name: o for o in model.graph.output}
    layers = dec["num_hidden_layers"]
    # the spec's own numbers
    assert (layers, dec["num_attention_heads"], dec["num_key_value_heads"]) == (hp["layers"], hp["heads"], kv_heads)
    assert dec["head_size"] == hp["d"] // hp["heads"] and dec["hidden_size"] == hp["d"]
    assert m["vocab_size"] == hp["vocab"] and m["context_length"] == hp["ctx"] == cfg["search"]["max_length"]
    # the tokenizer's end-of-sequence token (no other special token: bos and pad default to it)
    eos = Tokenizer.from_file(str(tokenizer_file)).token_to_id(EOS)
    assert m["eos_token_id"] == m["bos_token_id"] == m["pad_token_id"] == eos
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOS
    # every name genai feeds is an input, and nothing else is (genai would not feed it)
    names_in = dec["inputs"]
    fed = [names_in["input_ids"], names_in["attention_mask"], names_in["position_ids"]]
    fed += [names_in[t].replace("%d", str(i)) for i in range(layers) for t in ("past_key_names", "past_value_names")]
    assert sorted(fed) == sorted(inputs)
    read = [dec["outputs"]["logits"]] + [dec["outputs"][t].replace("%d", str(i)) for i in range(layers)
                                         for t in ("present_key_names", "present_value_names")]
    assert sorted(read) == sorted(outputs)
    ids, mask, pos = (inputs[names_in[k]] for k in ("input_ids", "attention_mask", "position_ids"))
    for v in (ids, mask, pos):
        assert v.type.tensor_type.elem_type == onnx.TensorProto.INT64 and len(_dims(v)) == 2
    b, t = _dims(ids)
    assert _dims(pos) == [b, t] and _dims(mask)[0] == b and t in str(_dims(mask)[1])
    # the cache: [B, kv_heads, past, head_size] in, [B, kv_heads, past + new, head_size] out; genai's
    # unshared buffers (present fed back as the next past) are what a present of P + T columns needs
    assert cfg["search"]["past_present_share_buffer"] is False
    for i in range(layers):
        for past_t, present_t in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
            past = _dims(inputs[names_in[past_t].replace("%d", str(i))])
            present = _dims(outputs[dec["outputs"][present_t].replace("%d", str(i))])
            assert past[0] == b and past[1] == kv_heads and past[3] == dec["head_size"] and isinstance(past[2], str)
            assert present[:2] == past[:2] and present[3] == past[3] and present[2] != past[2]
    # logits of the last position only, a fixed 1 (genai then takes them as the last token's)
    assert _dims(outputs[dec["outputs"]["logits"]]) == [b, 1, hp["vocab"]]
    assert cfg["search"]["do_sample"] is False and m["type"] == "decoder"


def _generate(capsys, model, prompts, new, eos):
    rc, out, err = cli(capsys, "generate", *model, "--input", f"tokens={json.dumps(prompts)}", "--max-new-tokens",
                       new, "--stop-token", eos, "--format", "json", "-q")
    assert rc == 0, err
    return [row["tokens"] for row in json.loads(out)["outputs"]]


def _greedy_by_recomputation(m, prompt, n, eos):
    """Greedy decoding the slow way: the uncached model over the whole sequence at every step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(m.run(tokens=[seq])["logits"][0, -1])))
        if seq[-1] == eos:
            break
    return seq[len(prompt):]


@needs_genai
def test_genai_greedy_equals_tessera(folder, tokenizer_file, tmp_path, capsys):
    name, out = folder
    spec, hp, _ = SPECS[name]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id(EOS)
    text = "hello the quick fox"
    new = 24
    singles = [[5, 17, 42, 99, 3, 250], [7], tok.encode(text).ids]
    batch = [[11, 12, 13, 14], [200, 100, 50, 25]]  # genai 0.18 runs padded rows as given: equal lengths
    runs = [{"prompts": [p], "max_length": len(p) + new} for p in singles] + [{"prompts": batch, "max_length": 4 + new}]
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"runs": runs, "texts": [text]}))
    proc = subprocess.run([GENAI_PYTHON, str(HERE / "genai_runner.py"), str(out), str(request)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    # genai's tokenizer (onnxruntime-extensions) reads the folder's files as `tokenizers` does
    assert got["texts"] == [{"ids": tok.encode(text).ids, "decoded": text}]
    genai_tokens = [rows[0] for rows in got["runs"][:len(singles)]]
    uncached = tessera.load(MODELS / spec, **hp)
    want = [_greedy_by_recomputation(uncached, p, new, eos) for p in singles]
    assert all(len(w) == new or w[-1] == eos for w in want)
    assert genai_tokens == want
    assert [_generate(capsys, [out], [p], new, eos)[0] for p in singles] == want
    assert [_generate(capsys, [MODELS / spec, *_sets(hp)], [p], new, eos)[0] for p in singles] == want
    assert got["runs"][-1] == _generate(capsys, [out], batch, new, eos)
    assert got["runs"][-1] == [_greedy_by_recomputation(uncached, p, new, eos) for p in batch]


# ------------------------------------------------------------------ the folder and bad combinations
SMALL = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", f"vocab={VOCAB}", "--set", "ctx=32"]
GPT2 = str(MODELS / "gpt2.tsr")


def test_rewrite_replaces_the_folder_and_a_failure_keeps_it(tokenizer_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "folder"
    rc, _, err = cli(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", tokenizer_file, "-o", out)
    assert rc == 0, err
    (out / "stale.txt").write_text("from before")
    rc, _, err = cli(capsys, "compile", GPT2, *SMALL, "--seed", 1, "--genai", "--tokenizer", tokenizer_file, "-o", out)
    assert rc == 0, err
    assert not (out / "stale.txt").exists()  # the whole folder is the new one
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    from tessera.runtime.packaging import genai

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(genai.shutil, "copyfile", broken)
    err = cli_error(capsys, "compile", GPT2, *SMALL, "--seed", 2, "--genai", "--tokenizer", tokenizer_file, "-o", out)
    assert "No space left on device" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # no temporary folder left


@pytest.mark.parametrize("extra,message", [
    (["--cache", "buffer"], "drop --cache buffer"),
    (["--target", "cuda"], "--target cuda is not supported"),
    (["--no-fuse"], "neither --no-fuse nor --attention"),
])
def test_unsupported_combinations(tokenizer_file, tmp_path, capsys, extra, message):
    err = cli_error(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", tokenizer_file, *extra,
                    "-o", tmp_path / "f")
    assert message in err
    assert not (tmp_path / "f").exists()


def test_bad_models_tokenizers_and_targets(tokenizer_file, tmp_path, capsys):
    gen = ["--genai", "--tokenizer", tokenizer_file]
    err = cli_error(capsys, "compile", MODELS / "transformer.tsr", "--set", "layers=1", "--set", "d=32", "--set",
                    "heads=2", "--set", "d_ff=64", "--set", f"vocab={VOCAB}", *gen, "-o", tmp_path / "f")
    assert "encoder-decoders are not supported" in err
    err = cli_error(capsys, "compile", MODELS / "bert.tsr", "--set", "layers=1", "--set", "d=32", "--set", "heads=2",
                    "--set", "d_ff=64", "--set", f"vocab={VOCAB}", "--set", "ctx=32", *gen, "-o", tmp_path / "f")
    assert "decoder-only" in err
    assert "names the folder" in cli_error(capsys, "compile", GPT2, *SMALL, *gen, "-o", tmp_path / "f.onnx")
    assert "--genai needs --tokenizer" in cli_error(capsys, "compile", GPT2, *SMALL, "--genai", "-o", tmp_path / "f")
    assert "--tokenizer applies to --genai" in cli_error(capsys, "compile", GPT2, *SMALL, "--tokenizer",
                                                         tokenizer_file, "-o", tmp_path / "f.onnx")
    small_vocab = [a.replace(f"vocab={VOCAB}", "vocab=200") for a in SMALL]
    assert "past the model's vocabulary of 200" in cli_error(capsys, "compile", GPT2, *small_vocab, *gen,
                                                             "-o", tmp_path / "f")
    from tokenizers import Tokenizer, models

    words = tmp_path / "words" / "tokenizer.json"
    words.parent.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a")).save(str(words))
    assert "WordLevel tokenizer" in cli_error(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", words,
                                              "-o", tmp_path / "f")
    assert "not found" in cli_error(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", tmp_path / "none.json",
                                    "-o", tmp_path / "f")
    window = HERE / "specs" / "mistral_window.tsr"
    assert "give --context-length N" in cli_error(capsys, "compile", window, *WINDOW[:-2], *gen, "-o", tmp_path / "f")
    assert "past the model's context of 32" in cli_error(capsys, "compile", GPT2, *SMALL, *gen, "--context-length",
                                                         64, "-o", tmp_path / "f")
    assert "at least 1" in cli_error(capsys, "compile", GPT2, *SMALL, *gen, "--context-length", 0, "-o", tmp_path / "f")
    assert "--context-length applies to --genai" in cli_error(capsys, "compile", GPT2, *SMALL, "--context-length", 16,
                                                              "-o", tmp_path / "f.onnx")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert "is not replaced" in cli_error(capsys, "compile", GPT2, *SMALL, *gen, "-o", other)
    assert (other / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "f").exists()


def test_eos_from_tokenizer_config_beside_it(tokenizer_file, tmp_path, capsys):
    """A tokenizer_config.json beside the tokenizer names the special tokens; it is copied as it is."""
    from tokenizers import Tokenizer

    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    tok = Tokenizer.from_file(str(tokenizer_file))
    eos_name = tok.id_to_token(299)
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": eos_name}))
    rc, _, err = cli(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", src / "tokenizer.json",
                     "-o", tmp_path / "f")
    assert rc == 0, err
    cfg = json.loads((tmp_path / "f" / "genai_config.json").read_text())["model"]
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == 299
    assert cfg["bos_token_id"] == tok.token_to_id(EOS)  # the special token of the usual name
    assert (tmp_path / "f" / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()


WINDOW = ["--set", "vocab=300", "--set", "d=64", "--set", "layers=2", "--set", "heads=4", "--set", "kv_heads=2",
          "--set", "d_ff=96", "--set", "window=8", "--context-length", "512"]

MIXTRAL = ["--set", "vocab=300", "--set", "d=64", "--set", "layers=2", "--set", "heads=4", "--set", "kv_heads=2",
           "--set", "d_ff=96", "--set", "ctx=256"]


@needs_genai
@pytest.mark.parametrize("name,extra", [("llama", ["--dtype", "fp16"]), ("gpt2", ["--quantize", "int4"]),
                                        ("llama", "external"), ("window", WINDOW), ("mixtral", MIXTRAL)],
                         ids=["llama-fp16", "gpt2-int4", "llama-external", "sliding-window", "mixtral-sparse"])
def test_genai_variants_equal_tessera_generate(name, extra, tokenizer_file, tmp_path, capsys, monkeypatch):
    """fp16 (a half-precision cache, fp32 logits), int4 linears (MatMulNBits), weights written as
    external data (model.onnx.data, as for models past 2 GiB), a sliding window of 8 (genai keeps
    every column, Tessera's loop only the window's; the mask makes them the same attention), and
    Mixtral's sparse experts (top-2 of 8): genai's tokens equal `tessera generate FOLDER`'s on the
    same folder."""
    if name == "window":  # no rotary context in this spec: --context-length gives genai its length
        spec, hp = HERE / "specs" / "mistral_window.tsr", {}
    elif name == "mixtral":
        spec, hp = MODELS / "mixtral.tsr", {}
    else:
        spec, hp, _ = SPECS[name]
        spec = MODELS / spec
    if extra == "external":
        from tessera.compiler.backends.onnx import export

        monkeypatch.setattr(export, "EXTERNAL_DATA_THRESHOLD", 0)
        extra = []
    out = tmp_path / "folder"
    rc, _, err = cli(capsys, "compile", spec, *_sets(hp), *extra, "--genai", "--tokenizer", tokenizer_file,
                     "-o", out)
    assert rc == 0, err
    assert (out / "model.onnx.data").exists() == (not extra)
    eos = json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"]
    prompts, new = [[5, 17, 42, 99, 3, 250], [7]], 20
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"runs": [{"prompts": [p], "max_length": len(p) + new} for p in prompts]}))
    proc = subprocess.run([GENAI_PYTHON, str(HERE / "genai_runner.py"), str(out), str(request)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [rows[0] for rows in json.loads(proc.stdout)["runs"]]
    assert got == [_generate(capsys, [out], [p], new, eos)[0] for p in prompts]


def test_python_api_writes_the_same_folder(tokenizer_file, tmp_path, capsys):
    """tessera.load(...).compile(out, genai=True, tokenizer=...) writes what the command writes."""
    rc, _, err = cli(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", tokenizer_file, "-o", tmp_path / "cli")
    assert rc == 0, err
    m = tessera.load(GPT2, layers=1, d=32, heads=2, vocab=VOCAB, ctx=32)
    files = m.compile(tmp_path / "api", genai=True, tokenizer=tokenizer_file)
    assert [f.name for f in files] == sorted(p.name for p in (tmp_path / "cli").iterdir())
    for f in files:
        assert f.read_bytes() == (tmp_path / "cli" / f.name).read_bytes(), f.name
    from tessera.runtime.pipeline import UsageError

    with pytest.raises(UsageError, match="needs tokenizer"):
        m.compile(tmp_path / "x", genai=True)
    with pytest.raises(UsageError, match="apply to genai=True"):
        m.compile(tmp_path / "x.onnx", tokenizer=tokenizer_file)


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"model": {"type": "BPE", "vocab": {"a": "x"}}}',
                                     '{"model": {"type": "BPE", "vocab": {}}, "added_tokens": [{"id": 1}]}'])
def test_malformed_tokenizer_is_a_clear_error(content, tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(content)
    err = cli_error(capsys, "compile", GPT2, *SMALL, "--genai", "--tokenizer", bad, "-o", tmp_path / "f")
    assert "is not a Hugging Face tokenizer.json" in err
