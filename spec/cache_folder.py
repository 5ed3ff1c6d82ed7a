"""Where Tessera keeps what it may rebuild at any time: lark's analysed grammar and parsed spec files.

One folder for both, so one setting moves or disables them: ``TESSERA_CACHE_DIR`` (a folder; the
words ``off``, ``none`` or an empty value turn caching off), else ``$XDG_CACHE_HOME/tessera``, else
``~/.cache/tessera``. Nothing in it is needed: a folder that cannot be made means no cache.
"""

from __future__ import annotations

import os

ENV = "TESSERA_CACHE_DIR"


def cache_folder(*parts: str) -> str | None:
    """The cache folder (or its subfolder ``parts``), made if missing; None when caching is off or
    the folder cannot be made."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        if chosen.strip().lower() in ("", "off", "none"):
            return None
        base = chosen
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "tessera")
    folder = os.path.join(base, *parts)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    return folder
