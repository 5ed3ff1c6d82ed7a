"""What this machine has, asked without importing onnxruntime: `--provider auto` (runtime/session.py)
and the report's note on its default device (runtime/cli/report.py) both need it, and the report
must not pay onnx's import for one look at /dev."""

from __future__ import annotations

import sys
from pathlib import Path


def gpu_present() -> bool:
    """Whether this machine shows an NVIDIA device (Linux: /dev/nvidia0..., /dev/dxg under WSL);
    elsewhere True, leaving it to onnxruntime."""
    if not sys.platform.startswith("linux"):
        return True
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "dxg").exists()
