"""--explain's lines: the sites that share a verdict (fused with one kernel for one reason, or left
unfused for one) on one line, named compactly (``layers.{0-11}.attn.sdpa``), so that GPT-2's twelve
identical 300-character reasons read once. A site alone keeps the single-site form, ``scope (pos): verdict``."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"\d+")


def grouped_lines(sites: list) -> list[str]:
    """One line per distinct ``site.verdict()``, in the order each verdict first appears. A site has
    ``scope``, ``verdict()``, ``describe()`` and, for attention sites, ``pos`` (a source position)."""
    groups: dict[str, list] = {}
    for s in sites:
        groups.setdefault(s.verdict(), []).append(s)
    lines = []
    for verdict, members in groups.items():
        if len(members) == 1:
            lines.append(members[0].describe())
            continue
        names = compact_names([m.scope or "<model>" for m in members])
        places = list(dict.fromkeys(str(p) for m in members if (p := getattr(m, "pos", None))))
        where = f" ({', '.join(places)})" if places else ""
        lines.append(f"{len(members)} sites {names}{where}: {verdict}")
    return lines


def compact_names(names: list[str]) -> str:
    """``layers.0.attn.sdpa`` ... ``layers.11.attn.sdpa`` as ``layers.{0-11}.attn.sdpa`` when the names
    differ in one number only (runs of consecutive numbers as ranges: ``{0,2,4-7}``); else all of them."""
    parts = [_NUMBER.split(n) for n in names]
    numbers = [_NUMBER.findall(n) for n in names]
    if len({tuple(p) for p in parts}) != 1 or len({len(x) for x in numbers}) != 1:
        return ", ".join(names)
    varying = [i for i in range(len(numbers[0])) if len({x[i] for x in numbers}) > 1]
    if len(varying) != 1:
        return ", ".join(names)
    at = varying[0]
    values = sorted({int(x[at]) for x in numbers})
    if len(values) != len(names):  # a name twice: say so rather than hide it
        return ", ".join(names)
    template = numbers[0]
    out = parts[0][0]
    for i, text in enumerate(parts[0][1:]):
        out += ("{" + _ranges(values) + "}" if i == at else template[i]) + text
    return out


def _ranges(values: list[int]) -> str:
    """Sorted distinct integers as runs: [0, 2, 4, 5, 6, 7] -> "0,2,4-7"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
