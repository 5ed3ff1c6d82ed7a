"""ONNX lowering of attention over a KV cache (impl ``cached``, set by compiler/passes/kv_cache.py).

Why not the other lowerings: a decoding step has one query row against P+1
keys, so there is nothing to tile; the portable kernel's Loop would pay its
per-iteration overhead (one iteration per head) for a handful of multiply-adds,
and onnxruntime 1.31's CPU GroupQueryAttention expects right-padded caches
addressed by seqlens_k, while Tessera's batches are left-padded with an explicit
mask. So the step is lowered to a few plain ops: S = (Q·scale)·Kᵀ + mask,
softmax, ·V. Grouped-query attention reads the cache's kv_heads directly: the
query heads of one group are stacked as rows ([B, G, rep·T, hd]), so K and V
are never repeated. The additive mask [B, 1, T, Tk] (causal with the cache's
offset, sliding window, padding) is built once for all layers by the pass.
"""

from __future__ import annotations

import numpy as np


def _split(b, x: str) -> tuple[str, str | None]:
    """(past, new) when x is concat(past, new) along the sequence, else (x, None)."""
    p = b.graph.producer(x)
    if p is not None and p.op == "concat" and len(p.inputs) == 2 and p.attrs["axis"] in (2, -2):
        return p.inputs[0], p.inputs[1]
    return x, None


def lower_cached_attention(b, node, out: str) -> None:
    g, a = b.graph, node.attrs
    q, k, v, bias = node.inputs[:4]
    q_t, v_t = g.type_of(q), g.type_of(v)
    np_dtype = np.float16 if q_t.dtype == "f16" else np.float32
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
    parts = [k_past] if k_new is None or v_new is None else [k_past, k_new]
    scores = [b.node("MatMul", [qs, b.node("Transpose", [kp], perm=[0, 1, 3, 2])[0]])[0] for kp in parts]
    s = scores[0] if len(scores) == 1 else b.node("Concat", scores, axis=-1)[0]  # [B, G, rep·T, Tk]
    if a.get("softcap"):  # logit soft-capping, before the mask
        s = b.node("Mul", [b.node("Tanh", [s])[0], b.const(np.array(a["softcap"], dtype=np_dtype), "softcap")])[0]
    tk = b.node("Shape", [s], start=3, end=4)[0]
    if rep > 1:
        s = b.node("Reshape", [s, b.node("Concat", [b.i64([0, groups, rep, -1]), tk], axis=0)[0]])[0]
        bias = b.node("Unsqueeze", [bias, b.i64([1])])[0]  # [B, 1, 1, T, Tk]
    p = b.node("Softmax", [b.node("Add", [s, bias])[0]], axis=-1)[0]
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


def prune_dead_nodes(model) -> int:
    """Drop nodes none of whose outputs is read (a cached graph in buffer mode leaves the
    concatenated keys and values unread: its attention reads past and new apart). Returns how many."""
    graph = model.graph
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(node.input)
            for attr in node.attribute:  # names a Loop body reads from the outer graph
                if attr.type == attr.GRAPH:
                    live.update(i for n in attr.g.node for i in n.input)
    dropped = len(graph.node) - len(keep)
    if dropped:
        del graph.node[:]
        graph.node.extend(reversed(keep))
        used = live
        inits = [i for i in graph.initializer if i.name in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)
    return dropped
