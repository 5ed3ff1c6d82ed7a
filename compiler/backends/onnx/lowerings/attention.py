"""ONNX lowerings of the attention pieces of compiler/ops/attention.py: the masks, rotary embedding
(six element-wise nodes, or one RotaryEmbedding on explicit positions) and the top-k gates.
``fused_attention``'s kernels live in backends/onnx/attention.py and cached_attention.py; this
table only names its entry point."""

from __future__ import annotations

import numpy as np

from tessera.compiler.backends.onnx import attention as kernels
from tessera.compiler.backends.onnx.lowerings.common import min_const, np_float
from tessera.compiler.ir import dims
from tessera.compiler.ops.attention import check_fused_attrs, rotated_dims
from tessera.compiler.reference.numerics import longrope_parts, rope_attention_factor, rope_inv_freq


def _positions(L):
    """Each query's position [Tq, 1] and each key's [Tk] (queries are the last Tq of Tk positions),
    shared by the causal and the two-sided window masks."""
    b, t = L.b, L.t_in[0]
    tq, tk = t.shape[-2], t.shape[-1]
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    rows = b.node("Range", [zero, b.dim_scalar(tq), one])[0]
    offset = tk - tq
    if not (dims.is_static(offset) and int(offset) == 0):
        rows = b.node("Add", [rows, b.dim_scalar(offset)])[0]
    rows = b.node("Unsqueeze", [rows, b.i64([1])])[0]
    cols = b.node("Range", [zero, b.dim_scalar(tk), one])[0]
    return rows, cols


def _causal_mask(L):
    b, a, t = L.b, L.a, L.t_in[0]
    rows, cols = _positions(L)
    hide = b.node("Greater", [cols, rows])[0]
    if a["window"]:
        lim = b.node("Sub", [rows, b.const(np.array(a["window"], dtype=np.int64), "window")])[0]
        far = b.node("LessOrEqual", [cols, lim])[0]
        hide = b.node("Or", [hide, far])[0]
    if a.get("chunk"):  # chunked attention: another block of C positions than the query's
        c = b.const(np.array(a["chunk"], dtype=np.int64), "chunk")
        other = b.node("Not", [b.node("Equal", [b.node("Div", [cols, c])[0], b.node("Div", [rows, c])[0]])[0]])[0]
        hide = b.node("Or", [hide, other])[0]
    L.emit("Where", [hide, min_const(b, t.dtype), L.x[0]])


def _local_mask(L):
    """|key - query| >= window hidden (queries are the last Tq of Tk positions)."""
    b, a, t = L.b, L.a, L.t_in[0]
    rows, cols = _positions(L)
    cols = b.node("Unsqueeze", [cols, b.i64([0])])[0]
    far = b.node("GreaterOrEqual", [b.node("Abs", [b.node("Sub", [cols, rows])[0]])[0],
                                    b.const(np.array(a["window"], dtype=np.int64), "window")])[0]
    L.emit("Where", [far, min_const(b, t.dtype), L.x[0]])


def _padding_mask(L):
    b, x, t_in = L.b, L.x, L.t_in
    zero = b.const(np.array(0, dtype=np.int64 if t_in[1].dtype == "i64" else np.int32), "zero")
    keep = b.node("Not", [b.node("Equal", [x[1], zero])[0]])[0] if t_in[1].dtype != "bool" else x[1]
    keep = b.node("Unsqueeze", [keep, b.i64([1, 2])])[0]
    L.emit("Where", [keep, x[0], min_const(b, t_in[0].dtype)])


def _rope(L):
    b, a, t, x = L.b, L.a, L.t_in[0], L.x
    hd = int(t.shape[-1])
    r = rotated_dims(a, hd)
    interleaved = bool(a.get("interleaved"))
    n = t.shape[-2]
    kind = a.get("rope_type", "llama3")
    inv_freq = rope_inv_freq(r, a["theta"], a.get("scaling"), kind)
    if kind == "dynamic" and len(x) > 1:
        raise ValueError("dynamic NTK rope has no cached form (its frequencies follow the whole length)")
    if len(x) > 1 and t.rank == 4 and t.dtype in ("f32", "f16"):  # the types onnxruntime's CPU kernel takes
        return _rope_fused(L, r, hd, interleaved, inv_freq)
    zero = b.const(np.array(0, dtype=np.int64), "zero")
    one = b.const(np.array(1, dtype=np.int64), "one")
    if len(x) > 1:  # explicit positions [B, T] (a KV-cached graph): tables [B, 1, T, hd]
        pos = b.node("Unsqueeze", [b.node("Cast", [x[1]], to=b.onnx_type("f32"))[0], b.i64([1, 3])])[0]
        lead = 3
    else:
        pos = b.node("Cast", [b.node("Range", [zero, b.dim_scalar(n), one])[0]], to=b.onnx_type("f32"))[0]
        pos = b.node("Unsqueeze", [pos, b.i64([1])])[0]
        lead = 1
    inv = b.const(inv_freq[None, :], "inv_freq")
    if kind == "dynamic":
        inv = _dynamic_inv_freq(L, r, n)
    elif kind == "longrope":
        inv = _longrope_inv_freq(b, L.a, r, _rope_length(b, x, n), lead=True)
    freqs = b.node("Mul", [pos, inv])[0]
    if interleaved:  # f0 f0 f1 f1 ...
        pair = b.node("Unsqueeze", [freqs, b.i64([-1])])[0]
        emb = b.node("Reshape", [b.node("Concat", [pair, pair], axis=-1)[0], b.i64([0] * lead + [r])])[0]
    else:
        emb = b.node("Concat", [freqs, freqs], axis=-1)[0]
    cos, sin = b.node("Cos", [emb])[0], b.node("Sin", [emb])[0]
    cos, sin = _attention_factor(b, a, cos), _attention_factor(b, a, sin)
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


