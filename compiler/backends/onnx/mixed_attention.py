"""The serving engine's combined call: one onnxruntime call over the decoding rows and a prompt chunk.

Why: the engine (runtime/serving/engine.py) used to run an iteration as two calls, a prefill chunk of
one prompt and then a decoding step over the decoding rows, and each call reads every weight. On CPU
a 16-token chunk in a call of its own costs 0.7-0.9 of a 16-row decoding step, while one call over
16 decoding rows and the 16 chunk tokens costs about what a 32-row step's matrix products do, 1.03
of the 16-row step (bench/prefill_mix_cost.py, docs/benchmarks/table.md S5). This module lowers that one
call; it exists only in the engine's variant of the cached decoder (compile option ``mixed``, set by
runtime/serving/model.py ``load``), so ``generate``'s graph is not changed by a node.

The call's inputs, as the engine feeds them (no input is added: every other caller -- ``generate``,
a decoding step, a prompt's chunk alone -- feeds what it fed before):

- the tokens ``[1, n + T]``: first one token per row of the cache view ``[:n]`` (a decoding row's
  next token; a dummy for a row not decoding, which rides along as in a decoding step), then the
  chunk's T prompt tokens; ``position_ids`` ``[1, n + T]`` each token's own position;
- the cache views ``[n, kv_heads, W, hd]`` (bound in place), ``attention_mask`` ``[n, W + 1]`` and
  ``cache_length`` ``[n]`` exactly as for a decoding step of those n rows, except that the chunk's
  row has a 0 in the mask's last column (its new token's, 1 in every other call): that marks the
  call as combined and names the chunk's row (``_marker``). (A graph input with a default, which
  onnxruntime allows, cannot be bound through IOBinding, which the in-place cache needs.)

Everything but attention treats the n + T tokens as n + T rows of one sequence (the MatMuls run
once over all of them). Each attention site, in the branch of its If taken for a combined call
(nested in the T > 1 branch, so a decoding step's branch is untouched), slices q, k, v at n: the
first n tokens, one per row, are the decoding step's GroupQueryAttention over the shared buffer
(per-row ``seqlens_k``, each row's new column written in place: the branch's buffer outputs are the
bound buffers, as in the decoding branch); the last T are the prompt chunk, one MatMul/Softmax
block (``_chunk_block``) over the chunk row's filled columns (``cache_length`` of its row: one row's
prefix copied, none for a prompt's first chunk) and the chunk, causal with that offset. The two
outputs are concatenated in token order. The cache outputs (``key.{i}``) give every
token's new keys; the engine writes the chunk's into its row. The logits are taken at the n row
tokens and the chunk's last (``settle_mixed`` turns the last-position slice before the head into
that gather), so the head costs a decoding step's plus one row.

Segments: the T chunk tokens may be several prompts' chunks one after another (a burst of prompts in
one call: every call reads every weight). The first segment is the marked row's chunk, with its past;
each later one is another prompt's FIRST chunk (no past), its positions starting again at 0. Nothing
else marks them: token j of the chunk belongs to segment j - p_j + p_0 (0 for the first, whose
positions run on from p_0; s + p_0 > 0 for a segment starting at token s), and the block hides every
key of another segment and the marked row's past from the later segments (``_chunk``). The logits are
taken at every segment's last token (where the next position is not this one's + 1), in token order.
Assumed, as the engine feeds it: a later segment starts at position 0 and has no filled column; a
call that is not combined is one segment.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tessera.compiler.backends.onnx.floats import np_float as _np_float, onnx_float as _onnx_float
from tessera.compiler.backends.onnx.gqa_inputs import gqa_node_inputs
from tessera.compiler.backends.onnx.half_cache import new_columns, to_half

POSITIONS = "position_ids"  # the cached graph's input (compiler/passes/kv_cache.py)

COMBINED_KEY = "tessera.combined_call"  # the model's metadata entry saying it has the combined call
# the metadata entry giving settle_mixed's short_logits: calls not combined of at most that many tokens get every
# position's logits
SHORT_LOGITS_KEY = "tessera.short_call_logits"
LAST_SLICE = "cache/last"  # the IR node passes/kv_cache.py LastPositionLogits puts before the head


def _marker(b, node) -> tuple[str, str]:
    """(is_combined, chunk_row) from the attention mask [n, W + 1] (built once in the main graph, read
    by every site's If): the call is a combined one when a row's last column (its new token's) is 0,
    which no other call has (a left-padded prompt's last token is real, a decoding row's new column is
    unmasked), and that row, the first such, is the chunk's (i64 [1])."""
    key = ("mixed", "marker")
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            last = b.node("Slice", [node.inputs[3], b.i64([-1]), b.i64([2**62]), b.i64([1])])[0]  # [n, 1]
            lowest = b.node("ReduceMin", [last], keepdims=0)[0]
            combined = b.node("Equal", [lowest, b.const(np.array(0, dtype=np.int64), "zero")],
                              [b.fresh("mixed/is_combined")])[0]
            row = b.node("Reshape", [b.node("ArgMin", [last], axis=0, keepdims=1)[0], b.i64([1])],
                         [b.fresh("mixed/chunk_row")])[0]
            b.shared[key] = (combined, row)
        finally:
            b.current = saved
    return b.shared[key]


def _chunk(b, node, split) -> dict:
    """What every site's chunk reads, built once in the main graph (on every call of the engine's
    variant: a dozen small nodes, whose values only a combined call uses; in any other call they are
    empty or unread): ``n`` the view's rows (i64 [1]), ``t`` the chunk's tokens (N - n), ``starts`` /
    ``ends`` the chunk row's filled columns as Slice bounds over [rows, ..., columns] ([r, 0] to
    [r + 1, cache_length[r]]), ``total`` its keys (filled + t), ``hidden`` the causal mask [t, total]
    (True: hidden; query i is at position filled + i)."""
    key = ("mixed", "chunk")
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            r = _marker(b, node)[1]
            filled = b.node("Gather", [node.attrs["length_input"], r], axis=0)[0]
            n = b.node("Shape", [split(b, node.inputs[1])[0]], start=0, end=1)[0]
            tokens = b.node("Shape", [POSITIONS], start=1, end=2)[0]
            t = b.node("Sub", [tokens, n])[0]
            total = b.node("Add", [filled, t])[0]
            zero, one = b.const(np.array(0, dtype=np.int64), "zero"), b.const(np.array(1, dtype=np.int64), "one")
            scalar = lambda x: b.node("Squeeze", [x, b.i64([0])])[0]  # noqa: E731
            index = b.node("Range", [zero, scalar(t), one])[0]  # the chunk's tokens 0..t-1
            rows = b.node("Add", [index, filled])[0]
            cols = b.node("Range", [zero, scalar(total), one])[0]
            causal = b.node("Greater", [b.node("Unsqueeze", [cols, b.i64([0])])[0],
                                        b.node("Unsqueeze", [rows, b.i64([1])])[0]])[0]
            # the chunk's segments (several prompts' first chunks after the first segment: module docstring):
            # token j's segment is j - p_j + p_0, 0 for the first segment (its positions run on from p_0) and
            # s + p_0 > 0 for one starting at token s (its positions run from 0); the r filled columns are
            # the first segment's past
            chunk_positions = b.node("Slice", [b.node("Slice", [POSITIONS, b.i64([0]), b.i64([1]), b.i64([0])])[0],
                                               n, b.i64([2**62]), b.i64([1])])[0]
            chunk_positions = b.node("Reshape", [chunk_positions, b.i64([-1])])[0]
            first_position = b.node("Slice", [chunk_positions, b.i64([0]), b.i64([1]), b.i64([0])])[0]
            segment = b.node("Add", [b.node("Sub", [index, chunk_positions])[0], first_position])[0]
            past_segment = b.node("Expand", [b.const(np.array([0], dtype=np.int64), "zero1"), filled])[0]
            key_segment = b.node("Concat", [past_segment, segment], axis=0)[0]
            # total columns (not filled + max(t, 0): in a call that is not combined t may be negative, and these
            # values, unread there, must still have the shapes of ``causal``'s)
            key_segment = b.node("Slice", [key_segment, b.i64([0]), b.node("Max", [total, b.i64([0])])[0],
                                           b.i64([0])])[0]
            other = b.node("Not", [b.node("Equal", [b.node("Unsqueeze", [key_segment, b.i64([0])])[0],
                                                     b.node("Unsqueeze", [segment, b.i64([1])])[0]])[0]])[0]
            hidden = b.node("Or", [causal, other], [b.fresh("mixed/causal")])[0]
            b.shared[key] = {"n": n, "t": t, "total": total, "hidden": hidden,
                             "starts": b.node("Concat", [r, b.i64([0])], axis=0)[0],
                             "ends": b.node("Concat", [b.node("Add", [r, b.i64([1])])[0], filled], axis=0)[0]}
        finally:
            b.current = saved
    return b.shared[key]


def main_graph_inputs(b, node, split) -> None:
    """What every site's branches read from the main graph (the If's condition, the chunk's bounds and
    mask): called before a site's branches are built, so the nodes land in the main graph."""
    _marker(b, node)
    a = node.attrs
    _block_shapes(b, _chunk(b, node, split), a["kv_heads"], a["heads"] // a["kv_heads"])


def lower_prefill_or_combined(b, node, outs: list[str], prefill, branch_outputs, split, gqa_in,
                              elems: list[int], packed=None) -> None:
    """The T > 1 branch of a mixed site's If: an If on the combined call's marker between the combined
    call (``_lower_combined``) and the site's own prefill lowering ``prefill(b, node, outs)``.
    ``branch_outputs`` and ``split`` are cached_attention.py's (passed in: that module imports this one)."""
    if not _block_fits(node.attrs):  # every gqa decoding site fits (its kernel allows no more)
        raise ValueError(f"the combined call computes {', '.join(BLOCK_FEATURES)} only; the attention at "
                         f"{node.scope or node.name} also needs {', '.join(sorted(_extra(node.attrs)))}")
    then_g = branch_outputs(b, lambda b, n, o: _lower_combined(b, n, o, gqa_in, split, packed), node, "combined",
                            elems)
    else_g = branch_outputs(b, prefill, node, "prompt", elems)
    b.node("If", [_marker(b, node)[0]], outs, then_branch=then_g, else_branch=else_g)


def _gqa_attrs(a: dict) -> dict:
    """GroupQueryAttention's attributes for the site (as cached_attention._lower_gqa_decode)."""
    attrs = {"num_heads": a["heads"], "kv_num_heads": a["kv_heads"], "scale": float(a["scale"])}
    if a.get("softcap"):
        attrs["softcap"] = float(a["softcap"])
        attrs["scale"] = float(a["scale"]) * float(a["softcap"])
    return attrs


def _lower_combined(b, node, outs: list[str], gqa_in, split, packed=None) -> None:
    """The combined call at one site (see the module docstring). ``outs``: the attention output
    [1, H, n + T, hd], the two cache buffers (GroupQueryAttention's present outputs, the buffer
    itself when bound), and for a packed site the new keys and values of every token."""

    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    (k_past, k_new), (v_past, v_new) = split(b, k), split(b, v)
    q_t = g.type_of(q)
    hd = int(q_t.shape[-1])
    heads, kv = a["heads"], a["kv_heads"]
    chunk = _chunk(b, node, split)
    n = chunk["n"]  # the rows of the view: the first n tokens
    big, axis2 = b.i64([2**62]), b.i64([2])
    zero = b.i64([0])

    # ---- the decoding part: token i of the first n is row i's step (GroupQueryAttention in place)
    def rows(x: str, h: int) -> str:  # [1, h, N, hd] -> its first n tokens as [n, 1, h*hd]
        first = b.node("Slice", [x, zero, n, axis2])[0]
        return b.node("Reshape", [b.node("Transpose", [first], perm=[0, 2, 1, 3])[0], b.i64([-1, 1, h * hd])])[0]

    seqlens, total, bias = gqa_in
    # an fp16 cache (passes/kv_cache_dtype.py): the rows' GroupQueryAttention in fp16 (gqa_in's bias is fp16
    # already: cached_attention.lower_phased_attention), its output back to fp32
    half = g.type_of(k_past).dtype == "f16" and q_t.dtype == "f32"
    cast = (lambda xs: to_half(b, xs)) if half else (lambda xs: xs)  # noqa: E731
    if packed is None:
        o = b.node("GroupQueryAttention", gqa_node_inputs(cast([rows(q, heads), rows(k_new, kv), rows(v_new, kv)])
                                                          + [k_past, v_past, seqlens, total, "", "", "", bias]),
                   [b.fresh("gqa_out"), outs[1], outs[2]], domain="com.microsoft", **_gqa_attrs(a))[0]
    else:  # a packed site: the rows read the q+k+v projection, rotated in the kernel, as its decoding step
        proj, (cos, sin) = packed
        first = lambda x, shape: b.node("Reshape", [b.node("Slice", [x, zero, n, b.i64([1])])[0],  # noqa: E731
                                                    b.i64(shape)])[0]
        width = (heads + 2 * kv) * hd
        o = b.node("GroupQueryAttention", gqa_node_inputs(cast([first(proj.fused, [-1, 1, width])])
                                                          + ["", "", k_past, v_past, seqlens, total, cos, sin,
                                                             first(proj.positions, [-1, 1]), bias]),
                   [b.fresh("gqa_out"), outs[1], outs[2]], domain="com.microsoft", do_rotary=1,
                   rotary_interleaved=int(proj.interleaved), **_gqa_attrs(a))[0]
    if half:
        o = b.node("Cast", [o], to=TensorProto.FLOAT)[0]
    o_rows = b.node("Transpose", [b.node("Reshape", [o, b.i64([1, -1, heads, hd])])[0]], perm=[0, 2, 1, 3])[0]

    # ---- the chunk: its queries against its row's filled columns (cache_length[r] of them, every one a
    # real token: a row fills its columns from 0; none for a prompt's first chunk) and its own keys,
    # causally
    bounds = [chunk["starts"], chunk["ends"], b.i64([0, 2])]
    past_k = b.node("Slice", [k_past] + bounds)[0]  # [1, kv, filled, hd]: one row's prefix
    past_v = b.node("Slice", [v_past] + bounds)[0]
    if half:  # an fp16 cache: the one row's prefix converted, not the cache
        past_k, past_v = (b.node("Cast", [x], to=TensorProto.FLOAT)[0] for x in (past_k, past_v))
    q_c, k_c, v_c = (b.node("Slice", [x, n, big, axis2])[0] for x in (q, k_new, v_new))
    keys = b.node("Concat", [past_k, k_c], axis=2)[0]
    values = b.node("Concat", [past_v, v_c], axis=2)[0]
    o_c = b.fresh("chunk_out")
    _chunk_block(b, node, o_c, q_c, keys, values, chunk)
    b.node("Concat", [o_rows, o_c], [outs[0]], axis=2)
    if len(outs) == 5:  # a packed site: the If gives the new keys and values of every token
        new_columns(b, k_past, k_new, outs[3])
        new_columns(b, v_past, v_new, outs[4])


# the score features ``_chunk_block`` computes: a gqa decoding site's (attention.py GQA_DECODE_FEATURES)
BLOCK_FEATURES = ("scale", "softcap", "causal", "padding")


def _extra(a: dict) -> set[str]:
    """The site's score features beyond BLOCK_FEATURES."""
    from tessera.compiler.reference import score_epilogue

    return set(score_epilogue.used(a)) - set(BLOCK_FEATURES)


def _block_fits(a: dict) -> bool:
    """Whether the site's scores need nothing but BLOCK_FEATURES (every gqa decoding site: its kernel
    allows no more), so the chunk is one block."""
    return not _extra(a)


def _chunk_block(b, node, out: str, q: str, keys: str, values: str, chunk: dict) -> None:
    """The chunk's attention as one block: its T queries against its row's P filled columns and its
    own T keys (P + T: tens to hundreds), scores [1, kv, rep·T, P + T] -- small, so plain
    MatMul/Softmax beat the tiled kernel's Loop, whose per-iteration nodes cost more than the
    products at these sizes (bench/prefill_mix_cost.py). Grouped-query heads read their group's keys
    in place ([1, kv, rep·T, hd] queries), the scale and soft-cap as the score epilogue has them
    (c·tanh(scale·s)), the causal mask with offset P (``chunk["hidden"]``, built once) as hidden
    scores (the dtype's minimum: weight 0). No padding: every key is a real token."""
    g, a = b.graph, node.attrs
    q_t, v_t = g.type_of(node.inputs[0]), g.type_of(node.inputs[2])
    np_dtype = _np_float(q_t.dtype)
    heads, kv = a["heads"], a["kv_heads"]
    rep, hd, hv = heads // kv, int(q_t.shape[-1]), int(v_t.shape[-1])
    qs = b.node("Mul", [q, b.const(np.array(a["scale"], dtype=np_dtype), "scale")])[0]
    qg = b.node("Reshape", [qs, b.i64([1, kv, -1, hd])])[0]  # [1, kv, rep·T, hd]: a group's heads stacked
    s = b.node("MatMul", [qg, b.node("Transpose", [keys], perm=[0, 1, 3, 2])[0]])[0]  # [1, kv, rep·T, P + T]
    if a.get("softcap"):
        s = b.node("Mul", [b.node("Tanh", [s])[0], b.const(np.array(a["softcap"], dtype=np_dtype), "softcap")])[0]
    shapes = _block_shapes(b, chunk, kv, rep)
    s5 = b.node("Reshape", [s, shapes[0]])[0]  # [1, kv, rep, T, P + T]
    s5 = b.node("Where", [chunk["hidden"], b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min"), s5])[0]
    p = b.node("Reshape", [b.node("Softmax", [s5], axis=-1)[0], shapes[1]])[0]
    o = b.node("MatMul", [p, values])[0]  # [1, kv, rep·T, hv]
    b.node("Reshape", [o, b.i64([1, heads, -1, hv])], [out])


def _block_shapes(b, chunk: dict, kv: int, rep: int) -> tuple[str, str]:
    """The block's score shapes [1, kv, rep, T, P + T] and [1, kv, rep·T, P + T]: built once, in the
    main graph (``main_graph_inputs``), for every site of that grouping."""
    key = ("mixed", "shapes", kv, rep)
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            b.shared[key] = (b.node("Concat", [b.i64([1, kv, rep]), chunk["t"], chunk["total"]], axis=0)[0],
                             b.node("Concat", [b.i64([1, kv, -1]), chunk["total"]], axis=0)[0])
        finally:
            b.current = saved
    return b.shared[key]


def settle_mixed(model, short_logits: int = 0) -> bool:
    """After export, for a graph with the combined call: take the logits at the row tokens and the
    chunk's last token (the last-position Slice before the head becomes a Gather of positions [0, n)
    and N - 1, n the view's rows in a combined call and 0 in any other, so every other call gets its
    last position as before), and say so in the metadata (``COMBINED_KEY``). Returns whether the
    graph has the combined call.

    ``short_logits`` > 0: a call that is not combined and has at most that many tokens gets every
    position's logits ([B, T, vocab]; longer ones the last position's, as before), said in the
    metadata (``SHORT_LOGITS_KEY``). Why: serve --speculative checks each row's drafts in one call of
    T = drafts + 1 tokens and needs every position's logits there, and with last-position logits
    for everything else its engine keeps the combined call (bench/serve_adaptive.py: without it the
    speculating engine lost 0.80x at 16 streams). The engine reads the last position of a prompt chunk
    whatever comes back (``[:, -1]``), so only the head's cost of a short chunk changes."""
    graph = model.graph
    marker = next((n for n in graph.node if n.output and n.output[0] == "mixed/is_combined"), None)
    if marker is None:
        return False
    last = next((n for n in graph.node if n.op_type == "Slice" and n.name.startswith(LAST_SLICE + "/")), None)
    if last is None:
        raise ValueError("the combined call needs last-position logits (last_only)")
    past = next(i.name for i in graph.input if i.name.startswith("past_key."))

    def const(name: str, values) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), f"mixed/{name}"))
        return f"mixed/{name}"

    def const_bool(name: str, values) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.bool_), f"mixed/{name}"))
        return f"mixed/{name}"

    x = last.input[0]
    nodes = [
        helper.make_node("Shape", [past], ["mixed/rows"], start=0, end=1),
        helper.make_node("Where", ["mixed/is_combined", "mixed/rows", const("none", [0])], ["mixed/n"]),
        helper.make_node("Squeeze", ["mixed/n", const("axis0", [0])], ["mixed/n_scalar"]),
        helper.make_node("Range", [const("zero", 0), "mixed/n_scalar", const("one", 1)], ["mixed/row_positions"]),
        # each segment's last token (the chunk's last, and in a combined call every token after the rows
        # whose successor's position is not its own + 1: the next segment starts there, at position 0)
        helper.make_node("Slice", [POSITIONS, const("zero1", [0]), const("one1", [1]), const("zero1b", [0])],
                         ["mixed/first_row_positions"]),
        helper.make_node("Reshape", ["mixed/first_row_positions", const("flat", [-1])], ["mixed/token_positions"]),
        helper.make_node("Slice", ["mixed/token_positions", const("one1b", [1]), const("big", [2**62])],
                         ["mixed/successors"]),
        helper.make_node("Slice", ["mixed/token_positions", const("zero1c", [0]), const("minus1", [-1])],
                         ["mixed/predecessors"]),
        helper.make_node("Add", ["mixed/predecessors", const("step", 1)], ["mixed/continued"]),
        helper.make_node("Equal", ["mixed/successors", "mixed/continued"], ["mixed/runs_on"]),
        helper.make_node("Not", ["mixed/runs_on"], ["mixed/breaks"]),
        helper.make_node("And", ["mixed/breaks", "mixed/is_combined"], ["mixed/combined_breaks"]),
        helper.make_node("Concat", ["mixed/combined_breaks", const_bool("last_ends", [True])], ["mixed/ends_here"],
                         axis=0),
        helper.make_node("Shape", ["mixed/token_positions"], ["mixed/token_count"]),
        helper.make_node("Squeeze", ["mixed/token_count", const("axis0b", [0])], ["mixed/token_count_scalar"]),
        helper.make_node("Range", [const("zero0", 0), "mixed/token_count_scalar", const("one0", 1)],
                         ["mixed/token_index"]),
        helper.make_node("GreaterOrEqual", ["mixed/token_index", "mixed/n_scalar"], ["mixed/in_chunk"]),
        helper.make_node("And", ["mixed/ends_here", "mixed/in_chunk"], ["mixed/segment_ends" if not short_logits
                                                                        else "mixed/segment_ends_only"]),
        *(_every_short_position(const, short_logits) if short_logits else []),
        helper.make_node("NonZero", ["mixed/segment_ends"], ["mixed/segment_end_index"]),
        helper.make_node("Reshape", ["mixed/segment_end_index", const("flat1", [-1])], ["mixed/last"]),
        helper.make_node("Concat", ["mixed/row_positions", "mixed/last"], ["mixed/positions"], axis=0),
        helper.make_node("Gather", [x, "mixed/positions"], list(last.output), name=f"{LAST_SLICE}/Gather", axis=1),
    ]
    at = list(graph.node).index(last)
    del graph.node[at]
    for i, n in enumerate(nodes):
        graph.node.insert(at + i, n)
    logits = graph.output[0].type.tensor_type.shape.dim[1]  # [B, 1, vocab] -> [B, positions, vocab]
    logits.ClearField("dim_value")
    logits.dim_param = "logit_positions"
    entry = model.metadata_props.add()
    entry.key, entry.value = COMBINED_KEY, "1"
    if short_logits:
        entry = model.metadata_props.add()
        entry.key, entry.value = SHORT_LOGITS_KEY, str(int(short_logits))
    return True


def _every_short_position(const, short_logits: int) -> list:
    """The nodes that mark every token of a call that is not combined and has at most ``short_logits``
    tokens (``mixed/segment_ends`` from ``mixed/segment_ends_only``, settle_mixed's): such a call's
    logits are every position's."""
    return [
        helper.make_node("LessOrEqual", ["mixed/token_count_scalar", const("short_logits", short_logits)],
                         ["mixed/is_short"]),
        helper.make_node("Not", ["mixed/is_combined"], ["mixed/not_combined"]),
        helper.make_node("And", ["mixed/is_short", "mixed/not_combined"], ["mixed/every_position"]),
        helper.make_node("Or", ["mixed/segment_ends_only", "mixed/every_position"], ["mixed/segment_ends"]),
    ]
