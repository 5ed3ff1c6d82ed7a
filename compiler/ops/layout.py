"""Ops that only move data: reshapes, transposes, head splitting, repeats, concatenation,
slicing, selection and broadcasting. None does arithmetic; reshape and expand are views."""

from __future__ import annotations

import numpy as np
import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, free, op


@op("reshape", reference=lambda x, a, ev: x[0].reshape([ev(d) for d in a["shape"]]),
    cost=free(), saved=(), traits=("alias",))
def _reshape(t, a):
    """Reshape to attrs["shape"] (dimensions may be symbolic); sizes must agree."""
    x = t[0]
    new = tuple(a["shape"])
    if not dims.equal(dims.numel(x.shape), dims.numel(new)):
        raise ShapeError(f"cannot reshape {dims.fmt_shape(x.shape)} to {dims.fmt_shape(new)}: sizes differ")
    return [TensorType(x.dtype, new)]


@op("transpose", reference=lambda x, a, ev: np.transpose(x[0], a["perm"]), cost=free(), saved=())
def _transpose(t, a):
    """Permute axes by attrs["perm"]."""
    x = t[0]
    perm = a["perm"]
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"transpose permutation {list(perm)} does not fit rank {x.rank}")
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


def _split_heads_ref(x, a, ev):
    *lead, t, d = x[0].shape
    h = a["heads"]
    return np.swapaxes(x[0].reshape(*lead, t, h, d // h), -2, -3)


@op("split_heads", reference=_split_heads_ref, cost=free(), saved=())
def _split_heads(t, a):
    """[..., T, H*hd] -> [..., H, T, hd] with H = attrs["heads"]."""
    x, h = t[0], a["heads"]
    if x.rank < 2:
        raise ShapeError(f"split_heads expects [..., T, D], got {dims.fmt_shape(x.shape)}")
    d = x.shape[-1]
    if dims.is_static(d) and int(d) % h:
        raise ShapeError(f"split_heads: width {dims.fmt(d)} is not divisible by {h} heads")
    return [TensorType(x.dtype, x.shape[:-2] + (sympy.Integer(h), x.shape[-2], d / h))]


def _merge_heads_ref(x, a, ev):
    *lead, h, t, hd = x[0].shape
    return np.swapaxes(x[0], -2, -3).reshape(*lead, t, h * hd)


@op("merge_heads", reference=_merge_heads_ref, cost=free(), saved=())
def _merge_heads(t, a):
    """[..., H, T, hd] -> [..., T, H*hd]."""
    x = t[0]
    if x.rank < 3:
        raise ShapeError(f"merge_heads expects [..., H, T, hd], got {dims.fmt_shape(x.shape)}")
    return [TensorType(x.dtype, x.shape[:-3] + (x.shape[-2], x.shape[-3] * x.shape[-1]))]


@op("repeat_kv", reference=lambda x, a, ev: np.repeat(x[0], a["times"], axis=-3),
    cost=free(), saved=())
def _repeat_kv(t, a):
    """Repeat each head attrs["times"] times along axis -3 (grouped-query attention)."""
    x = t[0]
    if x.rank < 3:
        raise ShapeError(f"repeat_kv expects [..., H, T, hd], got {dims.fmt_shape(x.shape)}")
    return [TensorType(x.dtype, x.shape[:-3] + (x.shape[-3] * a["times"],) + x.shape[-2:])]


@op("concat", reference=lambda x, a, ev: np.concatenate(x, axis=a["axis"]), cost=free(), saved=())
def _concat(t, a):
    """Join the inputs along attrs["axis"]; they agree on every other axis."""
    first = t[0]
    axis = common.axis(a["axis"], first.rank)
    total = sympy.Integer(0)
    for x in t:
        common.same_dtype(first, x, "concat")
        if x.rank != first.rank or not all(
                dims.equal(p, q) for i, (p, q) in enumerate(zip(first.shape, x.shape)) if i != axis):
            raise ShapeError(f"concat along axis {a['axis']}: shapes {dims.fmt_shape(first.shape)} and "
                             f"{dims.fmt_shape(x.shape)} differ off that axis")
        total = total + x.shape[axis]
    return [TensorType(first.dtype, first.shape[:axis] + (total,) + first.shape[axis + 1:])]


def _slice_ref(x, a, ev):
    idx = [slice(None)] * x[0].ndim
    idx[a["axis"]] = slice(ev(a["start"]), ev(a["end"]))
    return x[0][tuple(idx)]


@op("slice", reference=_slice_ref,
    cost=free(), saved=())
def _slice(t, a):
    """x[start:end] along attrs["axis"] (start and end may be symbolic)."""
    x = t[0]
    axis = common.axis(a["axis"], x.rank)
    start, end = dims.dim(a["start"]), dims.dim(a["end"])
    size = x.shape[axis]
    if dims.is_static(size) and dims.is_static(end) and int(end) > int(size):
        raise ShapeError(f"slice end {dims.fmt(end)} is past the axis size {dims.fmt(size)}")
    n = end - start
    if dims.is_static(n) and int(n) <= 0:
        raise ShapeError(f"slice [{dims.fmt(start)}:{dims.fmt(end)}] is empty")
    return [TensorType(x.dtype, x.shape[:axis] + (n,) + x.shape[axis + 1:])]


@op("select", reference=lambda x, a, ev: np.take(x[0], a["index"], axis=a["axis"]),
    cost=free(), saved=())
def _select(t, a):
    """Take position attrs["index"] along attrs["axis"], removing that axis."""
    x = t[0]
    axis = common.axis(a["axis"], x.rank)
    return [TensorType(x.dtype, x.shape[:axis] + x.shape[axis + 1:])]


def _gather_ref(x, a, ev):
    data, index = x
    return np.take_along_axis(data, index.astype(np.int64), axis=a["axis"])


@op("gather", reference=_gather_ref, cost=free(), saved=())
def _gather(t, a):
    """out[..., i, ...] = x[..., index[..., i, ...], ...] along attrs["axis"] (torch.gather, onnx
    GatherElements, np.take_along_axis): the index has x's rank and, on every other axis, x's size,
    so the three agree (none broadcasts); the output has the index's shape and x's dtype."""
    x, index = t
    axis = common.axis(a["axis"], x.rank)
    if index.dtype not in ("i64", "i32"):
        raise ShapeError(f"gather's index must be an integer tensor, got {index}")
    if index.rank != x.rank:
        raise ShapeError(f"gather's index must have x's rank {x.rank}, got {index}")
    for d in range(x.rank):
        if d != axis and not dims.equal(x.shape[d], index.shape[d]):
            raise ShapeError(f"gather's index must match x on every axis but {a['axis']}: axis {d} is "
                             f"{dims.fmt(index.shape[d])}, x has {dims.fmt(x.shape[d])} (expand it first)")
    return [TensorType(x.dtype, index.shape)]


@op("expand", reference=lambda x, a, ev: np.broadcast_to(x[0], [ev(d) for d in a["shape"]]).copy(),
    cost=free(), saved=(), traits=("alias",))
def _expand(t, a):
    """Broadcast to attrs["shape"]."""
    x = t[0]
    new = tuple(a["shape"])
    if dims.broadcast(x.shape, new) is None or len(new) < x.rank:
        raise ShapeError(f"cannot expand {dims.fmt_shape(x.shape)} to {dims.fmt_shape(new)}")
    return [TensorType(x.dtype, new)]
