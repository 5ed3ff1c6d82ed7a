"""Hostile and careless specs: each gives a positioned error and exit status 2, never a traceback,
a hang or a memory blow-up.

tests/hostile/*.tsr is a corpus of minimal reproducers, one per way a spec once crashed or hung
Tessera; each file's first line says what its error must contain (``# expect: ...``). Files that
cannot be checked in (FIFOs, devices, huge files) are made here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import cli_error

HOSTILE = Path(__file__).resolve().parents[1] / "hostile"
CASES = sorted(HOSTILE.glob("*.tsr"))


def _expected(path: Path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: ...'"
    return first.removeprefix("# expect: ")


def test_corpus_is_there():
    assert len(CASES) >= 20


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_hostile_spec_is_a_clean_error(capsys, path):
    err = cli_error(capsys, "ir", path)
    assert _expected(path) in err
    assert "\x1b" not in err  # escape bytes on a spec line are never echoed raw


def _model(extra: str = "") -> str:
    return f"{extra}model M() {{\n  in x: f32[B, 4]\n  out y: f32[B, 4]\n  y = x\n}}\n"


def test_spec_that_is_a_fifo_is_refused_without_reading(capsys, tmp_path):
    fifo = tmp_path / "m.tsr"
    os.mkfifo(fifo)
    assert "is not a regular file" in cli_error(capsys, "ir", fifo)


def test_used_fifo_is_refused_without_reading(capsys, tmp_path):
    os.mkfifo(tmp_path / "lib.tsr")
    (tmp_path / "m.tsr").write_text(_model('use "lib.tsr"\n'))
    assert "is not a regular file" in cli_error(capsys, "ir", tmp_path / "m.tsr")


def test_device_as_spec_is_refused(capsys):
    assert "is not a regular file" in cli_error(capsys, "ir", "/dev/zero")


def test_folder_as_spec_is_refused(capsys, tmp_path):
    assert "is a folder" in cli_error(capsys, "ir", tmp_path)


def test_spec_over_one_mebibyte_is_refused_before_parsing(capsys, tmp_path):
    big = tmp_path / "big.tsr"
    big.write_text(_model() + "# padding\n" * 120_000)
    assert "spec files are at most 1,048,576" in cli_error(capsys, "ir", big)


def test_used_file_that_is_not_utf8_is_refused(capsys, tmp_path):
    (tmp_path / "lib.tsr").write_bytes(b"block f(x) { return x }\n\xff\xfe\n")
    (tmp_path / "m.tsr").write_text(_model('use "lib.tsr"\n'))
    assert "is not UTF-8 text" in cli_error(capsys, "ir", tmp_path / "m.tsr")


def test_used_secret_is_never_echoed(capsys, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    (tmp_path / "m.tsr").write_text(_model(f'use "{secret}"\n'))
    err = cli_error(capsys, "ir", tmp_path / "m.tsr")
    assert "hunter2" not in err and "ending in .tsr" in err


def test_layer_count_from_the_command_line_is_budgeted(capsys):
    models = Path(__file__).resolve().parents[2] / "models"
    err = cli_error(capsys, "ir", models / "gpt2.tsr", "--set", "layers=1000000000")
    assert "past the elaboration budget" in err


def test_long_lines_are_quoted_around_the_caret(capsys, tmp_path):
    spec = tmp_path / "m.tsr"
    spec.write_text(_model().replace("  y = x\n", "  y = x" + " * 1.0" * 150 + " * nope\n"))
    err = cli_error(capsys, "ir", spec)
    quoted, caret = err.splitlines()[1:3]
    assert len(quoted) < 130 and "nope" in quoted
    assert quoted[caret.index("^"):].startswith("nope")


def test_recursion_limit_is_not_what_stops_deep_but_legal_nesting(capsys, tmp_path):
    # 150 levels is under the limit: it must elaborate, not hit Python's recursion limit.
    spec = tmp_path / "m.tsr"
    spec.write_text(_model().replace("  y = x\n", "  let c = " + "-" * 150 + "1.0\n  y = x * c\n"))
    from conftest import cli
    rc, out, err = cli(capsys, "ir", spec)
    assert rc == 0, err
