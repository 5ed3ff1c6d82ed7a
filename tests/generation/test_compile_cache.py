"""The compile cache (runtime/compile_cache.py): a model compiled once is loaded, not compiled, the next time.

A tiny Llama checkpoint folder made by transformers is the model; transformers' greedy tokens and
logits are the reference every load (compiled or from the cache) must give. A second load must hit
(and compile nothing: the compile is made to fail), a changed weights file, option, seed, --set or
spec text must miss, and a damaged entry (truncated, changed bytes, no manifest, garbage manifest) must
be noticed, removed with a note and compiled again. The suite runs with the cache off (conftest.py);
these tests name a folder of their own.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli, cli_error, hf_greedy, tiny_hf  # noqa: E402

from tessera.runtime import compile_cache  # noqa: E402
from tessera.runtime.generation import cached as gen  # noqa: E402

PROMPT = [5, 17, 42, 99, 3]
NEW = 8


@pytest.fixture
def folder(tmp_path):
    """A Llama checkpoint folder (2 layers, grouped-query attention) and its transformers model."""
    hf = tiny_hf("llama", vocab=128)
    path = tmp_path / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _generate(capsys, model, cache, *more):
    rc, out, err = cli(capsys, "generate", model, "--input", f"tokens=[{PROMPT}]", "--max-new-tokens", NEW,
                       "--logprobs", 3, "--format", "json", "--explain", "--compile-cache", cache, *more)
    assert rc == 0, err
    row = json.loads(out)["outputs"][0]
    return row["tokens"], [t["logprob"] for t in row["logprobs"]], err


def _entries(cache):
    return [e for e in compile_cache.entries(cache) if e.manifest is not None]


def _no_compile(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("compiled although the compile cache holds the model")

    monkeypatch.setattr(gen, "compile_cached", refuse)


def test_a_second_generate_hits_compiles_nothing_and_gives_the_same_tokens_and_logprobs(folder, tmp_path, capsys,
                                                                                      monkeypatch):
    path, hf = folder
    cache = tmp_path / "cc"
    want = hf_greedy(hf, [PROMPT], NEW)[0]
    tokens, logprobs, err = _generate(capsys, path, cache)
    assert tokens == want
    assert "compile cache: miss, compiled and stored in" in err
    assert "weights: 1 file(s): " + str((path / "model.safetensors").resolve()) in err
    assert len(_entries(cache)) == 1
    _no_compile(monkeypatch)
    tokens2, logprobs2, err2 = _generate(capsys, path, cache)
    assert "compile cache: hit" in err2 and "miss" not in err2
    assert tokens2 == want and logprobs2 == logprobs  # the very same model: equal, not close
    # transformers' log-probabilities of the chosen tokens, the independent reference for both
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + want])).logits[0, len(PROMPT) - 1:-1].double()
    ref = torch.log_softmax(logits, -1)[torch.arange(NEW), torch.tensor(want)].numpy()
    np.testing.assert_allclose(logprobs2, ref, atol=2e-4)


def test_the_progress_line_says_hit_or_miss(folder, tmp_path, capsys):
    path, _ = folder
    args = ["generate", path, "--input", f"tokens=[{PROMPT}]", "--max-new-tokens", 2, "--compile-cache",
            tmp_path / "cc"]
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and "(compile cache miss)" in err and "storing in the compile cache" in err, err
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and "compile cache hit" in err and "passes and ONNX" not in err, err


def test_a_changed_weights_file_misses_and_gives_the_new_weights_tokens(folder, tmp_path, capsys):
    path, hf = folder
    cache = tmp_path / "cc"
    _generate(capsys, path, cache)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(-1.0)
    hf.save_pretrained(path, safe_serialization=True)
    tokens, _, err = _generate(capsys, path, cache)
    assert "compile cache: miss" in err
    assert tokens == hf_greedy(hf, [PROMPT], NEW)[0]
    assert len(_entries(cache)) == 2
    # the same bytes written again: a new modification time, a miss (the key reads path, size, mtime)
    st = (path / "model.safetensors").stat()
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    assert "compile cache: miss" in _generate(capsys, path, cache)[2]


@pytest.mark.parametrize("change", [["--quantize", "int8"], ["--seed", "1"], ["--set", "layers=1"], "spec",
                                    ["--provider", "cpu", "--cache", "concat"]])
def test_an_option_the_seed_a_set_or_the_spec_text_misses_and_the_same_again_hits(change, tmp_path, capsys):
    cache = tmp_path / "cc"
    spec = tmp_path / "gpt2.tsr"
    text = (compile_cache.Path(compile_cache.__file__).parents[1] / "models" / "gpt2.tsr").read_text()
    spec.write_text(text)
    base = [spec, "--set", "vocab=128", "--set", "d=32", "--set", "heads=2", "--set", "ctx=64"]
    first, _, err = _generate(capsys, base[0], cache, *base[1:], "--set", "layers=2")
    assert "miss" in err
    if change == "spec":  # the spec's text: another epsilon, written where the spec gives its default
        assert "eps = 1e-5" in text
        spec.write_text(text.replace("eps = 1e-5", "eps = 1e-2", 1))
        more = ["--set", "layers=2"]
    else:
        more = change + (["--set", "layers=2"] if "layers=1" not in change else [])
    _, _, err = _generate(capsys, base[0], cache, *base[1:], *more)
    assert "compile cache: miss" in err, err
    assert len(_entries(cache)) == 2
    _, _, err = _generate(capsys, base[0], cache, *base[1:], *more)
    assert "compile cache: hit" in err


@pytest.mark.parametrize("damage", ["truncate", "flip", "no manifest", "garbage manifest", "other key"])
def test_a_damaged_entry_is_noticed_removed_and_compiled_again(damage, folder, tmp_path, capsys):
    path, hf = folder
    cache = tmp_path / "cc"
    want, logprobs, _ = _generate(capsys, path, cache)
    (entry,) = _entries(cache)
    data = entry.path / "model.onnx.data"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "no manifest":
        (entry.path / "manifest.json").unlink()
    elif damage == "garbage manifest":
        (entry.path / "manifest.json").write_bytes(b"\xff{not json")
    else:
        m = json.loads((entry.path / "manifest.json").read_text())
        (entry.path / "manifest.json").write_text(json.dumps({**m, "key": "0" * 64}))
    tokens, logprobs2, err = _generate(capsys, path, cache)
    assert "Traceback" not in err
    assert f"note: compile cache entry {entry.path} " in err and "removed, compiling again" in err, err
    assert "compile cache: miss, compiled and stored" in err
    assert tokens == want == hf_greedy(hf, [PROMPT], NEW)[0] and logprobs2 == logprobs
    assert "compile cache: hit" in _generate(capsys, path, cache)[2]  # stored whole again


def test_run_and_perplexity_hit_with_transformers_logits(folder, tmp_path, capsys, monkeypatch):
    path, hf = folder
    cache = tmp_path / "cc"
    tokens = [[3, 9, 27, 81, 4, 12, 36, 108, 68, 76, 100, 44]]
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    got = []
    for _ in range(2):
        rc, _, err = cli(capsys, "run", path, "--input", f"tokens={tokens}", "--save", tmp_path / "out",
                         "--compile-cache", cache, "--explain")
        assert rc == 0, err
        got.append((np.load(tmp_path / "out" / "logits.npy"), err))
    assert "compile cache: miss" in got[0][1] and "compile cache: hit" in got[1][1]
    np.testing.assert_allclose(got[0][0], want, atol=1e-4)
    np.testing.assert_array_equal(got[1][0], got[0][0])
    # perplexity compiles as run does: the same entry, a hit, the same figure as without the cache
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 37) % 128}" for i in range(200)))
    runs = []
    for flags in (["--no-compile-cache"], ["--compile-cache", cache]):
        rc, out, err = cli(capsys, "perplexity", path, "--text", text, "--tokenizer", tmp_path / "tokenizer.json",
                           "--context", 16, "--format", "json", "-q", *flags)
        assert rc == 0, err
        runs.append(json.loads(out))
    assert runs[0]["compile_cache"] == "off" and runs[1]["compile_cache"] == "hit"
    assert runs[1]["perplexity"] == runs[0]["perplexity"]


def test_the_serving_engine_and_batch_hit(folder, tmp_path, capsys, monkeypatch):
    path, hf = folder
    cache = tmp_path / "cc"
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt": PROMPT, "max_tokens": NEW}) + "\n")
    want = hf_greedy(hf, [PROMPT], NEW)[0]
    for n in range(2):
        if n:
            _no_compile(monkeypatch)
        rc, _, err = cli(capsys, "batch", path, "-i", rows, "-o", tmp_path / f"out{n}.jsonl", "--compile-cache", cache)
        assert rc == 0, err
        (line,) = (tmp_path / f"out{n}.jsonl").read_text().splitlines()
        assert json.loads(line)["tokens"] == want, line
    assert len(_entries(cache)) == 1


def test_where_the_cache_is(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "home"))
    assert compile_cache.folder_for() == (tmp_path / "home" / "compiled", "Tessera's cache folder")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.folder_for()[0] == tmp_path / "env"
    assert compile_cache.folder_for(tmp_path / "flag")[0] == tmp_path / "flag"
    assert compile_cache.folder_for(tmp_path / "flag", disabled=True)[0] is None
    for off in ("off", "", "NONE"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.folder_for()[0] is None
    (tmp_path / "a_file").write_text("x")
    err = cli_error(capsys, "generate", "gpt2", "--set", "layers=1", "--input", "tokens=[[1]]",
                    "--compile-cache", tmp_path / "a_file")
    assert "compile cache folder" in err and "cannot be used" in err
    err = cli_error(capsys, "generate", "gpt2", "--input", "tokens=[[1]]", "--compile-cache", tmp_path,
                    "--no-compile-cache")
    assert "contradict" in err


def test_the_size_bound_evicts_the_least_recently_used(tmp_path, monkeypatch):
    cache = tmp_path / "cc"
    for i, name in enumerate(["old", "mid", "new"]):
        d = cache / name
        d.mkdir(parents=True)
        (d / "model.onnx").write_bytes(b"x" * 1000)
        (d / "manifest.json").write_text("{}")
        os.utime(d / "manifest.json", (1000 + i, 1000 + i))
    assert [e.path.name for e in compile_cache.entries(cache)] == ["new", "mid", "old"]
    removed = compile_cache.evict(cache, keep=cache / "old", limit=2100)
    assert [p.name for p in removed] == ["mid"]  # old is kept (just stored); mid is the least recently used else
    assert sorted(p.name for p in cache.iterdir()) == ["new", "old"]


def test_the_cache_command_lists_and_clears(folder, tmp_path, capsys):
    path, _ = folder
    cache = tmp_path / "cc"
    _generate(capsys, path, cache)
    rc, out, _ = cli(capsys, "cache", "list", "--compile-cache", cache, "--format", "json")
    got = json.loads(out)
    (entry,) = got["entries"]
    assert rc == 0 and entry["model"] == "Llama" and entry["what"] == "cached decoder" and entry["complete"]
    assert entry["bytes"] == sum(f.stat().st_size for f in compile_cache.Path(entry["entry"]).iterdir())
    rc, out, _ = cli(capsys, "cache", "clear", "--compile-cache", cache)
    assert rc == 0 and out.startswith("removed 1 entry")
    assert compile_cache.entries(cache) == []
    assert "miss" in _generate(capsys, path, cache)[2]
