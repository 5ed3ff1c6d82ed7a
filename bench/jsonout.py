"""One way the benches write their ``--json`` reports: whole, then renamed over the target, so a
report is never half-written (the project's outputs are atomic), its folder made if missing."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, data, indent: int = 1) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data, indent=indent))
    part.replace(path)