def _attention_factor(b, a, table: str) -> str:
    """YaRN's cos/sin factor (transformers' attention_scaling), in fp32; other kinds: the table."""
    factor = rope_attention_factor(a.get("scaling"), a.get("rope_type", "llama3"))
    if factor == 1.0:
        return table
    return b.node("Mul", [table, b.const(np.array(factor, dtype=np.float32), "rope_attention_factor")])[0]


def _dynamic_inv_freq(L, r: int, n) -> str:
    """Dynamic NTK's frequencies [1, r/2] for the run's length T (reference/numerics.rope_inv_freq):
    theta · (factor · max(T, ctx) / ctx - (factor - 1))^(r / (r - 2)), raised to -2i/r."""
    b, a = L.b, L.a
    factor, ctx = a["scaling"]
    f32 = lambda v: b.const(np.array(v, dtype=np.float32), "dynamic_rope")  # noqa: E731
    length = b.node("Cast", [b.node("Max", [b.dim_scalar(n), b.const(np.array(int(ctx), dtype=np.int64), "ctx")])[0]],
                    to=b.onnx_type("f32"))[0]
    grow = b.node("Sub", [b.node("Div", [b.node("Mul", [f32(factor), length])[0], f32(ctx)])[0], f32(factor - 1)])[0]
    base = b.node("Mul", [f32(a["theta"]), b.node("Pow", [grow, f32(r / (r - 2))])[0]])[0]
    exps = f32((np.arange(0, r, 2, dtype=np.int64).astype(np.float32) / r)[None, :])
    return b.node("Reciprocal", [b.node("Pow", [base, exps])[0]])[0]


def _rope_length(b, x: list[str], n) -> str:
    """The sequence length longrope switches on, an i64 scalar: T for a whole sequence, the largest
    position + 1 of the whole batch with explicit positions (transformers' max(position_ids) + 1)."""
    if len(x) == 1:
        return b.dim_scalar(n)
    # TopK(1) of the flattened positions rather than ReduceMax: onnxruntime's CUDA ReduceMax over [B, T]
    # goes through cuDNN's reduction (tests/cuda: the stub has none), its TopK does not
    flat = b.node("Reshape", [x[1], b.i64([-1])])[0]
    top = b.node("TopK", [flat, b.i64([1])], 2, axis=-1, largest=1, sorted=1)[0]  # [1]
    return b.node("Add", [b.node("Squeeze", [top, b.i64([0])])[0], b.const(np.array(1, dtype=np.int64), "one")])[0]


def _longrope_inv_freq(b, a, r: int, length: str, lead: bool) -> str:
    """longrope's frequencies (reference/numerics.rope_inv_freq): the long factors' where ``length``
    passes original_ctx, else the short ones'; [1, r/2] with ``lead``, else [r/2]."""
    ctx = longrope_parts(a["scaling"])[0]
    short, long = (rope_inv_freq(r, a["theta"], a["scaling"], "longrope", seq_len=n) for n in (ctx, ctx + 1))
    shape = (lambda v: v[None, :]) if lead else (lambda v: v)
    past = b.node("Greater", [length, b.const(np.array(ctx, dtype=np.int64), "longrope_ctx")])[0]
    return b.node("Where", [past, b.const(shape(long), "inv_freq_long"), b.const(shape(short), "inv_freq")])[0]


