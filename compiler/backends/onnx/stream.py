"""Write an ONNX file with its weights streamed in, one tensor at a time.

Why: building a ModelProto that holds every weight and then serialising it keeps the weights in
memory about three times over (the arrays, the proto's copies, the serialised bytes) and spends
seconds copying. Here the model is built without its weights (a skeleton of a few kilobytes), and
each weight goes from its source straight to the file: the skeleton's bytes are written around
the tensors in protobuf's wire format, whose lengths are all known from the shapes in advance.

Two layouts:
- inline: one ``.onnx`` file; each streamed tensor is a ``GraphProto.initializer`` entry with
  ``raw_data``. Protobuf parsers concatenate repeated fields and merge a message field that
  appears more than once, so the streamed initializers are written first, then the rest of the
  graph, then the model's other fields (the same bytes for the same inputs: files stay deterministic).
- external: tensors of at least ``EXTERNAL_MIN_BYTES`` go to ``<name>.onnx.data`` at offsets
  aligned to 4096 bytes (onnxruntime can map aligned data instead of copying it); the model file
  is the skeleton with ``external_data`` references, small tensors inline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Callable

import numpy as np
from onnx import ModelProto, TensorProto

EXTERNAL_MIN_BYTES = 1024  # smaller tensors stay in the model file (as onnx.save_model does)
ALIGN = 4096


@dataclass
class Streamed:
    """One tensor to be written: its ONNX name, shape and element type, and where its values come from."""

    name: str
    shape: tuple[int, ...]
    onnx_type: int
    dtype: np.dtype
    values: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        """The values, checked against the declared shape, in the declared dtype (converted only
        if the source holds another dtype; never copied when it already matches)."""
        arr = contiguous(self.values(), self.dtype)
        if tuple(arr.shape) != tuple(self.shape):
            raise ValueError(f"tensor {self.name} has shape {list(arr.shape)}, expected {list(self.shape)}")
        return arr

    def header(self) -> TensorProto:
        t = TensorProto()
        t.name = self.name
        t.dims.extend(self.shape)
        t.data_type = self.onnx_type
        return t


def contiguous(values, dtype) -> np.ndarray:
    """``values`` as a C-contiguous array of ``dtype``, copied only if it is not one already
    (np.ascontiguousarray would turn a 0-d array into a 1-d one)."""
    arr = np.asarray(values, dtype=dtype)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def open_output(path) -> BinaryIO:
    """The file a layout writes to (a seam for tests that simulate a full disk)."""
    return open(path, "wb")


# ------------------------------------------------------------------ protobuf wire format
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int) -> bytes:  # a length-delimited field's key (wire type 2)
    return _varint(field << 3 | 2)


_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data


def _initializer_prefix(t: Streamed) -> bytes:
    """Everything of the initializer entry before its raw bytes."""
    head = t.header().SerializeToString() + _key(_RAW_DATA) + _varint(t.nbytes)
    return _key(_INITIALIZER) + _varint(len(head) + t.nbytes) + head


AHEAD = 2  # tensors fetched ahead of the one being written, each by its own worker thread


# progress(bytes written, bytes in all) after each tensor: the command line's progress bar (runtime/progress.py)
Progress = Callable[[int, int], None]


def _arrays(tensors: list[Streamed], progress: Progress | None = None):
    """Each tensor's values in turn, the next AHEAD fetched (drawn, read, converted) by worker
    threads while the caller writes the current one: numpy's generators and file reads release the
    GIL, so drawing runs on every core and overlaps writing. At most AHEAD + 1 tensors are held;
    each tensor's values do not depend on which thread fetched it. ``progress`` is told once the
    caller has written each one."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    total, done = sum(t.nbytes for t in tensors), 0
    with ThreadPoolExecutor(max_workers=AHEAD) as pool:
        pending = deque(pool.submit(t.array) for t in tensors[:AHEAD])
        for t, nxt in zip(tensors, tensors[AHEAD:] + [None] * min(AHEAD, len(tensors))):
            arr = pending.popleft().result()
            if nxt is not None:
                pending.append(pool.submit(nxt.array))
            yield arr
            del arr
            done += t.nbytes
            if progress is not None:
                progress(done, total)


def _write(f: BinaryIO, arr: np.ndarray) -> None:
    if arr.dtype.kind == "V":  # bfloat16 (ml_dtypes): no buffer format; its bytes as they lie
        arr = np.ascontiguousarray(arr).view(np.uint16)
    f.write(memoryview(arr).cast("B") if arr.ndim else arr.tobytes())


# ------------------------------------------------------------------ layouts
def write_inline(model: ModelProto, tensors: list[Streamed], f: BinaryIO, progress: Progress | None = None) -> None:
    """The model with every streamed tensor as an initializer with raw_data, in one stream."""
    graph = model.graph.SerializeToString()
    rest = ModelProto()
    rest.CopyFrom(model)  # the skeleton: no weights in it, so the copy is small
    rest.ClearField("graph")
    prefixes = [_initializer_prefix(t) for t in tensors]
    total = len(graph) + sum(len(p) + t.nbytes for p, t in zip(prefixes, tensors))
    f.write(_key(_GRAPH) + _varint(total))
    for p, arr in zip(prefixes, _arrays(tensors, progress)):
        f.write(p)
        _write(f, arr)
    f.write(graph)
    f.write(rest.SerializeToString())


def external_layout(model: ModelProto, tensors: list[Streamed], location: str) -> tuple[ModelProto, list[tuple[int, Streamed]]]:
    """The model file's proto (small tensors inline, the others referenced at aligned offsets of
    ``location``) and the (offset, tensor) list of the data file."""
    out = ModelProto()
    out.CopyFrom(model)
    placed, offset, front = [], 0, []
    for t in tensors:
        init = t.header()
        if t.nbytes < EXTERNAL_MIN_BYTES:
            init.raw_data = t.array().tobytes()
        else:
            offset = -(-offset // ALIGN) * ALIGN
            init.data_location = TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(t.nbytes))):
                e = init.external_data.add()
                e.key, e.value = k, v
            placed.append((offset, t))
            offset += t.nbytes
        front.append(init)
    inits = list(out.graph.initializer)
    out.graph.ClearField("initializer")
    out.graph.initializer.extend(front + inits)  # streamed tensors first, as inline files have them
    return out, placed


def write_external_data(placed: list[tuple[int, Streamed]], f: BinaryIO, progress: Progress | None = None) -> None:
    pos = 0
    for (offset, t), arr in zip(placed, _arrays([t for _, t in placed], progress)):
        if offset > pos:
            f.write(b"\0" * (offset - pos))
        _write(f, arr)
        pos = offset + t.nbytes


def fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
