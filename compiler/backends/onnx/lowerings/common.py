"""Small pieces several lowerings share: constants at a tensor's precision."""

from __future__ import annotations

import numpy as np


from tessera.compiler.backends.onnx.floats import np_float, onnx_float  # noqa: F401 (the lowerings' names)


def min_const(b, dtype: str) -> str:
    """The dtype's most negative finite value, the fill of masked scores."""
    np_dtype = np_float(dtype)
    return b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min")

