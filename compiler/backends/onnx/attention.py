"""ONNX lowerings of fused_attention: onnxruntime's contrib kernels, or Tessera's portable tiled kernel.

The node's ``impl`` attribute (set by passes.attention_kernels) picks one:

- ``gqa`` / ``mha``: com.microsoft.GroupQueryAttention / MultiHeadAttention,
  which take [B, T, H·hd] tensors, so heads are merged before and split after.
- ``portable``: a Loop over (head, query tile) pairs in standard ONNX ops. Each
  iteration takes one head's tile of query rows (at least ``q_tile``; more, up to
  MAX_TILE, while the tile's scores fit SCORE_BLOCK_BUDGET at the run's length;
  a causal tile at most a quarter of the queries), the keys they can see (a
  causal tile stops at its last row's position; a sliding window starts at its
  first row's window), computes that block's scores, masks (a causal tile only
  its diagonal block), softmax and product with V. The scan output stacks the
  tiles. Only one tile × Tk block of scores exists at once.
- ``block``: no Loop: all heads' scores as one [B, H, Tq, Tk] block of plain
  MatMul/Softmax (the unfused graph's ops, with the masks as one constant-shaped
  select). For short sequences, where the Loop's per-iteration bookkeeping costs
  more than the products.

A node whose ``block_bytes`` attribute is set (passes.attention_kernels, CPU auto, the
length known only at run time) is lowered as an If: the block while B·H·Tq·Tk scores
take at most that many bytes, else its ``impl``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.compiler.backends.onnx.floats import np_float as _np_float, onnx_float as _onnx_float

# onnx is imported in the lowering functions, not here: passes/attention_kernels.py reads this module's
# kernel tables when `tessera report` runs, and onnx (with ml_dtypes) takes ~0.6 s to import
from tessera.compiler.backends.onnx import score_epilogue as epilogue
from tessera.compiler.ir import dims


SCORE_BLOCK_BUDGET = 16 * 1024 * 1024  # bytes of scores one head's tile may hold
MAX_TILE = 256
MIN_CAUSAL_TILES = 4  # a causal tile holds at most 1/MIN_CAUSAL_TILES of the queries (unless q_tile is more)


# Which score-epilogue features (compiler/reference/score_epilogue.py FEATURES) each lowering computes:
# an allow-list. passes/attention_kernels.py picks only a kernel that computes every feature a node
# uses, and fusion leaves a site unfused when none does. Tessera's own kernels (block, portable, and
# the cached decode/prefill in cached_attention.py) compute scores through the one ONNX epilogue
# (score_epilogue.py), so they compute exactly what it computes; the contrib ops have their own.
@dataclass(frozen=True)
class Epilogue:
    """Every feature backends/onnx/score_epilogue.py computes, less ``less``: read when asked, so a
    feature added to the epilogue's STEPS reaches every kernel that computes scores through it."""

    less: frozenset = frozenset()


EPILOGUE = Epilogue()
KERNEL_FEATURES: dict[str, frozenset | Epilogue] = {
    # scale, softcap (c·tanh(scale·s / c), before its causal mask), local_window_size; no padding mask or bias
    # and attention sinks (its head_sink input)
    "gqa": frozenset({"scale", "softcap", "causal", "window", "sinks"}),
    "mha": frozenset({"scale"}),                        # no mask, bias, cap (not causal: see attention_kernels)
    # onnx's Attention (opset 23): the scale and softcap attributes (the spec caps the scaled scores before
    # the mask, as the reference's stages do; onnxruntime 1.31.1's CUDA kernel takes the attribute, where 1.2x
    # threw "softcap is not supported yet"), every mask and the bias as its one attn_mask
    # (score_epilogue.prepare_whole's boolean, or bias + the masks as the dtype's lowest value), and attention
    # sinks as one extra key per head (``_sink_key``; not with a soft-cap, which would cap the sink too)
    "attn23": frozenset({"scale", "softcap", "causal", "window", "local_window", "padding", "bias", "sinks"}),
    "block": EPILOGUE,
    "portable": EPILOGUE,
    # the cached kernels add one mask the cache builds (causal, window, chunk, padding): no two-sided window
    "cached": Epilogue(frozenset({"local_window"})),
    "phased": Epilogue(frozenset({"local_window"})),
}
# Features a kernel computes alone but not together, and why (passes/attention_kernels.py ``unsupported``).
KERNEL_CLASHES: dict[str, dict[frozenset, str]] = {
    "attn23": {frozenset({"softcap", "sinks"}): "a soft-cap with attention sinks (its softcap would cap the sink key's score too)"},
}


def kernel_clash(impl: str, used) -> str | None:
    """Why lowering ``impl`` cannot compute these features together (None: it can)."""
    for pair, why in KERNEL_CLASHES.get(impl, {}).items():
        if pair <= set(used):
            return why
    return None


