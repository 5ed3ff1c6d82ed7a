"""Attention pieces: the masks, rotary embedding, mixture-of-experts gating, and
fused_attention, the node the fusion pass (passes/fuse_attention.py) puts in place of a
recognised attention core. Its ONNX lowering lives in backends/onnx/attention.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import TensorType
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, custom, op, per_element
from tessera.compiler.reference import score_epilogue
from tessera.compiler.reference.numerics import min_value, rope_inv_freq, softmax


# ------------------------------------------------------------------ masks
def causal(s, window):
    """Hide keys after each query (queries are the last Tq of Tk positions) and, with a window,
    keys `window` or more positions before it, by filling them with the dtype's minimum."""
    tq, tk = s.shape[-2], s.shape[-1]
    i = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    hide = j > i
    if window:
        hide |= j <= i - window
    return np.where(hide, min_value(s.dtype), s).astype(s.dtype)


def _causal_lower(L):
    b, a, t = L.b, L.a, L.t_in[0]
    tq, tk = t.shape[-2], t.shape[-1]
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    rows = b.node("Range", [zero, b.dim_scalar(tq), one])[0]
    offset = tk - tq
    if not (dims.is_static(offset) and int(offset) == 0):
        rows = b.node("Add", [rows, b.dim_scalar(offset)])[0]
    rows = b.node("Unsqueeze", [rows, b.i64([1])])[0]
    cols = b.node("Range", [zero, b.dim_scalar(tk), one])[0]
    hide = b.node("Greater", [cols, rows])[0]
    if a["window"]:
        lim = b.node("Sub", [rows, b.const(np.array(a["window"], dtype=np.int64), "window")])[0]
        far = b.node("LessOrEqual", [cols, lim])[0]
        hide = b.node("Or", [hide, far])[0]
    L.emit("Where", [hide, common.min_const(b, t.dtype), L.x[0]])


@op("causal_mask", reference=lambda x, a, ev: causal(x[0], a["window"]), lower=_causal_lower,
    cost=per_element("mask", 1),     # one select per score
    saved=())                        # a static pattern: nothing to keep
def _causal_mask(t, a):
    """Causal mask on scores [..., Tq, Tk]; attrs["window"] > 0 also hides keys that far back."""
    s = t[0]
    if s.rank < 2:
        raise ShapeError(f"a mask applies to scores [..., Tq, Tk], got {dims.fmt_shape(s.shape)}")
    common.need_float(s, "causal_mask")
    return [s]


def _padding_ref(x, a, ev):
    keep = (x[1] != 0)[:, None, None, :]
    return np.where(keep, x[0], min_value(x[0].dtype)).astype(x[0].dtype)


def _padding_lower(L):
    b, x, t_in = L.b, L.x, L.t_in
    zero = b.const(np.array(0, dtype=np.int64 if t_in[1].dtype == "i64" else np.int32), "zero")
    keep = b.node("Not", [b.node("Equal", [x[1], zero])[0]])[0] if t_in[1].dtype != "bool" else x[1]
    keep = b.node("Unsqueeze", [keep, b.i64([1, 2])])[0]
    L.emit("Where", [keep, x[0], common.min_const(b, t_in[0].dtype)])


@op("padding_mask", reference=_padding_ref, lower=_padding_lower,
    cost=per_element("mask", 1), saved=())   # the mask is an input: nothing to keep
def _padding_mask(t, a):
    """Hide padded keys: scores [B, H, Tq, Tk], mask [B, Tk] (0 = padding)."""
    s, m = t
    common.need_float(s, "padding_mask")
    if m.rank != 2 or s.rank != 4:
        raise ShapeError(f"padding_mask expects scores [B, H, Tq, Tk] and mask [B, Tk], got "
                         f"{dims.fmt_shape(s.shape)} and {dims.fmt_shape(m.shape)}")
    if not (dims.equal(m.shape[0], s.shape[0]) and dims.equal(m.shape[1], s.shape[3])):
        raise ShapeError(f"padding mask {dims.fmt_shape(m.shape)} does not match scores {dims.fmt_shape(s.shape)} "
                         f"(expected [{dims.fmt(s.shape[0])}, {dims.fmt(s.shape[3])}])")
    return [s]


