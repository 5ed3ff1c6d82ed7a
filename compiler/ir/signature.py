"""Checking concrete inputs against a model's declared inputs.

A model's inputs are described by InputSpecs (name, dtype, dims), read from an
IR graph or from an ONNX file. ``bind_inputs`` binds the symbolic dimensions
(B, T, ...) from the arrays given and reports any mismatch by naming the
input with its expected shape and dtype. The numpy interpreter and the
runtime both check inputs this way before anything runs.

``input_limits`` reads what the model's tables allow: an integer input that
indexes an embedding table must hold ids in [0, rows), and a dimension used as
positions into a table (``embedding(arange(T), ctx, d)``) must be at most the
table's rows, or, for a table read at ``a * arange(T) + c`` (BART's ``arange(T) + 2``;
ir/affine_index.py), at most the positions it serves. ONNX would wrap a negative id to the table's
end and fail deep inside onnxruntime on an id past it; checked here, the error names the input,
the offending value and the table. The export stores the limits in the ONNX
file's metadata so ``tessera run model.onnx`` checks them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.affine_index import NotAffine, affine_reads, positions_reached
from tessera.compiler.ir.graph import DTYPES, Graph


class InputError(Exception):
    """A run input that does not fit the model's declared inputs."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str  # Tessera dtype name: f32, i64, ...
    dims: tuple  # ints, or names of symbolic dimensions

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.dims)}]"


def specs_from_graph(graph: Graph) -> list[InputSpec]:
    out = []
    for name in graph.inputs:
        t = graph.type_of(name)
        out.append(InputSpec(name, t.dtype, tuple(int(d) if dims.is_static(d) else dims.fmt(d) for d in t.shape)))
    return out


@dataclass
class InputLimits:
    """Id ranges of inputs that index a table, and upper bounds of dimensions used as positions."""

    ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # input -> (table rows, table)
    dims: dict[str, tuple[int, str]] = field(default_factory=dict)  # symbol -> (table rows, table)

    METADATA_KEY = "tessera.input_limits"

    def to_json(self) -> dict:
        return {"ids": {k: list(v) for k, v in sorted(self.ids.items())},
                "dims": {k: list(v) for k, v in sorted(self.dims.items())}}

    @classmethod
    def from_json(cls, text: str) -> "InputLimits":
        data = json.loads(text)  # a malformed value raises ValueError/TypeError for the caller to report
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return cls({str(k): (int(r), str(t)) for k, (r, t) in data.get("ids", {}).items()},
                   {str(k): (int(r), str(t)) for k, (r, t) in data.get("dims", {}).items()})


def input_limits(graph: Graph) -> InputLimits:
    """The limits the graph's embedding tables set (the smallest table wins where several share an input)."""
    limits = InputLimits()

    def tighten(where: dict, key: str, rows: int, table: str) -> None:
        if key not in where or rows < where[key][0]:
            where[key] = (rows, table)

    for n in graph.nodes.values():
        if n.op == "rope" and n.attrs.get("max_ctx"):  # rotary positions declare their trained context
            t_dim = dims.dim(graph.type_of(n.inputs[0]).shape[-2])
            if not dims.is_static(t_dim) and t_dim.is_Symbol and len(n.inputs) == 1:
                tighten(limits.dims, str(t_dim), int(n.attrs["max_ctx"]), f"{n.scope or n.name} (rotary max_ctx)")
            continue
        if n.op not in ("embedding", "embedding_nbits"):  # a table's codes have its rows too
            continue
        ids, table = n.inputs[0], n.inputs[1]
        rows = dims.static_int(graph.type_of(table).shape[0])
        derive = getattr(graph.params.get(table), "derive", None)
        if n.op == "embedding_nbits" and isinstance(derive, tuple) and len(derive) > 1:
            table = derive[1]  # the errors name the table the codes stand for, not the codes
        producer = graph.producer(ids)
        if rows is None:
            continue
        if ids in graph.inputs:
            tighten(limits.ids, ids, rows, table)
        elif producer is not None and producer.op == "arange":
            n_dim = dims.dim(producer.attrs["n"])
            if not dims.is_static(n_dim) and n_dim.is_Symbol:
                tighten(limits.dims, str(n_dim), rows, table)
    for n in graph.nodes.values():  # tables read at a * arange(T) + c (BART's arange(T) + 2): ir/affine_index.py
        if n.op != "arange":
            continue
        n_dim = dims.dim(n.attrs["n"])
        if dims.is_static(n_dim) or not n_dim.is_Symbol:
            continue
        try:
            reads = affine_reads(graph, n)
        except NotAffine:  # some other use: only the direct reads above are bounded
            continue
        for read in reads:
            rows = dims.static_int(graph.type_of(read.embedding.inputs[1]).shape[0])
            if rows is not None and read.chain and read.a >= 1 and read.c >= 0:
                table = read.embedding.inputs[1]
                where = f"{table} (read at {_affine(read.a, read.c)})"
                tighten(limits.dims, str(n_dim), positions_reached(rows, read.a, read.c), where)
    return limits


