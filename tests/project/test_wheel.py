"""The wheel holds every module and data file a plain (non-editable) install needs.

The expectation is read from the folders on disk, not from setup.py, so a package that
packaging drops (a folder left out of setup.py's discovery, a data file missing from
package-data) fails here. The wheel is built from a clean copy of the checkout, so stale
files in a local build/ folder cannot hide a missing one. .ci/run installs the same kind
of wheel in a fresh environment and runs the command from outside the checkout.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("spec", "compiler", "runtime", "models")
DATA = ["models/*.tsr", "models/*.hf.toml", "spec/stdlib/*.tsr", "spec/grammar.lark",
        "compiler/analysis/devices.toml"]
SKIP = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", "out", "*.onnx", "*.onnx.data")


def expected_files() -> set[str]:
    """Paths inside the wheel: every .py file under the layer folders, the package's own
    __init__.py, and the data files the spec loader, the report and the CLI read."""
    want = {"tessera/__init__.py"}
    for layer in LAYERS:
        for py in (ROOT / layer).rglob("*.py"):
            if "__pycache__" not in py.parts:
                want.add(f"tessera/{py.relative_to(ROOT).as_posix()}")
    for pattern in DATA:
        found = list(ROOT.glob(pattern))
        assert found, f"nothing on disk matches {pattern}"
        want.update(f"tessera/{p.relative_to(ROOT).as_posix()}" for p in found)
    return want


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(4, "--no-build-isolation")  # fast: the setuptools already here
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("tessera-*.whl")
    return wheel


def test_wheel_holds_every_package_and_data_file(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    want = expected_files()
    assert len(want) > 50
    missing = sorted(want - names)
    assert not missing, f"the wheel lacks {missing}"
    packaged = {n for n in names if n.startswith("tessera/")}
    assert "tessera/setup.py" not in packaged
    assert not [n for n in packaged if n.startswith(("tessera/tests/", "tessera/bench/", "tessera/docs/"))]
    assert "tessera = tessera.runtime.cli:main" in entry_points
