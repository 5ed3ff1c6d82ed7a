"""Looking at a user's file before opening it: a missing file, a name the OS refuses and (by the
caller's check of the result) a FIFO or device become one clear error, never a hang or traceback."""

from __future__ import annotations

import os
from pathlib import Path


def stat_or_raise(path: Path, what: str, error: type[Exception]) -> os.stat_result:
    """``os.stat(path)``, raising ``error("{what} not found: path")`` or ``error("cannot read {what}
    path: reason")`` (a name too long, a NUL byte, a folder we may not enter)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except (OSError, ValueError) as e:
        raise error(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
