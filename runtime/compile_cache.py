"""The compile cache: compiled models kept between runs, so that ``generate``, ``serve``, ``batch``, ``run``
and ``perplexity`` load a model compiled before instead of compiling it again (issue 42 item 5: 86-94 s
for a 135 M Llama's cached decoder, every time).

Where: ``--no-compile-cache`` turns it off; else ``--compile-cache DIR``; else ``TESSERA_COMPILE_CACHE``
(a folder; ``off``, ``none`` or an empty value turn it off); else ``compiled/`` in Tessera's cache
folder (spec/cache_folder.py: ``TESSERA_CACHE_DIR``, ``$XDG_CACHE_HOME/tessera`` or ``~/.cache/tessera``).

The key is the sha256 of a JSON object of its parts (``Key.parts``, which ``--explain`` lists):

- ``what``: which compile (the cached decoder, the engine's, the full model);
- ``graph``: a sha256 of the elaborated graph (its listing, every constant's bytes, the hyperparameters
  and the variant): whatever the spec text, ``--variant``, ``--set``, the specs it ``use``s and a
  checkpoint's config.json make of the model. The graph is elaborated on every load (0.1 s for a 135 M
  Llama) rather than trusting file names, so no way of changing the model is missed;
- ``weights``: the seed (seeded weights), or each weights file's absolute path, size and modification
  time (ns), and the sha256 of the spec's ``.hf.toml`` name map. Path, size and mtime rather than a hash
  of the contents: hashing a checkpoint costs what reading it costs (seconds to minutes), which is what
  a hit saves; any rewrite of a file changes its mtime. (A file rewritten with its old size and its
  mtime set back by hand would be missed: give ``--no-compile-cache`` then.);
- ``options``: the compile's PipelineOptions, every option that changes the compiled graph (target,
  dtype, quantisation, cache mode, kernels, ...);
- ``versions``: Tessera's version and a sha256 of its own source files (a changed pass is a changed
  compiler), onnx's, onnxruntime's, numpy's and Python's.

An entry is a folder named by the key: the model (``model.onnx``, its weights in ``model.onnx.data``)
and ``manifest.json``, written last, with the key's parts and each file's size and sha256. It is
written into a temporary folder beside the others and renamed into place, so an entry is whole or
absent. A lookup checks the manifest, the key and every file's size and sha256 (about 0.3 s per GB)
before use; an entry that fails (partial, corrupt, from another format) is removed with a note and the
model compiled again. Entries past the size bound (``TESSERA_COMPILE_CACHE_MAX_GB``, default 20) are
evicted least recently used first after each store; ``tessera cache list|clear`` shows or empties it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.runtime.errors import UsageError

ENV = "TESSERA_COMPILE_CACHE"
MAX_ENV = "TESSERA_COMPILE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
FORMAT = 1          # of an entry's layout and manifest: a change makes every older entry a miss
MANIFEST = "manifest.json"
MODEL = "model.onnx"
TMP_PREFIX = ".tmp-"
_OFF_WORDS = ("", "off", "none")


# ------------------------------------------------------------------ the folder
def folder_for(given=None, disabled: bool = False) -> tuple[Path | None, str]:
    """The cache folder and where that choice came from (``--compile-cache``, the environment, the
    cache folder); (None, why) when the cache is off. A folder named by ``--compile-cache`` that cannot
    be made is a UsageError; the default one that cannot be made is the cache off, with the reason."""
    if disabled:
        return None, "off (--no-compile-cache)"
    if given is not None:
        return _made(Path(given), "--compile-cache", strict=True)
    env = os.environ.get(ENV)
    if env is not None:
        if env.strip().lower() in _OFF_WORDS:
            return None, f"off ({ENV}={env!r})"
        return _made(Path(env), ENV, strict=False)
    from tessera.spec.cache_folder import ENV as CACHE_ENV, cache_folder

    base = cache_folder("compiled")
    if base is None:
        return None, f"off (no cache folder: {CACHE_ENV} is off, or the folder cannot be made)"
    return Path(base), "Tessera's cache folder"


def _made(folder: Path, source: str, strict: bool) -> tuple[Path | None, str]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
    except OSError as e:
        why = f"the compile cache folder {folder} ({source}) cannot be used: {e.strerror or e}"
        if strict:
            raise UsageError(why + "; give another folder or --no-compile-cache") from None
        return None, f"off ({why})"
    return folder, source


# ------------------------------------------------------------------ the key
@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A sha256 of Tessera's own source files (.py, .tsr, .toml, .lark; not tests, benchmarks or docs):
    a changed pass or spec compiles differently, whatever the version number says."""
    import tessera

    root = Path(tessera.__file__).resolve().parent
    h = hashlib.sha256()
    found = [*root.glob("*.py"), *(p for sub in ("spec", "compiler", "runtime", "models")
                                   for p in (root / sub).rglob("*"))]
    for path in sorted(p for p in found if p.suffix in (".py", ".tsr", ".toml", ".lark")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h.update(str(rel).encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def versions() -> dict:
    import numpy
    import onnx
    import onnxruntime

    import tessera

    return {"tessera": tessera.__version__, "tessera code": code_fingerprint()[:16], "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__,
            "python": ".".join(map(str, sys.version_info[:3]))}


def _plain(v):
    """A hyperparameter's value as JSON (a block or other object by its repr, without addresses)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    text = repr(v)
    return text if " at 0x" not in text else type(v).__name__ + ":" + str(getattr(v, "name", ""))


def graph_fingerprint(built) -> str:
    """A sha256 of the elaborated graph: its listing (nodes, attributes, types, parameters), the bytes
    of every constant (the listing abbreviates large ones), the hyperparameters and the variant."""
    import numpy as np

    g = built.graph
    h = hashlib.sha256(g.dump().encode())
    for name in sorted(g.consts):
        arr = np.ascontiguousarray(g.consts[name])
        h.update(f"\0{name}\0{arr.dtype}\0{arr.shape}\0".encode() + arr.tobytes())
    info = {"model": built.info.model, "variant": built.info.variant,
            "hyperparams": {k: _plain(v) for k, v in sorted(built.info.hyperparams.items())}}
    h.update(json.dumps(info, sort_keys=True, default=str).encode())
    return h.hexdigest()


def weights_fingerprint(built, weights_path, seed: int) -> dict:
    """The weights as the key sees them: the seed, or each file's path, size and mtime (module docstring)."""
    name_map = Path(built.spec_path).with_suffix(".hf.toml")
    out: dict = {}
    if not weights_path:
        out["seeded"] = int(seed)
    else:
        p = Path(weights_path).resolve()
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        listed = []
        for f in files:
            try:
                st = f.stat()
                listed.append([str(f), st.st_size, st.st_mtime_ns])
            except OSError as e:
                listed.append([str(f), None, e.strerror])
        out["files"] = listed
    try:
        out["name map"] = hashlib.sha256(name_map.read_bytes()).hexdigest()[:16] if name_map.is_file() else None
    except OSError:
        out["name map"] = None
    return out


def options_fingerprint(options) -> dict:
    """The PipelineOptions as JSON: every choice the compile reads."""
    return json.loads(json.dumps(dataclasses.asdict(options), sort_keys=True, default=str))


@dataclass
class Key:
    parts: dict
    digest: str = ""

    def __post_init__(self):
        if not self.digest:
            self.digest = hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()

    def describe(self) -> list[str]:
        p = self.parts
        w = p["weights"]
        if "seeded" in w:
            weights = f"seeded weights, seed {w['seeded']}"
        else:
            shown = [f"{f} ({size:,} bytes, mtime_ns {mtime})" if isinstance(size, int) else f"{f} ({mtime})"
                     for f, size, mtime in w["files"][:4]]
            more = f" and {len(w['files']) - 4} more" if len(w["files"]) > 4 else ""
            weights = f"{len(w['files'])} file(s): {'; '.join(shown)}{more}"
        if w.get("name map"):
            weights += f"; name map sha256 {w['name map']}"
        options = ", ".join(f"{k}={v}" for k, v in sorted(p["options"].items()))
        vers = ", ".join(f"{k} {v}" for k, v in p["versions"].items())
        return [f"key {self.digest[:16]}: sha256 of",
                f"  what: {p['what']}",
                f"  graph: sha256 {p['graph'][:16]} of {p['model']}'s elaborated graph (the spec, its variant "
                f"and --set, a checkpoint's config.json)",
                f"  weights: {weights}",
                f"  options: {options}",
                f"  versions: {vers}"]


def make_key(what: str, built, weights_path, seed: int, options) -> Key:
    return Key({"format": FORMAT, "what": what, "model": built.graph.name, "graph": graph_fingerprint(built),
                "weights": weights_fingerprint(built, weights_path, seed),
                "options": options_fingerprint(options), "versions": versions()})


# ------------------------------------------------------------------ a lookup
@dataclass
class Lookup:
    """One model's way through the cache: ``start`` computes the key, ``hit()`` gives the entry's model
    file (checked) or None, ``store(write)`` keeps a compile. ``state``: off, hit, miss (stored or not);
    ``line()`` and ``explain()`` say so (the progress line, --explain, the serving engine's statement)."""

    folder: Path | None
    source: str
    key: Key | None = None
    state: str = "off"
    entry: Path | None = None
    notes: list[str] = field(default_factory=list)
    stored: bool = False
    check_seconds: float = 0.0
    checked_bytes: int = 0
    _said: int = 0

    @classmethod
    def start(cls, o, what: str, built, weights_path, seed: int, options, off: bool = False) -> "Lookup":
        """``o``: options with ``compile_cache`` and ``no_compile_cache`` (options.CompileCacheOptions);
        ``off``: this compile is not cached (the caller says why in its own terms)."""
        if off:
            return cls(None, "off for this compile")
        folder, source = folder_for(o.compile_cache, o.no_compile_cache)
        out = cls(folder, source)
        if folder is not None:
            out.key = make_key(what, built, weights_path, seed, options)
            out.entry = folder / out.key.digest[:40]
        return out

    @property
    def on(self) -> bool:
        return self.folder is not None

    def hit(self) -> Path | None:
        """The entry's model file when the entry is whole and its key is this one; else None (a miss), an
        entry that fails the checks removed with a note."""
        if not self.on:
            return None
        self.state = "miss"
        if not self.entry.exists():
            return None
        t0 = time.perf_counter()
        problem = self._check()
        self.check_seconds = time.perf_counter() - t0
        if problem is not None:
            self.notes.append(f"compile cache entry {self.entry} {problem}; removed, compiling again")
            _remove(self.entry)
            return None
        try:
            os.utime(self.entry / MANIFEST)  # its last use, for the size bound's eviction
        except OSError:
            pass
        self.state = "hit"
        return self.entry / MODEL

    def _check(self) -> str | None:
        """Why the entry cannot be used, or None."""
        try:
            manifest = json.loads((self.entry / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return "has no manifest (a write that did not finish)"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            return f"has an unreadable manifest ({type(e).__name__})"
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return "is of another format"
        if manifest.get("key") != self.key.digest:
            return "holds another key"
        files = manifest.get("files")
        if not isinstance(files, dict) or MODEL not in files:
            return "has a manifest without its files"
        for name, want in files.items():
            if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(want, dict):
                return "has a manifest naming an unexpected file"
            path = self.entry / name
            try:
                size = path.stat().st_size
            except OSError:
                return f"lacks {name}"
            if size != want.get("size"):
                return f"has {name} of {size:,} bytes, not {want.get('size')} (truncated or changed)"
            if _sha256(path) != want.get("sha256"):
                return f"has {name} whose contents changed (sha256 differs)"
            self.checked_bytes += size
        return None

    def store(self, write) -> Path | None:
        """Keep a compile: ``write(folder)`` writes the model into a fresh folder and returns the files
        written; the manifest follows, and the folder is renamed into place. Returns the stored model
        file, or None (cache off, or the write failed: a note says why, and nothing is left behind)."""
        if not self.on:
            return None
        tmp = self.folder / f"{TMP_PREFIX}{self.key.digest[:16]}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            tmp.mkdir()
            written = [Path(p) for p in write(tmp)]
            files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in written}
            manifest = {"format": FORMAT, "key": self.key.digest, "parts": self.key.parts, "files": files,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(tmp, self.entry)
            except OSError:
                if not self.entry.exists():
                    raise
                _remove(tmp)  # another process stored the same key meanwhile: theirs is as good
        except OSError as e:
            _remove(tmp)
            self.notes.append(f"compile cache: could not store the compiled model in {self.folder} "
                              f"({e.strerror or e}); it runs from memory")
            return None
        except BaseException:
            _remove(tmp)
            raise
        self.stored = True
        evict(self.folder, keep=self.entry)
        return self.entry / MODEL

    # -------------------------------------------------------------- what it says
    def line(self) -> str:
        """One line: off (why), hit, or miss (stored or not)."""
        if not self.on:
            return f"compile cache: {self.source}"
        if self.state == "hit":
            return (f"compile cache: hit, {self.entry} (checked {self.checked_bytes / 1e6:,.1f} MB in "
                    f"{self.check_seconds:.1f} s)")
        if self.state == "miss":
            return f"compile cache: miss, compiled{' and stored in ' + str(self.entry) if self.stored else ''}"
        return f"compile cache: {self.folder} ({self.source})"

    def explain(self) -> str:
        lines = [self.line()] + self.notes
        if self.key is not None:
            lines += ["  " + s for s in self.key.describe()]
        return "\n".join(lines)

    def say_notes(self, file=None) -> None:
        """Print the notes not printed yet (a removed entry, a store that failed) to stderr."""
        for note in self.notes[self._said:]:
            print(f"note: {note}", file=file or sys.stderr)
        self._said = len(self.notes)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Remove an entry or a temporary folder: renamed aside first, so no reader sees half of it."""
    if not path.exists():
        return
    aside = path.with_name(f"{TMP_PREFIX}gone-{path.name}-{os.urandom(4).hex()}")
    try:
        os.rename(path, aside)
    except OSError:
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------ the folder's entries
@dataclass
class Entry:
    path: Path
    size: int
    used: float                 # the manifest's mtime: its last store or hit
    manifest: dict | None       # None: no readable manifest (partial)

    def as_dict(self) -> dict:
        m = self.manifest or {}
        parts = m.get("parts", {}) if isinstance(m.get("parts"), dict) else {}
        return {"entry": str(self.path), "bytes": self.size, "last_used": time.strftime(
            "%Y-%m-%dT%H:%M:%S", time.localtime(self.used)), "model": parts.get("model"),
                "what": parts.get("what"), "complete": self.manifest is not None}


def entries(folder: Path) -> list[Entry]:
    """The folder's entries, most recently used first (temporary folders left out)."""
    out = []
    try:
        children = list(Path(folder).iterdir())
    except OSError:
        return []
    for d in children:
        if not d.is_dir() or d.name.startswith(TMP_PREFIX):
            continue
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        try:
            manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            used = (d / MANIFEST).stat().st_mtime
        except (OSError, ValueError, RecursionError):
            manifest, used = None, d.stat().st_mtime
        out.append(Entry(d, size, used, manifest if isinstance(manifest, dict) else None))
    return sorted(out, key=lambda e: -e.used)


def max_bytes() -> int:
    text = os.environ.get(MAX_ENV)
    try:
        gb = float(text) if text is not None else DEFAULT_MAX_GB
    except ValueError:
        gb = DEFAULT_MAX_GB
    return int(max(gb, 0.0) * 2 ** 30)


def evict(folder: Path, keep: Path | None = None, limit: int | None = None) -> list[Path]:
    """Remove the least recently used entries while the folder holds more than ``limit`` bytes
    (``max_bytes()``); ``keep`` (the entry just stored) stays. Returns the entries removed."""
    limit = max_bytes() if limit is None else limit
    found = entries(folder)
    total = sum(e.size for e in found)
    removed = []
    for e in reversed(found):  # least recently used first
        if total <= limit:
            break
        if keep is not None and e.path == keep:
            continue
        _remove(e.path)
        total -= e.size
        removed.append(e.path)
    return removed


def clear(folder: Path) -> tuple[int, int]:
    """Remove every entry (and temporary folders left by writes that died over an hour ago); returns
    (entries removed, bytes freed)."""
    found = entries(folder)
    for e in found:
        _remove(e.path)
    now = time.time()
    for d in Path(folder).glob(TMP_PREFIX + "*"):
        try:
            if now - d.stat().st_mtime > 3600:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass
    return len(found), sum(e.size for e in found)
