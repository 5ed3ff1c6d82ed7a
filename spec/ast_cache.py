"""Parsed spec files, kept between runs: a command that loads a spec it has parsed before skips
lark (its import and the parse are most of ``tessera ir``'s start-up, docs/benchmarks/log.md "Start-up").

An entry is the pickled AST of one file, named by the SHA-256 of everything the AST depends on:
the text, the file name its positions carry, the source of the grammar, the AST classes and the
parser (SOURCES: an edited parser never reads an old entry), this module's FORMAT and the Python
version. Any change makes a new name, so an entry is never stale, only unused; the folder keeps
the ``LIMIT`` most recently used entries (a hit touches its entry). Entries are written to a
temporary file and renamed (a reader never sees half a file); an entry that cannot be read or
unpickled is ignored and written afresh. Errors are never cached: a spec with a syntax error is
parsed (and reported) every time.

The folder is the user's own (spec/cache_folder.py), as lark's grammar cache already is; unpickling
trusts it as much as the user's other files.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from functools import lru_cache
from importlib import resources

from . import ast
from .cache_folder import cache_folder
from .diagnostics import register_source

FORMAT = 1    # bump when an entry's form changes (the SOURCES' own changes are in the key already)
LIMIT = 256   # entries kept
SUFFIX = ".ast"


# what the AST depends on besides the text: the grammar, the AST classes and the tree -> AST transformer
SOURCES = ("grammar.lark", "ast.py", "parser.py", "diagnostics.py")


@lru_cache(maxsize=1)
def _sources_digest() -> bytes:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(resources.files(__package__).joinpath(name).read_bytes())
    return h.digest()


def key(text: str, filename: str) -> str:
    h = hashlib.sha256()
    h.update(f"tessera-ast {FORMAT} py{sys.version_info[0]}.{sys.version_info[1]}\0".encode())
    h.update(_sources_digest())
    h.update(filename.encode("utf-8", "surrogatepass") + b"\0")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def parse(text: str, filename: str = "<spec>") -> ast.SpecFile:
    """The AST of ``text`` (as spec/parser.parse_text gives it), from the cache when it holds it."""
    folder = cache_folder("ast")
    path = os.path.join(folder, key(text, filename) + SUFFIX) if folder else None
    if path is not None:
        spec = _read(path)
        if spec is not None:
            register_source(filename, text)  # as parse_text does: diagnostics quote the source
            return spec
    from .parser import parse_text  # lark is imported only here, on a miss

    spec = parse_text(text, filename)
    if path is not None:
        _write(path, spec)
        _prune(folder)
    return spec


def _read(path: str) -> ast.SpecFile | None:
    try:
        with open(path, "rb") as f:
            spec = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a torn, corrupt or foreign entry: ignored, written afresh
        return None
    if not isinstance(spec, ast.SpecFile):
        return None
    try:
        os.utime(path)  # most recently used
    except OSError:
        pass
    return spec


def _write(path: str, spec: ast.SpecFile) -> None:
    """Write atomically (a temporary file in the same folder, renamed); any failure leaves no entry."""
    try:
        data = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except (RecursionError, pickle.PicklingError, TypeError):
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=SUFFIX)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _prune(folder: str, limit: int | None = None) -> None:
    """Keep the ``limit`` (default LIMIT) most recently used entries."""
    limit = LIMIT if limit is None else limit
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(SUFFIX) and not e.name.startswith(".tmp-")]
        if len(entries) <= limit:
            return
        entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        for e in entries[limit:]:
            os.unlink(e.path)
    except OSError:  # another process pruned first, or the folder went away: nothing to keep tidy
        pass
