"""Write the builtins table of docs/language.md from ``BUILTINS`` (compiler/frontend/builtins.py).

    python docs/gen_builtins.py           # rewrite the table between the marker comments
    python docs/gen_builtins.py --check   # exit status 1 if the document's table is stale

The table lists every builtin in registration order with its arguments (defaults as the
language writes them) and its ``doc`` (on one line). tests/project/test_docs.py fails
when the table in the document differs from what this script would write, so adding a
builtin means running this script.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

DOC = Path(__file__).resolve().parent / "language.md"
BEGIN = "<!-- BEGIN GENERATED builtins: python docs/gen_builtins.py -->"
END = "<!-- END GENERATED builtins -->"


def _literal(value) -> str:
    """A default as a spec would write it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _summary(doc: str) -> str:
    """The doc on one line (paragraphs joined), with table bars escaped."""
    return " ".join(doc.split()).replace("|", "\\|")


def table() -> str:
    """The generated section: a sentence with the count, then the markdown table."""
    from tessera.compiler.frontend.builtins import BUILTINS
    from tessera.compiler.frontend.values import REQUIRED

    lines = [f"Generated from `BUILTINS` in `compiler/frontend/builtins.py` by `docs/gen_builtins.py` "
             f"({len(BUILTINS)} entries, in registration order).", "",
             "| builtin | arguments (defaults) | what it does |", "| --- | --- | --- |"]
    for name, b in BUILTINS.items():
        args = ", ".join(p if d is REQUIRED else f"{p}={_literal(d)}" for p, d in b.params)
        doc = _summary(b.doc)
        if not doc:
            raise SystemExit(f"builtin '{name}' has no doc string; give it one (builtin(..., doc=...) "
                             f"or a docstring) before regenerating the table")
        lines.append(f"| `{name}` | `{args}` | {doc} |")
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """``text`` (the document) with the generated section replaced."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{DOC}: expected one '{BEGIN}' ... '{END}' pair")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the table is stale")
    args = ap.parse_args(argv)
    old = DOC.read_text(encoding="utf-8")
    new = render(old)
    if new == old:
        print(f"{DOC}: builtins table is up to date")
        return 0
    if args.check:
        print(f"{DOC}: builtins table is stale; run python docs/gen_builtins.py")
        return 1
    fd, tmp = tempfile.mkstemp(dir=DOC.parent, prefix=".language.md.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new)
        os.replace(tmp, DOC)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"{DOC}: builtins table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
