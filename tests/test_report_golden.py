"""Golden tests: the full table and JSON of `tessera report models/gpt2.tsr --variant small`.

Every figure in the golden files was checked by hand against the seed and the
formulas in docs/report.md before the files were written (the derivations are
in tests/test_report.py). After an intended change, regenerate them with

    TESSERA_UPDATE_GOLDEN=1 pytest tests/test_report_golden.py

and review the diff number by number.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tessera.runtime.cli import main

GOLDEN = Path(__file__).resolve().parent / "golden"
GPT2 = Path(__file__).resolve().parents[1] / "models" / "gpt2.tsr"
UPDATE = os.environ.get("TESSERA_UPDATE_GOLDEN") == "1"


def _run(capsys, monkeypatch, fmt: str) -> str:
    monkeypatch.setenv("COLUMNS", "140")       # rich sizes the table to the terminal
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["report", str(GPT2), "--variant", "small", "--seq", "1024", "--format", fmt]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("fmt,name", [("table", "gpt2_small_report.txt"), ("json", "gpt2_small_report.json")])
def test_gpt2_small_report_is_golden(capsys, monkeypatch, fmt, name):
    out = _run(capsys, monkeypatch, fmt)
    path = GOLDEN / name
    if UPDATE:
        path.write_text(out)
    assert out == path.read_text(), f"{name} changed; see the module docstring to regenerate it"
