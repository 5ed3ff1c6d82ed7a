"""The bundled model specs (``*.tsr``) and their checkpoint mappings (``*.hf.toml``).

They ship in the wheel, so ``tessera report gpt2`` works after a plain install from any folder.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_names() -> list[str]:
    """Names of the bundled specs, e.g. ``gpt2``."""
    return sorted(p.name[:-4] for p in resources.files(__package__).iterdir() if p.name.endswith(".tsr"))


def bundled_spec(name: str) -> Path | None:
    """The file of a bundled spec given by name (``gpt2`` or ``gpt2.tsr``), or None."""
    stem = name[:-4] if name.endswith(".tsr") else name
    if stem not in bundled_names():
        return None
    return Path(str(resources.files(__package__).joinpath(f"{stem}.tsr")))
