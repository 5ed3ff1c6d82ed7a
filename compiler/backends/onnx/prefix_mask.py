"""The serving engine's attention mask derived inside the graph (CUDA, ``prefix_keys``), not fed.

Why: the engine's variant of the cached decoder (passes/kv_cache.py ``prefix_keys``) assumes each row's
keys are its cache columns 0..cache_length[b] (the engine fills a row from column 0 and never hides a
column among them, attention.py PREFIX_KEYS_ASSUMES). Its mask is then a function of what every call
already feeds: for a call with past P columns and T new tokens, key j of row b is visible exactly when
j < cache_length[b] (a filled column) or j >= P (one of the call's own tokens; the causal part is the
kernel's). On CUDA its decoding step (GroupQueryAttention with seqlens_k alone) never reads the mask,
but the prompt branch's inputs are built in the main graph from it (attention.py ``attn23_inputs``: key
pads, the batch), so a decoding step copied the mask host-to-device -- n x (W + 1) x 8 bytes a step,
more than the token ids, positions and lengths together. Built here from cache_length and the shapes
of the tokens and the first past input, the mask is computed where its readers run (on the device),
and the graph has no ``attention_mask`` input at all: a call feeds token ids, positions and lengths.

Only for graphs where every reader of the mask makes that assumption (``derive_prefix_mask``'s caller,
passes/model_passes.py ``DerivePrefixMask``, checks it: the engine's decoder on CUDA, every cached site the
mask-less gqa decoding step, or every site the plain branch -- fp32, no GroupQueryAttention -- whose lengths
are then the first position ids; no combined call, whose mask marks a chunk's row).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def derive_prefix_mask(model, mask: str, tokens: str, length: str, past: str, positions: bool = False) -> bool:
    """Replace the graph input ``mask`` (i64 [B, P+T]) by nodes computing it, at the front of the main
    graph: ``(j < length[b]) or (j >= P)`` over j in [0, P+T), with P the width of the input ``past``
    ([B, kv, P, hd]), T and B from ``tokens`` ([B, T]) and ``length`` i64 [1] or [B]; with ``positions``,
    ``length`` is the position ids [B, T] and a row's filled columns their first (the engine's plain
    decoder, which has no cache_length: a row's positions count its own tokens from 0, so its first new
    token's position is its filled columns). Returns whether it did (False: the graph has no such input)."""
    graph = model.graph
    inputs = [i.name for i in graph.input]
    if mask not in inputs or any(x not in inputs for x in (tokens, length, past)):
        return False
    p = "prefix_mask/"
    consts = {p + "zero": np.array(0, np.int64), p + "one": np.array(1, np.int64),
              p + "rows": np.array([-1, 1], np.int64), p + "first": np.array([0], np.int64)}
    if positions:
        consts.update({p + "one_1d": np.array([1], np.int64), p + "axis1": np.array([1], np.int64)})
    nodes = [
        helper.make_node("Shape", [tokens], [p + "batch"], start=0, end=1),
        helper.make_node("Shape", [tokens], [p + "t"], start=1, end=2),
        helper.make_node("Shape", [past], [p + "p"], start=2, end=3),
        helper.make_node("Add", [p + "p", p + "t"], [p + "width"]),
        helper.make_node("Squeeze", [p + "width", p + "first"], [p + "width_scalar"]),
        helper.make_node("Range", [p + "zero", p + "width_scalar", p + "one"], [p + "columns"]),  # [P+T]
        helper.make_node("Slice", [length, p + "first", p + "one_1d", p + "axis1"], [p + "lengths"]) if positions
        else helper.make_node("Reshape", [length, p + "rows"], [p + "lengths"]),              # [1|B, 1]
        helper.make_node("Less", [p + "columns", p + "lengths"], [p + "filled"]),             # j < length[b]
        helper.make_node("GreaterOrEqual", [p + "columns", p + "p"], [p + "new"]),            # j >= P
        helper.make_node("Or", [p + "filled", p + "new"], [p + "visible"]),
        helper.make_node("Concat", [p + "batch", p + "width"], [p + "shape"], axis=0),
        helper.make_node("Expand", [p + "visible", p + "shape"], [p + "expanded"]),
        helper.make_node("Cast", [p + "expanded"], [mask], to=TensorProto.INT64),
    ]
    kept = [i for i in graph.input if i.name != mask]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in consts.items())
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return True
