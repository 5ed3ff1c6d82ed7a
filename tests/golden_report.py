"""The golden report cases, shared by the test (which only compares) and tests/update_golden.py
(the only thing that writes the files).

The report is rendered with the working directory set to the repository root, because the
attention section names each site as ``file:line:col`` with the file relative to the working
directory (compiler/analysis/attention_report.py ``_where``); the golden files say
``models/gpt2.tsr:12:10`` whatever folder pytest was started from.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

# file name in tests/golden -> the --format it holds
CASES = {
    "gpt2_small_report.txt": "table",
    "gpt2_small_report.json": "json",
}


@contextlib.contextmanager
def _environment():
    """Repository root as working directory, a 140-column terminal without colour; restored after."""
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    os.environ["COLUMNS"] = "140"  # rich sizes the table to the terminal
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        os.environ.pop(var, None)
    os.environ["NO_COLOR"] = "1"
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def render(fmt: str) -> str:
    """What ``tessera report models/gpt2.tsr --variant small --seq 1024 --format FMT`` prints."""
    from tessera.runtime.cli import main

    out = io.StringIO()
    with _environment(), contextlib.redirect_stdout(out):
        rc = main(["report", "models/gpt2.tsr", "--variant", "small", "--seq", "1024", "--format", fmt])
    if rc != 0:
        raise RuntimeError(f"tessera report --format {fmt} exited with status {rc}")
    return out.getvalue()
