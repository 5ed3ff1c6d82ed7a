"""Rewrite the golden report files in tests/golden after an intended change.

    python tests/update_golden.py          # rewrite every golden file, print which changed
    python tests/update_golden.py --check  # only say which differ (exit status 1 if any)

The tests never write these files; they only compare. Review the diff number by number
(``git diff tests/golden``) before committing: every figure was checked by hand against the
seed and the formulas in docs/report.md (the derivations are in tests/report/test_report.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_report import CASES, GOLDEN, render  # noqa: E402


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a golden file differs")
    args = ap.parse_args(argv)
    differ = []
    for name, fmt in CASES.items():
        path = GOLDEN / name
        text = render(fmt)
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if text == old:
            print(f"unchanged {path}")
            continue
        differ.append(name)
        if args.check:
            print(f"differs   {path}")
        else:
            _write_atomic(path, text)
            print(f"rewrote   {path}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