# The structural shortcuts each lowering takes (compiler/reference/score_epilogue.py ASSUMPTIONS): a
# kernel is picked only for a node none of whose features breaks one (passes/attention_kernels.py
# ``unsupported``). The block kernel computes every score of [Tq, Tk] and takes none; the portable
# kernel's causal tiles end at their last row and its windows start late; the cached kernels read a
# buffer whose slots past the positions are hidden keys; the contrib kernels are flash/tiled kernels.
KERNEL_ASSUMES: dict[str, frozenset[str]] = {
    "gqa": frozenset({"hidden_weigh_zero", "tiles_scores"}),
    "mha": frozenset({"hidden_weigh_zero", "tiles_scores", "keys_only_softmax"}),
    # the memory-efficient/flash kernels tile the scores and skip hidden blocks; the keys padded to KEY_ALIGN
    # are hidden and weigh zero; its softmax is over the keys alone, and attention sinks come in as one more
    # key (``_sink_key``), so it takes no "keys_only_softmax" shortcut
    "attn23": frozenset({"hidden_weigh_zero", "tiles_scores"}),
    "block": frozenset(),
    "portable": frozenset({"hidden_weigh_zero", "tiles_scores"}),
    "cached": frozenset({"hidden_weigh_zero"}),
    "phased": frozenset({"hidden_weigh_zero", "tiles_scores"}),
}
# A phased node's decoding step as one GroupQueryAttention (cached_attention.py ``_lower_gqa_decode``):
# its scale and softcap attributes, and the cache's mask (padding, causal) as its attention_bias.
GQA_DECODE_FEATURES = frozenset({"scale", "softcap", "causal", "padding", "sinks"})  # sinks: its head_sink
# The serving engine's variant of that step (attribute ``prefix_keys``, set by passes/kv_cache.py where its
# compile option asks: runtime/options.py ``engine_pipeline_options``): GroupQueryAttention with seqlens_k alone
# and no attention_bias, so onnxruntime's CUDA kernel may choose flash (or memory-efficient) decoding, where
# with the bias it chose MATH (tests/cuda). It computes the same features, taking one shortcut more: each
# row's keys are its columns 0..seqlens_k, none hidden among them (score_epilogue.py ASSUMPTIONS
# "keys_by_length"). Guaranteed by the engine (a row fills its columns from 0); not by ``tessera generate``,
# which left-pads prompts of different lengths (its rows' first columns are hidden: the bias is needed).
PREFIX_KEYS_ASSUMES = frozenset({"keys_by_length"})


def kernel_assumes(impl: str, attrs: dict | None = None) -> frozenset[str]:
    """The shortcuts lowering ``impl`` takes for a node with these attributes: KERNEL_ASSUMES, and with a
    gqa decoding step without its mask (``prefix_keys``) PREFIX_KEYS_ASSUMES too."""
    a = attrs or {}
    extra = PREFIX_KEYS_ASSUMES if a.get("prefix_keys") and a.get("decode") == "gqa" else frozenset()
    return KERNEL_ASSUMES[impl] | extra


def kernel_features(impl: str, decode: str | None = None, prefill: str | None = None) -> frozenset[str]:
    """The score-epilogue features lowering ``impl`` computes (with ``decode`` "gqa" or ``prefill``
    "attn23": every branch's)."""
    have = KERNEL_FEATURES[impl]
    have = epilogue.computed() - have.less if isinstance(have, Epilogue) else have
    if prefill:
        have = have & kernel_features(prefill)
    return have & GQA_DECODE_FEATURES if decode == "gqa" else have


def _to_bsd(b, x: str) -> str:
    """[B, H, T, hd] -> [B, T, H*hd]; when x is split_heads(y), y already is that tensor."""
    producer = b.graph.producer(x)
    if producer is not None and producer.op == "split_heads" and b.graph.type_of(producer.inputs[0]).rank == 3:
        return producer.inputs[0]
    t = b.node("Transpose", [x], perm=[0, 2, 1, 3])[0]
    return b.node("Reshape", [t, b.i64([0, 0, -1])])[0]


def _from_bsd(b, x: str, heads: int, hv: int, out: str) -> None:
    r = b.node("Reshape", [x, b.i64([0, 0, heads, hv])])[0]
    b.node("Transpose", [r], [out], perm=[0, 2, 1, 3])


def _scalar(b, value, dtype=np.int64) -> str:
    return b.const(np.array(value, dtype=dtype), "scalar")


def short_or(b, node, out: str, lower, budget: int) -> None:
    """If the whole [B, H, Tq, Tk] score block takes at most ``budget`` bytes, the block
    kernel (no Loop), else ``lower``. The test is on run-time dimensions, computed outside the If."""
    from tessera.compiler.backends.onnx.branches import branch

    q_t, k_t = b.graph.type_of(node.inputs[0]), b.graph.type_of(node.inputs[1])
    elem = _onnx_float(q_t.dtype)
    fits = _fits(b, q_t, k_t, node.attrs["heads"], budget)
    whole = _block_prep(b, node, fits)
    then_g = branch(b, lambda b, n, o: _block(b, n, o, whole), node, "block", elem)
    else_g = branch(b, lower, node, node.attrs.get("impl", "portable"), elem)
    b.node("If", [fits], [out], then_branch=then_g, else_branch=else_g)


