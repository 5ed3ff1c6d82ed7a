"""Golden tests: the full table and JSON of `tessera report models/gpt2.tsr --variant small`.

Every figure in the golden files was checked by hand against the seed and the
formulas in docs/report.md before the files were written (the derivations are
in tests/report/test_report.py). The test only compares; after an intended change,
regenerate the files with

    python tests/update_golden.py

and review the diff number by number. The report is rendered from the
repository root (tests/golden_report.py), so the test passes whatever folder
pytest is started from.
"""

from __future__ import annotations

import pytest

from golden_report import CASES, GOLDEN, render


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpt2_small_report_is_golden(name):
    out = render(CASES[name])
    want = (GOLDEN / name).read_text(encoding="utf-8")
    assert out == want, f"{name} changed; if intended, run python tests/update_golden.py and review the diff"
