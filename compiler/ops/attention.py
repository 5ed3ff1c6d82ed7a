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
from tessera.compiler.reference.numerics import min_value, rope_attention_factor, rope_inv_freq, softmax


# ------------------------------------------------------------------ masks
def _positions(s):
    """Each query's position [Tq, 1] and each key's [1, Tk]: the queries are the last Tq of Tk."""
    tq, tk = s.shape[-2], s.shape[-1]
    return np.arange(tq)[:, None] + (tk - tq), np.arange(tk)[None, :]


def _mask_rule(t, name: str):
    """The type rule every score mask shares: scores [..., Tq, Tk] of a float type, unchanged."""
    s = t[0]
    if s.rank < 2:
        raise ShapeError(f"a mask applies to scores [..., Tq, Tk], got {dims.fmt_shape(s.shape)}")
    common.need_float(s, name)
    return [s]


def causal(s, window, chunk=0):
    """Hide keys after each query (queries are the last Tq of Tk positions) and, with a window,
    keys `window` or more positions before it; with a chunk C, keys in another block of C positions
    than the query's (chunked attention, Llama 4: positions // C differ), by filling them with the
    dtype's minimum."""
    i, j = _positions(s)
    hide = j > i
    if window:
        hide |= j <= i - window
    if chunk:
        hide |= (j // chunk) != (i // chunk)
    return np.where(hide, min_value(s.dtype), s).astype(s.dtype)


@op("causal_mask", reference=lambda x, a, ev: causal(x[0], a["window"], a.get("chunk") or 0),
    cost=per_element("mask", 1),     # one select per score
    saved=())                        # a static pattern: nothing to keep
def _causal_mask(t, a):
    """Causal mask on scores [..., Tq, Tk]; attrs["window"] > 0 also hides keys that far back;
    attrs["chunk"] > 0 (present only when set) hides keys outside the query's chunk."""
    out = _mask_rule(t, "causal_mask")
    if "chunk" in a and (not isinstance(a["chunk"], int) or a["chunk"] < 1):
        raise ShapeError(f"causal_mask: chunk must be 1 or more, got {a['chunk']!r}")
    return out


def local(s, window):
    """Hide keys ``window`` or more positions from each query, on either side (ModernBERT's local
    attention: a two-sided window over a bidirectional encoder; queries are the last Tq of Tk)."""
    i, j = _positions(s)
    return np.where(np.abs(j - i) >= window, min_value(s.dtype), s).astype(s.dtype)


@op("local_mask", reference=lambda x, a, ev: local(x[0], a["window"]),
    cost=per_element("mask", 1),     # one select per score
    saved=())                        # a static pattern: nothing to keep
def _local_mask(t, a):
    """Two-sided window on scores [..., Tq, Tk]: keys at distance attrs["window"] (>= 1) or more hidden."""
    out = _mask_rule(t, "local_mask")
    if not isinstance(a.get("window"), int) or a["window"] < 1:
        raise ShapeError(f"local_mask: window must be 1 or more, got {a.get('window')!r}")
    return out


def _padding_ref(x, a, ev):
    keep = (x[1] != 0)[:, None, None, :]
    return np.where(keep, x[0], min_value(x[0].dtype)).astype(x[0].dtype)


@op("padding_mask", reference=_padding_ref,
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
# attrs: theta, optional scaling (its parameters; rope_type says which: Llama 3.1's when absent,
# else linear, dynamic, yarn or longrope, see reference/numerics.rope_inv_freq), and -- only when not the default, so graphs of
# existing specs keep their attributes -- dims (rotate the first `dims` features of the head,
# pass the rest through: partial rotary as in GPT-NeoX, Phi, GPT-J) and interleaved (pair
# features (0, 1), (2, 3), ... as GPT-J does, instead of the halves (i, i + dims/2) of NeoX
# and Llama). The frequencies are theta^(-2i/dims) over the rotated features.
def rotated_dims(a, hd: int) -> int:
    return int(a.get("dims") or hd)


def rope(x, theta, scaling=None, positions=None, dims_=None, interleaved=False, kind="llama3"):
    n, hd = x.shape[-2], x.shape[-1]
    r = dims_ or hd
    seq_len = n  # longrope's switch reads the largest position + 1 (the whole batch's, as transformers)
    if positions is not None and kind == "longrope":
        seq_len = int(positions.max()) + 1 if positions.size else 0
    inv_freq = rope_inv_freq(r, theta, scaling, kind, seq_len=seq_len)
    if positions is None:
        freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    else:  # explicit positions [B, T] (a KV-cached graph: past length P > 0, left padding)
        freqs = (positions.astype(np.float32)[..., None] * inv_freq)[:, None]  # [B, 1, T, r/2]
    if interleaved:
        emb = np.repeat(freqs, 2, axis=-1)
    else:
        emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    factor = rope_attention_factor(scaling, kind)
    if factor != 1.0:  # YaRN: cos and sin scaled in fp32, as transformers' rotary embedding
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        rotated = np.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)
    else:
        rotated = np.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], axis=-1)
    out = xr * cos + rotated * sin
    return out if r == hd else np.concatenate([out, rest], axis=-1)


