"""The serving engine's combined call: one onnxruntime call over the decoding rows and a prompt chunk.

Why: the engine (runtime/serving/engine.py) used to run an iteration as two calls, a prefill chunk of
one prompt and then a decoding step over the decoding rows, and each call reads every weight. On CPU
a 16-token chunk in a call of its own costs 0.7-0.9 of a 16-row decoding step, while one call over
16 decoding rows and the 16 chunk tokens costs about what a 32-row step's matrix products do, 1.03
of the 16-row step (bench/prefill_mix_cost.py, docs/BENCHMARKS.md S5). This module lowers that one
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
bound buffers, as in the decoding branch); the last T are the prompt chunk, the tiled kernel over
the chunk row's filled columns (``cache_length`` of its row: one row's prefix copied, none for a
prompt's first chunk, which then runs as a prompt alone does) and the chunk, causal with that
offset. The two outputs are concatenated in token order. The cache outputs (``key.{i}``) give every
token's new keys; the engine writes the chunk's into its row. The logits are taken at the n row
tokens and the chunk's last (``settle_mixed`` turns the last-position slice before the head into
that gather), so the head costs a decoding step's plus one row.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from tessera.compiler.ir import dims

COMBINED_KEY = "tessera.combined_call"  # the model's metadata entry saying it has the combined call
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


def _chunk_filled(b, node) -> str:
    """i64 [1]: the chunk row's filled columns, cache_length[chunk_row] (main graph, built once)."""
    key = ("mixed", "filled")
    if key not in b.shared:
        saved, b.current = b.current, ""
        try:
            b.shared[key] = b.node("Gather", [node.attrs["length_input"], _marker(b, node)[1]],
                                   [b.fresh("mixed/chunk_filled")], axis=0)[0]
        finally:
            b.current = saved
    return b.shared[key]


def main_graph_inputs(b, node) -> None:
    """What every site's branches read from the main graph (the If's condition, the chunk's row):
    called before a site's branches are built, so the nodes land in the main graph."""
    _marker(b, node)
    _chunk_filled(b, node)


def lower_prefill_or_combined(b, node, outs: list[str], prefill, branch_outputs, gqa_in, elems: list[int]) -> None:
    """The T > 1 branch of a mixed site's If: an If on ``chunk_row`` >= 0 between the combined call
    (``_lower_combined``) and the site's own prefill lowering ``prefill(b, node, outs)``."""
    then_g = branch_outputs(b, lambda b, n, o: _lower_combined(b, n, o, gqa_in), node, "combined", elems)
    else_g = branch_outputs(b, prefill, node, "prompt", elems)
    b.node("If", [_marker(b, node)[0]], outs, then_branch=then_g, else_branch=else_g)


def _gqa_attrs(a: dict) -> dict:
    """GroupQueryAttention's attributes for the site (as cached_attention._lower_gqa_decode)."""
    attrs = {"num_heads": a["heads"], "kv_num_heads": a["kv_heads"], "scale": float(a["scale"])}
    if a.get("softcap"):
        attrs["softcap"] = float(a["softcap"])
        attrs["scale"] = float(a["scale"]) * float(a["softcap"])
    return attrs