def _rope_fused(L, r: int, hd: int, interleaved: bool, inv_freq: np.ndarray) -> None:
    """Explicit positions on [B, H, T, hd] (the KV-cached graph): one ONNX RotaryEmbedding (opset 23)
    per rope instead of six element-wise nodes. Its cos and sin tables are given per position,
    [B, T, r/2], computed once from the positions and shared by every rope with the same
    frequencies (a Llama decoding step has 24 ropes), so there is no table of maximum length
    and no limit on the position."""
    b, t, x = L.b, L.t_in[0], L.x
    key = ("rope_tables", x[1], inv_freq.tobytes(), t.dtype,
           rope_attention_factor(L.a.get("scaling"), L.a.get("rope_type", "llama3")),
           L.a.get("scaling") if L.a.get("rope_type") == "longrope" else None)  # its long factors too
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            pos = b.node("Unsqueeze", [b.node("Cast", [x[1]], to=b.onnx_type("f32"))[0], b.i64([2])])[0]
            inv = b.const(inv_freq.astype(np.float32), "inv_freq")
            if L.a.get("rope_type") == "longrope":  # the short or long factors by the batch's length
                inv = _longrope_inv_freq(b, L.a, r, _rope_length(b, x, None), lead=False)
            freqs = b.node("Mul", [pos, inv], [b.fresh("rope/freqs")])[0]  # [B, T, r/2]
            tables = [_attention_factor(b, L.a, b.node(f, [freqs], [b.fresh(f"rope/{f.lower()}")])[0])
                      for f in ("Cos", "Sin")]
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


def _topk_index(L, out: str | None = None) -> str:
    """TopK's indices of the node's input along the last axis, largest first, ties to the lower index
    (written to ``out`` if given; bf16: TopK has no kernel for it at opset 21, so in fp32)."""
    b, x = L.b, L.x[0]
    if L.t_in[0].dtype == "bf16":
        x = b.node("Cast", [x], to=b.onnx_type("f32"))[0]
    return b.node("TopK", [x, b.i64([L.a["k"]])], [b.fresh("TopK"), out or b.fresh("TopK")], axis=-1, largest=1,
                  sorted=1)[1]


def _topk_mask(L):
    """False everywhere, then True scattered at TopK's indices."""
    b, idx = L.b, _topk_index(L)
    none = b.node("ConstantOfShape", [b.node("Shape", [L.x[0]])[0]], value=b.tensor_value(np.zeros(1, np.bool_)))[0]
    every = b.node("ConstantOfShape", [b.node("Shape", [idx])[0]], value=b.tensor_value(np.ones(1, np.bool_)))[0]
    L.emit("ScatterElements", [none, idx, every], axis=-1)


def _topk_gates(L):
    b, x = L.b, L.x
    logits = x[0]
    if L.t_in[0].dtype == "bf16":  # TopK takes no bfloat16 at opset 21: the gates in fp32, cast back
        logits = b.node("Cast", [logits], to=b.onnx_type("f32"))[0]
    if L.a.get("normalize") is False:  # the softmax over all logits, at the top k (the same indices)
        w, idx = b.node("TopK", [b.node("Softmax", [logits], axis=-1)[0], b.i64([L.a["k"]])], 2, axis=-1,
                        largest=1, sorted=1)
    else:
        vals, idx = b.node("TopK", [logits, b.i64([L.a["k"]])], 2, axis=-1, largest=1, sorted=1)
        w = b.node("Softmax", [vals], axis=-1)[0]
    if L.t_in[0].dtype == "bf16":
        w = b.node("Cast", [w], to=b.onnx_type("bf16"))[0]
    zeros = b.node("ConstantOfShape", [b.node("Shape", [x[0]])[0]],
                   value=b.tensor_value(np.zeros(1, dtype=np_float(L.t_in[0].dtype))))[0]
    L.emit("ScatterElements", [zeros, idx, w], axis=-1)


def lower_fused_attention(b, node, out: str) -> None:
    """fused_attention by its ``impl`` (passes/attention_kernels.py): the KV cache's kernels
    (backends/onnx/cached_attention.py), the block kernel, or a long-sequence kernel (with the block
    kernel in front while the scores fit ``block_bytes``: backends/onnx/attention.py ``short_or``).
    Here, above both kernel modules, so that neither imports the other for the dispatch."""
    check_fused_attrs(node.attrs)  # an attribute no kernel reads is an error, never dropped
    impl = node.attrs.get("impl", "portable")
    if impl in ("cached", "phased"):  # attention over a KV cache (compiler/passes/kv_cache.py)
        from tessera.compiler.backends.onnx import cached_attention

        lower = cached_attention.lower_cached_attention if impl == "cached" else \
            cached_attention.lower_phased_attention
        return lower(b, node, out)
    if impl == "block":
        return kernels._block(b, node, out)
    lower = {"gqa": kernels._gqa, "mha": kernels._mha, "attn23": kernels._attn23, "portable": kernels._portable}[impl]
    budget = node.attrs.get("block_bytes") or 0
    if budget:
        return kernels.short_or(b, node, out, lower, budget)
    lower(b, node, out)


LOWERINGS = {
    "causal_mask": _causal_mask,
    "local_mask": _local_mask,
    "padding_mask": _padding_mask,
    "rope": _rope,
    "topk_gates": _topk_gates,
    "topk_indices": lambda L: _topk_index(L, L.out),
    "topk_mask": _topk_mask,
    "fused_attention": lambda L: lower_fused_attention(L.b, L.node, L.out),
}
