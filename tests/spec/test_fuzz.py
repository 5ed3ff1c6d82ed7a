"""The spec fuzz harness (tests/fuzz_specs.py) in CI: a few hundred mutated bundled specs and
standard-library files through ``tessera ir`` and ``tessera report``, each in a worker with a
4 GiB address-space cap and a 20 s limit; every case must end with status 0 or 2, no traceback,
no hang and no memory blow-up. The long run (5,000 cases) is documented in docs/guarantees.md.

tests/hostile/report/ holds specs the fuzzer found crashing the report although they are
legal: each must report with status 0.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from conftest import cli
import fuzz_specs

CI_CASES, CI_SEED = 200, 20261201
REPORT_CASES = sorted((Path(__file__).resolve().parents[1] / "hostile" / "report").glob("*.tsr"))


def test_mutations_are_deterministic_and_varied():
    a, b = fuzz_specs.make_cases(60, 7), fuzz_specs.make_cases(60, 7)
    assert [c["text"] for c in a] == [c["text"] for c in b]
    kinds = Counter(k for c in a for k in c["mutations"])
    assert len(kinds) >= 8, kinds
    assert len({c["source"] for c in a}) >= 5


def test_the_harness_counts_each_kind_of_failure(tmp_path, monkeypatch):
    """Each kind of failure is counted; and the workers killed for a hang or dead of their memory,
    which cannot remove their own folders, leave none behind (the run's folder holds them)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    good = {"id": 0, "source": "-", "mutations": [], "argv": ["ir", "{spec}"],
            "text": "model M() {\n in x: f32[B, 4]\n out y: f32[B, 4]\n y = x\n}\n"}
    cases = [good, {**good, "id": 1, "text": "model M( {"},
             {**good, "id": 2, "selftest": "import time\nwhile True: pass"},  # spins: a hang by CPU time
             {**good, "id": 3, "selftest": "import time; time.sleep(60)"},  # blocks: a hang by wall time
             {**good, "id": 4, "selftest": "bytearray(8 << 30)"},  # past the 4 GiB cap
             {**good, "id": 5, "selftest": "import os; os._exit(9)"},  # the worker dies
             {**good, "id": 6, "selftest": "{}['missing']"},
             {**good, "id": 7}]
    results = fuzz_specs.run_cases(cases, workers=2, timeout=1.0)
    assert [r["status"] for r in results] == ["ok", "user_error", "hang", "hang", "memory", "memory",
                                              "traceback", "ok"]
    assert list(tmp_path.iterdir()) == []


def test_fuzzed_specs_never_crash_hang_or_blow_up():
    results = fuzz_specs.run_cases(fuzz_specs.make_cases(CI_CASES, CI_SEED), workers=2, timeout=20.0,
                                   mem_bytes=4 << 30)
    counts = Counter(r["status"] for r in results)
    bad = [r for r in results if r["status"] in fuzz_specs.FAILURES]
    assert not bad, "\n".join(f"case {r['id']} {r['status']} {r['source']} {r['mutations']} {r['argv']}\n"
                              f"{r['detail'][-800:]}" for r in bad[:5])
    assert counts["ok"] + counts["user_error"] == CI_CASES and counts["ok"] > 0 and counts["user_error"] > 0


@pytest.mark.parametrize("path", REPORT_CASES, ids=[p.stem for p in REPORT_CASES])
def test_fuzz_found_report_crashes_stay_fixed(capsys, path):
    rc, out, err = cli(capsys, "report", path, "--format", "json")
    assert rc == 0, err