# ------------------------------------------------------------------ rotary embedding
# attrs: theta, optional scaling (Llama 3.1), and -- only when not the default, so graphs of
# existing specs keep their attributes -- dims (rotate the first `dims` features of the head,
# pass the rest through: partial rotary as in GPT-NeoX, Phi, GPT-J) and interleaved (pair
# features (0, 1), (2, 3), ... as GPT-J does, instead of the halves (i, i + dims/2) of NeoX
# and Llama). The frequencies are theta^(-2i/dims) over the rotated features.
def _rot_dims(a, hd: int) -> int:
    return int(a.get("dims") or hd)


def rope(x, theta, scaling=None, positions=None, dims_=None, interleaved=False):
    n, hd = x.shape[-2], x.shape[-1]
    r = dims_ or hd
    inv_freq = rope_inv_freq(r, theta, scaling)
    if positions is None:
        freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    else:  # explicit positions [B, T] (a KV-cached graph: past length P > 0, left padding)
        freqs = (positions.astype(np.float32)[..., None] * inv_freq)[:, None]  # [B, 1, T, r/2]
    if interleaved:
        emb = np.repeat(freqs, 2, axis=-1)
    else:
        emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(x.dtype), np.sin(emb).astype(x.dtype)
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        rotated = np.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)
    else:
        rotated = np.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], axis=-1)
    out = xr * cos + rotated * sin
    return out if r == hd else np.concatenate([out, rest], axis=-1)


