"""What ``tessera run`` does with its outputs: JSON that stays small, and .npy files.

GPT-2's logits for 1,024 tokens are 51 M floats: as JSON text that is about 1 GB built in memory.
So ``--format json`` summarises any output of more than SUMMARY_ELEMENTS elements (shape, dtype,
min, max, mean and the first HEAD_VALUES values, computed without copying the array) and prints
the values in full only with ``--full``, streamed element by element rather than built as one
string. ``--save DIR`` writes each output as DIR/<name>.npy through the atomic writer
(compiler/backends/atomic.py), so a failed run never leaves a partial file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TextIO

import numpy as np

from tessera.compiler.backends.atomic import OutputError, write_atomically

SUMMARY_ELEMENTS = 10_000
HEAD_VALUES = 8
FULL_MAX_ELEMENTS = 50_000_000  # --full: about 1 GB of JSON text; past it, --save DIR writes .npy files
ROW_CHUNK = 4096  # elements turned into text at a time, however long an innermost row is


def summary(v: np.ndarray) -> dict:
    """Shape, dtype, min, max, mean (in float64) and the first values of ``v``."""
    flat = v.reshape(-1)
    out = {"shape": list(v.shape), "dtype": str(v.dtype), "size": int(v.size), "summarised": True}
    if v.size:
        stats = v.astype(np.float64, copy=False) if v.dtype.kind == "b" else v
        out.update(min=_scalar(stats.min()), max=_scalar(stats.max()),
                   mean=_scalar(stats.mean(dtype=np.float64)), first=[_scalar(x) for x in flat[:HEAD_VALUES]])
    return out


def _scalar(x) -> float | int | bool | str:
    """A numpy scalar as JSON: NaN and infinities as the strings "nan", "inf", "-inf"."""
    x = x.item()
    return x if not isinstance(x, float) or np.isfinite(x) else str(x)


def print_json(outputs: dict[str, np.ndarray], provider: str, full: bool, stream: TextIO) -> None:
    """One JSON object {provider, outputs: {name: {shape, dtype, values} or a summary}}; large
    outputs are summarised unless ``full``, and full values are written row by row."""
    if full:  # refused before anything is written: half a JSON document is no use to anyone
        big = {name: v.size for name, v in outputs.items() if v.size > FULL_MAX_ELEMENTS}
        if big:
            name, size = next(iter(big.items()))
            raise OutputError(f"--full: output '{name}' has {size:,} elements, more than the {FULL_MAX_ELEMENTS:,} "
                              f"that --format json --full prints (about 20 bytes of text each); use --save DIR to "
                              f"write it as a .npy file")
    stream.write('{"provider": ' + json.dumps(provider) + ', "outputs": {')
    for i, (name, v) in enumerate(outputs.items()):
        stream.write((", " if i else "") + json.dumps(name) + ": ")
        if full or v.size <= SUMMARY_ELEMENTS:
            stream.write('{"shape": ' + json.dumps(list(v.shape)) + ', "dtype": ' + json.dumps(str(v.dtype))
                         + ', "values": ')
            _write_values(v, stream)
            stream.write("}")
        else:
            stream.write(json.dumps(summary(v)))
    stream.write("}}\n")


def _write_values(v: np.ndarray, stream: TextIO) -> None:
    """Nested JSON lists, ROW_CHUNK elements of an innermost row at a time (memory: that chunk's text)."""
    if v.ndim == 0:
        stream.write(json.dumps(v.tolist()))
        return
    if v.ndim == 1:
        stream.write("[")
        for start in range(0, v.shape[0], ROW_CHUNK):
            stream.write((", " if start else "") + json.dumps(v[start:start + ROW_CHUNK].tolist())[1:-1])
        stream.write("]")
        return
    stream.write("[")
    for i in range(v.shape[0]):
        if i:
            stream.write(", ")
        _write_values(v[i], stream)
    stream.write("]")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_name(output: str) -> str:
    """An output's name as a file name: characters other than letters, digits, '.', '_' and '-'
    become '_' (an output named 'a/b' must not write outside the folder)."""
    name = _UNSAFE.sub("_", output).lstrip(".") or "output"
    return name[:200] + ".npy"


def check_folder(folder: str) -> Path:
    """--save's folder: refused before the run when it cannot hold files."""
    if not folder:
        raise OutputError("--save '' names no folder")
    path = Path(folder)
    try:
        if path.exists() and not path.is_dir():
            raise OutputError(f"--save {path}: exists and is not a folder")
        existing = next((a for a in [path, *path.parents] if a.exists()), None)
        if existing is not None and not existing.is_dir():
            raise OutputError(f"--save {path}: {existing} is a file, not a folder")
    except ValueError:
        raise OutputError(f"invalid --save folder {folder!r}") from None
    except OSError as e:
        raise OutputError(f"--save {path}: {e.strerror or e}") from None
    return path


def save_npy(outputs: dict[str, np.ndarray], folder: str) -> list[Path]:
    """Write every output as folder/<name>.npy (atomically, allow_pickle=False); returns the files."""
    root = check_folder(folder)
    names = {k: file_name(k) for k in outputs}
    clash = [n for n in set(names.values()) if list(names.values()).count(n) > 1]
    if clash:
        raise OutputError(f"--save: outputs {', '.join(k for k in outputs if names[k] in clash)} would share "
                          f"the file name {clash[0]}")
    written = []
    for k, v in outputs.items():
        def write(tmp: Path, v=v) -> None:
            with open(tmp, "wb") as f:
                np.save(f, v, allow_pickle=False)

        written.append(write_atomically(root / names[k], write, "output.npy"))
    return written


__all__ = ["SUMMARY_ELEMENTS", "HEAD_VALUES", "summary", "print_json", "save_npy", "check_folder", "file_name"]
