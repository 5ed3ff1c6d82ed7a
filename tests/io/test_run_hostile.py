"""``tessera run`` on files that are not what they claim: each is a clean error (status 2, no
traceback) that says what is wrong with which file or input."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from conftest import cli, cli_error

X = "x=[[1,0],[0,1],[1,1]]"


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    from tessera.runtime.cli import main

    out = tmp_path_factory.mktemp("m") / "we.onnx"
    assert main(["compile", "worked_example", "-o", str(out)]) == 0
    return out


def _write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, expected", [
    (lambda t, g: _write(t, "e.onnx", b""), "is empty, not an ONNX model"),
    (lambda t, g: _write(t, "t.onnx", b"hello, I am text\n"), "is not an ONNX model"),
    (lambda t, g: _write(t, "r.onnx", np.random.default_rng(0).bytes(5000)), "is not an ONNX model"),
    (lambda t, g: _write(t, "c.onnx", g.read_bytes()[:300]), "is not an ONNX model"),
    (lambda t, g: (t / "d.onnx").mkdir() or t / "d.onnx", "is a folder, not an ONNX model"),
])
def test_unreadable_model_files(capsys, tmp_path, good_model, make, expected):
    assert expected in cli_error(capsys, "run", make(tmp_path, good_model), "--input", X)


def test_fifo_model_is_refused_without_reading(capsys, tmp_path):
    os.mkfifo(tmp_path / "f.onnx")
    assert "not a regular file" in cli_error(capsys, "run", tmp_path / "f.onnx", "--input", X)


def test_malformed_limits_metadata(capsys, tmp_path, good_model):
    m = onnx.load(str(good_model))
    entry = m.metadata_props.add()
    entry.key, entry.value = "tessera.input_limits", "{not json"
    onnx.save(m, str(tmp_path / "m.onnx"))
    assert "metadata is malformed" in cli_error(capsys, "run", tmp_path / "m.onnx", "--input", X)


def test_model_onnxruntime_refuses(capsys, tmp_path, good_model):
    m = onnx.load(str(good_model))
    m.graph.node[0].op_type = "NoSuchOp"
    onnx.save(m, str(tmp_path / "m.onnx"))
    assert "onnxruntime cannot load" in cli_error(capsys, "run", tmp_path / "m.onnx", "--input", X)


def test_folder_as_npy_input(capsys, tmp_path, good_model):
    (tmp_path / "x.npy").mkdir()
    assert "is not a regular file" in cli_error(capsys, "run", good_model, "--input", f"x={tmp_path / 'x.npy'}")


def test_truncated_npy_input(capsys, tmp_path, good_model):
    np.save(tmp_path / "x.npy", np.ones((3, 2), np.float32))
    (tmp_path / "x.npy").write_bytes((tmp_path / "x.npy").read_bytes()[:90])
    assert "cannot read" in cli_error(capsys, "run", good_model, "--input", f"x={tmp_path / 'x.npy'}")


def test_bools_are_not_token_ids(capsys):
    err = cli_error(capsys, "run", "gpt2", "--set", "layers=1", "--set", "d=32", "--set", "heads=2",
                    "--input", "tokens=[[true, false]]")
    assert "holds true/false values but expects i64" in err


def test_decompression_bomb_is_refused_before_decoding(capsys, tmp_path):
    pil = pytest.importorskip("PIL.Image")
    path = tmp_path / "bomb.png"
    pil.new("L", (9000, 9000)).save(path)  # 81 megapixels, a few kB on disk
    err = cli_error(capsys, "run", "vit", "--set", "layers=1", "--set", "d=32", "--set", "heads=2",
                    "--image", path)
    assert "images are at most" in err