def _fits(b, q_t, k_t, heads: int, budget: int) -> str:
    """B·H·Tq·Tk·bytes <= budget, computed once in the main graph for every site of the same shape
    (``b.shared``): one test, not one per layer."""
    bytes_per = (2 if q_t.dtype in ("f16", "bf16") else 4)
    key = ("block_fits", str(q_t.shape[0]), str(q_t.shape[-2]), str(k_t.shape[-2]), heads * bytes_per, int(budget))
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            per_batch = _scalar(b, heads * bytes_per)
            n = b.node("Mul", [b.node("Mul", [b.dim_scalar(q_t.shape[0]), per_batch])[0],
                               b.node("Mul", [b.dim_scalar(q_t.shape[-2]), b.dim_scalar(k_t.shape[-2])])[0]])[0]
            b.shared[key] = b.node("LessOrEqual", [n, _scalar(b, int(budget))], [b.fresh("block_fits")])[0]
        finally:
            b.current = saved
    return b.shared[key]


def _block_prep(b, node, fits: str) -> str | None:
    """The block kernel's masks for the short branch, built once outside every layer's If
    (score_epilogue.prepare_whole): empty while ``fits`` is False."""
    a = node.attrs
    mask = node.inputs[3] if a["padding"] else None
    q_t, k_t = b.graph.type_of(node.inputs[0]), b.graph.type_of(node.inputs[1])
    return epilogue.prepare_whole(b, a, mask, q_t, k_t, fits)


def _block(b, node, out: str, whole: str | None = None) -> None:
    """softmax(cap(q·kᵀ·scale) + bias + masks)·v as one block over all heads: the unfused graph's
    order of operations (onnxruntime folds the transpose and the scale into one FusedMatMul), the
    causal and sliding-window masks one select over [Tq, Tk], grouped key/value heads shared
    through a broadcast over [B, G, rep, T, d] (no copy of K or V). ``whole``: the masks built
    outside (``_block_prep``, as the short branch of ``short_or``), else they are built here."""
    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    extra = list(node.inputs[3:])
    mask = extra.pop(0) if a["padding"] else None
    bias = extra.pop(0) if a["bias"] else None
    q_t, k_t, v_t = (g.type_of(x) for x in node.inputs[:3])
    heads, kv_heads = a["heads"], a["kv_heads"]
    rep = heads // kv_heads
    hd, hv = q_t.shape[-1], int(v_t.shape[-1])
    sinks = extra.pop(0) if a.get("sinks") else None
    prep = epilogue.prepare(b, a, mask, bias, q_t, k_t, hide=whole, sinks=sinks)
    k_t_all = b.node("Transpose", [k], perm=[0, 1, 3, 2])[0]  # [B, G, d, Tk]
    if rep > 1:  # queries [B, G, rep, Tq, d] against keys [B, G, 1, d, Tk]
        q5 = b.node("Reshape", [q, b.shape_vec([q_t.shape[0], kv_heads, rep, q_t.shape[-2], hd])])[0]
        k5 = b.node("Unsqueeze", [k_t_all, b.i64([2])])[0]
        s = b.node("Reshape", [b.node("MatMul", [q5, k5])[0],
                               b.shape_vec([q_t.shape[0], heads, q_t.shape[-2], k_t.shape[-2]])])[0]
    else:
        s = b.node("MatMul", [q, k_t_all])[0]
    s = epilogue.apply(b, a, s, prep, epilogue.Block())
    p = epilogue.softmax(b, a, s, prep, epilogue.Block())
    if rep > 1:
        p5 = b.node("Reshape", [p, b.shape_vec([q_t.shape[0], kv_heads, rep, q_t.shape[-2], k_t.shape[-2]])])[0]
        o5 = b.node("MatMul", [p5, b.node("Unsqueeze", [v, b.i64([2])])[0]])[0]
        b.node("Reshape", [o5, b.shape_vec([q_t.shape[0], heads, q_t.shape[-2], hv])], [out])
    else:
        b.node("MatMul", [p, v], [out])


