"""An ONNX file's structure without its weight bytes.

Before onnxruntime opens a compiled file, ``tessera run`` and ``generate`` read its inputs, its
metadata and its Loop trip counts. ``onnx.load`` would parse the whole protobuf, weights included:
for a file holding its weights inline (GPT-2 small: 498 MB) that is the weights read and parsed
once more beside the ones onnxruntime then loads, and the allocator keeps much of it after it is
freed (measured: the run's peak resident set 1.26 GB against 0.96 GB for onnxruntime alone).

So the file is mapped, its protobuf wire format is walked down to the top-level graph's
initializers, and every byte is copied except the data of initializers larger than
``KEEP_DATA_BYTES`` (their names, types and shapes stay); what is left is parsed as usual. Small
tensors (shape constants, Loop trip counts) keep their data. A file whose wire format does not
hold together raises ``ValueError`` naming what is wrong; the caller turns it into its own error.
"""

from __future__ import annotations

import mmap
from pathlib import Path

KEEP_DATA_BYTES = 1 << 16
"""Initializers up to this many bytes keep their data (every constant the checks read is far smaller)."""

_GRAPH, _INITIALIZER = 7, 5            # ModelProto.graph, GraphProto.initializer
_TENSOR_DATA = {4, 5, 6, 7, 9, 10, 11}  # TensorProto float/int32/string/int64/raw/double/uint64 data
_MAX_VARINT_BYTES = 10


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos >= end:
            raise ValueError("a field is cut short (truncated file)")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("a varint runs past 10 bytes")


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, start of the field's key, start of its payload, end) for each field."""
    pos = start
    while pos < end:
        key_at = pos
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("a field numbered 0")
        if wire == 0:
            _, pos_end = _varint(buf, pos, end)
        elif wire == 1:
            pos_end = pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            pos_end = pos + length
        elif wire == 5:
            pos_end = pos + 4
        else:
            raise ValueError(f"wire type {wire} (groups or garbage)")
        if pos_end > end:
            raise ValueError("a field runs past its message (truncated file)")
        yield field, wire, key_at, pos, pos_end
        pos = pos_end


def _without_data(buf, start: int, end: int) -> bytearray:
    """A TensorProto's bytes with its data fields left out."""
    out = bytearray()
    for field, _, key_at, _, field_end in _fields(buf, start, end):
        if field not in _TENSOR_DATA:
            out += buf[key_at:field_end]
    return out


def _graph(buf, start: int, end: int) -> bytearray:
    out = bytearray()
    for field, wire, key_at, at, field_end in _fields(buf, start, end):
        if field == _INITIALIZER and wire == 2 and field_end - at > KEEP_DATA_BYTES:
            tensor = _without_data(buf, at, field_end)
            out += _encode_varint(_INITIALIZER << 3 | 2) + _encode_varint(len(tensor)) + tensor
        else:
            out += buf[key_at:field_end]
    return out


def skeleton_of(model: bytes | memoryview) -> bytes:
    """Serialised ModelProto bytes with the data of the large top-level initializers left out."""
    out = bytearray()
    for field, wire, key_at, at, field_end in _fields(model, 0, len(model)):
        if field == _GRAPH and wire == 2:
            graph = _graph(model, at, field_end)
            out += _encode_varint(_GRAPH << 3 | 2) + _encode_varint(len(graph)) + graph
        else:
            out += model[key_at:field_end]
    return bytes(out)


def skeleton_bytes(path: str | Path) -> bytes:
    """The file's ModelProto bytes with the data of its large top-level initializers left out (the
    file mapped, not read: only what is kept is copied)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            return skeleton_of(view)
        finally:
            view.release()
