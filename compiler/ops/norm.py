"""Normalisations over the last axis: layernorm (scale and optional shift) and rmsnorm (scale)."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, custom, op, per_element


def layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return y + b if b is not None else y


def _rmsnorm_ref(x, a, ev):
    v = x[0]
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + a["eps"]) * x[1]


def _layernorm_flops(c):
    # mean, subtract, square, sum, normalise, scale (+ shift): 7 or 8 per element
    return {"norm": c.out() * (8 if len(c.node.inputs) == 3 else 7)}


@op("layernorm", "rmsnorm",
    reference={"layernorm": lambda x, a, ev: layernorm(x[0], x[1], x[2] if len(x) == 3 else None, a["eps"]),
               "rmsnorm": _rmsnorm_ref},
    cost={"layernorm": custom(_layernorm_flops),
          "rmsnorm": per_element("norm", 4)},      # square, sum, scale by 1/rms, weight
    saved=(0,))                                    # the input (its statistics are recomputed)
def _norm(t, a):
    """Normalise over the last axis with attrs["eps"]; weight (and layernorm's bias) are [d]."""
    x = t[0]
    common.need_float(x, "normalisation")
    for p in t[1:]:
        if not dims.shapes_equal(p.shape, (x.shape[-1],)):
            raise ShapeError(f"norm parameter must be [{dims.fmt(x.shape[-1])}], got {dims.fmt_shape(p.shape)}")
    return [x]
