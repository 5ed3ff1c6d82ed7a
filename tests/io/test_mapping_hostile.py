"""issue 25, item 2: hostile mapping files (.hf.toml) and checkpoint folders. Name patterns with a
stray brace, ``{0}`` or ``{I}`` reached str.format (ValueError, IndexError, KeyError); a split axis
past the tensor's rank was an IndexError; deep TOML a RecursionError; a pattern with several '*'
hung in regex backtracking; a dangling shard symlink was a FileNotFoundError traceback."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import cli_error

SPEC = """model Tiny(d = 4) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = linear(x, d, name="proj")
}
"""


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "tiny.tsr"
    path.write_text(SPEC)
    return path


def _weights(tmp_path, names=("h.0.w", "h.0.b")):
    rng = np.random.default_rng(0)
    save_file({names[0]: rng.standard_normal((4, 4)).astype(np.float32),
               names[1]: rng.standard_normal(4).astype(np.float32)}, str(tmp_path / "w.safetensors"))
    return tmp_path / "w.safetensors"


@contextmanager
def _within(seconds: int):
    """A hang fails the test instead of stopping the suite."""
    def late(*_):
        raise TimeoutError(f"took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


BAD = {
    "stray brace in target": ('"h.{i}.w" = "proj.weight{"\n', "Single '{'"),
    "positional field in target": ('"h.{i}.w" = "proj.weight{0}"\n', "placeholder {0}"),
    "capital field in target": ('"h.{i}.w" = "proj.weight{I}"\n', "placeholder {I}"),
    "conversion in target": ('"h.{i}.w" = "proj.weight{i!r}"\n', "placeholder {i!r}"),
    "stray brace in source": ('"h.{i.w" = "proj.weight"\n', "stray brace"),
    "lone brace (found by tests/io/test_fuzz_inputs.py)": ('"{" = "proj.weight"\n', "stray brace"),
    "capital field in source": ('"h.{I}.w" = "proj.weight"\n', "stray brace or a placeholder"),
    "adjacent placeholders": ('"h.{i}{j}.w" = "proj.weight"\n', "next to another placeholder"),
    "star beside placeholder": ('"h.*{i}" = "proj.weight"\n', "next to '*'"),
    "split past rank": ('"h.{i}.b" = { split = ["proj.weight", "proj.bias"], axis = 3 }\n', "past its rank"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_mapping_rule(capsys, spec, tmp_path, case):
    rule, says = BAD[case]
    (tmp_path / "tiny.hf.toml").write_text(f"[names]\n{rule}")
    with _within(20):
        err = cli_error(capsys, "compile", spec, "--weights", _weights(tmp_path), "-o", tmp_path / "o.onnx")
    assert says in err, err


def test_deep_toml_is_a_clean_error(capsys, spec, tmp_path):
    (tmp_path / "tiny.hf.toml").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    err = cli_error(capsys, "compile", spec, "--weights", _weights(tmp_path), "-o", tmp_path / "o.onnx")
    assert "nested too deep" in err and "tiny.hf.toml" in err


def test_backtracking_pattern_on_a_long_name_does_not_hang(capsys, spec, tmp_path):
    """'*a*a*a*a*b' against 'aaaa...' took exponential time; one '*' is allowed, and a name of
    100,000 characters is not matched against patterns at all."""
    (tmp_path / "tiny.hf.toml").write_text('[names]\n"*a.weight" = "proj.weight"\n"h.{i}.b" = "proj.bias"\n')
    weights = _weights(tmp_path, names=("a" * 100_000, "h.0.b"))
    with _within(20):
        err = cli_error(capsys, "compile", spec, "--weights", weights, "-o", tmp_path / "o.onnx")
    assert "proj.weight" in err  # missing: the long name matched nothing


def test_good_mapping_still_maps(capsys, spec, tmp_path):
    from conftest import cli

    (tmp_path / "tiny.hf.toml").write_text('[names]\n"h.{i}.w" = "proj.weight"\n"*.{i}.b" = "proj.bias"\n')
    rc, _, err = cli(capsys, "compile", spec, "--weights", _weights(tmp_path), "-o", tmp_path / "o.onnx")
    assert rc == 0, err


def test_dangling_shard_symlink(capsys, spec, tmp_path):
    shards = tmp_path / "ckpt"
    shards.mkdir()
    save_file({"proj.weight": np.zeros((4, 4), np.float32)}, str(shards / "a.safetensors"))
    os.symlink(tmp_path / "gone.safetensors", shards / "b.safetensors")
    err = cli_error(capsys, "compile", spec, "--weights", shards, "-o", tmp_path / "o.onnx")
    assert "weights shard not found" in err and "b.safetensors" in err


def test_deep_config_json_is_a_clean_error(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((50, 32), np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"n_layer": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = cli_error(capsys, "compile", "llama", "--weights", folder, "-o", tmp_path / "o.onnx")
    assert "nested too deep" in err and "config.json" in err