def _rope_flops(c):
    # x·cos + rotate(x)·sin on the rotated features; the rest pass through
    t = c.type(0)
    hd = int(t.shape[-1]) if dims.is_static(t.shape[-1]) else None
    numel = c.numel(t.shape)
    if hd is None or rotated_dims(c.attrs, hd) == hd:
        return {"position": numel * 3}
    return {"position": numel * 3 * Fraction(rotated_dims(c.attrs, hd), hd)}


@op("rope", reference=lambda x, a, ev: rope(x[0], a["theta"], a.get("scaling"), x[1] if len(x) > 1 else None,
                                            a.get("dims"), bool(a.get("interleaved")),
                                            a.get("rope_type", "llama3")),
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
def topk_gates(x, k, normalize=True):
    """normalize: the softmax over the k chosen (Mixtral's renormalised gates); else the softmax over
    all logits, taken at the k chosen (Qwen-MoE's norm_topk_prob=false: the gates sum to less than 1)."""
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(x, idx, axis=-1)
    w = softmax(top, -1) if normalize else np.take_along_axis(softmax(x, -1), idx, axis=-1)
    out = np.zeros_like(x)
    np.put_along_axis(out, idx, w, axis=-1)
    return out


def _topk_flops(c):
    # top-k selection (k compares per logit) and a softmax over the k chosen (5 each)
    x = c.numel(c.type(0).shape)
    e = int(c.type(0).shape[-1])
    k = int(c.attrs["k"])
    if c.attrs.get("normalize") is False:  # the softmax over every logit
        return {"routing": x * k + x * 5}
    return {"routing": x * k + x * Fraction(5 * k, e)}


@op("topk_gates", reference=lambda x, a, ev: topk_gates(x[0], a["k"], a.get("normalize", True)),
    cost=custom(_topk_flops), saved=("out",))
def _topk_gates(t, a):
    """Softmax over the top attrs["k"] logits of the last axis, zero elsewhere (shape kept);
    attrs["normalize"] False: the softmax over all logits at the top k."""
    x = t[0]
    common.need_float(x, "topk_gates")
    e = x.shape[-1]
    if dims.is_static(e) and a["k"] > int(e):
        raise ShapeError(f"top-{a['k']} of {dims.fmt(e)} experts")
    return [x]


def topk_indices(x, k):
    """The positions of the k largest along the last axis, largest first, ties to the lower index (as ONNX TopK)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int64)


def topk_mask(x, k):
    """True at the k largest along the last axis (ties to the lower index), False elsewhere."""
    out = np.zeros(x.shape, bool)
    np.put_along_axis(out, topk_indices(x, k), True, axis=-1)
    return out


def _topk_pick_flops(c):
    # k compares per element to choose (the mask: one more write per element)
    x = c.numel(c.type(0).shape)
    return {"routing": x * int(c.attrs["k"]) + (x if c.op == "topk_mask" else 0)}


def _topk_checked(t, a) -> TensorType:
    """x, checked: a float tensor with a fixed last axis of at least attrs["k"] >= 1."""
    x = t[0]
    common.need_float(x, "topk")
    e, k = x.shape[-1] if x.rank else None, a.get("k")
    if e is None or not dims.is_static(e):
        raise ShapeError(f"topk needs a fixed last axis, got {x}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= int(e):
        raise ShapeError(f"topk needs 1 <= k <= {dims.fmt(e)} (the last axis), got {k!r}")
    return x


@op("topk_indices", reference=lambda x, a, ev: topk_indices(x[0], a["k"]), cost=custom(_topk_pick_flops), saved=())
def _topk_indices(t, a):
    """The positions of the top attrs["k"] of the last axis (a fixed size), i64 [..., k], largest first,
    ties to the lower index. A routing step, not a mixture of experts."""
    x = _topk_checked(t, a)
    return [TensorType("i64", x.shape[:-1] + (dims.dim(a["k"]),))]


@op("topk_mask", reference=lambda x, a, ev: topk_mask(x[0], a["k"]), cost=custom(_topk_pick_flops), saved=())
def _topk_mask(t, a):
    """A bool tensor of x's shape, true at the top attrs["k"] of the last axis (ties to the lower index)."""
    x = _topk_checked(t, a)
    return [TensorType("bool", x.shape)]


# ------------------------------------------------------------------ fused attention
# The attribute schema of fused_attention (``fused_schema``): every attribute a node may carry, its
# type and allowed values. The score epilogue's own (scale, softcap, bias, causal, window, padding) come from
# reference/score_epilogue.py's FEATURES, so a new score option declares its attributes once; the
# rest describe the heads and the kernel the lowering uses (set by passes/attention_kernels.py and
# passes/kv_cache.py). An attribute not named here, or of the wrong type, is a ShapeError from the
# type rule (ops.check_graph), never ignored by a kernel.
Attr = score_epilogue.Attr
# The lowerings backends/onnx/attention.py dispatches on (tests/compiler/test_attention_contract.py checks the two agree).
IMPLS = ("gqa", "mha", "attn23", "block", "portable", "cached", "phased")


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
    "prefill": Attr((str,), "the KV-cached prompt's kernel on CUDA: onnx's Attention (opset 23) instead of the "
                    "portable Loop (passes/kv_cache.py)", _one_of("attn23")),
    "buffer_outputs": Attr((list, tuple), "the cache buffers a gqa decoding step writes", _names(2)),
    "pack_qkv": Attr((bool,), "false: the gqa decoding step reads split, rotated q/k/v, not the packed q+k+v "
                     "projection (--decode gqa-unpacked; backends/onnx/cached_attention.py)"),
    "length_input": Attr((str,), "the cache_length input a gqa decoding step reads", lambda v: None if v else
                         "must name an input"),
    "decode_mask": Attr((str,), "CUDA: the input holding a gqa decoding step's mask of the filled slots and the new "
                        "column (its width the total length, kept on the host); with prefix_keys the input "
                        "decode_span [0, width], its width alone", lambda v: None if v else
                        "must name an input"),
    "mixed": Attr((bool,), "the serving engine's combined call: decoding rows and a prompt chunk packed in one "
                  "call (backends/onnx/mixed_attention.py)"),
    "prefix_keys": Attr((bool,), "the serving engine's gqa decoding step without its mask: seqlens_k alone, each "
                        "row's keys its columns 0..seqlens_k (backends/onnx/attention.py PREFIX_KEYS_ASSUMES)"),
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
    if a.get("chunk") and not a["causal"]:
        raise ShapeError("fused_attention: chunked attention (chunk > 0) needs causal")
    if a.get("local_window") and a["causal"]:
        raise ShapeError("fused_attention: a two-sided local window (local_window > 0) is for non-causal "
                         "attention; causal attention takes a sliding window")
    if a["heads"] % a["kv_heads"]:
        raise ShapeError(f"fused_attention: {a['heads']} query heads do not divide into {a['kv_heads']} groups")


def _fused_ref(x, a, ev):
    rep = a["heads"] // a["kv_heads"]
    q, k_, v_ = x[0], np.repeat(x[1], rep, axis=1), np.repeat(x[2], rep, axis=1)
    extra = x[3:]
    mask = extra.pop(0) if a["padding"] else None
    bias = extra.pop(0) if a["bias"] else None
    sinks = score_epilogue.sink_logits(extra.pop(0), a["heads"]) if a.get("sinks") else None
    where = score_epilogue.Where(q.shape[-2], k_.shape[-2], key_mask=mask, bias=bias, sinks=sinks)
    s = score_epilogue.apply(q @ np.swapaxes(k_, -1, -2), a, where)
    if a.get("sinks"):
        return score_epilogue.softmax(s, a, where).astype(s.dtype) @ v_
    return softmax(s, -1) @ v_


def _pairs(c):
    q, k = c.type(0), c.type(1)
    return c.pairs if c.pairs is not None else c.dim(q.shape[-2]) * c.dim(k.shape[-2])


def _fused_macs(c):
    """q·kᵀ and p·v over the query-key pairs per head (all Tq·Tk unless c.pairs says fewer):
    (hd + hd_v) per pair, for each batch row and query head."""
    q, v = c.type(0), c.type(2)
    return c.numel(q.shape[:-2]) * _pairs(c) * (c.dim(q.shape[-1]) + c.dim(v.shape[-1]))


def _fused_flops(c):
    """The products, the softmax, and per score what the node's score-epilogue features do
    (reference/score_epilogue.py ``flops`` of each: as the unfused ops would count them)."""
    scores = c.numel(c.type(0).shape[:-2]) * _pairs(c)
    f = {"matmul": c.macs * 2, "softmax": scores * 5}
    for kind, n in score_epilogue.flops_per_score(c.attrs).items():
        if n:
            f[kind] = f.get(kind, 0) + scores * n
    return f


@op("fused_attention", reference=_fused_ref,
    cost=custom(_fused_flops, macs=_fused_macs, per_pair=True),
    # What a fused kernel keeps (q, k, v, its output, one log-sum-exp per row) is counted by
    # analysis/memory.py from the attention structure, which recognises fused_attention nodes.
    saved=(), traits=("matmul_class",))
def _fused_attention(t, a):
    """softmax(cap(q·kᵀ·scale) + masks + bias)·v on [B, H, T, hd] with kv_heads key/value heads; with
    attrs["softcap"] = c > 0, cap(s) = tanh(s)·c (logit soft-capping, the 1/c folded into the scale);
    with attrs["sinks"], inputs q, k, v[, mask][, bias], sinks: one more logit per head in the softmax's
    normaliser (attention sinks, gpt-oss)."""
    check_fused_attrs(a)
    n_in = 3 + int(a["padding"]) + int(a["bias"]) + int(bool(a.get("sinks")))
    if len(t) != n_in:
        raise ShapeError(f"fused_attention: {len(t)} inputs, its attributes (padding, bias, sinks) say {n_in}")
    q, k, v = t[0], t[1], t[2]
    if a.get("sinks"):  # the last input: one logit per query head (any shape of that many values)
        sk = t[-1]
        if not dims.is_static(dims.numel(sk.shape)) or int(dims.numel(sk.shape)) != a["heads"]:
            raise ShapeError(f"fused_attention: sinks {dims.fmt_shape(sk.shape)} is not one value per head "
                             f"({a['heads']})")
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError("fused_attention takes q, k, v as [B, H, T, hd]")
    if not dims.equal(q.shape[-1], k.shape[-1]) or not dims.equal(k.shape[-2], v.shape[-2]):
        raise ShapeError(f"fused_attention: q {dims.fmt_shape(q.shape)}, k {dims.fmt_shape(k.shape)}, "
                         f"v {dims.fmt_shape(v.shape)} do not fit")
    if a["heads"] % a["kv_heads"] or int(k.shape[1]) != a["kv_heads"]:
        raise ShapeError(f"fused_attention: {a['heads']} query heads over {dims.fmt(k.shape[1])} key/value heads")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))]
