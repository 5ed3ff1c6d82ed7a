"""spec/ast_cache.py: a parsed spec file comes back from the cache equal to what the parser gives
(the parser's own output is the reference), a hit needs no lark, and a bad cache never breaks a load.

Each test points TESSERA_CACHE_DIR at its own temporary folder."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.spec import ast_cache, load_program
from tessera.spec.diagnostics import SpecError
from tessera.spec.parser import parse_text

SPEC = Path(__file__).resolve().parents[2] / "models" / "gpt2.tsr"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ast"


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + ast_cache.SUFFIX))


def test_a_miss_writes_an_entry_and_a_hit_equals_the_parser(folder):
    text = SPEC.read_text()
    want = parse_text(text, "gpt2.tsr")
    assert ast_cache.parse(text, "gpt2.tsr") == want  # miss: parsed and written
    [entry] = _entries(folder)
    assert entry.name == ast_cache.key(text, "gpt2.tsr") + ast_cache.SUFFIX
    assert pickle.loads(entry.read_bytes()) == want
    assert ast_cache.parse(text, "gpt2.tsr") == want  # hit
    assert len(_entries(folder)) == 1


def test_the_key_follows_the_text_and_the_file_name(folder):
    text = SPEC.read_text()
    keys = {ast_cache.key(text, "a.tsr"), ast_cache.key(text, "b.tsr"), ast_cache.key(text + "\n", "a.tsr")}
    assert len(keys) == 3  # positions carry the file name: another name is another entry


def test_a_corrupt_or_foreign_entry_is_ignored_and_rewritten(folder):
    text = SPEC.read_text()
    want = parse_text(text, "gpt2.tsr")
    ast_cache.parse(text, "gpt2.tsr")
    [entry] = _entries(folder)
    for junk in (b"not a pickle", pickle.dumps({"a": 1}), entry.read_bytes()[:40]):
        entry.write_bytes(junk)
        assert ast_cache.parse(text, "gpt2.tsr") == want
        assert pickle.loads(entry.read_bytes()) == want  # written afresh


def test_errors_are_not_cached_and_keep_their_positions(folder):
    bad = "model M() {\n  in x: f32[B]\n  y = x +\n}\n"
    for _ in range(2):
        with pytest.raises(SpecError) as e:
            ast_cache.parse(bad, "bad.tsr")
        assert e.value.pos.file == "bad.tsr" and e.value.pos.line == 4
    assert _entries(folder) == []


def test_the_least_recently_used_entries_go_past_the_limit(folder):
    texts = [f"model M{i}() {{\n  in x: f32[B]\n  out y: f32[B]\n  y = x\n}}\n" for i in range(5)]
    for i, t in enumerate(texts):
        ast_cache.parse(t, "m.tsr")
        os.utime(folder / (ast_cache.key(t, "m.tsr") + ast_cache.SUFFIX), (1000 + i, 1000 + i))
    os.utime(folder / (ast_cache.key(texts[0], "m.tsr") + ast_cache.SUFFIX), (2000, 2000))  # used last
    ast_cache._prune(str(folder), limit=3)
    kept = {p.name for p in _entries(folder)}
    assert kept == {ast_cache.key(t, "m.tsr") + ast_cache.SUFFIX for t in (texts[0], texts[3], texts[4])}


def test_caching_off_or_an_unusable_folder_still_loads(tmp_path, monkeypatch):
    want = load_program(SPEC)
    blocker = tmp_path / "file"
    blocker.write_text("")
    for setting in ("off", str(blocker / "under-a-file")):
        monkeypatch.setenv("TESSERA_CACHE_DIR", setting)
        got = load_program(SPEC)
        assert got.main_model == want.main_model and set(got.blocks) == set(want.blocks)
    assert not (tmp_path / "off").exists()


def test_a_hit_does_not_import_lark(tmp_path):
    """Loading a spec twice in fresh processes: the second never imports lark."""
    env = {**os.environ, "TESSERA_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from tessera.spec import load_program; "
            f"p = load_program({str(SPEC)!r}); print(p.main_model.name, 'lark' in sys.modules)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["GPT2", "True"]
    assert second.stdout.split() == ["GPT2", "False"]
