"""ONNX lowerings of attention over a KV cache (impls ``cached`` and ``phased``, set by
compiler/passes/kv_cache.py through passes/attention_kernels.py ``choose_cached``).

The cached graph's attention takes q [B, H, T, hd], the keys and values concat(past, new)
[B, kv_heads, P+T, hd] and the attention mask [B, P+T] (1 = a real token, 0 = padding or an
unfilled cache slot); it is causal with the queries as the last T of the P+T positions, and a
sliding window when the spec has one. Two phases run through the same graph:

- decode (T = 1 against P cached keys): ``cached``, a few plain ops. S = (Q·scale)·Kᵀ + mask,
  softmax, ·V, with the past (the cache buffer) and the new columns read where they lie, so the
  cache is never copied. Grouped-query attention reads the cache's kv_heads directly: the query
  heads of one group are stacked as rows ([B, G, rep·T, hd]), so K and V are never repeated.
  Alone it is about as fast on CPU as onnxruntime's GroupQueryAttention with a shared buffer
  (bench/decode_attention.py, docs/generate.md); in the whole model one GroupQueryAttention is
  faster than these dozen nodes, so in buffer mode on CPU the decode branch is that instead
  (``_lower_gqa_decode``: attrs ``decode`` "gqa", the loop binds the buffers).
- prefill (T > 1, the prompt): the portable tiled kernel (backends/onnx/attention.py), which never
  forms the T×(P+T) scores; ``cached`` would, for the whole prompt at once.

``phased`` is an ONNX If on T == 1 between the two, so one session serves both phases and the
branch not taken costs nothing. The additive mask the decode branch needs ([B, 1, 1, P+1]: the
attention mask alone, since a step's one query sees every earlier key) is built once in the main
graph and read by every layer's decode branch (with a sliding window, inside each branch, causal
with the window); a prefill never builds a T×(P+T) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, numpy_helper

from tessera.compiler.backends.onnx import score_epilogue as epilogue
from tessera.compiler.backends.onnx.attention import _attn23, _portable
from tessera.compiler.backends.onnx.branches import branch, branch_outputs
from tessera.compiler.backends.onnx.gqa_inputs import gqa_node_inputs
from tessera.compiler.backends.onnx.half_cache import as_compute as _as_compute, half_bias, half_cache, new_columns, \
    stored_past, to_half
from tessera.compiler.backends.onnx.floats import np_float as _np_float, onnx_float as _onnx_float
from tessera.compiler.backends.onnx.score_epilogue import _hidden_keys
from tessera.compiler.backends.onnx.walk import all_nodes
from tessera.compiler.ops.attention import rotated_dims
from tessera.compiler.patterns.matcher import Pat, match
from tessera.compiler.reference.numerics import rope_attention_factor, rope_inv_freq


def _split(b, x: str) -> tuple[str, str | None]:
    """(past, new) when x is concat(past, new) along the sequence, else (x, None). The past is the cache
    input as stored: with ``--kv-cache-dtype fp16`` on an fp32 model the f16 input itself, not the IR's
    cast of it (passes/kv_cache_dtype.py), which no lowering emits in the main graph (it would convert
    the whole cache at every step): GroupQueryAttention reads the f16 buffer, every other reader
    converts what it reads inside its branch (``_as_compute``)."""
    p = b.graph.producer(x)
    if p is not None and p.op == "concat" and len(p.inputs) == 2 and p.attrs["axis"] in (2, -2):
        return stored_past(b.graph, p.inputs[0]), p.inputs[1]
    return x, None


def _mask_bias(b, node, np_dtype) -> str | None:
    """The additive mask [B, 1, T, P+T] (0 visible, the dtype's minimum hidden) from the node's
    attention mask [B, P+T] (padding and unfilled slots), causal with offset P, the sliding window, the
    chunks (by slot, as transformers' chunked mask over cache positions; the concat cache only):
    the score epilogue's masks applied to zeros (None when the node has none of them)."""
    a = node.attrs
    if not (a["padding"] or a["causal"]):
        return None
    masks = {k: v for k, v in a.items() if k in ("causal", "window", "padding")}
    additive = _masks_on_zeros(b, masks, node.inputs[3] if a["padding"] else None, node, np_dtype)
    if a.get("chunk"):
        additive = _chunks_by_position(b, node, additive, np_dtype)
    return additive


def _chunks_by_position(b, node, additive: str, np_dtype) -> str:
    """Chunked attention over the cache: a key in another block of ``chunk`` positions than its query
    hidden. Positions are counted from each row's first real token (the attention mask's running sum
    less one), as transformers' chunked mask does with left padding (``chunked_overlay``: slot less
    the row's left padding); padded keys are hidden by the mask already."""

    mask = node.inputs[3]
    real = b.node("Cast", [b.node("Not", [_hidden_keys(b, mask)])[0]], to=TensorProto.INT64)[0]
    one = b.const(np.array(1, dtype=np.int64), "one")
    pos = b.node("Sub", [b.node("CumSum", [real, b.const(np.array(1, dtype=np.int64), "axis")])[0], one])[0]
    c = b.const(np.array(node.attrs["chunk"], dtype=np.int64), "chunk")
    block = b.node("Div", [pos, c])[0]                                        # [B, P+T]
    t = b.node("Shape", [node.inputs[0]], start=2, end=3)[0]                  # the queries: the last T
    q_block = b.node("Slice", [block, b.node("Neg", [t])[0], b.i64([2**62]), b.i64([1])])[0]
    other = b.node("Not", [b.node("Equal", [b.node("Unsqueeze", [block, b.i64([1, 2])])[0],
                                            b.node("Unsqueeze", [q_block, b.i64([1, 3])])[0]])[0]])[0]
    low = b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min")
    return b.node("Where", [other, low, additive])[0]                         # [B, 1, T, P+T]


def _masks_on_zeros(b, masks: dict, mask: str | None, node, np_dtype) -> str:
    """The score epilogue's masks (attributes ``masks``: causal, window, padding) applied to zeros:
    an additive mask, 0 where visible and the dtype's minimum where hidden."""
    q_t, k_t = b.graph.type_of(node.inputs[0]), b.graph.type_of(node.inputs[1])
    zero = b.const(np.zeros((1, 1, 1, 1), dtype=np_dtype), "zero")
    prep = epilogue.prepare(b, masks, mask, None, q_t, k_t)
    return epilogue.apply(b, {"scale": 1.0, **masks}, zero, prep, epilogue.Block(scaled=True))


def _decode_bias(b, node, np_dtype) -> str:
    """The additive mask [B, 1, 1, P+1] of a decoding step without a sliding window: the attention
    mask alone (the one query is the last position, so the causal part hides nothing). It is the
    same for every layer reading that mask, so it is built once, in the main graph (the builder
    keeps it), and each layer's decode branch reads it from there."""
    mask = node.inputs[3]
    key = ("decode_bias", mask, np.dtype(np_dtype).str)
    cache = b.shared
    if key not in cache:
        saved, b.current = b.current, ""
        try:
            cache[key] = _masks_on_zeros(b, {"padding": True}, mask, node, np_dtype)
        finally:
            b.current = saved
    return cache[key]


def lower_cached_attention(b, node, out: str, bias: str | None = None) -> None:
    """A decoding step: (Q·scale)·Kᵀ over the cache where it lies, the score epilogue (soft-cap, bias,
    masks: ``bias`` is the additive mask built outside, ``_decode_bias``, else it is built here from the
    attention mask), softmax, ·V."""
    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    q_t, v_t = g.type_of(q), g.type_of(v)
    np_dtype = _np_float(q_t.dtype)
    additive = bias if bias is not None else _mask_bias(b, node, np_dtype)  # causal, window, padding
    user_bias = node.inputs[3 + int(a["padding"])] if a["bias"] else None
    heads, groups = a["heads"], a["kv_heads"]
    rep = heads // groups
    hd, hv = int(q_t.shape[-1]), int(v_t.shape[-1])
    scale = b.const(np.array(a["scale"], dtype=np_dtype), "scale")
    qs = b.node("Mul", [q, scale])[0]
    if rep > 1:  # [B, H, T, hd] -> [B, G, rep·T, hd]: the heads of a group share its K and V
        qs = b.node("Reshape", [qs, b.i64([0, groups, -1, hd])])[0]
    # Keys and values as the past (the cache buffer) and the new columns, each read where it lies:
    # the scores are computed per part and only they are concatenated (T rows, not the cache).
    (k_past, k_new), (v_past, v_new) = _split(b, k), _split(b, v)
    k_past, v_past = _as_compute(b, k_past, q), _as_compute(b, v_past, q)  # an fp16 cache: converted here
    parts = [k_past] if k_new is None or v_new is None else [k_past, k_new]
    scores = [b.node("MatMul", [qs, b.node("Transpose", [kp], perm=[0, 1, 3, 2])[0]])[0] for kp in parts]
    s = scores[0] if len(scores) == 1 else b.node("Concat", scores, axis=-1)[0]  # [B, G, rep·T, Tk]
    tk = b.node("Shape", [s], start=3, end=4)[0]
    view = None
    if rep > 1:  # scores [B, G, rep, T, Tk]; a mask or bias [B, 1|H, T, Tk] viewed as [B, 1|G, 1|rep, T, Tk]
        s = b.node("Reshape", [s, b.node("Concat", [b.i64([0, groups, rep, -1]), tk], axis=0)[0]])[0]

        def grouped(x):
            x5 = b.node("Unsqueeze", [x, b.i64([1])])[0]
            per_head = x == user_bias and g.type_of(x).rank == 4 and str(g.type_of(x).shape[1]) != "1"
            return b.node("Reshape", [x5, b.i64([0, groups, rep, 0, 0])])[0] if per_head else x5
        view = grouped
    sinks = node.inputs[-1] if a.get("sinks") else None
    prep = epilogue.prepare(b, a, None, user_bias, q_t, g.type_of(k), additive=additive, sinks=sinks)
    blk = epilogue.Block(scaled=True, view=view, sink_shape=(1, groups, rep, 1, 1) if rep > 1 else (1, -1, 1, 1))
    s = epilogue.apply(b, a, s, prep, blk)
    p = epilogue.softmax(b, a, s, prep, blk)
    if rep > 1:
        p = b.node("Reshape", [p, b.node("Concat", [b.i64([0, groups, -1]), tk], axis=0)[0]])[0]
    target = [out] if rep == 1 else 1
    if len(parts) == 1:
        o = b.node("MatMul", [p, v_past], target)[0]
    else:
        n_past = b.node("Shape", [k_past], start=2, end=3)[0]
        axis = b.i64([3])
        p_past = b.node("Slice", [p, b.i64([0]), n_past, axis])[0]
        p_new = b.node("Slice", [p, n_past, b.i64([2**62]), axis])[0]
        o = b.node("Add", [b.node("MatMul", [p_past, v_past])[0], b.node("MatMul", [p_new, v_new])[0]], target)[0]
    if rep > 1:  # [B, G, rep·T, hv] -> [B, H, T, hv]
        b.node("Reshape", [o, b.i64([0, heads, -1, hv])], [out])


def _lower_prefill(b, node, out: str) -> None:
    """The prompt: the portable tiled kernel over concat(past, new) with the causal offset and the
    attention mask as its key padding. The concatenation is made here, inside the branch, so a
    decoding step (the other branch) never copies the cache."""

    names = list(node.inputs)
    for i in (1, 2):
        past, new = _split(b, names[i])
        if new is not None:  # an fp16 cache is converted here, inside the prompt's branch
            names[i] = b.node("Concat", [_as_compute(b, past, names[0]), new], axis=2)[0]
    if node.attrs.get("prefill") == "attn23":  # CUDA: onnx's Attention, its mask built before the If
        return _attn23(b, node, out, names=names)
    _portable(b, node, out, names=names)


def _gqa_inputs(b, node) -> tuple[str, str, str]:
    """GroupQueryAttention's seqlens_k (i32 [B]: the filled slots, where each row's new column goes),
    total_sequence_length (i32 scalar: the longest row's filled + 1) and attention_bias ([B, 1, 1,
    longest + 1]: the decode mask's first ``longest`` slots and the new token's column), built once in
    the main graph from the cache_length input and shared by every layer. cache_length is [1] (one
    length for every row: ``generate``'s left-padded batch) or [B] (one per row: the serving engine,
    whose rows fill their buffers from slot 0 each; the kernel attends row b over its own
    cache_length[b] + 1 slots, so columns past a shorter row's new one are never read)."""
    prefix = bool(node.attrs.get("prefix_keys"))
    key = ("gqa_inputs", node.inputs[3], prefix, node.attrs.get("decode_mask"))
    if key not in b.shared and node.attrs.get("decode_mask"):
        return _gqa_inputs_on_device(b, node, key)
    if key not in b.shared and prefix:
        return _gqa_inputs_by_length(b, node, key)
    if key not in b.shared:
        bias = _decode_bias(b, node, np.float32)  # [B, 1, 1, C + 1]
        saved, b.current = b.current, ""
        try:
            seqlens, total, longest = _lengths(b, node)
            axis = b.i64([3])
            filled = b.node("Slice", [bias, b.i64([0]), longest, axis])[0]
            new = b.node("Slice", [bias, b.i64([-1]), b.i64([2**62]), axis])[0]
            b.shared[key] = (seqlens, total, b.node("Concat", [filled, new], [b.fresh("gqa/bias")], axis=3)[0])
        finally:
            b.current = saved
    return b.shared[key]


def _lengths(b, node) -> tuple[str, str, str]:
    """GroupQueryAttention's seqlens_k [B] (int32) and total_sequence_length (int32 scalar) from the
    cache_length input, and its longest row [1] (int64): built in the main graph by the caller."""
    length = node.attrs["length_input"]
    batch = b.node("Shape", [node.inputs[3]], start=0, end=1)[0]
    seqlens = b.node("Cast", [b.node("Expand", [length, batch])[0]], [b.fresh("gqa/seqlens_k")],
                     to=TensorProto.INT32)[0]
    longest = b.node("ReduceMax", [length], keepdims=1)[0]  # [1]
    total = b.node("Cast", [b.node("Squeeze", [b.node("Add", [longest, b.i64([1])])[0], b.i64([0])])[0]],
                   [b.fresh("gqa/total")], to=TensorProto.INT32)[0]
    return seqlens, total, longest


def _gqa_inputs_by_length(b, node, key) -> tuple[str, str, str]:
    """``_gqa_inputs`` of the serving engine's variant (``prefix_keys``, CPU: no decode_mask input): seqlens_k
    and total_sequence_length from cache_length, and no attention_bias ("": the input left out). Exact only
    where each row's keys are its columns 0..cache_length[b], none hidden among them -- the engine's layout
    (a row fills its columns from 0), not a left-padded batch's (attention.py PREFIX_KEYS_ASSUMES)."""
    saved, b.current = b.current, ""
    try:
        seqlens, total, _ = _lengths(b, node)
        b.shared[key] = (seqlens, total, "")
    finally:
        b.current = saved
    return b.shared[key]


def _gqa_inputs_on_device(b, node, key) -> tuple[str, str, str]:
    """``_gqa_inputs`` on CUDA (fp16, the cache on the device): total_sequence_length and the bias from the
    ``decode_mask`` input, [B, filled + 1] (the filled slots and the new column, runtime/generation/cached.py):
    its width is shape arithmetic onnxruntime keeps on the host, where computed from cache_length (an input
    it puts on the device) the kernel's host-side total would be copied back from the device each step.
    With ``prefix_keys`` (the serving engine's variant: each row's keys its columns 0..cache_length, none
    hidden) the input is ``decode_span`` [0, filled + 1] (passes/kv_cache.py DECODE_SPAN), holding no values:
    only its width is read, the batch comes from the attention mask's shape, and there is no attention_bias,
    so onnxruntime may choose flash decoding and no mask is copied to the device for it."""
    np_dtype = _np_float(b.graph.type_of(node.inputs[0]).dtype)
    saved, b.current = b.current, ""
    try:
        dm = node.attrs["decode_mask"]
        prefix = bool(node.attrs.get("prefix_keys"))
        batch = b.node("Shape", [node.inputs[3] if prefix else dm], start=0, end=1)[0]
        seqlens = b.node("Cast", [b.node("Expand", [node.attrs["length_input"], batch])[0]],
                         [b.fresh("gqa/seqlens_k")], to=TensorProto.INT32)[0]
        width = b.node("Shape", [dm], start=1, end=2)[0]
        total = b.node("Cast", [b.node("Squeeze", [width, b.i64([0])])[0]], [b.fresh("gqa/total")],
                       to=TensorProto.INT32)[0]
        if prefix:
            b.shared[key] = (seqlens, total, "")
            return b.shared[key]
        hidden = b.node("Equal", [dm, b.const(np.array(0, np.int64), "zero_i64")])[0]
        lowest = b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "lowest")
        additive = b.node("Where", [hidden, lowest, b.const(np.array(0, dtype=np_dtype), "zero")])[0]
        bias = b.node("Unsqueeze", [additive, b.i64([1, 2])], [b.fresh("gqa/bias")])[0]  # [B, 1, 1, filled + 1]
        b.shared[key] = (seqlens, total, bias)
    finally:
        b.current = saved
    return b.shared[key]


def _lower_gqa_decode(b, node, outs: list[str], gqa_in) -> None:
    """A decoding step (T = 1) as one com.microsoft GroupQueryAttention over the cache buffer: the past
    inputs and the If's buffer outputs are the same memory when the loop binds them (runtime/generation/cached.py, BoundStep),
    and the kernel writes the new column into slot cache_length and attends over the filled slots and
    it. At T = 1, [B, H, 1, hd] and GroupQueryAttention's [B, 1, H*hd] hold the same order, so the
    head split needs only a Reshape each way. The rotary embedding was applied before (rope nodes)."""
    a = node.attrs
    q, k, v = node.inputs[:3]
    (k_past, k_new), (v_past, v_new) = _split(b, k), _split(b, v)
    seqlens, total, bias = gqa_in
    flat = [b.node("Reshape", [x, b.i64([0, 1, -1])])[0] for x in (q, k_new, v_new)]
    attrs = {"num_heads": a["heads"], "kv_num_heads": a["kv_heads"], "scale": float(a["scale"])}
    if a.get("softcap"):  # GroupQueryAttention caps as c·tanh(scale·s / c); Tessera folds the 1/c into its scale
        attrs["softcap"] = float(a["softcap"])
        attrs["scale"] = float(a["scale"]) * float(a["softcap"])
    sinks = [node.inputs[-1]] if a.get("sinks") else []  # head_sink (input 11): attention sinks
    half = half_cache(b, k_past, q)
    if half:  # an fp16 cache: the kernel in fp16 (passes/kv_cache_dtype.py), its output back to fp32
        flat, sinks = to_half(b, flat), to_half(b, sinks)  # the bias is fp16 already (lower_phased_attention)
    o = b.node("GroupQueryAttention", gqa_node_inputs(flat + [k_past, v_past, seqlens, total, "", "", "", bias] + sinks),
               [b.fresh("gqa_out"), outs[1], outs[2]], domain="com.microsoft", **attrs)[0]
    if half:
        o = b.node("Cast", [o], to=TensorProto.FLOAT)[0]
    hd = int(b.graph.type_of(q).shape[-1])
    b.node("Reshape", [o, b.i64([0, a["heads"], 1, hd])], [outs[0]])


# ---- the packed decoding step: one GroupQueryAttention reading the fused q+k+v linear's output
# the unpacked step stays reachable with --decode gqa-unpacked (passes/kv_cache.py sets the site's
# pack_qkv attribute): tests and bench/generate.py --decode compare the two
PACKED_MARK = "tessera:packed-qkv"  # the If's doc_string: settle_packed sinks its prefill-only nodes
# the packed step's cos/sin caches hold every trained position: past this size (Llama 3.1's 131,072
# positions at head size 128 take 64 MiB) the step stays unpacked rather than fold a huge table at load
ROTARY_CACHE_BYTES = 256 * 2 ** 20


@dataclass(frozen=True)
class PackedQKV:
    """A site whose decoding step can read the packed projection: ``fused`` [B, T, (H + 2·kv)·hd] (the
    q+k+v linear, passes/fuse_linears.py), the rope's tables, the names of its new key/value outputs."""

    fused: str
    inv_freq: np.ndarray
    factor: float
    interleaved: bool
    positions: str
    max_positions: int
    key_out: str
    value_out: str


def _split_of(heads: int, slice_name: str) -> Pat:
    """split_heads(slice(fused, last axis)) with ``heads`` heads; the slice captured as ``slice_name``."""
    def heads_check(g, value, node):
        if node is not None and node.op == "split_heads" and node.attrs.get("heads") != heads:
            return f"{value} splits {node.attrs.get('heads')} heads, not {heads}"
        return None

    def last_axis(g, value, node):
        if node is not None and node.op == "slice" and node.attrs.get("axis") not in (-1, 2):
            return f"{value} slices axis {node.attrs.get('axis')}, not the last"
        return None

    fused = Pat(name="fused", differs="q, k, v are not the consecutive slices of one linear (fuse-linears off, or "
                                      "unequal inputs)")
    return Pat("split_heads", (Pat("slice", (fused,), name=slice_name, check=last_axis,
                                   why="q, k, v are not split_heads(slice(...)) of one projection"),),
               check=heads_check, why="q, k, v are not split_heads(slice(...)) of one projection")


def _rotated(heads: int, slice_name: str) -> Pat:
    """rope(split_heads(slice(fused)), positions): the same position ids for q and the new keys."""
    return Pat("rope", (_split_of(heads, slice_name),
                        Pat(name="positions", differs="q and k are rotated at different positions")),
               name=slice_name + "_rope", why="q or the new keys are not rope(..., position_ids)")


def packed_qkv(g, node) -> "PackedQKV | str":
    """The packed form of a gqa decoding site, or why it has none (the patterns ``_rotated`` and
    ``_split_of`` on the one matcher, the checks below, the reason).

    Pattern: q = rope(split_heads(slice(F, 0:H·hd)), positions), the new keys rope(split_heads(slice(F,
    H·hd:(H+kv)·hd))), the new values split_heads(slice(F, (H+kv)·hd:(H+2kv)·hd)), F one linear (fused
    by fuse-linears, float or quantised) of exactly that width; the two ropes alike. Checks: the rope
    is expressible as GroupQueryAttention's cos/sin caches [max_positions, hd/2] indexed by the
    position ids (every kind but dynamic NTK and longrope, whose frequencies follow the length; the whole head
    rotated; a trained context bounding the positions, so the caches have a length)."""

    if not node.attrs.get("pack_qkv", True):
        return "--decode gqa-unpacked"
    a = node.attrs
    heads, kv = a["heads"], a["kv_heads"]
    q = node.inputs[0]
    (_, k_new), (_, v_new) = _split_ir(g, node.inputs[1]), _split_ir(g, node.inputs[2])
    if k_new is None or v_new is None:
        return "keys or values are not concat(past, new)"
    found = match(g, _rotated(heads, "q"), q)
    found = found and match(g, _rotated(kv, "k"), k_new, found.captured)
    found = found and match(g, _split_of(kv, "v"), v_new, found.captured)
    if not found:
        return found.reason
    rq, rk = found["q_rope.node"], found["k_rope.node"]
    keys = ("theta", "scaling", "rope_type", "interleaved", "dims", "max_ctx")
    if any(rq.attrs.get(k) != rk.attrs.get(k) for k in keys):
        return "q and k are rotated differently"
    hd = int(g.type_of(q).shape[-1])
    fused = found["fused"]
    want = [(0, heads * hd), (heads * hd, (heads + kv) * hd), ((heads + kv) * hd, (heads + 2 * kv) * hd)]
    got = [(int(found[p + ".node"].attrs["start"]), int(found[p + ".node"].attrs["end"])) for p in "qkv"]
    width = g.type_of(fused).shape[-1]
    if got != want or int(width) != want[-1][1]:
        return "q, k, v are not the consecutive slices of one linear (fuse-linears off, or unequal inputs)"
    ra = rq.attrs
    kind = ra.get("rope_type", "llama3")
    if kind == "dynamic":
        return "dynamic NTK rope: its frequencies follow the length, no fixed cos/sin cache"
    if kind == "longrope":
        return "longrope: its frequencies switch with the sequence's length, no fixed cos/sin cache"
    if rotated_dims(ra, hd) != hd:
        return "partial rotary (GroupQueryAttention is checked here rotating the whole head only)"
    if hd % 16:
        return f"head size {hd}: GroupQueryAttention's rotary wants a multiple of 16"
    if not ra.get("max_ctx"):
        return "no trained context bounds the positions (the cos/sin caches need a length)"
    if int(ra["max_ctx"]) * hd * 4 > ROTARY_CACHE_BYTES:  # cos and sin, [max_ctx, hd/2] fp32 each
        return (f"cos/sin caches for a context of {int(ra['max_ctx']):,} positions would take "
                f"{int(ra['max_ctx']) * hd * 4:,} bytes (over {ROTARY_CACHE_BYTES:,})")
    # the cache outputs: identities of the new keys and values, or casts to fp16 (passes/kv_cache_dtype.py)
    gives = ("identity", "cast")
    outs = {c.outputs[0] for x in (k_new, v_new) for c in g.consumers(x) if c.op in gives}
    key_out = next((c.outputs[0] for c in g.consumers(k_new) if c.op in gives and c.outputs[0] in g.outputs), None)
    value_out = next((c.outputs[0] for c in g.consumers(v_new) if c.op in gives and c.outputs[0] in g.outputs), None)
    if key_out is None or value_out is None or len(outs) != 2:
        return "the new keys and values are not the cache's outputs (buffer mode)"
    return PackedQKV(fused, rope_inv_freq(hd, ra["theta"], ra.get("scaling"), kind), rope_attention_factor(
        ra.get("scaling"), kind), bool(ra.get("interleaved")), rq.inputs[1], int(ra["max_ctx"]), key_out, value_out)


def packed_note(g, node) -> str:
    """--explain's words for a gqa decoding site's input: packed, or the failed check and its reason."""
    packed = packed_qkv(g, node)
    if isinstance(packed, str):
        return f"decode input unpacked (pattern rope(split_heads(slice(q+k+v))) not used: {packed})"
    return ("decode input packed: the q+k+v projection into GroupQueryAttention, rotary inside "
            f"(do_rotary, cos/sin caches of {packed.max_positions} positions{', interleaved' if packed.interleaved else ''})")


def _split_ir(g, x: str) -> tuple[str, str | None]:
    """``_split`` on the IR graph alone."""
    p = g.producer(x)
    if p is not None and p.op == "concat" and len(p.inputs) == 2 and p.attrs["axis"] in (2, -2):
        return p.inputs[0], p.inputs[1]
    return x, None


def _rotary_caches(b, packed: PackedQKV, half: str | None = None) -> tuple[str, str]:
    """cos and sin [max_positions, hd/2], fp32: the rope's tables at every position, computed in the
    graph by the same nodes as the per-step tables (Cos, Sin of position · inv_freq, YaRN's factor), so
    onnxruntime folds them once at load with the same kernels. Built once in the main graph; ``half``: the
    queries' 16-bit type (f16, bf16: CUDA), which GroupQueryAttention wants its cos/sin caches in."""
    key = ("rotary_caches", packed.inv_freq.tobytes(), packed.factor, packed.max_positions, half)
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            pos = b.const(np.arange(packed.max_positions, dtype=np.float32)[:, None], "rope/positions")
            freqs = b.node("Mul", [pos, b.const(packed.inv_freq.astype(np.float32), "inv_freq")])[0]
            tables = []
            for f in ("Cos", "Sin"):
                t = b.node(f, [freqs], [b.fresh(f"rope/{f.lower()}_cache")])[0]
                if packed.factor != 1.0:
                    t = b.node("Mul", [t, b.const(np.array(packed.factor, dtype=np.float32), "rope_attention_factor")])[0]
                if half:  # GroupQueryAttention takes cos/sin caches of the queries' type (fp16/bf16 on CUDA)
                    t = b.node("Cast", [t], to=_onnx_float(half))[0]
                tables.append(t)
            b.shared[key] = tuple(tables)
        finally:
            b.current = saved
    return b.shared[key]


def _new_column_index(b, node, kv: int, hd: int) -> str:
    """i64 [B, kv, 1, hd]: each row's cache_length, where GroupQueryAttention wrote its new column
    (GatherElements reads the new keys and values back from the buffer for the cache outputs)."""
    key = ("new_column", node.attrs["length_input"], kv, hd)
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            length = node.attrs["length_input"]
            batch = b.node("Shape", [node.inputs[3]], start=0, end=1)[0]
            rows = b.node("Reshape", [b.node("Expand", [length, batch])[0], b.i64([-1, 1, 1, 1])])[0]
            shape = b.node("Concat", [batch, b.i64([kv, 1, hd])], axis=0)[0]
            b.shared[key] = b.node("Expand", [rows, shape], [b.fresh("gqa/new_column")])[0]
        finally:
            b.current = saved
    return b.shared[key]


def _lower_gqa_packed(b, node, outs: list[str], gqa_in, packed: PackedQKV, shared) -> None:
    """A decoding step as one GroupQueryAttention on the packed projection [B, 1, (H + 2·kv)·hd] with
    do_rotary (cos/sin caches, the position ids: a left-padded row's position is not its slot), the
    split and the rotation inside the kernel; the new keys and values (the cache outputs) read back
    from the buffer where the kernel wrote them."""
    a = node.attrs
    seqlens, total, bias = gqa_in
    (cos, sin), index = shared  # built in the main graph (_rotary_caches, _new_column_index)
    (k_past, _), (v_past, _) = _split(b, node.inputs[1]), _split(b, node.inputs[2])
    attrs = {"num_heads": a["heads"], "kv_num_heads": a["kv_heads"], "scale": float(a["scale"]), "do_rotary": 1,
             "rotary_interleaved": int(packed.interleaved)}
    if a.get("softcap"):
        attrs["softcap"] = float(a["softcap"])
        attrs["scale"] = float(a["scale"]) * float(a["softcap"])
    sinks = [node.inputs[-1]] if a.get("sinks") else []  # head_sink (input 11): attention sinks
    fused, half = packed.fused, half_cache(b, k_past, node.inputs[0])
    if half:  # an fp16 cache: the kernel in fp16 (cos/sin caches cast in the main graph), its output back
        (fused,), sinks = to_half(b, [fused]), to_half(b, sinks)  # the bias: fp16 already
    o = b.node("GroupQueryAttention", gqa_node_inputs([fused, "", "", k_past, v_past, seqlens, total, cos,
                                                       sin, packed.positions, bias] + sinks),
               [b.fresh("gqa_out"), outs[1], outs[2]], domain="com.microsoft", **attrs)[0]
    if half:
        o = b.node("Cast", [o], to=TensorProto.FLOAT)[0]
    hd = int(b.graph.type_of(node.inputs[0]).shape[-1])
    b.node("Reshape", [o, b.i64([0, a["heads"], 1, hd])], [outs[0]])
    b.node("GatherElements", [outs[1], index], [outs[3]], axis=2)
    b.node("GatherElements", [outs[2], index], [outs[4]], axis=2)


def _lower_prefill_packed(b, node, outs: list[str]) -> None:
    """The prompt as ``_lower_prefill_keeping_buffers``, and the new keys and values as the cache outputs
    (their chain, read by this branch alone, is moved into it by settle_packed)."""
    _lower_prefill_keeping_buffers(b, node, outs[:3])
    for i, out in ((1, outs[3]), (2, outs[4])):
        past, new = _split(b, node.inputs[i])
        new_columns(b, past, new, out)


def settle_packed(model) -> int:
    """After export: for each packed If, drop the main-graph Identity nodes (Cast with an fp16 cache) that gave
    the cache outputs the If now gives, and move into its prefill branch every main-graph node read by that branch alone
    (the q/k/v slices, head splits and ropes), so a decoding step does not run them. Returns how many
    nodes moved. Nodes that read no data (Shape, and nodes over initializers and such nodes' outputs alone:
    shape arithmetic, a constant expanded to a shape, as bf16's zero keys) stay in the main graph: in a
    branch onnxruntime would run their shape arithmetic on the device and copy it to the host (CUDA)."""
    graph = model.graph
    ifs = [n for n in graph.node if n.op_type == "If" and n.doc_string == PACKED_MARK]
    if not ifs:
        return 0
    given = {o for n in ifs for o in n.output}
    nodes = [n for n in graph.node if n.op_type == "If" or not (n.op_type in ("Identity", "Cast")
                                                                  and set(n.output) <= given)]
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in _graph_reads([n]):
            readers.setdefault(name, []).append(i)
    moved_to: dict[int, int] = {}  # node index -> the If index it moves into
    index = {id(n): i for i, n in enumerate(nodes)}
    dataless = {t.name for t in graph.initializer} | {""}
    for n in nodes:
        if n.op_type != "If" and (n.op_type == "Shape" or set(n.input) <= dataless):
            dataless.update(n.output)
    then_reads = {index[id(n)]: _graph_reads(_branch_graph(n, "then_branch").node) | set(n.input) for n in ifs}
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if n.op_type == "If" or any(o in outputs for o in n.output) or set(n.output) <= dataless:
            continue
        targets = {moved_to.get(r, r) for o in n.output for r in readers.get(o, [])}
        if len(targets) != 1:
            continue
        (t,) = targets
        if t in then_reads and not any(o in then_reads[t] for o in n.output):
            moved_to[i] = t
    for t in then_reads:
        sunk = [nodes[i] for i in sorted(i for i, to in moved_to.items() if to == t)]
        if sunk:
            branch = _branch_graph(nodes[t], "else_branch")
            rest = list(branch.node)
            del branch.node[:]
            branch.node.extend(sunk + rest)
    keep = [n for i, n in enumerate(nodes) if i not in moved_to]
    inits = {i.name: i for i in graph.initializer}
    merged = [pair for n in ifs for pair in [_merge_heads_after(keep, n, inits, outputs)] if pair]
    for ifn, (tr, rs) in merged:
        _hoist_merge_heads(ifn, tr, rs)
    dropped = {id(n) for pair in merged for n in pair[1]}
    del graph.node[:]
    graph.node.extend(n for n in keep if id(n) not in dropped)
    return len(moved_to) + 2 * len(merged)


def _merge_heads_after(nodes, ifn, inits, outputs):
    """(If, (Transpose, Reshape)) when the If's attention output is read only by merge_heads' pair
    (Transpose [0, 2, 1, 3], Reshape to [0, 0, -1]): at T = 1 GroupQueryAttention's [B, 1, H·hd]
    output is already that, so the pair can move into the prefill branch. Else None."""

    def readers(name):
        return [n for n in nodes if name in _graph_reads([n])]

    (out,) = ifn.output[:1]
    tr = readers(out)
    if len(tr) != 1 or tr[0].op_type != "Transpose" or out in outputs:
        return None
    perm = next((list(a.ints) for a in tr[0].attribute if a.name == "perm"), None)
    rs = readers(tr[0].output[0])
    if perm != [0, 2, 1, 3] or len(rs) != 1 or rs[0].op_type != "Reshape" or tr[0].output[0] in outputs:
        return None
    shape = inits.get(rs[0].input[1])
    if shape is None or numpy_helper.to_array(shape).tolist() != [0, 0, -1]:
        return None
    return ifn, (tr[0], rs[0])


def _hoist_merge_heads(ifn, tr, rs) -> None:
    """The If gives the merged [B, T, H·hd] itself: the decode branch GroupQueryAttention's output as it
    is (its Reshape to heads dropped), the prefill branch its output through the Transpose and Reshape."""
    then_g, else_g = _branch_graph(ifn, "then_branch"), _branch_graph(ifn, "else_branch")
    last = next(n for n in then_g.node if n.output[0] == then_g.output[0].name)
    then_g.output[0].name = last.input[0]
    then_g.node.remove(last)
    tr.input[0] = else_g.output[0].name
    rs.output[0] = rs.output[0] + "/prefill"
    else_g.node.extend([tr, rs])
    else_g.output[0].name = rs.output[0]
    ifn.output[0] = rs.output[0][:-len("/prefill")]


def _branch_graph(node, name: str):
    return next(a.g for a in node.attribute if a.name == name)


def _lower_prefill_keeping_buffers(b, node, outs: list[str]) -> None:
    """The prompt (tiled kernel) and, for the If's buffer outputs, the past inputs as they are."""
    _lower_prefill(b, node, outs[0])
    for i, out in ((1, outs[1]), (2, outs[2])):
        b.node("Identity", [_split(b, node.inputs[i])[0]], [out])


def _or_combined(b, node, prefill, gqa_in, elems: list[int], packed=None):
    """A gqa site's T > 1 lowering: ``prefill``, or with the ``mixed`` attribute (the serving engine's
    variant) an If between the engine's combined call and it (backends/onnx/mixed_attention.py);
    ``packed``: (PackedQKV, (cos, sin)) of a packed site, whose decoding rows then read the projection."""
    if not node.attrs.get("mixed"):
        return prefill
    from tessera.compiler.backends.onnx import mixed_attention

    mixed_attention.main_graph_inputs(b, node, _split)  # built now, in the main graph, before the branches
    return lambda b, n, outs: mixed_attention.lower_prefill_or_combined(b, n, outs, prefill, branch_outputs, _split,
                                                                        gqa_in, elems, packed)


def lower_phased_attention(b, node, out: str) -> None:
    """If T == 1 (a decoding step) the cached lowering, else (a prompt) the tiled one."""
    q_t = b.graph.type_of(node.inputs[0])
    elem = _onnx_float(q_t.dtype)
    t = b.dim_scalar(q_t.shape[-2])
    decoding = b.node("Equal", [t, b.const(np.array(1, np.int64), "one")])[0]
    a = node.attrs
    if a.get("prefill") == "attn23":  # the prompt's attn_mask and key pads in the main graph (no shape
        from tessera.compiler.backends.onnx.attention import attn23_inputs  # arithmetic in the branch)

        attn23_inputs(b, node)
    if a.get("decode") == "gqa":  # decoding writes the buffer in place: the If also gives the buffers
        gqa_in = _gqa_inputs(b, node)
        cache_elem = _onnx_float(b.graph.type_of(_split(b, node.inputs[1])[0]).dtype)  # the buffers' (an fp16 cache)
        if half_cache(b, _split(b, node.inputs[1])[0], node.inputs[0]):  # the kernel's bias at fp16, main graph
            gqa_in = (*gqa_in[:2], half_bias(b, gqa_in[2]))
        packed = packed_qkv(b.graph, node)
        b.shared.setdefault("packed_qkv", {})[node.name] = packed if isinstance(packed, str) else None
        if not isinstance(packed, str):  # the If also gives the new keys and values (the cache outputs)
            elems = [elem] + [cache_elem] * 4
            hd = int(b.graph.type_of(node.inputs[0]).shape[-1])
            half = q_t.dtype if q_t.dtype != "f32" else ("f16" if cache_elem == TensorProto.FLOAT16 else None)
            shared = (_rotary_caches(b, packed, half), _new_column_index(b, node, a["kv_heads"], hd))  # main graph
            then_g = branch_outputs(b, lambda b, n, o: _lower_gqa_packed(b, n, o, gqa_in, packed, shared), node,
                                     "decode", elems)
            else_g = branch_outputs(b, _or_combined(b, node, _lower_prefill_packed, gqa_in, elems, (packed, shared[0])),
                                     node, "prefill", elems)
            buffers = list(a["buffer_outputs"])
            b.node("If", [decoding], [out] + buffers + [packed.key_out, packed.value_out], then_branch=then_g,
                   else_branch=else_g)
            b.nodes[-1].doc_string = PACKED_MARK
            for name, past in zip(buffers, (_split(b, node.inputs[1])[0], _split(b, node.inputs[2])[0])):
                b.extra_outputs.append((name, b.graph.type_of(past)))
            return
        elems = [elem, cache_elem, cache_elem]
        then_g = branch_outputs(b, lambda b, n, o: _lower_gqa_decode(b, n, o, gqa_in), node, "decode", elems)
        else_g = branch_outputs(b, _or_combined(b, node, _lower_prefill_keeping_buffers, gqa_in, elems), node, "prefill",
                                 elems)
        buffers = list(a["buffer_outputs"])
        b.node("If", [decoding], [out] + buffers, then_branch=then_g, else_branch=else_g)
        for name, past in zip(buffers, (_split(b, node.inputs[1])[0], _split(b, node.inputs[2])[0])):
            b.extra_outputs.append((name, b.graph.type_of(past)))
        return
    if a["padding"] and a["causal"] and not a["window"] and not a.get("chunk"):  # one mask for every layer's decoding step
        bias = _decode_bias(b, node, _np_float(q_t.dtype))
        then_g = branch(b, lambda b, n, o: lower_cached_attention(b, n, o, bias), node, "decode", elem)
    else:
        then_g = branch(b, lower_cached_attention, node, "decode", elem)
    else_g = branch(b, _lower_prefill, node, "prefill", elem)
    b.node("If", [decoding], [out], then_branch=then_g, else_branch=else_g)


def _graph_reads(nodes) -> set[str]:
    """Names read by these nodes and by the nodes of their subgraphs, at any depth (If, Loop)."""
    return {name for n in all_nodes(nodes) for name in n.input}


def prune_dead_nodes(model) -> int:
    """Drop nodes none of whose outputs is read (a cached graph in buffer mode leaves the
    concatenated keys and values unread: its attention reads past and new apart). Returns how many."""
    graph = model.graph
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live |= _graph_reads([node])  # with the names its subgraphs (If, Loop) read from outside
    dropped = len(graph.node) - len(keep)
    if dropped:
        del graph.node[:]
        graph.node.extend(reversed(keep))
        used = live
        inits = [i for i in graph.initializer if i.name in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)
    return dropped
