"""Parse ``--input NAME=VALUE`` arguments: every command's --input parser.

``tessera run`` takes arrays (``parse_inputs``: a JSON array or a .npy file, checked against the
input's element type). ``tessera generate`` takes token ids for its prompts (``named_token_rows``:
one list per prompt, rows of any lengths, since prompts are left-padded by the loop) and, for an
encoder-decoder's source inputs, arrays parsed as run parses them (``parse_value``: token ids,
or Whisper's float log-mel features as a literal or a .npy file); ``split_named`` checks the
NAME=VALUE form and the names for both. Bad values are clear errors (InputError for arrays,
UsageError for the form and for prompts), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES
from tessera.compiler.ir.signature import InputError, InputSpec
from tessera.spec.diagnostics import did_you_mean

from tessera.runtime.errors import UsageError


def parse_inputs(items: list[str], specs: list[InputSpec]) -> dict[str, np.ndarray]:
    by_name = {s.name: s for s in specs}
    feeds: dict[str, np.ndarray] = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"--input '{item}' must be NAME=VALUE (VALUE: a JSON array or a .npy file)")
        name, text = item.split("=", 1)
        if name in feeds:
            raise InputError(f"input '{name}' is given twice")
        spec = by_name.get(name)
        if spec is None:
            raise InputError(f"unknown input '{name}'; the model's inputs are: "
                             + ", ".join(f"{s.name}: {s}" for s in specs))
        feeds[name] = parse_value(name, text, spec)
    return feeds


def parse_value(name: str, text: str, spec: InputSpec, ragged: str = "") -> np.ndarray:
    """One input's VALUE (a JSON array or a .npy path) as an array of the input's element type;
    ``ragged``: a hint added to the error for rows of uneven lengths."""
    if text.endswith(".npy"):
        path = Path(text)
        if not path.exists():
            raise InputError(f"input '{name}': file not found: {path}")
        if not path.is_file():
            raise InputError(f"input '{name}': {path} is not a regular file")
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"input '{name}': cannot read {path} as .npy: {e}") from None
        if not isinstance(arr, np.ndarray):
            raise InputError(f"input '{name}': {path} holds an archive, not one array")
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"input '{name}': value is neither a JSON array nor a .npy path ({e.msg} at "
                             f"character {e.pos}); expected {spec}") from None
        except RecursionError:  # json's decoder recurses per level; numpy takes at most 64 dimensions anyway
            raise InputError(f"input '{name}': the JSON array is nested too deep; expected {spec}") from None
        arr = _rectangular(name, data, spec, ragged=ragged)
    return _cast(name, arr, spec)


def _rectangular(name: str, data, spec: InputSpec, what: str = "the JSON array", ragged: str = "") -> np.ndarray:
    """Nested lists of numbers as one array; ragged rows, strings, None, dicts or integers past int64
    (numpy would make an object array of them) are InputErrors naming the input."""
    try:
        arr = np.array(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise InputError(f"input '{name}': {what} is not rectangular{ragged}; expected {spec}") from None
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise InputError(f"input '{name}': expected numbers (integers within int64 for ids) in a rectangular "
                         f"array of shape {spec}")
    return arr


def to_array(name: str, value, specs: list[InputSpec]) -> np.ndarray:
    """An input given as a Python value (the API's ``run(tokens=...)``, an array or nested lists),
    under --input's rules: float or bool values for an integer input are refused, never truncated."""
    spec = next((s for s in specs if s.name == name), None)
    if spec is None:
        raise InputError(f"unknown input '{name}'; the model's inputs are: "
                         + ", ".join(f"{s.name}: {s}" for s in specs))
    arr = value if isinstance(value, np.ndarray) else _rectangular(name, value, spec, "the array")
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise InputError(f"input '{name}': expected numbers in a rectangular array of shape {spec}, "
                         f"got dtype {arr.dtype}")
    return _cast(name, arr, spec)


def _cast(name: str, arr: np.ndarray, spec: InputSpec) -> np.ndarray:
    """``arr`` as the input's element type, where that loses nothing a user meant."""
    want = np.dtype(DTYPES[spec.dtype])
    if arr.dtype == want:
        return arr
    if arr.size == 0:
        return arr.astype(want)  # empty: reported as an empty axis by the shape check
    if want.kind in "iu" and arr.dtype.kind == "f":
        raise InputError(f"input '{name}' holds floating-point values but expects {spec.dtype} (shape {spec})")
    if arr.dtype.kind == "b" and want.kind != "b":
        raise InputError(f"input '{name}' holds true/false values but expects {spec.dtype} (shape {spec})")
    if not np.can_cast(arr.dtype, want, "same_kind") and not (arr.dtype.kind in "iub" and want.kind in "iuf"):
        raise InputError(f"input '{name}' has dtype {arr.dtype}, expected {spec.dtype} (shape {spec})")
    return arr.astype(want)


def _json_rows(name: str, text: str) -> list[list[int]]:
    """--input NAME=JSON: one list of integer ids per row (a flat list is one row)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--input {name}: not a JSON list ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise UsageError(f"--input {name}: the JSON list is nested too deep; give rows of token ids, e.g. "
                         f"{name}=[[464, 2068]]") from None
    if isinstance(data, list) and data and all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(p, list) for p in data):
        raise UsageError(f"--input {name} must be a list of rows, each a list of token ids, e.g. {name}=[[464, 2068]]")
    for i, p in enumerate(data):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise UsageError(f"--input {name}: row {i} holds something other than integer token ids")
    return data


def split_named(items: list[str], allowed: list[str]) -> dict[str, str]:
    """Every --input NAME=VALUE as {NAME: VALUE}, each NAME one of ``allowed`` and given once."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"--input '{item}' must be NAME=JSON, e.g. '{allowed[0]}=[[464, 2068], [7586]]'")
        if name not in allowed:
            raise UsageError(f"--input {name}: the model has no such input (its inputs: {', '.join(allowed)})"
                             + did_you_mean(name, allowed))
        if name in out:
            raise UsageError(f"--input {name} is given more than once; give every row in one list: "
                             f"'{name}=[[...], [...]]'")
        out[name] = text
    return out


def named_token_rows(items: list[str], allowed: list[str]) -> dict[str, list[list[int]]]:
    """Every --input NAME=JSON, each NAME one of the model's inputs and given once, as rows of ids."""
    return {name: _json_rows(name, text) for name, text in split_named(items, allowed).items()}
