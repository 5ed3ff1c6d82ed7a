"""Small pieces several lowerings share: constants at a tensor's precision."""

from __future__ import annotations

import numpy as np


def np_float(dtype: str):
    """The numpy type of constants for a tensor of this IR dtype (fp16 or fp32)."""
    return np.float16 if dtype == "f16" else np.float32


def min_const(b, dtype: str) -> str:
    """The dtype's most negative finite value, the fill of masked scores."""
    np_dtype = np_float(dtype)
    return b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min")
