"""Ops without inputs that make a tensor from their attributes: positions and the fixed
sinusoidal position table (n may be the symbolic sequence length)."""

from __future__ import annotations

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops.registry import free, op, per_element
from tessera.compiler.reference.numerics import sinusoidal_table


@op("arange", reference=lambda x, a, ev: np.arange(ev(a["n"]), dtype=np.int64),
    cost=free(), saved=())
def _arange(t, a):
    """Positions 0..n-1 (i64)."""
    return [TensorType("i64", (dims.dim(a["n"]),))]


@op("sinusoidal", reference=lambda x, a, ev: sinusoidal_table(ev(a["n"]), a["d"]),
    cost=per_element("position", 2),   # divide, sin or cos
    saved=())
def _sinusoidal(t, a):
    """The fixed sinusoidal position table [n, d] (sin and cos interleaved)."""
    return [TensorType(a.get("dtype", "f32"), (dims.dim(a["n"]), sympy.Integer(a["d"])))]