def _lower_combined(b, node, outs: list[str], gqa_in) -> None:
    """The combined call at one site (see the module docstring). ``outs``: the attention output
    [1, H, n + T, hd], the two cache buffers (GroupQueryAttention's present outputs, the buffer
    itself when bound), and for a packed site the new keys and values of every token."""
    from tessera.compiler.backends.onnx.attention import _portable
    from tessera.compiler.backends.onnx.cached_attention import _split

    g, a = b.graph, node.attrs
    q, k, v = node.inputs[:3]
    (k_past, k_new), (v_past, v_new) = _split(b, k), _split(b, v)
    q_t = g.type_of(q)
    hd = int(q_t.shape[-1])
    heads, kv = a["heads"], a["kv_heads"]
    n = b.node("Shape", [k_past], start=0, end=1)[0]  # the rows of the view: the first n tokens
    big, axis2 = b.i64([2**62]), b.i64([2])
    zero = b.i64([0])

    # ---- the decoding part: token i of the first n is row i's step (GroupQueryAttention in place)
    def rows(x: str, h: int) -> str:  # [1, h, N, hd] -> its first n tokens as [n, 1, h*hd]
        first = b.node("Slice", [x, zero, n, axis2])[0]
        return b.node("Reshape", [b.node("Transpose", [first], perm=[0, 2, 1, 3])[0], b.i64([-1, 1, h * hd])])[0]

    seqlens, total, bias = gqa_in
    o = b.node("GroupQueryAttention", [rows(q, heads), rows(k_new, kv), rows(v_new, kv), k_past, v_past, seqlens,
                                       total, "", "", "", bias],
               [b.fresh("gqa_out"), outs[1], outs[2]], domain="com.microsoft", **_gqa_attrs(a))[0]
    o_rows = b.node("Transpose", [b.node("Reshape", [o, b.i64([1, -1, heads, hd])])[0]], perm=[0, 2, 1, 3])[0]

    # ---- the chunk: the prefill over its row's filled columns (cache_length[r] of them: none for a
    # prompt's first chunk, which then runs as a prompt alone does) and its mask there
    r, filled = _marker(b, node)[1], _chunk_filled(b, node)
    r1 = b.node("Add", [r, b.i64([1])])[0]
    starts, ends = b.node("Concat", [r, zero], axis=0)[0], b.node("Concat", [r1, filled], axis=0)[0]
    past_k = b.node("Slice", [k_past, starts, ends, b.i64([0, 2])])[0]  # [1, kv, filled, hd]: one row's
    past_v = b.node("Slice", [v_past, starts, ends, b.i64([0, 2])])[0]
    q_c, k_c, v_c = (b.node("Slice", [x, n, big, axis2])[0] for x in (q, k_new, v_new))
    keys = b.node("Concat", [past_k, k_c], axis=2)[0]
    values = b.node("Concat", [past_v, v_c], axis=2)[0]
    width = filled
    t_c = b.node("Shape", [q_c], start=2, end=3)[0]
    mask = node.inputs[3]
    mask_row = b.node("Slice", [mask, starts, ends, b.i64([0, 1])])[0]  # [1, filled]
    ones = b.node("Expand", [b.const(np.ones((1, 1), dtype=np.int64), "one"),
                             b.node("Concat", [b.i64([1]), t_c], axis=0)[0]])[0]
    mask_c = b.node("Concat", [mask_row, ones], axis=1)[0]
    # the tiled kernel reads B, T and P from the graph's inputs (tokens [1, n + T], past [n, ...]): here
    # they are the chunk's (1, T, its filled columns), so its run-time dimensions are given for this branch alone
    # (_branch_outputs restores the builder's after)
    b._dims = {dims.dim(q_t.shape[0]): b.i64([1]), dims.dim(q_t.shape[-2]): t_c, dims.symbol("P"): width}
    o_c = b.fresh("chunk_out")
    if _block_fits(a):
        _chunk_block(b, node, o_c, q_c, keys, values, mask_c, t_c, width)
    else:  # a score feature the block here does not compute: the tiled kernel, as a prompt's chunk alone
        graph, b.graph = b.graph, _Typed(g, {mask_c: g.type_of(mask)})  # the kernel asks the mask's dtype by name
        try:
            _portable(b, node, o_c, names=[q_c, keys, values, mask_c])
        finally:
            b.graph = graph
    b.node("Concat", [o_rows, o_c], [outs[0]], axis=2)
    if len(outs) == 5:  # a packed site: the If gives the new keys and values of every token
        b.node("Identity", [k_new], [outs[3]])
        b.node("Identity", [v_new], [outs[4]])


# the score features ``_chunk_block`` computes: a gqa decoding site's (attention.py GQA_DECODE_FEATURES)
BLOCK_FEATURES = ("scale", "softcap", "causal", "padding")


def _block_fits(a: dict) -> bool:
    """Whether the site's scores need nothing but BLOCK_FEATURES (every gqa decoding site: its kernel
    allows no more), so the chunk can be one block rather than the tiled kernel."""
    from tessera.compiler.reference import score_epilogue

    return set(score_epilogue.used(a)) <= set(BLOCK_FEATURES)