def _gqa(b, node, out: str) -> None:
    from onnx import TensorProto
    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    q_t = g.type_of(q)
    hv = int(g.type_of(v).shape[-1])
    t = b.dim_scalar(q_t.shape[-2])
    t32 = b.node("Cast", [t], to=TensorProto.INT32)[0]
    last = b.node("Sub", [t32, _scalar(b, 1, np.int32)])[0]
    seqlens = b.node("Expand", [b.node("Unsqueeze", [last, b.i64([0])])[0], b.dim(q_t.shape[0])])[0]
    # present_key/present_value named: onnxruntime's CUDA kernel refuses a GroupQueryAttention without them
    # (group_query_attention.cc: "present_key and present_value are required unless borrowing a ... KV cache");
    # nothing reads them, onnxruntime fills them ([B, kv_heads, T, hd], the keys and values as given)
    attrs = {"scale": float(a["scale"])}
    if a.get("softcap"):  # GroupQueryAttention caps as c·tanh(scale·s / c); Tessera folds the 1/c into its scale
        attrs = {"softcap": float(a["softcap"]), "scale": float(a["scale"]) * float(a["softcap"])}
    # attention sinks: its head_sink input (11), exp(sink - max) added to the softmax's denominator per head,
    # checked against numpy and the unfused graph on CPU (tests/compiler/test_attention_sinks.py)
    sinks = ["", "", "", "", node.inputs[-1]] if a.get("sinks") else []
    res = b.node("GroupQueryAttention", [_to_bsd(b, q), _to_bsd(b, k), _to_bsd(b, v), "", "", seqlens, t32] + sinks,
                 3, domain="com.microsoft", num_heads=a["heads"], kv_num_heads=a["kv_heads"],
                 local_window_size=a["window"] if a["window"] else -1, **attrs)[0]
    _from_bsd(b, res, a["heads"], hv, out)


def _mha(b, node, out: str) -> None:
    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    hv = int(g.type_of(v).shape[-1])
    res = b.node("MultiHeadAttention", [_to_bsd(b, q), _to_bsd(b, k), _to_bsd(b, v)], 1, domain="com.microsoft",
                 num_heads=a["heads"], scale=float(a["scale"]))[0]
    _from_bsd(b, res, a["heads"], hv, out)


# onnxruntime 1.31's memory-efficient CUDA kernel takes an attn_mask only when the key length is a multiple
# of 4 (fp32; seen under tests/cuda_stub: Tk = 7 fell back to MATH, 4 and 8 did not): keys, values and the
# mask are padded to a multiple of KEY_ALIGN, the padded keys hidden (exact: their weights are 0)
KEY_ALIGN = 8


