"""The cached decoder's interface as the model file records it (``tessera.kv_cache``): one schema,
declared on the dataclasses' fields (CacheInfo, CacheLayer, CacheKernel, CacheState), from which the
writer (``to_json``), the trusting reader (``from_json``) and the checking reader of an untrusted file
(``read``, used by runtime/metadata.py) are all derived. A field added to one of those dataclasses
is written, read and checked with no other change; a field without a schema is refused at import.

Each field's ``metadata["json"]`` is a ``Kind``: what the value is (a graph input's name, an output's,
a size, a choice, a list of records ...). Fields with ``metadata["json"] is None`` are not written
(``--explain``'s notes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_SIZE = 1 << 40  # rows, heads, head sizes, context: anything larger is not a real model


class SchemaError(Exception):
    """A value breaks the schema; the message says where (``layers[3].kv_heads must be ...``)."""


@dataclass(frozen=True)
class Kind:
    """What one field holds. ``what``: name (non-empty text), text (any text), input / output (a name
    of the graph's inputs or outputs; ``empty``: may be ""), int (``minimum`` to MAX_SIZE), bool,
    choice (one of ``choices``), records (a list of the dataclass ``of``), ints (a non-empty list of
    ints >= ``minimum``). ``optional``: None is allowed."""

    what: str
    minimum: int = 0
    choices: tuple = ()
    of: Any = None
    empty: bool = False
    optional: bool = False
    nonempty: bool = False


def json(kind: Kind | None, **field_args):
    """A dataclass field with its schema (``json(Kind("input"))``, ``json(Kind("int", 1), default=0)``)."""
    return dataclasses.field(metadata={"json": kind}, **field_args)


def _fields(cls) -> list[dataclasses.Field]:
    out = []
    for f in dataclasses.fields(cls):
        if "json" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no schema (cache_schema.json(Kind(...)))")
        if f.metadata["json"] is not None:
            out.append(f)
    return out


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def to_json(obj) -> dict:
    """The record as the file holds it (every field with a schema; records and lists of them nested)."""
    out = {}
    for f in _fields(type(obj)):
        v = getattr(obj, f.name)
        out[f.name] = [to_json(x) for x in v] if f.metadata["json"].what == "records" else \
            list(v) if isinstance(v, (list, tuple)) else v
    return out


def from_json(cls, data: dict):
    """A record from what ``to_json`` wrote (trusted: the compiler's own output)."""
    args = {}
    for f in _fields(cls):
        if f.name in data:
            v = data[f.name]
            args[f.name] = [from_json(f.metadata["json"].of, x) for x in v] if f.metadata["json"].what == "records" else v
    return cls(**args)


def read(cls, data, inputs: set[str], outputs: set[str], at: str = "the value"):
    """A record from an untrusted file: every field checked against its Kind (names against the graph's
    ``inputs`` and ``outputs``), no unknown field, every required one present. Raises SchemaError."""
    if not isinstance(data, dict):
        raise SchemaError(f"{at} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in _fields(cls)}
    missing = [n for n, f in fields.items() if _required(f) and n not in data]
    if missing:
        raise SchemaError(f"{at} has no '{missing[0]}'")
    extra = [k for k in data if k not in fields]
    if extra:
        raise SchemaError(f"{at} has an unknown field '{str(extra[0])[:40]}'")
    args = {}
    for name, value in data.items():
        where = name if at == "the value" else f"{at}.{name}"
        args[name] = _check(fields[name].metadata["json"], value, where, inputs, outputs)
    return cls(**args)


def _check(k: Kind, v, where: str, inputs: set[str], outputs: set[str]):
    if v is None and k.optional:
        return None
    if k.what in ("name", "text", "input", "output"):
        if not isinstance(v, str) or (not v and not (k.empty or k.what == "text")):
            raise SchemaError(f"{where} must be a non-empty string, got {str(v)[:40]!r}")
        names = inputs if k.what == "input" else outputs if k.what == "output" else None
        if names is not None and v and v not in names:
            raise SchemaError(f"{where} names '{v[:60]}', which the graph does not have")
        return v
    if k.what == "int":
        if not isinstance(v, int) or isinstance(v, bool) or not k.minimum <= v <= MAX_SIZE:
            raise SchemaError(f"{where} must be an integer in [{k.minimum}, {MAX_SIZE}], got {str(v)[:40]}")
        return v
    if k.what == "bool":
        if not isinstance(v, bool):
            raise SchemaError(f"{where} must be true or false, got {str(v)[:40]}")
        return v
    if k.what == "choice":
        if v not in k.choices:
            raise SchemaError(f"{where} must be one of {', '.join(map(str, k.choices))}, got {str(v)[:40]!r}")
        return v
    if k.what in ("records", "ints"):
        if not isinstance(v, list) or (k.nonempty and not v):
            raise SchemaError(f"{where} must be a{' non-empty' if k.nonempty else ''} list")
        if k.what == "ints":
            return [_check(Kind("int", k.minimum), x, f"{where}[{i}]", inputs, outputs) for i, x in enumerate(v)]
        return [read(k.of, x, inputs, outputs, f"{where}[{i}]") for i, x in enumerate(v)]
    raise TypeError(f"unknown schema kind {k.what!r}")  # pragma: no cover - a bug in a declaration
