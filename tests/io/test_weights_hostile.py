"""Bad weights and mapping files: each gives an error that names the file and the problem, never a
traceback, a hang or a silent cast."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import cli, cli_error

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


def _good():
    rng = np.random.default_rng(0)
    return {"proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
            "proj.bias": rng.standard_normal(4).astype(np.float32)}


def _compile(capsys, spec, weights, tmp_path):
    return cli(capsys, "compile", spec, "--weights", weights, "-o", tmp_path / "out.onnx")


def test_good_weights_compile(capsys, spec, tmp_path):
    save_file(_good(), str(tmp_path / "w.safetensors"))
    rc, _, err = _compile(capsys, spec, tmp_path / "w.safetensors", tmp_path)
    assert rc == 0, err


def test_fifo_as_weights_is_refused_without_opening(capsys, spec, tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    err = cli_error(capsys, "compile", spec, "--weights", tmp_path / "w.safetensors", "-o", tmp_path / "o.onnx")
    assert "is not a regular file" in err


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.bool_])
def test_integer_or_bool_tensor_for_a_float_parameter_is_an_error(capsys, spec, tmp_path, dtype):
    w = _good()
    w["proj.weight"] = np.ones((4, 4), dtype=dtype)
    save_file(w, str(tmp_path / "w.safetensors"))
    err = cli_error(capsys, "compile", spec, "--weights", tmp_path / "w.safetensors", "-o", tmp_path / "o.onnx")
    assert f"proj.weight is {np.dtype(dtype)}" in err


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_infinite_weights_are_an_error(capsys, spec, tmp_path, bad):
    w = _good()
    w["proj.bias"][2] = bad
    save_file(w, str(tmp_path / "w.safetensors"))
    err = cli_error(capsys, "compile", spec, "--weights", tmp_path / "w.safetensors", "-o", tmp_path / "o.onnx")
    assert "NaN or infinity: proj.bias" in err


def test_f64_weights_are_cast_with_a_note(capsys, spec, tmp_path):
    w = {k: v.astype(np.float64) for k, v in _good().items()}
    save_file(w, str(tmp_path / "w.safetensors"))
    rc, _, err = _compile(capsys, spec, tmp_path / "w.safetensors", tmp_path)
    assert rc == 0, err
    assert "note: 2 f64 tensor(s)" in err


def test_a_name_in_two_shards_is_an_error(capsys, spec, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file(_good(), str(shards / "a.safetensors"))
    save_file({"proj.bias": np.zeros(4, np.float32)}, str(shards / "b.safetensors"))
    err = cli_error(capsys, "compile", spec, "--weights", shards, "-o", tmp_path / "o.onnx")
    assert "more than one shard" in err and "proj.bias (in a.safetensors and b.safetensors)" in err


@pytest.mark.parametrize("text, expected", [
    (b"\xff\xfe[names]\n", "not UTF-8 text"),
    (b"names = 3\n", "'names' must be a table"),
    (b"ignore = 'x'\n", "'ignore' must be a list"),
    (b"[names]\n\"w\" = 3\n", "rule for 'w' must be a string or a table"),
    (b"[names]\n\"w\" = { split = \"proj.weight\" }\n", "'split' must be a list"),
    (b"[names]\n\"w\" = { split = [\"a\", \"b\"], axis = \"x\" }\n", "'axis' must be a non-negative integer"),
    (b"[names]\n\"w\" = { to = \"proj.weight\", transpose = \"yes\" }\n", "'transpose' must be true or false"),
    (b"[names]\n\"h.{i}.{i}.w\" = \"proj.weight\"\n", "a placeholder appears twice"),
    (b"[names]\n\"w\" = { to = \"proj.weight\", colour = 1 }\n", "unknown key(s) ['colour']"),
])
def test_malformed_mapping_file_names_the_key(capsys, spec, tmp_path, text, expected):
    (tmp_path / "tiny.hf.toml").write_bytes(text)
    save_file(_good(), str(tmp_path / "w.safetensors"))
    err = cli_error(capsys, "compile", spec, "--weights", tmp_path / "w.safetensors", "-o", tmp_path / "o.onnx")
    assert expected in err and "tiny.hf.toml" in err
