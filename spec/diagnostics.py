"""Source positions and spec errors.

Every error a user can cause in a spec file is a :class:`SpecError` that knows
where it happened. Its ``render()`` gives the compiler-style report

    models/gpt2.tsr:12:23: error: unknown name 'hedas'; did you mean 'heads'?
       12 |     q = split_heads(x, hedas)
          |                        ^^^^^

so that nothing the user wrote ever surfaces as a Python traceback.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable

# Source text of every file that has been read, so an error can quote its line.
_SOURCES: dict[str, str] = {}


def register_source(filename: str, text: str) -> None:
    _SOURCES[filename] = text


@dataclass(frozen=True)
class Pos:
    """A span in a spec file: 1-based line and column, end column exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class SpecError(Exception):
    """An error in a spec (or in a value given for one), with its position."""

    def __init__(self, message: str, pos: Pos | None = None, notes: Iterable[str] = ()):
        super().__init__(message)
        self.message = message
        self.pos = pos
        self.notes = list(notes)

    def render(self) -> str:
        if self.pos is None:
            head = f"error: {printable(self.message)}"
            return "\n".join([head, *(f"note: {printable(n)}" for n in self.notes)])
        lines = [f"{printable(str(self.pos))}: error: {printable(self.message)}"]
        source = _SOURCES.get(self.pos.file)
        if source is not None:
            src_lines = source.splitlines()
            if 1 <= self.pos.line <= len(src_lines):
                text = src_lines[self.pos.line - 1].expandtabs(1)
                width = 1
                if self.pos.end_line == self.pos.line and self.pos.end_col:
                    width = max(1, self.pos.end_col - self.pos.col)
                width = min(width, max(1, len(text) - self.pos.col + 1))
                shown, col, width = _window(text, self.pos.col, width)
                gutter = f"{self.pos.line:>5} | "
                lines.append(gutter + shown)
                lines.append(" " * (len(gutter) - 2) + "| " + " " * (col - 1) + "^" * width)
        lines.extend(f"note: {printable(n)}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.render()


# Quoted source lines are cut to this many characters around the caret.
MAX_SHOWN = 100


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a spec cannot send escape sequences to the
    terminal through an error message."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in text)


def _window(text: str, col: int, width: int) -> tuple[str, int, int]:
    """The part of a source line to quote: control characters shown as U+FFFD (one column each, so
    the caret stays aligned), and at most MAX_SHOWN characters around ``col``."""
    text = "".join(ch if ch.isprintable() else "\ufffd" for ch in text)
    width = min(width, MAX_SHOWN // 2)
    if len(text) <= MAX_SHOWN:
        return text, col, width
    start = max(0, min(col - 1 - MAX_SHOWN // 4, len(text) - MAX_SHOWN))
    shown = text[start:start + MAX_SHOWN]
    prefix = "..." if start > 0 else ""
    suffix = "..." if start + MAX_SHOWN < len(text) else ""
    return prefix + shown + suffix, col - start + len(prefix), width


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return "; did you mean 'x'?" for the closest candidate, or ''."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{matches[0]}'?" if matches else ""
