"""``tessera report --plot``: every bad path is a clean error before the report is computed, and
the figure is written atomically like the ONNX outputs (compiler/backends/atomic.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from conftest import MODELS, cli, cli_error

pytest.importorskip("matplotlib")

TINY = [MODELS / "gpt2.tsr", "--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=64",
        "--set", "ctx=16"]
OLD = b"previous plot, must survive"


def _under_a_file(d: Path) -> Path:
    (d / "file.txt").write_text("x")
    return d / "file.txt" / "p.png"


@pytest.mark.parametrize("make, expected", [
    (lambda d: d, "is a folder"),
    (_under_a_file, "file.txt is a file, not a folder"),
    (lambda d: "", "names no file"),
    (lambda d: d / ("x" * 300 + ".png"), "File name too long"),
    (lambda d: Path("/dev/full"), "not a regular file"),
    (lambda d: d / "plot", "no suffix names no image format"),
    (lambda d: d / "plot.xyz", "'.xyz' names no image format"),
], ids=["folder", "under-a-file", "empty", "too-long", "dev-full", "no-suffix", "unknown-suffix"])
def test_bad_plot_paths_are_clean_errors(capsys, tmp_path, make, expected, monkeypatch):
    from tessera.compiler.analysis import costreport

    def never(*a, **k):
        raise AssertionError("the report was computed before the path was checked")

    monkeypatch.setattr(costreport, "build_report", never)
    assert expected in cli_error(capsys, "report", *TINY, "--plot", make(tmp_path))


def test_read_only_folder_is_a_clean_error(capsys, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make the staging folder fail as it would for a user
        import tempfile

        def denied(*a, **k):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(tempfile, "mkdtemp", denied)
    else:
        folder.chmod(0o500)
    try:
        err = cli_error(capsys, "report", *TINY, "--plot", folder / "p.png")
    finally:
        folder.chmod(0o700)
    assert "Permission denied" in err and not (folder / "p.png").exists()


def test_a_failed_plot_leaves_the_previous_file(capsys, tmp_path, monkeypatch):
    import matplotlib.figure

    png = tmp_path / "p.png"
    png.write_bytes(OLD)

    def full(self, fname, *a, **k):
        Path(fname).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    err = cli_error(capsys, "report", *TINY, "--plot", png)
    assert "No space left on device" in err
    assert png.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]  # no partial or hidden file left


def test_plot_replaces_the_previous_file_and_a_symlink_is_not_followed(capsys, tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(OLD)
    link = tmp_path / "p.svg"
    link.symlink_to(target)
    rc, _, err = cli(capsys, "report", *TINY, "--plot", link)
    assert rc == 0, err
    assert target.read_bytes() == OLD and not link.is_symlink()
    assert link.read_bytes().lstrip().startswith(b"<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.svg", "precious.bin"]