def _attn23(b, node, out: str, names: list[str] | None = None) -> None:
    """onnx's Attention (opset 23; the exporter writes the model at 23 for it, export.NEWER_OPS) on the
    [B, H, T, d] tensors as they are. The masks (causal, sliding and two-sided windows, padding) and the
    bias become one attn_mask built in the main graph (``attn23_inputs``): a boolean [B, 1, Tq, Tk']
    (True = attend), or with a bias the float bias plus the hidden scores at the dtype's lowest value;
    Tk' is Tk rounded up to KEY_ALIGN, the keys and values padded with zeros and the padded keys hidden
    (exact: their weights are 0). On CUDA (onnxruntime 1.31.1, sm_90) the op then runs the
    memory-efficient kernel in fp32, fp16 and bf16; ``is_causal`` is not used: in fp32 it selected the
    unfused MATH path (tests/cuda_stub). A soft-cap is the op's softcap attribute (Tessera's scale has
    the 1/c folded in, as for GroupQueryAttention); attention sinks one extra key (``_sink_key``).
    ``names`` replaces the inputs' names (same types): a cached prompt's keys and values, past and new
    concatenated in an If branch (backends/onnx/cached_attention.py), whose mask was built in the main
    graph before the If."""
    a = node.attrs
    q, k, v = (names or node.inputs)[:3]
    mask, pads = attn23_inputs(b, node)
    q_t = b.graph.type_of(node.inputs[0])
    more = SINK_DIMS if a.get("sinks") else 0
    hd, hv = int(q_t.shape[-1]) + more, int(b.graph.type_of(node.inputs[2]).shape[-1]) + more
    if more:
        q, k, v = _sink_key(b, node, q, k, v)
    if q_t.dtype == "f32" and a["kv_heads"] != a["heads"]:
        # grouped key/value heads in fp32: onnxruntime 1.31's CUDA Attention took its MATH path (the whole
        # N x N scores) for them and the memory-efficient kernel once the heads are repeated (tests/cuda_stub)
        k, v = (_repeat_heads(b, x, a["heads"], a["heads"] // a["kv_heads"], d) for x, d in ((k, hd), (v, hv)))
    if isinstance(pads, tuple):  # bf16: onnxruntime has no bf16 CUDA Pad; zeros concatenated instead
        k, v = (b.node("Concat", [x, z], axis=2)[0] for x, z in zip((k, v), pads))
    elif pads is not None:
        k, v = b.node("Pad", [k, pads])[0], b.node("Pad", [v, pads])[0]
    attrs = {"scale": float(a["scale"])}
    if a.get("softcap"):  # c·tanh(scale·s / c): Tessera's scale already holds the 1/c
        attrs = {"scale": float(a["scale"]) * float(a["softcap"]), "softcap": float(a["softcap"])}
    inputs = [q, k, v] + ([mask] if mask else [])
    if not more:
        b.node("Attention", inputs, [out], **attrs)
        return
    wide = b.node("Attention", inputs, **attrs)[0]  # the values' zero dimensions sliced off
    b.node("Slice", [wide, b.i64([0]), b.i64([hv - more]), b.i64([3])], [out])


# Attention sinks on onnx's Attention, which has no input for them: softmax over the keys and one logit per
# query head, s_h, whose weight is dropped, is the softmax over one extra key whose score is s_h and whose
# value is zero. Its score comes from SINK_DIMS more head dimensions (a multiple of 8, the CUDA kernels'
# rule): queries get [s_h / scale, 0, ...] there, the real keys zeros, the sink key [1, 0, ...] there and
# zeros elsewhere, so q·k_sink·scale = s_h and every real score is unchanged. The sink key is key 0, seen
# by every query (its mask column is True); its value row is zeros. The values get SINK_DIMS zero dimensions
# too, sliced off the output: with value heads narrower than the keys' onnxruntime 1.31's CUDA Attention took
# its MATH path in fp16/bf16 (tests/cuda_stub). Exact up to s_h / scale rounded to the scores' dtype.
SINK_DIMS = 8


def _sink_key(b, node, q: str, k: str, v: str) -> tuple[str, str, str]:
    """q, k, v with the sink key (see SINK_DIMS): the constants and every shape built in the main graph by
    ``_sink_inputs`` (no shape arithmetic in an If branch), expanded here."""
    q_more, (q_shape, k_shape, key_shape, value_shape), (key, zero) = _sink_inputs(b, node)
    q = b.node("Concat", [q, b.node("Expand", [q_more, q_shape])[0]], axis=-1)[0]
    k, v = (b.node("Concat", [x, b.node("Expand", [zero, k_shape])[0]], axis=-1)[0] for x in (k, v))
    k = b.node("Concat", [b.node("Expand", [key, key_shape])[0], k], axis=2)[0]
    v = b.node("Concat", [b.node("Expand", [zero, value_shape])[0], v], axis=2)[0]
    return q, k, v


def _sink_inputs(b, node):
    """In the main graph, once per node: the queries' extra dimensions [1, H, 1, SINK_DIMS] (s_h / scale,
    zeros), the shapes [B, H, Tq, SINK_DIMS], [B, G, Tk, SINK_DIMS] (zeros after the keys and values),
    [B, G, 1, hd + SINK_DIMS] (the sink key), [B, G, 1, hv + SINK_DIMS] (its value), and the sink key's row
    and a zero, in the scores' dtype."""
    cache = ("attn23_sinks", node.name)
    if cache in b.shared:
        return b.shared[cache]
    a = node.attrs
    q_t, k_t, v_t = (b.graph.type_of(x) for x in node.inputs[:3])
    np_dtype = _np_float(q_t.dtype)
    hd, hv, batch = int(q_t.shape[-1]), int(v_t.shape[-1]), q_t.shape[0]
    scale = float(a["scale"]) * (float(a["softcap"]) if a.get("softcap") else 1.0)
    first = np.zeros((1, 1, 1, SINK_DIMS), np.float32)
    first[..., 0] = 1.0 / scale
    saved, b.current = b.current, ""
    try:
        logits = b.node("Reshape", [node.inputs[-1], b.i64([1, -1, 1, 1])])[0]
        if q_t.dtype != "f32":  # divided in fp32, then rounded once
            logits = b.node("Cast", [logits], to=_onnx_float("f32"))[0]
        q_more = b.node("Mul", [logits, b.const(first, "sink_query")])[0]
        if q_t.dtype != "f32":
            q_more = b.node("Cast", [q_more], to=_onnx_float(q_t.dtype))[0]
        shapes = (b.shape_vec([batch, a["heads"], q_t.shape[-2], SINK_DIMS]),
                  b.shape_vec([batch, a["kv_heads"], k_t.shape[-2], SINK_DIMS]),
                  b.shape_vec([batch, a["kv_heads"], 1, hd + SINK_DIMS]),
                  b.shape_vec([batch, a["kv_heads"], 1, hv + SINK_DIMS]))
    finally:
        b.current = saved
    key = np.zeros((1, 1, 1, hd + SINK_DIMS), np_dtype)
    key[..., hd] = 1
    b.shared[cache] = q_more, shapes, (b.const(key, "sink_key"), b.const(np.zeros((1, 1, 1, 1), np_dtype), "zero"))
    return b.shared[cache]


def _repeat_heads(b, x: str, heads: int, rep: int, hd: int) -> str:
    """[B, G, T, d] -> [B, G·rep, T, d], each key/value head repeated for its ``rep`` query heads (constant
    shapes only: no shape arithmetic inside an If branch)."""
    wide = b.node("Expand", [b.node("Unsqueeze", [x, b.i64([2])])[0], b.i64([1, 1, rep, 1, 1])])[0]
    return b.node("Reshape", [wide, b.i64([0, heads, -1, hd])])[0]


def attn23_inputs(b, node) -> tuple[str | None, str | None]:
    """The attn_mask of the Attention node lowering ``node`` (None: it needs none) and the pads of its keys
    and values (None: the key length is a fixed multiple of KEY_ALIGN), built in the main graph: called
    before the If of a cached prompt (backends/onnx/cached_attention.py), so the branch holds no shape
    arithmetic (onnxruntime places an If branch's on the device, with a copy to the host for each), and
    kept per node (``b.shared``); the boolean mask once for every layer alike."""
    key = ("attn23_inputs", node.name)
    if key in b.shared:
        return b.shared[key]
    a = node.attrs
    extra = list(node.inputs[3:])
    mask = extra.pop(0) if a["padding"] else None
    bias = extra.pop(0) if a["bias"] else None
    q_t, k_t = b.graph.type_of(node.inputs[0]), b.graph.type_of(node.inputs[1])
    sink = 1 if a.get("sinks") else 0  # the sink key (``_sink_key``) is key 0
    tk = dims.dim(k_t.shape[-2] + sink)
    aligned = dims.is_static(tk) and int(tk) % KEY_ALIGN == 0
    saved, b.current = b.current, ""
    try:
        hidden = epilogue.prepare_whole(b, a, mask, q_t, k_t, b.const(np.array(True), "true"))
        attn_mask = None
        if hidden is not None or bias is not None or not aligned:
            attn_mask = _attn_mask(b, hidden, bias, q_t, k_t, aligned, sink)
        pads = None if aligned else _key_pads(b, tk, 2)
        if pads is not None and q_t.dtype == "bf16":  # the zero keys and values themselves (no bf16 CUDA Pad)
            extra = b.node("Slice", [pads, b.i64([6]), b.i64([7])])[0]
            zero = b.const(np.zeros((1, 1, 1, 1), dtype=_np_float("bf16")), "zero_bf16")
            widths = (int(k_t.shape[-1]) + SINK_DIMS * sink,
                      int(b.graph.type_of(node.inputs[2]).shape[-1]) + SINK_DIMS * sink)
            pads = tuple(b.node("Expand", [zero, b.node("Concat", [b.dim(q_t.shape[0]), b.i64([a["kv_heads"]]), extra,
                                                                 b.i64([w])], axis=0)[0]])[0]
                         for w in widths)
        b.shared[key] = attn_mask, pads
    finally:
        b.current = saved
    return b.shared[key]


def _key_pads(b, tk, axis: int) -> str:
    """Pad's pads for a rank-4 tensor: (KEY_ALIGN - Tk % KEY_ALIGN) % KEY_ALIGN at the end of ``axis`` (the keys:
    2 of [B, H, Tk, d], 3 of the mask [B, 1, Tq, Tk]), once per key length."""
    key = ("attn23_pads", str(tk), axis)
    if key not in b.shared:
        n = b.dim_scalar(tk)
        align = _scalar(b, KEY_ALIGN)
        extra = b.node("Mod", [b.node("Sub", [align, b.node("Mod", [n, align])[0]])[0], align])[0]
        parts = [b.i64([0] * (4 + axis)), b.node("Unsqueeze", [extra, b.i64([0])])[0]]
        if axis < 3:
            parts.append(b.i64([0] * (3 - axis)))
        b.shared[key] = b.node("Concat", parts, [b.fresh("attn23_pads")], axis=0)[0]
    return b.shared[key]


def _attn_mask(b, hidden: str | None, bias: str | None, q_t, k_t, aligned: bool, sink: int = 0) -> str:
    """Attention-23's attn_mask: [B, 1, Tq, Tk'] boolean (True = attend) from the hidden-score mask (all
    True without one), or, with a bias, bias + (the dtype's lowest value where hidden) as the scores'
    dtype; with ``sink`` the sink key's column first (seen, nothing added); the keys past Tk hidden. The
    boolean one once per shape (``b.shared``)."""
    tq, tk = q_t.shape[-2], k_t.shape[-2]
    keys = dims.dim(tk + sink)
    np_dtype = _np_float(q_t.dtype)
    if bias is None:
        key = ("attn23_mask", hidden, str(q_t.shape[0]), str(tq), str(tk), sink)
        if key not in b.shared:
            full = b.shape_vec([q_t.shape[0], 1, tq, keys])
            if hidden is None:
                keep = b.node("ConstantOfShape", [full], value=_bool_tensor(True))[0]
            else:
                keep = b.node("Expand", [b.node("Not", [hidden])[0], b.shape_vec([q_t.shape[0], 1, tq, tk])])[0]
                if sink:
                    seen = b.node("ConstantOfShape", [b.shape_vec([q_t.shape[0], 1, tq, 1])], value=_bool_tensor(True))[0]
                    keep = b.node("Concat", [seen, keep], axis=3)[0]
            if not aligned:
                keep = _pad_keys(b, keep, keys, np.array(False))
            b.shared[key] = b.node("Identity", [keep], [b.fresh("attn23_mask")])[0]
        return b.shared[key]
    lowest = np.array(np.finfo(np_dtype).min, dtype=np_dtype)
    summed = bias
    if q_t.dtype == "bf16":  # built in fp32 (no bf16 CUDA Pad), bf16's lowest finite value, cast at the end
        np_dtype, lowest = np.float32, np.array(np.finfo(np_dtype).min, dtype=np.float32)
        summed = b.node("Cast", [bias], to=_onnx_float("f32"))[0]
    if hidden is not None:
        where = b.node("Where", [hidden, b.const(lowest, "lowest"), b.const(np.array(0, dtype=np_dtype), "zero")])[0]
        summed = b.node("Add", [summed, where])[0]
    summed = b.node("Expand", [summed, b.shape_vec([1, 1, tq, tk])])[0]  # rank 4, Tq x Tk
    if sink:  # the sink key's column: nothing added (its score is the sink logit)
        rows = b.node("Shape", [summed], start=0, end=3)[0]
        column = b.node("ConstantOfShape", [b.node("Concat", [rows, b.i64([1])], axis=0)[0]],
                        value=_float_tensor(0.0, np_dtype))[0]
        summed = b.node("Concat", [column, summed], axis=3)[0]
    summed = summed if aligned else _pad_keys(b, summed, keys, lowest)
    return b.node("Cast", [summed], to=_onnx_float("bf16"))[0] if q_t.dtype == "bf16" else summed


def _float_tensor(value: float, np_dtype):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array([value], dtype=np_dtype), "value")


def _bool_tensor(value: bool):
    from onnx import TensorProto, helper

    return helper.make_tensor("value", TensorProto.BOOL, [1], [value])


def _pad_keys(b, x: str, tk, value: np.ndarray) -> str:
    """x [..., Tk] padded at the end of its last axis to Tk' with ``value``."""
    return b.node("Pad", [x, _key_pads(b, tk, 3), b.const(value, "pad_value")])[0]


def _portable(b, node, out: str, names: list[str] | None = None) -> None:
    """One Loop iteration per (head, query tile): small slices, large matrix products. ``names``
    replaces the inputs' names (same types) when a caller made them itself (backends/onnx/cached_attention.py)."""
    from onnx import TensorProto, helper
    g, a = b.graph, node.attrs
    names = list(names or node.inputs)
    q, k, v = names[:3]
    extra = names[3:]
    mask = extra.pop(0) if a["padding"] else None
    bias = extra.pop(0) if a["bias"] else None
    q_t, k_t, v_t = (g.type_of(x) for x in node.inputs[:3])  # types by the IR names
    dtype = q_t.dtype
    np_dtype = _np_float(dtype)
    heads, rep = a["heads"], a["heads"] // a["kv_heads"]
    hv = int(v_t.shape[-1])

    tq, tk = b.dim_scalar(q_t.shape[-2]), b.dim_scalar(k_t.shape[-2])
    one = _scalar(b, 1)
    zero = _scalar(b, 0)
    # Rows per tile: at least the cost model's q_tile, more while one head's tile of scores stays
    # within SCORE_BLOCK_BUDGET (bigger tiles make bigger, faster matrix products), at most MAX_TILE,
    # and for causal attention at most a quarter of the queries (a causal tile computes its whole
    # diagonal block, half of it hidden: four or more tiles per head keep that waste at an eighth or
    # less). Faster than 512-row tiles on CPU at N = 512 to 2048, as fast at 8192 and 16384 (docs/benchmarks/log.md).
    bytes_per = (2 if dtype in ("f16", "bf16") else 4)
    row_bytes = b.node("Mul", [b.dim_scalar(q_t.shape[0]), b.node("Mul", [tk, _scalar(b, bytes_per)])[0]])[0]
    fit = b.node("Div", [_scalar(b, SCORE_BLOCK_BUDGET), row_bytes])[0]
    if a["causal"]:
        fit = b.node("Min", [fit, b.node("Div", [tq, _scalar(b, MIN_CAUSAL_TILES)])[0]])[0]
    min_tile = int(a["q_tile"])
    tile_c = b.node("Min", [b.node("Max", [fit, _scalar(b, min_tile)])[0], _scalar(b, max(min_tile, MAX_TILE))])[0]
    tile_c = b.node("Min", [tile_c, tq])[0]
    n_tiles = b.node("Div", [b.node("Add", [tq, b.node("Sub", [tile_c, one])[0]])[0], tile_c])[0]
    last_start = b.node("Sub", [tq, tile_c])[0]  # the last tile ends at Tq (it may overlap the one before)
    k_t_all = b.node("Transpose", [k], perm=[0, 1, 3, 2])[0]  # Kᵀ once: [B, G, d, Tk]
    offset = b.node("Sub", [tk, tq])[0]  # keys before the first query (0 for self-attention)
    sinks = extra.pop(0) if a.get("sinks") else None
    prep = epilogue.prepare(b, a, mask, bias, q_t, k_t, tiled=True, tile=tile_c, positions=(tq, tk, offset),
                            sinks=sinks)

    # ---- loop body: head h, query tile j (iteration i = h * n_tiles + j)
    outer_nodes = b.nodes
    b.nodes = []
    i = b.fresh("iteration")
    cond_in, cond_out = b.fresh("cond_in"), b.fresh("cond_out")
    h = b.node("Div", [i, n_tiles])[0]
    j = b.node("Mod", [i, n_tiles])[0]
    kv_h = b.node("Div", [h, _scalar(b, rep)])[0] if rep > 1 else h
    start = b.node("Min", [b.node("Mul", [j, tile_c])[0], last_start])[0]
    end = b.node("Add", [start, tile_c])[0]
    u = lambda x: b.node("Unsqueeze", [x, b.i64([0])])[0]  # noqa: E731
    pair = lambda x, y: b.node("Concat", [u(x), u(y)], axis=0)[0]  # noqa: E731
    h1 = b.node("Add", [h, one])[0]
    kv_h1 = b.node("Add", [kv_h, one])[0]
    axes_hr = b.i64([1, 2])
    # the tile's queries, scaled (tile·d work rather than tile·N on the scores)
    q_tile = b.node("Slice", [q, pair(h, start), pair(h1, end), axes_hr])[0]
    q_tile = b.node("Mul", [q_tile, b.const(np.array(a["scale"], dtype=np_dtype), "scale")])[0]
    k_start = zero
    if a["causal"]:
        k_end = b.node("Min", [b.node("Add", [end, offset])[0], tk])[0]
        if a["window"]:
            first = b.node("Sub", [b.node("Add", [start, offset])[0], _scalar(b, a["window"] - 1)])[0]
            k_start = b.node("Max", [first, zero])[0]
    else:
        k_end = tk
    v_tile = b.node("Slice", [v, pair(kv_h, k_start), pair(kv_h1, k_end), axes_hr])[0]
    keys_t = lambda lo, hi: b.node("Slice", [k_t_all, pair(kv_h, lo), pair(kv_h1, hi), b.i64([1, 3])])[0]  # noqa: E731

    block = lambda lo, hi, causal="compute": epilogue.Block(rows=(start, end), cols=(lo, hi), head=(h, h1),  # noqa: E731
                                                           scaled=True, causal=causal)
    if prep.triangle is not None:
        # Keys before the tile's first row are visible to every row of the tile; only the last
        # tile × tile block (the diagonal) needs the causal mask, a constant added to that block.
        # The epilogue's steps before the masks run on each part, the rest once on the whole tile.
        d_start = b.node("Sub", [k_end, tile_c])[0]
        part = lambda lo, hi: epilogue.apply(b, a, b.node("MatMul", [q_tile, keys_t(lo, hi)])[0], prep,  # noqa: E731
                                             block(lo, hi), epilogue.before_masks)
        s = b.node("Concat", [part(zero, d_start), epilogue.add_triangle(b, part(d_start, k_end), prep)], axis=-1)[0]
        s = epilogue.apply(b, a, s, prep, block(k_start, k_end, "visible"), epilogue.from_masks)
    else:
        s = epilogue.apply(b, a, b.node("MatMul", [q_tile, keys_t(k_start, k_end)])[0], prep, block(k_start, k_end))
    p = epilogue.softmax(b, a, s, prep, block(k_start, k_end, "visible"))  # the tile's whole rows
    tile_out = b.node("MatMul", [p, v_tile])[0]  # [B, 1, tile, hv]
    b.node("Identity", [cond_in], [cond_out])
    body = helper.make_graph(
        b.nodes, b.fresh("tile_body"),
        inputs=[helper.make_tensor_value_info(i, TensorProto.INT64, []),
                helper.make_tensor_value_info(cond_in, TensorProto.BOOL, [])],
        outputs=[helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                 helper.make_tensor_value_info(tile_out, _onnx_float(dtype),
                                               None)])
    b.nodes = outer_nodes
    # ---- the loop and reassembly: [H·n, B, 1, tile, hv] -> [B, H, n·tile, hv] -> Tq rows, taking from
    # the last tile only the rows the tile before it did not cover
    iterations = b.node("Mul", [_scalar(b, heads), n_tiles])[0]
    tiles = b.node("Loop", [iterations, ""], 1, body=body)[0]
    by_head = b.node("Reshape", [tiles, b.node("Concat", [b.i64([heads]), u(n_tiles), b.dim(q_t.shape[0]),
                                                          b.i64([-1, hv])], axis=0)[0]])[0]  # [H, n, B, tile, hv]
    stacked = b.node("Transpose", [by_head], perm=[2, 0, 1, 3, 4])[0]
    rows_all = b.node("Reshape", [stacked, b.i64([0, 0, -1, hv])])[0]
    full = b.node("Mul", [b.node("Sub", [n_tiles, one])[0], tile_c])[0]  # rows of the tiles before the last
    n_rows = b.node("Mul", [n_tiles, tile_c])[0]
    tail_from = b.node("Sub", [b.node("Add", [full, n_rows])[0], tq])[0]
    index = b.node("Concat", [b.node("Range", [zero, full, one])[0], b.node("Range", [tail_from, n_rows, one])[0]],
                   axis=0)[0]
    b.node("Gather", [rows_all, index], [out], axis=2)
