"""Tessera's own metadata (``tessera.*`` metadata_props) read back from an ONNX file, as untrusted input.

Why: a compiled file may have been changed by hand, by another tool, or written by another version
of Tessera. Its metadata decides how big the cache buffers are, which names are bound and which
ids are refused, so a value of the wrong type, a negative layer count, a 10,000-deep JSON or a name
the graph does not have must not reach numpy or onnxruntime (RecursionError, OverflowError,
StopIteration, "Failed to find NodeArg"). Each value is parsed with bounded size and depth, then
checked against the schema the writer produces (the cache's: declared once on its dataclasses,
compiler/passes/cache_schema.py; compiler/ir/signature.py InputLimits.to_json); anything else is a ModelFileError saying the
file was not written by this version of Tessera, or was changed.
"""

from __future__ import annotations

import json

from tessera.compiler.ir.signature import InputLimits
from tessera.compiler.passes import cache_schema
from tessera.compiler.passes.kv_cache import CacheInfo

from tessera.runtime.errors import ModelFileError

MAX_METADATA_BYTES = 16 << 20  # a 1,000-layer cache description is about 300 KB
MAX_DEPTH = 8                  # the writers nest at most 3 deep
MAX_SIZE = cache_schema.MAX_SIZE  # rows, heads, head sizes, context: anything larger is not a real model


class _Bad(Exception):
    """One rule of the schema broken; ``what`` says where."""


def _changed(path, key: str, why: str) -> ModelFileError:
    return ModelFileError(f"{path}: its '{key}' metadata is malformed ({why}): this file was not written by this "
                          f"version of Tessera, or was changed; recompile it")


def parse_json(text: str, path, key: str):
    """A metadata value as JSON, its size and nesting bounded (json's decoder recurses per level)."""
    if len(text) > MAX_METADATA_BYTES:
        raise _changed(path, key, f"{len(text)} characters, more than {MAX_METADATA_BYTES}")
    try:
        data = json.loads(text)
    except RecursionError:
        raise _changed(path, key, "nested too deep") from None
    except ValueError as e:
        raise _changed(path, key, f"not JSON: {str(e)[:100]}") from None
    stack = [(data, 1)]
    while stack:  # without recursion: the depth is what is being checked
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _changed(path, key, f"nested more than {MAX_DEPTH} deep")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children)
    return data


def _obj(v, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(v, dict):
        raise _Bad(f"{what} must be a JSON object, got {type(v).__name__}")
    missing = [k for k in required if k not in v]
    if missing:
        raise _Bad(f"{what} has no '{missing[0]}'")
    extra = [k for k in v if k not in required + optional]
    if extra:
        raise _Bad(f"{what} has an unknown field '{str(extra[0])[:40]}'")
    return v


def _str(v, what: str, names: set[str] | None = None, empty: bool = False) -> str:
    if not isinstance(v, str) or (not v and not empty):
        raise _Bad(f"{what} must be a non-empty string, got {str(v)[:40]!r}")
    if names is not None and v and v not in names:
        raise _Bad(f"{what} names '{v[:60]}', which the graph does not have")
    return v


def _int(v, what: str, minimum: int, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= MAX_SIZE:
        raise _Bad(f"{what} must be an integer in [{minimum}, {MAX_SIZE}], got {str(v)[:40]}")
    return v


def _bool(v, what: str) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"{what} must be true or false, got {str(v)[:40]}")
    return v


def _list(v, what: str, nonempty: bool = False) -> list:
    if not isinstance(v, list) or (nonempty and not v):
        raise _Bad(f"{what} must be a{' non-empty' if nonempty else ''} list")
    return v


def cache_info(text: str, path, inputs: set[str], outputs: set[str]) -> CacheInfo:
    """``tessera.kv_cache``: the cached decoder's names and shapes, every name one the graph has. The
    schema is CacheInfo's own (compiler/passes/cache_schema.py: the writer's fields, read and checked)."""
    key = CacheInfo.METADATA_KEY
    data = parse_json(text, path, key)
    try:
        info = cache_schema.read(CacheInfo, data, inputs, outputs)
    except cache_schema.SchemaError as e:
        raise _changed(path, key, str(e)) from None
    problem = info.record_problem()
    if problem:
        raise _changed(path, key, problem)
    return info


QUANTIZE_KEY = "tessera.quantize"  # compiler/build.py model_metadata writes it


def quantization(text: str, path) -> dict:
    """``tessera.quantize``: the scheme, block size (0: one scale per output row), head, activations."""
    data = parse_json(text, path, QUANTIZE_KEY)
    try:
        q = _obj(data, "the value", ("scheme", "block_size", "head", "activations"), ("head_bits", "embedding_bits"))
        _str(q["scheme"], "scheme")
        _int(q["block_size"], "block_size", 0)
        _bool(q["head"], "head")
        _int(q.get("head_bits", 0), "head_bits", 0)  # 0: float, or a file written before the head had bits
        _int(q.get("embedding_bits", 0), "embedding_bits", 0)  # 0: float (or an older file)
        _str(q["activations"], "activations")
        return q
    except _Bad as e:
        raise _changed(path, QUANTIZE_KEY, str(e)) from None


def input_limits(text: str, path, inputs: set[str]) -> InputLimits:
    """``tessera.input_limits``: id ranges of inputs (names the graph has) and bounds of dimensions."""
    key = InputLimits.METADATA_KEY
    data = parse_json(text, path, key)
    try:
        d = _obj(data, "the value", (), ("ids", "dims"))
        out = []
        for part in ("ids", "dims"):
            entries = d.get(part, {})
            if not isinstance(entries, dict):
                raise _Bad(f"{part} must be a JSON object")
            limits = {}
            for name, value in entries.items():
                _str(name, f"a name in {part}", inputs if part == "ids" else None)
                pair = _list(value, f"{part}.{name[:40]}")
                if len(pair) != 2:
                    raise _Bad(f"{part}.{name[:40]} must be [rows, table]")
                at = f"{part}.{name[:40]}"
                limits[name] = (_int(pair[0], f"{at} rows", 1), _str(pair[1], f"{at} table"))
            out.append(limits)
        return InputLimits(*out)
    except _Bad as e:
        raise _changed(path, key, str(e)) from None
