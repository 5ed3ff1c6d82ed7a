"""``tessera run`` outputs: large ones are summarised in JSON unless --full, memory stays bounded,
and --save DIR writes .npy files atomically; bad --save folders are clean errors."""

from __future__ import annotations

import errno
import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import cli, cli_error
from tessera.runtime.io import outputs

# Cheap but large: 4-wide embeddings projected to 50,257 logits (GPT-2's vocabulary).
WIDE = """model Wide(vocab = 50257) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  logits = linear(embedding(tokens, 10, 4), vocab, bias=false, name="head")
}
"""


@pytest.fixture
def wide(tmp_path):
    spec = tmp_path / "wide.tsr"
    spec.write_text(WIDE)
    return spec


def _tokens(t: int) -> str:
    return "tokens=" + json.dumps([[i % 10 for i in range(t)]])


def test_large_output_is_summarised_and_memory_stays_bounded(capsys, wide, tmp_path):
    t = 200  # 10,051,400 logits: 40 MB as float32, about 200 MB as JSON text
    tracemalloc.start()
    try:
        rc, out, err = cli(capsys, "run", wide, "--input", _tokens(t), "--format", "json", "--save", tmp_path / "o")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rc == 0, err
    assert len(out) < 2000
    s = json.loads(out)["outputs"]["logits"]
    ref = np.load(tmp_path / "o" / "logits.npy", allow_pickle=False)
    assert ref.shape == (1, t, 50257) and s["shape"] == [1, t, 50257] and s["summarised"] is True
    assert s["min"] == float(ref.min()) and s["max"] == float(ref.max())
    assert s["mean"] == pytest.approx(float(ref.astype(np.float64).mean()), rel=1e-12)
    assert s["first"] == ref.reshape(-1)[:outputs.HEAD_VALUES].tolist()
    assert peak < 4 * ref.nbytes  # the output and a copy or two, never its text


def test_full_prints_every_value_equal_to_the_saved_file(capsys, wide, tmp_path):
    rc, out, err = cli(capsys, "run", wide, "--input", _tokens(3), "--format", "json", "--full",
                       "--save", tmp_path)
    assert rc == 0, err
    got = json.loads(out)["outputs"]["logits"]
    ref = np.load(tmp_path / "logits.npy", allow_pickle=False)
    assert ref.size > outputs.SUMMARY_ELEMENTS and "summarised" not in got
    assert np.array_equal(np.array(got["values"], np.float32), ref)
    assert f"wrote {tmp_path / 'logits.npy'}" in err


def test_small_outputs_are_printed_in_full_by_default(capsys):
    rc, out, err = cli(capsys, "run", "worked_example", "--input", "x=[[1,0],[0,1],[1,1]]", "--format", "json")
    assert rc == 0, err
    y = json.loads(out)["outputs"]["y"]
    assert y["shape"] == [3, 2] and len(y["values"]) == 3


def test_full_needs_json(capsys):
    assert "--full applies to --format json" in cli_error(capsys, "run", "worked_example", "--input",
                                                          "x=[[1,0]]", "--full")


def _a_file(d: Path) -> Path:
    (d / "f").write_text("x")
    return d / "f"


@pytest.mark.parametrize("make, expected", [
    (lambda d: "", "names no folder"),
    (_a_file, "exists and is not a folder"),
    (lambda d: _a_file(d) / "sub", "is a file, not a folder"),
    (lambda d: d / ("x" * 300), "File name too long"),
])
def test_bad_save_folders_are_clean_errors_before_running(capsys, tmp_path, make, expected):
    assert expected in cli_error(capsys, "run", "worked_example", "--input", "x=[[1,0]]", "--save", make(tmp_path))


def test_a_failed_save_leaves_the_previous_file(capsys, tmp_path, monkeypatch):
    old = tmp_path / "y.npy"
    old.write_bytes(b"previous")

    def full(f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", full)
    err = cli_error(capsys, "run", "worked_example", "--input", "x=[[1,0]]", "--save", tmp_path)
    assert "No space left on device" in err and old.read_bytes() == b"previous"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_output_names_cannot_leave_the_folder():
    assert outputs.file_name("../../etc/passwd") == "_.._etc_passwd.npy"
    assert outputs.file_name("present_key.0") == "present_key.0.npy"
    assert outputs.file_name("") == "output.npy"


def test_summary_of_nan_and_bool_outputs_is_valid_json():
    s = outputs.summary(np.array([np.nan, 1.0], np.float32))
    assert json.loads(json.dumps(s, allow_nan=False))["min"] == "nan"
    assert outputs.summary(np.array([True, False]))["mean"] == 0.5
