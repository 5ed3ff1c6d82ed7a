"""Checking concrete inputs against a model's declared inputs.

A model's inputs are described by InputSpecs (name, dtype, dims), read from an
IR graph or from an ONNX file. ``bind_inputs`` binds the symbolic dimensions
(B, T, ...) from the arrays given and reports any mismatch by naming the
input with its expected shape and dtype. The numpy interpreter and the
runtime both check inputs this way before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import dims
from .ir import DTYPES, Graph


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


def bind_inputs(specs: list[InputSpec] | Graph, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Check feeds against the inputs; return the symbol bindings, e.g. {'B': 2, 'T': 5}."""
    if isinstance(specs, Graph):
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
    return bindings
