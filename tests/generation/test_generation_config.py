"""Generation stops where the checkpoint says, and uses its generation_config.json defaults.

The reference is transformers' own ``generate`` on the same folder (saved by ``save_pretrained``):
with ``eos_token_id`` chosen so greedy decoding hits it after a few tokens, transformers stops
there; ``tessera generate`` (the command line and the API), the serving engine's EOS ids and the
``--genai`` folder must stop at the same token. ``--ignore-eos`` gives transformers' tokens with
EOS off.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tessera  # noqa: E402
from tessera.runtime.options import GenerateOptions  # noqa: E402
from tessera.runtime.io import generation_config  # noqa: E402
from tessera.runtime.errors import UsageError  # noqa: E402

from conftest import cli, cli_error  # noqa: E402

SETS = ["layers=2", "d=32", "heads=4", "vocab=300", "ctx=64"]
PROMPT = [5, 17, 42, 99, 3]
NEW = 12


def _hf_greedy(model, prompt, new, **kw):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny GPT-2 folder whose eos_token_id is greedy decoding's 3rd new token (so it stops early)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    free = _hf_greedy(model, PROMPT, NEW, eos_token_id=None, min_new_tokens=NEW)
    eos = free[2]
    stop_at = free.index(eos) + 1
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    folder = tmp_path_factory.mktemp("gpt2eos")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model, eos, free, stop_at


def _tessera(capsys, folder, *extra):
    args = ["generate", "gpt2", *sum((["--set", s] for s in SETS), []), "--weights", str(folder),
            "--input", f"tokens={json.dumps([PROMPT])}", "--format", "json", "-q", *extra]
    rc, out, err = cli(capsys, *args)
    assert rc == 0, err
    return json.loads(out)["outputs"][0]["tokens"], err


def test_generate_stops_at_the_checkpoint_eos_as_transformers_does(ckpt, capsys):
    folder, model, eos, free, stop_at = ckpt
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()  # reads generation_config.json
    want = _hf_greedy(reloaded, PROMPT, NEW)
    assert stop_at < NEW and want[:stop_at] == free[:stop_at] and want[stop_at - 1] == eos
    # transformers pads the batch after EOS; the tokens it generated end at EOS
    want = want[:stop_at]
    ours, _ = _tessera(capsys, folder, "--max-new-tokens", str(NEW))
    assert ours == want
    # the API: the same stop, and ignore_eos=True the whole run
    m = tessera.load("gpt2", weights=folder, **{k: int(v) for k, v in (s.split("=") for s in SETS)})
    assert m.generate(PROMPT, max_new_tokens=NEW) == want
    assert m.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True) == free


def test_ignore_eos_generates_every_token(ckpt, capsys):
    folder, model, eos, free, stop_at = ckpt
    ours, _ = _tessera(capsys, folder, "--max-new-tokens", str(NEW), "--ignore-eos")
    assert ours == free and len(ours) == NEW


def test_generation_config_defaults_apply_and_explain_names_their_source(ckpt, tmp_path, capsys):
    folder, model, eos, free, stop_at = ckpt
    mine = tmp_path / "ckpt"
    mine.mkdir()
    for f in folder.iterdir():
        (mine / f.name).write_bytes(f.read_bytes())
    gc = json.loads((mine / "generation_config.json").read_text())
    gc.update(repetition_penalty=1.5, max_new_tokens=7, eos_token_id=[299, 298])  # ids greedy does not reach
    (mine / "generation_config.json").write_text(json.dumps(gc))
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(mine).eval()
    with torch.no_grad():
        out = reloaded.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                dtype=torch.long), pad_token_id=0)
    want = out[0, len(PROMPT):].tolist()
    assert len(want) == 7 and want != free[:7]  # the penalty changed the tokens, and 7 came from the file
    ours, err = _tessera(capsys, mine, "--explain")
    assert ours == want
    where = str(mine / "generation_config.json")
    assert f"repetition_penalty = 1.5: {where}" in err
    assert f"max_new_tokens = 7: {where}" in err
    assert "temperature = 0.0: Tessera's default" in err
    assert f"end of sequence: [299, 298] from {where}" in err
    # a value given wins over the file's, and says so
    ours, err = _tessera(capsys, mine, "--explain", "--repetition-penalty", "1.0", "--max-new-tokens", "5")
    assert ours == free[:5] and "repetition_penalty = 1.0: given (--repetition-penalty)" in err


def test_eos_list_and_config_fallback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    d = generation_config.read([tmp_path])
    assert d.eos == [7, 8] and d.eos_source.endswith("config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "temperature": 0.7}))
    d = generation_config.read([tmp_path])
    assert d.eos == [3] and "temperature" not in d.values  # no do_sample: transformers decodes greedily
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 0.9}))
    d = generation_config.read([tmp_path])
    assert d.values == {"temperature": 1.0, "top_k": 50, "top_p": 0.9}  # transformers' sampling defaults


@pytest.mark.parametrize("content,words", [("{", "not valid JSON"), ('{"eos_token_id": "x"}', "eos_token_id must be"),
                                           ('{"max_new_tokens": 1.5}', "max_new_tokens must be an integer")])
def test_bad_generation_config_is_a_clear_error(tmp_path, capsys, content, words):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(UsageError, match=words):
        generation_config.read([tmp_path])
    err = cli_error(capsys, "generate", "gpt2", *sum((["--set", s] for s in SETS), []), "--input",
                    "tokens=[[1, 2]]", "--tokenizer", str(tmp_path / "tokenizer.json"))
    assert words in err


def test_options_fill_from_defaults_only_what_is_not_given():
    d = generation_config.GenerationDefaults(eos=[4], eos_source="x", values={"top_k": 5, "max_new_tokens": 9},
                                             sources={"top_k": "f", "max_new_tokens": "f"})
    o, lines = GenerateOptions(max_new_tokens=3, stop_tokens=[1]).with_defaults(d)
    assert (o.max_new_tokens, o.top_k, o.temperature, o.stop_tokens, o.eos_tokens) == (3, 5, 0.0, [1], [4])
    o, lines = GenerateOptions(ignore_eos=True).with_defaults(d)
    assert o.eos_tokens == [] and o.max_new_tokens == 9


def test_an_eos_past_a_small_models_vocabulary_is_no_error(ckpt, tmp_path, capsys):
    """A tokenizer folder's EOS (GPT-2's 50256) with a 300-token model: never generated, not refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder, model, eos, free, stop_at = ckpt
    tok = Tokenizer(models.WordPiece({f"w{i}": i for i in range(300)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 50256}))
    ours, err = _tessera(capsys, folder, "--max-new-tokens", str(NEW), "--tokenizer", str(tmp_path), "--explain")
    # the weights' folder comes first: its EOS stops generation; the tokenizer folder's is not read
    assert ours == free[:stop_at] and f"from {folder / 'generation_config.json'}" in err
    (folder / "generation_config.json").rename(tmp_path / "moved.json")
    (folder / "config.json").rename(tmp_path / "moved_config.json")
    try:
        rc, out, err = cli(capsys, "generate", "gpt2", *sum((["--set", s] for s in SETS), []), "--weights",
                           str(folder / "model.safetensors"), "--tokenizer", str(tmp_path), "--input",
                           f"tokens={json.dumps([PROMPT])}", "--max-new-tokens", str(NEW), "--format", "json",
                           "--explain", "-q")
    finally:
        (tmp_path / "moved.json").rename(folder / "generation_config.json")
        (tmp_path / "moved_config.json").rename(folder / "config.json")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["tokens"] == free and "[50256] are past the model's vocabulary" in err


def test_serving_and_genai_read_the_same_eos(ckpt, tmp_path, capsys):
    from tessera.runtime.serving import model as serving_model

    folder, model, eos, free, stop_at = ckpt
    assert serving_model.eos_ids(None, None, "gpt2", folder) == [eos]

    # compile --genai writes the same eos into genai_config.json, and `tessera generate` on that folder stops there
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({f"w{i}": i for i in range(300)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    out = tmp_path / "genai"
    sets = {k: int(v) for k, v in (s.split("=") for s in SETS)}
    tessera.load("gpt2", weights=folder, **sets).compile(out, genai=True, tokenizer=tok_dir / "tokenizer.json")
    assert json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"] == eos
    rc, printed, err = cli(capsys, "generate", str(out), "--input", f"tokens={json.dumps([PROMPT])}",
                           "--max-new-tokens", str(NEW), "--format", "json", "-q")
    assert rc == 0, err
    assert json.loads(printed)["outputs"][0]["tokens"] == free[:stop_at]