def _chunk_block(b, node, out: str, q: str, keys: str, values: str, mask: str, t: str, past: str) -> None:
    """The chunk's attention as one block: its T queries against its row's P filled columns and its
    own T keys (P + T: tens to hundreds), scores [1, kv, rep·T, P + T] -- small, so plain
    MatMul/Softmax beat the tiled kernel's Loop, whose per-iteration nodes cost more than the
    products at these sizes (bench/prefill_mix_cost.py). Grouped-query heads read their group's keys
    in place ([1, kv, rep·T, hd] queries), the scale and soft-cap as the score epilogue has them
    (c·tanh(scale·s)), the causal mask with offset P and the row's mask as hidden scores (the
    dtype's minimum: weight 0)."""
    g, a = b.graph, node.attrs
    q_t, v_t = g.type_of(node.inputs[0]), g.type_of(node.inputs[2])
    np_dtype = np.float16 if q_t.dtype == "f16" else np.float32
    heads, kv = a["heads"], a["kv_heads"]
    rep, hd, hv = heads // kv, int(q_t.shape[-1]), int(v_t.shape[-1])
    qs = b.node("Mul", [q, b.const(np.array(a["scale"], dtype=np_dtype), "scale")])[0]
    qg = b.node("Reshape", [qs, b.i64([1, kv, -1, hd])])[0]  # [1, kv, rep·T, hd]: a group's heads stacked
    s = b.node("MatMul", [qg, b.node("Transpose", [keys], perm=[0, 1, 3, 2])[0]])[0]  # [1, kv, rep·T, P + T]
    if a.get("softcap"):
        s = b.node("Mul", [b.node("Tanh", [s])[0], b.const(np.array(a["softcap"], dtype=np_dtype), "softcap")])[0]
    total = b.node("Add", [past, t])[0]
    s5 = b.node("Reshape", [s, b.node("Concat", [b.i64([1, kv, rep]), t, total], axis=0)[0]])[0]
    zero, one = b.const(np.array(0, dtype=np.int64), "zero"), b.const(np.array(1, dtype=np.int64), "one")
    scalar = lambda x: b.node("Squeeze", [x, b.i64([0])])[0]  # noqa: E731
    rows = b.node("Add", [b.node("Range", [zero, scalar(t), one])[0], past])[0]  # each query's position
    cols = b.node("Range", [zero, scalar(total), one])[0]
    hidden = b.node("Or", [b.node("Greater", [b.node("Unsqueeze", [cols, b.i64([0])])[0],
                                              b.node("Unsqueeze", [rows, b.i64([1])])[0]])[0],
                           b.node("Equal", [mask, b.const(np.array(0, dtype=np.int64), "zero")])[0]])[0]  # [T, P + T]
    s5 = b.node("Where", [hidden, b.const(np.array(np.finfo(np_dtype).min, dtype=np_dtype), "min"), s5])[0]
    p = b.node("Reshape", [b.node("Softmax", [s5], axis=-1)[0], b.node("Concat", [b.i64([1, kv, -1]), total],
                                                                      axis=0)[0]])[0]
    o = b.node("MatMul", [p, values])[0]  # [1, kv, rep·T, hv]
    b.node("Reshape", [o, b.i64([1, heads, -1, hv])], [out])


class _Typed:
    """The IR graph, answering ``type_of`` also for values made here (the chunk's mask)."""

    def __init__(self, graph, types: dict):
        self._graph, self._types = graph, types

    def type_of(self, value: str):
        return self._types[value] if value in self._types else self._graph.type_of(value)

    def __getattr__(self, name: str):
        return getattr(self._graph, name)


def settle_mixed(model) -> bool:
    """After export, for a graph with the combined call: take the logits at the row tokens and the
    chunk's last token (the last-position Slice before the head becomes a Gather of positions [0, n)
    and N - 1, n the view's rows in a combined call and 0 in any other, so every other call gets its
    last position as before), and say so in the metadata (``COMBINED_KEY``). Returns whether the
    graph has the combined call."""
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

    x = last.input[0]
    nodes = [
        helper.make_node("Shape", [past], ["mixed/rows"], start=0, end=1),
        helper.make_node("Where", ["mixed/is_combined", "mixed/rows", const("none", [0])], ["mixed/n"]),
        helper.make_node("Squeeze", ["mixed/n", const("axis0", [0])], ["mixed/n_scalar"]),
        helper.make_node("Range", [const("zero", 0), "mixed/n_scalar", const("one", 1)], ["mixed/row_positions"]),
        helper.make_node("Shape", [x], ["mixed/tokens"], start=1, end=2),
        helper.make_node("Sub", ["mixed/tokens", const("one1", [1])], ["mixed/last"]),
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
    return True