def _affine(a: int, c: int) -> str:
    """The index ``a * position + c`` as the error message shows it."""
    return ("position" if a == 1 else f"{a} * position") + (f" + {c}" if c else "")


def check_limits(limits: InputLimits, feeds: dict[str, np.ndarray], bindings: dict[str, int]) -> None:
    for name, (rows, table) in limits.ids.items():
        arr = feeds.get(name)
        if arr is None or arr.size == 0:
            continue
        bad = np.argwhere((arr < 0) | (arr >= rows))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            raise InputError(f"input '{name}' holds {int(arr[at])} at {list(at)}, but its values index the "
                             f"{rows} rows of '{table}': they must be in [0, {rows})"
                             + (f" ({len(bad)} values are out of range)" if len(bad) > 1 else ""))
    for sym, (rows, table) in limits.dims.items():
        if sym in bindings and bindings[sym] > rows:
            raise InputError(f"{sym}={bindings[sym]} is longer than the {rows} positions of '{table}'; "
                             f"the model takes at most {sym}={rows}")


def bind_inputs(specs: list[InputSpec] | Graph, feeds: dict[str, np.ndarray],
                limits: InputLimits | None = None) -> dict[str, int]:
    """Check feeds against the inputs (and the limits, if given); return the symbol bindings, e.g. {'B': 2, 'T': 5}.

    Given a Graph, its own limits are checked."""
    if isinstance(specs, Graph):
        limits = input_limits(specs) if limits is None else limits
        specs = specs_from_graph(specs)
    by_name = {s.name: s for s in specs}
    missing = [s for s in specs if s.name not in feeds]
    extra = [n for n in feeds if n not in by_name]
    if missing or extra:
        parts = []
        if missing:
            parts.append("missing input " + ", ".join(f"'{s.name}' ({s})" for s in missing))
        if extra:
            parts.append("unknown input " + ", ".join(f"'{n}'" for n in extra))
        raise InputError(f"{'; '.join(parts)}; the model's inputs are: "
                         + ", ".join(f"{s.name}: {s}" for s in specs))
    bindings: dict[str, int] = {}
    for s in specs:
        arr = feeds[s.name]
        want_dtype = np.dtype(DTYPES[s.dtype])
        if arr.dtype != want_dtype:
            raise InputError(f"input '{s.name}' has dtype {arr.dtype}, expected {s.dtype} (shape {s})")
        if arr.ndim != len(s.dims):
            raise InputError(f"input '{s.name}' has shape {list(arr.shape)}, expected {s} (rank {len(s.dims)})")
        for axis, (d, n) in enumerate(zip(s.dims, arr.shape)):
            if isinstance(d, int):
                if d != n:
                    raise InputError(f"input '{s.name}' has shape {list(arr.shape)}, expected {s} "
                                     f"(axis {axis} must be {d})")
            elif d.isidentifier():
                if d in bindings and bindings[d] != n:
                    raise InputError(f"input '{s.name}' has {d}={n} on axis {axis}, but another input has "
                                     f"{d}={bindings[d]} (expected {s})")
                if n == 0:
                    raise InputError(f"input '{s.name}' has an empty axis {axis} ({d}=0); expected {s}")
                bindings[d] = n
    if limits is not None:
        check_limits(limits, feeds, bindings)
    return bindings