def _rope_lower(L):
    b, a, t, x = L.b, L.a, L.t_in[0], L.x
    hd = int(t.shape[-1])
    r = _rot_dims(a, hd)
    interleaved = bool(a.get("interleaved"))
    n = t.shape[-2]
    inv_freq = rope_inv_freq(r, a["theta"], a.get("scaling"))
    if len(x) > 1 and t.rank == 4 and t.dtype in ("f32", "f16"):  # the types onnxruntime's CPU kernel takes
        return _rope_lower_fused(L, r, hd, interleaved, inv_freq)
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    if len(x) > 1:  # explicit positions [B, T] (a KV-cached graph): tables [B, 1, T, hd]
        pos = b.node("Unsqueeze", [b.node("Cast", [x[1]], to=b.onnx_type("f32"))[0], b.i64([1, 3])])[0]
        lead = 3
    else:
        pos = b.node("Cast", [b.node("Range", [zero, b.dim_scalar(n), one])[0]], to=b.onnx_type("f32"))[0]
        pos = b.node("Unsqueeze", [pos, b.i64([1])])[0]
        lead = 1
    freqs = b.node("Mul", [pos, b.const(inv_freq[None, :], "inv_freq")])[0]
    if interleaved:  # f0 f0 f1 f1 ...
        pair = b.node("Unsqueeze", [freqs, b.i64([-1])])[0]
        emb = b.node("Reshape", [b.node("Concat", [pair, pair], axis=-1)[0], b.i64([0] * lead + [r])])[0]
    else:
        emb = b.node("Concat", [freqs, freqs], axis=-1)[0]
    cos, sin = b.node("Cos", [emb])[0], b.node("Sin", [emb])[0]
    if t.dtype != "f32":  # tables in fp32, applied at the tensor's precision
        cos = b.node("Cast", [cos], to=b.onnx_type(t.dtype))[0]
        sin = b.node("Cast", [sin], to=b.onnx_type(t.dtype))[0]
    xr = x[0] if r == hd else b.node("Slice", [x[0], b.i64([0]), b.i64([r]), b.i64([-1])])[0]
    if interleaved:  # (x0, x1) -> (-x1, x0) per pair
        keep = [0] * (t.rank - 1)
        pairs = b.node("Reshape", [xr, b.i64(keep + [r // 2, 2])])[0]
        even = b.node("Slice", [pairs, b.i64([0]), b.i64([1]), b.i64([-1])])[0]
        odd = b.node("Slice", [pairs, b.i64([1]), b.i64([2]), b.i64([-1])])[0]
        rot = b.node("Reshape", [b.node("Concat", [b.node("Neg", [odd])[0], even], axis=-1)[0],
                                 b.i64(keep + [r])])[0]
    else:
        half = b.i64([r // 2])
        x1 = b.node("Slice", [xr, b.i64([0]), half, b.i64([-1])])[0]
        x2 = b.node("Slice", [xr, half, b.i64([r]), b.i64([-1])])[0]
        rot = b.node("Concat", [b.node("Neg", [x2])[0], x1], axis=-1)[0]
    if r == hd:
        return L.emit("Add", [b.node("Mul", [x[0], cos])[0], b.node("Mul", [rot, sin])[0]])
    out = b.node("Add", [b.node("Mul", [xr, cos])[0], b.node("Mul", [rot, sin])[0]])[0]
    rest = b.node("Slice", [x[0], b.i64([r]), b.i64([hd]), b.i64([-1])])[0]
    L.emit("Concat", [out, rest], axis=-1)


def _rope_lower_fused(L, r: int, hd: int, interleaved: bool, inv_freq: np.ndarray) -> None:
    """Explicit positions on [B, H, T, hd] (the KV-cached graph): one ONNX RotaryEmbedding (opset 23)
    per rope instead of six element-wise nodes. Its cos and sin tables are given per position,
    [B, T, r/2], computed once from the positions and shared by every rope with the same
    frequencies (a Llama decoding step has 24 ropes), so there is no table of maximum length
    and no limit on the position."""
    b, a, t, x = L.b, L.a, L.t_in[0], L.x
    key = ("rope_tables", x[1], inv_freq.tobytes(), t.dtype)
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            pos = b.node("Unsqueeze", [b.node("Cast", [x[1]], to=b.onnx_type("f32"))[0], b.i64([2])])[0]
            freqs = b.node("Mul", [pos, b.const(inv_freq.astype(np.float32), "inv_freq")],
                           [b.fresh("rope/freqs")])[0]  # [B, T, r/2]
            tables = [b.node(f, [freqs], [b.fresh(f"rope/{f.lower()}")])[0] for f in ("Cos", "Sin")]
            if t.dtype != "f32":  # computed in fp32, applied at the tensor's precision
                tables = [b.node("Cast", [v], to=b.onnx_type(t.dtype))[0] for v in tables]
            b.shared[key] = tables
        finally:
            b.current = saved
    cos, sin = b.shared[key]
    attrs = {"interleaved": int(interleaved)}
    if r != hd:
        attrs["rotary_embedding_dim"] = r
    L.emit("RotaryEmbedding", [x[0], cos, sin], **attrs)


def _rope_flops(c):
    # x·cos + rotate(x)·sin on the rotated features; the rest pass through
    t = c.type(0)
    hd = int(t.shape[-1]) if dims.is_static(t.shape[-1]) else None
    numel = c.numel(t.shape)
    if hd is None or _rot_dims(c.attrs, hd) == hd:
        return {"position": numel * 3}
    return {"position": numel * 3 * Fraction(_rot_dims(c.attrs, hd), hd)}


@op("rope", reference=lambda x, a, ev: rope(x[0], a["theta"], a.get("scaling"), x[1] if len(x) > 1 else None,
                                            a.get("dims"), bool(a.get("interleaved"))),
    lower=_rope_lower,
    cost=custom(_rope_flops),
    saved=())                          # a fixed rotation: its backward needs no activation
def _rope(t, a):
    """Rotary embedding on [..., T, hd], attrs theta and optional scaling, dims (rotate only the first
    dims features) and interleaved (GPT-J's pairs instead of halves); an optional second input gives
    the positions [B, T] (the KV-cached graph: past length, left padding)."""
    x = t[0]
    if x.rank < 2:
        raise ShapeError(f"rope expects [..., T, hd], got {dims.fmt_shape(x.shape)}")
    hd = x.shape[-1]
    if dims.is_static(hd) and int(hd) % 2:
        raise ShapeError(f"rope needs an even head size, got {dims.fmt(hd)}")
    r = a.get("dims")
    if r is not None:
        if not dims.is_static(hd):
            raise ShapeError("partial rotary needs a fixed head size")
        if r % 2 or not 0 < r <= int(hd):
            raise ShapeError(f"rope dims must be even and between 2 and the head size {dims.fmt(hd)}, got {r}")
    return [x]


# ------------------------------------------------------------------ mixture-of-experts gates
def topk_gates(x, k):
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(x, idx, axis=-1)
    w = softmax(top, -1)
    out = np.zeros_like(x)
    np.put_along_axis(out, idx, w, axis=-1)
    return out


def _topk_lower(L):
    b, x = L.b, L.x
    vals, idx = b.node("TopK", [x[0], b.i64([L.a["k"]])], 2, axis=-1, largest=1, sorted=1)
    w = b.node("Softmax", [vals], axis=-1)[0]
    zeros = b.node("ConstantOfShape", [b.node("Shape", [x[0]])[0]],
                   value=b.tensor_value(np.zeros(1, dtype=common.np_float(L.t_in[0].dtype))))[0]
    L.emit("ScatterElements", [zeros, idx, w], axis=-1)


def _topk_flops(c):
    # top-k selection (k compares per logit) and a softmax over the k chosen (5 each)
    x = c.numel(c.type(0).shape)
    e = int(c.type(0).shape[-1])
    k = int(c.attrs["k"])
    return {"routing": x * k + x * Fraction(5 * k, e)}


@op("topk_gates", reference=lambda x, a, ev: topk_gates(x[0], a["k"]), lower=_topk_lower,
    cost=custom(_topk_flops), saved=("out",))
def _topk_gates(t, a):
    """Softmax over the top attrs["k"] logits of the last axis, zero elsewhere (shape kept)."""
    x = t[0]
    common.need_float(x, "topk_gates")
    e = x.shape[-1]
    if dims.is_static(e) and a["k"] > int(e):
        raise ShapeError(f"top-{a['k']} of {dims.fmt(e)} experts")
    return [x]


# ------------------------------------------------------------------ fused attention
# The attribute schema of fused_attention (``fused_schema``): every attribute a node may carry, its
# type and allowed values. The score epilogue's own (scale, softcap, bias, causal, window, padding) come from
# reference/score_epilogue.py's FEATURES, so a new score option declares its attributes once; the
# rest describe the heads and the kernel the lowering uses (set by passes/attention_kernels.py and
# passes/kv_cache.py). An attribute not named here, or of the wrong type, is a ShapeError from the
# type rule (ops.check_graph), never ignored by a kernel.
Attr = score_epilogue.Attr
# The lowerings backends/onnx/attention.py dispatches on (tests/test_attention_contract.py checks the two agree).
IMPLS = ("gqa", "mha", "block", "portable", "cached", "phased")


def _one_of(*allowed):
    return lambda v: None if v in allowed else f"must be one of {', '.join(map(repr, allowed))}, got {v!r}"


def _at_least(n):
    return lambda v: None if v >= n else f"must be {n} or more, got {v}"


def _names(n):
    return lambda v: None if len(v) == n and all(isinstance(x, str) and x for x in v) else \
        f"must be {n} value names, got {v!r}"


FUSED_ATTRS: dict[str, Attr] = {
    "heads": Attr((int,), "query heads", _at_least(1), required=True),
    "kv_heads": Attr((int,), "key/value heads (grouped-query attention: fewer, dividing heads)", _at_least(1),
                     required=True),
    "impl": Attr((str,), "the kernel that lowers the node (passes/attention_kernels.py)", _one_of(*IMPLS)),
    "q_tile": Attr((int,), "query rows per tile (portable kernel)", _at_least(1)),
    "k_tile": Attr((int,), "key columns per tile", _at_least(1)),
    "block_bytes": Attr((int,), "an If picks the block kernel while the scores fit this many bytes (0: never)",
                        _at_least(0)),
    "decode": Attr((str,), "the KV-cached decoding step's kernel (passes/kv_cache.py)", _one_of("gqa")),
    "buffer_outputs": Attr((list, tuple), "the cache buffers a gqa decoding step writes", _names(2)),
    "length_input": Attr((str,), "the cache_length input a gqa decoding step reads", lambda v: None if v else
                         "must name an input"),
}


def fused_schema() -> dict[str, Attr]:
    """Every fused_attention attribute: the score epilogue's (read from its table now, so a feature
    added there is known here) and FUSED_ATTRS."""
    return {**{name: spec for f in score_epilogue.FEATURES.values() for name, spec in f.attrs.items()},
            **FUSED_ATTRS}


def check_fused_attrs(a: dict) -> None:
    """Raise ShapeError for an unknown, missing or ill-typed fused_attention attribute, or a value
    outside its range."""
    schema = fused_schema()
    unknown = sorted(set(a) - set(schema))
    if unknown:
        raise ShapeError(f"fused_attention: unknown attribute{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                         f"(known: {', '.join(schema)}; a new score option is declared in "
                         f"compiler/reference/score_epilogue.py)")
    for name, spec in schema.items():
        if name not in a:
            if spec.required:
                raise ShapeError(f"fused_attention: attribute {name} ({spec.doc}) is missing")
            continue
        problem = spec.problem(a[name])
        if problem:
            raise ShapeError(f"fused_attention: attribute {name} ({spec.doc}) {problem}")
    if a["window"] and not a["causal"]:
        raise ShapeError("fused_attention: a sliding window (window > 0) needs causal")
    if a["heads"] % a["kv_heads"]:
        raise ShapeError(f"fused_attention: {a['heads']} query heads do not divide into {a['kv_heads']} groups")


def _fused_ref(x, a, ev):
    rep = a["heads"] // a["kv_heads"]
    q, k_, v_ = x[0], np.repeat(x[1], rep, axis=1), np.repeat(x[2], rep, axis=1)
    extra = x[3:]
    mask = extra.pop(0) if a["padding"] else None
    bias = extra.pop(0) if a["bias"] else None
    s = score_epilogue.apply(q @ np.swapaxes(k_, -1, -2), a,
                             score_epilogue.Where(q.shape[-2], k_.shape[-2], key_mask=mask, bias=bias))
    return softmax(s, -1) @ v_


def _fused_lower(L):
    from tessera.compiler.backends.onnx.attention import lower_fused_attention

    lower_fused_attention(L.b, L.node, L.out)


def _pairs(c):
    q, k = c.type(0), c.type(1)
    return c.pairs if c.pairs is not None else c.dim(q.shape[-2]) * c.dim(k.shape[-2])


def _fused_macs(c):
    """q·kᵀ and p·v over the query-key pairs per head (all Tq·Tk unless c.pairs says fewer):
    (hd + hd_v) per pair, for each batch row and query head."""
    q, v = c.type(0), c.type(2)
    return c.numel(q.shape[:-2]) * _pairs(c) * (c.dim(q.shape[-1]) + c.dim(v.shape[-1]))


def _fused_flops(c):
    """The products, and per score: scale, masks, bias, softmax (as the unfused ops would count)."""
    scores = c.numel(c.type(0).shape[:-2]) * _pairs(c)
    masks = int(bool(c.attrs.get("causal"))) + int(bool(c.attrs.get("padding")))
    cap = bool(c.attrs.get("softcap"))  # tanh(s / cap) * cap: a divide, a tanh and a multiply per score
    f = {"matmul": c.macs * 2, "softmax": scores * 5,
         "elementwise": scores * (1 + int(bool(c.attrs.get("bias"))) + 2 * int(cap))}
    if cap:
        f["activation"] = scores
    if masks:
        f["mask"] = scores * masks
    return f


@op("fused_attention", reference=_fused_ref, lower=_fused_lower,
    cost=custom(_fused_flops, macs=_fused_macs, per_pair=True),
    # What a fused kernel keeps (q, k, v, its output, one log-sum-exp per row) is counted by
    # analysis/memory.py from the attention structure, which recognises fused_attention nodes.
    saved=(), traits=("matmul_class",))
def _fused_attention(t, a):
    """softmax(cap(q·kᵀ·scale) + masks + bias)·v on [B, H, T, hd] with kv_heads key/value heads; with
    attrs["softcap"] = c > 0, cap(s) = tanh(s)·c (logit soft-capping, the 1/c folded into the scale)."""
    check_fused_attrs(a)
    n_in = 3 + int(a["padding"]) + int(a["bias"])
    if len(t) != n_in:
        raise ShapeError(f"fused_attention: {len(t)} inputs, its attributes (padding, bias) say {n_in}")
    q, k, v = t[0], t[1], t[2]
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError("fused_attention takes q, k, v as [B, H, T, hd]")
    if not dims.equal(q.shape[-1], k.shape[-1]) or not dims.equal(k.shape[-2], v.shape[-2]):
        raise ShapeError(f"fused_attention: q {dims.fmt_shape(q.shape)}, k {dims.fmt_shape(k.shape)}, "
                         f"v {dims.fmt_shape(v.shape)} do not fit")
    if a["heads"] % a["kv_heads"] or int(k.shape[1]) != a["kv_heads"]:
        raise ShapeError(f"fused_attention: {a['heads']} query heads over {dims.fmt(k.shape[1])} key/value heads")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]
