"""Primitive ops: their type rules (shape inference).

Each op's rule takes the input types and the node's attributes and returns the
output types, or raises ShapeError with a message that says what did not fit.
The elaborator reports that message at the spec position that created the
node; ``check_graph`` re-runs every rule after a pass has rewritten the graph.
Execution (numpy) and lowering (ONNX) live in their own modules, keyed by the
same op names.
"""

from __future__ import annotations

from typing import Callable

import sympy

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import FLOAT_DTYPES, Graph, TensorType


class ShapeError(Exception):
    pass


Rule = Callable[[list[TensorType], dict], list[TensorType]]
RULES: dict[str, Rule] = {}


def rule(*names: str):
    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def infer(op: str, types: list[TensorType], attrs: dict) -> list[TensorType]:
    return RULES[op](types, attrs)


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


def _need_float(t: TensorType, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{what} needs a floating-point tensor, got {t}")


def _same_dtype(a: TensorType, b: TensorType, what: str) -> None:
    if a.dtype != b.dtype:
        raise ShapeError(f"{what}: dtypes differ ({a} and {b})")


# ------------------------------------------------------------------ elementwise
@rule("add", "sub", "mul", "div", "pow")
def _binary(t, a):
    x, y = t
    _same_dtype(x, y, "elementwise op")
    out = dims.broadcast(x.shape, y.shape)
    if out is None:
        raise ShapeError(f"shapes {dims.fmt_shape(x.shape)} and {dims.fmt_shape(y.shape)} do not broadcast")
    return [TensorType(x.dtype, out)]


@rule("neg", "sqrt", "exp", "relu", "gelu", "silu", "sigmoid", "tanh", "identity", "sin", "cos")
def _unary(t, a):
    return [t[0]]


@rule("cast")
def _cast(t, a):
    return [TensorType(a["dtype"], t[0].shape)]


@rule("softmax")
def _softmax(t, a):
    _need_float(t[0], "softmax")
    _axis(a["axis"], t[0].rank)
    return [t[0]]


# ------------------------------------------------------------------ linear algebra
@rule("linear")
def _linear(t, a):
    x, w = t[0], t[1]
    _need_float(x, "linear")
    if w.rank != 2:
        raise ShapeError(f"linear weight must be [out, in], got {dims.fmt_shape(w.shape)}")
    if x.rank < 1 or not dims.equal(x.shape[-1], w.shape[1]):
        raise ShapeError(f"linear expects input [..., {dims.fmt(w.shape[1])}], got {dims.fmt_shape(x.shape)}")
    if len(t) == 3 and not dims.shapes_equal(t[2].shape, (w.shape[0],)):
        raise ShapeError(f"linear bias must be [{dims.fmt(w.shape[0])}], got {dims.fmt_shape(t[2].shape)}")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


@rule("matmul")
def _matmul(t, a):
    x, y = t
    _same_dtype(x, y, "matmul")
    if x.rank < 2 or y.rank < 2:
        raise ShapeError(f"matmul needs tensors of rank >= 2, got {dims.fmt_shape(x.shape)} and {dims.fmt_shape(y.shape)}")
    if not dims.equal(x.shape[-1], y.shape[-2]):
        raise ShapeError(f"matmul inner dimensions differ: {dims.fmt_shape(x.shape)} @ {dims.fmt_shape(y.shape)}")
    batch = dims.broadcast(x.shape[:-2], y.shape[:-2])
    if batch is None:
        raise ShapeError(f"matmul batch dimensions do not broadcast: {dims.fmt_shape(x.shape)} @ {dims.fmt_shape(y.shape)}")
    return [TensorType(x.dtype, batch + (x.shape[-2], y.shape[-1]))]


@rule("embedding")
def _embedding(t, a):
    ids, w = t
    if ids.dtype not in ("i64", "i32"):
        raise ShapeError(f"embedding ids must be integers, got {ids}")
    return [TensorType(w.dtype, ids.shape + (w.shape[1],))]


@rule("conv2d")
def _conv2d(t, a):
    x, w = t[0], t[1]
    if x.rank != 4:
        raise ShapeError(f"conv2d expects [B, C, H, W], got {dims.fmt_shape(x.shape)}")
    if not dims.equal(x.shape[1], w.shape[1]):
        raise ShapeError(f"conv2d expects {dims.fmt(w.shape[1])} input channels, got {dims.fmt(x.shape[1])}")
    k, s = a["kernel"], a["stride"]
    out = []
    for d in x.shape[2:]:
        span = d - k
        q = sympy.cancel(span / s)
        if not (q.is_integer or (dims.is_static(span) and int(span) % s == 0)):
            raise ShapeError(f"conv2d: size {dims.fmt(d)} minus kernel {k} is not a multiple of stride {s}")
        out.append(sympy.Integer(int(span) // s + 1) if dims.is_static(span) else q + 1)
    return [TensorType(x.dtype, (x.shape[0], w.shape[0], *out))]


# ------------------------------------------------------------------ normalisation
@rule("layernorm", "rmsnorm")
def _norm(t, a):
    x = t[0]
    _need_float(x, "normalisation")
    for p in t[1:]:
        if not dims.shapes_equal(p.shape, (x.shape[-1],)):
            raise ShapeError(f"norm parameter must be [{dims.fmt(x.shape[-1])}], got {dims.fmt_shape(p.shape)}")
    return [x]


# ------------------------------------------------------------------ layout
@rule("reshape")
def _reshape(t, a):
    x = t[0]
    new = tuple(a["shape"])
    if not dims.equal(dims.numel(x.shape), dims.numel(new)):
        raise ShapeError(f"cannot reshape {dims.fmt_shape(x.shape)} to {dims.fmt_shape(new)}: sizes differ")
    return [TensorType(x.dtype, new)]


@rule("transpose")
def _transpose(t, a):
    x = t[0]
    perm = a["perm"]
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"transpose permutation {list(perm)} does not fit rank {x.rank}")
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@rule("split_heads")
def _split_heads(t, a):
    x, h = t[0], a["heads"]
    if x.rank < 2:
        raise ShapeError(f"split_heads expects [..., T, D], got {dims.fmt_shape(x.shape)}")
    d = x.shape[-1]
    if dims.is_static(d) and int(d) % h:
        raise ShapeError(f"split_heads: width {dims.fmt(d)} is not divisible by {h} heads")
    return [TensorType(x.dtype, x.shape[:-2] + (sympy.Integer(h), x.shape[-2], d / h))]


@rule("merge_heads")
def _merge_heads(t, a):
    x = t[0]
    if x.rank < 3:
        raise ShapeError(f"merge_heads expects [..., H, T, hd], got {dims.fmt_shape(x.shape)}")
    return [TensorType(x.dtype, x.shape[:-3] + (x.shape[-2], x.shape[-3] * x.shape[-1]))]


@rule("repeat_kv")
def _repeat_kv(t, a):
    x = t[0]
    if x.rank < 3:
        raise ShapeError(f"repeat_kv expects [..., H, T, hd], got {dims.fmt_shape(x.shape)}")
    return [TensorType(x.dtype, x.shape[:-3] + (x.shape[-3] * a["times"],) + x.shape[-2:])]


@rule("concat")
def _concat(t, a):
    first = t[0]
    axis = _axis(a["axis"], first.rank)
    total = sympy.Integer(0)
    for x in t:
        _same_dtype(first, x, "concat")
        if x.rank != first.rank or not all(
                dims.equal(p, q) for i, (p, q) in enumerate(zip(first.shape, x.shape)) if i != axis):
            raise ShapeError(f"concat along axis {a['axis']}: shapes {dims.fmt_shape(first.shape)} and "
                             f"{dims.fmt_shape(x.shape)} differ off that axis")
        total = total + x.shape[axis]
    return [TensorType(first.dtype, first.shape[:axis] + (total,) + first.shape[axis + 1:])]


@rule("slice")
def _slice(t, a):
    x = t[0]
    axis = _axis(a["axis"], x.rank)
    start, end = dims.dim(a["start"]), dims.dim(a["end"])
    size = x.shape[axis]
    if dims.is_static(size) and dims.is_static(end) and int(end) > int(size):
        raise ShapeError(f"slice end {dims.fmt(end)} is past the axis size {dims.fmt(size)}")
    n = end - start
    if dims.is_static(n) and int(n) <= 0:
        raise ShapeError(f"slice [{dims.fmt(start)}:{dims.fmt(end)}] is empty")
    return [TensorType(x.dtype, x.shape[:axis] + (n,) + x.shape[axis + 1:])]


@rule("select")
def _select(t, a):
    x = t[0]
    axis = _axis(a["axis"], x.rank)
    return [TensorType(x.dtype, x.shape[:axis] + x.shape[axis + 1:])]


@rule("expand")
def _expand(t, a):
    x = t[0]
    new = tuple(a["shape"])
    if dims.broadcast(x.shape, new) is None or len(new) < x.rank:
        raise ShapeError(f"cannot expand {dims.fmt_shape(x.shape)} to {dims.fmt_shape(new)}")
    return [TensorType(x.dtype, new)]


@rule("mean", "sum")
def _reduce(t, a):
    x = t[0]
    axes = [_axis(ax, x.rank) for ax in a["axes"]]
    if a.get("keepdims"):
        shape = tuple(sympy.Integer(1) if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [TensorType(x.dtype, shape)]


# ------------------------------------------------------------------ attention pieces
@rule("causal_mask")
def _causal_mask(t, a):
    s = t[0]
    if s.rank < 2:
        raise ShapeError(f"a mask applies to scores [..., Tq, Tk], got {dims.fmt_shape(s.shape)}")
    _need_float(s, "causal_mask")
    return [s]


@rule("padding_mask")
def _padding_mask(t, a):
    s, m = t
    _need_float(s, "padding_mask")
    if m.rank != 2 or s.rank != 4:
        raise ShapeError(f"padding_mask expects scores [B, H, Tq, Tk] and mask [B, Tk], got "
                         f"{dims.fmt_shape(s.shape)} and {dims.fmt_shape(m.shape)}")
    if not (dims.equal(m.shape[0], s.shape[0]) and dims.equal(m.shape[1], s.shape[3])):
        raise ShapeError(f"padding mask {dims.fmt_shape(m.shape)} does not match scores {dims.fmt_shape(s.shape)} "
                         f"(expected [{dims.fmt(s.shape[0])}, {dims.fmt(s.shape[3])}])")
    return [s]


@rule("rope")
def _rope(t, a):
    x = t[0]
    if x.rank < 2:
        raise ShapeError(f"rope expects [..., T, hd], got {dims.fmt_shape(x.shape)}")
    hd = x.shape[-1]
    if dims.is_static(hd) and int(hd) % 2:
        raise ShapeError(f"rope needs an even head size, got {dims.fmt(hd)}")
    return [x]


@rule("topk_gates")
def _topk_gates(t, a):
    x = t[0]
    _need_float(x, "topk_gates")
    e = x.shape[-1]
    if dims.is_static(e) and a["k"] > int(e):
        raise ShapeError(f"top-{a['k']} of {dims.fmt(e)} experts")
    return [x]


# ------------------------------------------------------------------ generators
@rule("arange")
def _arange(t, a):
    return [TensorType("i64", (dims.dim(a["n"]),))]


@rule("sinusoidal")
def _sinusoidal(t, a):
    return [TensorType(a.get("dtype", "f32"), (dims.dim(a["n"]), sympy.Integer(a["d"])))]


def check_graph(graph: Graph) -> None:
    """Re-run every node's type rule; raise ShapeError naming the first node that fails."""
    for node in graph.nodes.values():
        types = [graph.type_of(v) for v in node.inputs]
        try:
            out = infer(node.op, types, node.attrs)
        except ShapeError as e:
            raise ShapeError(f"node {node.name}: {e}") from None
        for o, t in zip(node.outputs, out):
            have = graph.type_of(o)
            if have.dtype != t.dtype or not dims.shapes_equal(have.shape, t.shape):
                raise ShapeError(f"node {node.name}: output {o} is {have}, rules give {t}")


@rule("fused_attention")
def _fused_attention(t, a):
    q, k, v = t[0], t[1], t[2]
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError("fused_attention takes q, k, v as [B, H, T, hd]")
    if not dims.equal(q.shape[-1], k.shape[-1]) or not dims.equal(k.shape[-2], v.shape[-2]):
        raise ShapeError(f"fused_attention: q {dims.fmt_shape(q.shape)}, k {dims.fmt_shape(k.shape)}, "
                         f"v {dims.fmt_shape(v.shape)} do not fit")
    if a["heads"] % a["kv_heads"] or int(k.shape[1]) != a["kv_heads"]:
        raise ShapeError(f"fused_attention: {a['heads']} query heads over {dims.fmt(k.shape[1])} key/value heads")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]
