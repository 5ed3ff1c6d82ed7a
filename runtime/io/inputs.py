"""Parse ``--input NAME=VALUE`` arguments (a JSON array or a .npy file) into arrays."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES
from tessera.compiler.ir.signature import InputError, InputSpec


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
        feeds[name] = _value(name, text, spec)
    return feeds


def _value(name: str, text: str, spec: InputSpec) -> np.ndarray:
    want = np.dtype(DTYPES[spec.dtype])
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
        try:
            arr = np.array(data)
        except ValueError:
            raise InputError(f"input '{name}': the JSON array is not rectangular; expected {spec}") from None
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise InputError(f"input '{name}': expected numbers in a rectangular array of shape {spec}")
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
