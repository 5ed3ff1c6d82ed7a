"""Atomic output files: every file Tessera writes (ONNX models and their data, report plots,
saved run outputs) goes through here.

A file is written into a hidden folder beside its target, fsynced, and only then renamed into
place, so a full disk, Ctrl-C, SIGTERM or a crash leaves any previous file as it was and no
partial file behind; a symlink at the target is replaced, its target never written. Every way a
target path can be wrong (an existing folder, a path under a regular file, an empty name, a
device such as /dev/full, a folder we may not write, a name too long) is an OutputError with
the path, never a traceback.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class OutputError(Exception):
    """An output file that cannot be written (a bad path, a full disk, no permission)."""


def check_target(path: str | Path, example: str = "model.onnx") -> Path:
    """The target as a Path, refused with an OutputError when no regular file can be written there."""
    text = os.fspath(path)
    path = Path(text)
    if not text or not path.name or path.name in (".", ".."):
        raise OutputError(f"output path {text!r} names no file")
    try:
        if path.is_dir():
            raise OutputError(f"output path {path} is a folder; give a file name such as {path / example}")
        if path.exists() and not path.is_file():  # a device, FIFO or socket is never replaced
            raise OutputError(f"output path {path} exists and is not a regular file")
        existing = next((a for a in path.parents if a.exists()), None)
        if existing is not None and not existing.is_dir():
            raise OutputError(f"cannot write {path}: {existing} is a file, not a folder")
    except ValueError:  # a NUL byte in the name
        raise OutputError(f"invalid output path {text!r}") from None
    except OSError as e:  # a name too long, a folder we may not look into
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    return path


@contextmanager
def staging(path: Path) -> Iterator[Path]:
    """A hidden temporary folder beside ``path`` (created with its parents), removed on exit
    with whatever is still in it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: str | Path, write: Callable[[Path], None], example: str = "out.bin") -> Path:
    """Call ``write(tmp_file)`` (a file of the target's name in a hidden folder beside it), fsync
    it and rename it onto ``path``; returns the target. An OSError while writing becomes an
    OutputError naming the target; the previous file at ``path`` is kept until the rename."""
    target = check_target(path, example)
    with staging(target) as tmp:
        tmp_file = tmp / target.name
        try:
            write(tmp_file)
            fsync_file(tmp_file)
            os.replace(tmp_file, target)
        except OSError as e:
            raise OutputError(f"cannot write {target}: {e.strerror or e}") from None
        fsync_dir(target.parent)
    return target


def check_folder_target(path: str | Path, marker: str) -> Path:
    """The target folder as a Path, refused with an OutputError when it cannot be (re)written: an
    existing folder is replaced only when it is empty or holds ``marker`` (an earlier output of the
    same kind), so a folder of other files is never swapped away."""
    text = os.fspath(path)
    path = Path(text)
    if not text or not path.name or path.name in (".", ".."):
        raise OutputError(f"output path {text!r} names no folder")
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise OutputError(f"output path {path} exists and is not a folder; give a folder name")
        if path.is_dir() and any(path.iterdir()) and not (path / marker).is_file():
            raise OutputError(f"output folder {path} holds other files and no {marker}; it is not replaced "
                              f"(give a new folder, or one written by an earlier such compile)")
        existing = next((a for a in path.parents if a.exists()), None)
        if existing is not None and not existing.is_dir():
            raise OutputError(f"cannot write {path}: {existing} is a file, not a folder")
    except ValueError:
        raise OutputError(f"invalid output path {text!r}") from None
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_folder_atomically(path: str | Path, write: Callable[[Path], None], marker: str) -> list[Path]:
    """Call ``write(tmp_folder)`` (an empty folder of the target's name in a hidden folder beside
    it), fsync what it wrote and put the folder in place of ``path``; returns the files written. A
    previous folder at ``path`` (see ``check_folder_target``) is swapped out in one step where the
    system allows it (else renamed aside and restored on failure) and only then removed, so a
    failed, interrupted or killed compile leaves it as it was."""
    target = check_folder_target(path, marker)
    with staging(target) as tmp:
        new = tmp / target.name
        try:
            new.mkdir()
            write(new)
            for f in sorted(new.rglob("*")):
                if f.is_file():
                    fsync_file(f)
            fsync_dir(new)
            if target.exists():
                if not _exchange(new, target):  # the old folder now lies at `new`, removed with tmp
                    old = tmp / ".previous"
                    os.rename(target, old)
                    try:
                        os.rename(new, target)
                    except BaseException:
                        os.rename(old, target)
                        raise
            else:
                os.rename(new, target)
        except OSError as e:
            raise OutputError(f"cannot write {target}: {e.strerror or e}") from None
        fsync_dir(target.parent)
    return sorted(f for f in target.iterdir() if f.is_file())


__all__ = ["OutputError", "check_target", "check_folder_target", "staging", "fsync_file", "fsync_dir",
           "write_atomically", "write_folder_atomically"]
