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
    kt = b.node("Transpose", [k], perm=[0, 1, 3, 2])[0]
    s = b.node("MatMul", [qs, kt])[0]  # [B, G, rep·T, Tk]
    if rep > 1:
        tk = b.node("Shape", [k], start=2, end=3)[0]
        s5 = b.node("Reshape", [s, b.node("Concat", [b.i64([0, groups, rep, -1]), tk], axis=0)[0]])[0]  # [B, G, rep, T, Tk]
        s5 = b.node("Add", [s5, b.node("Unsqueeze", [bias, b.i64([1])])[0]])[0]
        p = b.node("Softmax", [s5], axis=-1)[0]
        p = b.node("Reshape", [p, b.node("Concat", [b.i64([0, groups, -1]), tk], axis=0)[0]])[0]
        o = b.node("MatMul", [p, v])[0]  # [B, G, rep·T, hv]
        b.node("Reshape", [o, b.i64([0, heads, -1, hv])], [out])
    else:
        p = b.node("Softmax", [b.node("Add", [s, bias])[0]], axis=-1)[0]
        b.node("MatMul", [p, v], [out])
