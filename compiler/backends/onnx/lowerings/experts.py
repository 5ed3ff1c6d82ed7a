"""ONNX lowerings of ``sparse_moe`` (compiler/ops/experts.py), one per ``impl``: onnxruntime's
com.microsoft.MoE, or a gather/scatter per expert in standard ops."""

from __future__ import annotations

import numpy as np

from tessera.compiler.ops.experts import IMPLS


def _lower_ort(L):
    """com.microsoft.MoE on [tokens, d] and [tokens, E]; weights stacked [E, 2f, d] and [E, d, f]."""
    b, x, k, e = L.b, L.x, L.a["k"], L.a["experts"]
    d, f = int(L.t_in[0].shape[-1]), int(L.t_in[2].shape[0])
    flat = b.node("Reshape", [x[0], b.i64([-1, d])])[0]
    logits = b.node("Reshape", [x[1], b.i64([-1, e])])[0]
    fc1, fc2 = [], []
    ax1, ax0 = b.i64([1]), b.i64([0])
    for i in range(e):
        gate, up, down = x[2 + 3 * i: 5 + 3 * i]
        pair = b.node("Concat", [b.node("Unsqueeze", [gate, ax1])[0], b.node("Unsqueeze", [up, ax1])[0]], axis=1)[0]
        rows = b.node("Reshape", [pair, b.i64([2 * f, d])])[0]     # gate_0, up_0, gate_1, up_1, ...
        fc1.append(b.node("Unsqueeze", [rows, ax0])[0])
        fc2.append(b.node("Unsqueeze", [down, ax0])[0])
    w1 = b.node("Concat", fc1, axis=0)[0] if e > 1 else fc1[0]
    w2 = b.node("Concat", fc2, axis=0)[0] if e > 1 else fc2[0]
    y = b.node("MoE", [flat, logits, w1, "", w2], domain="com.microsoft", k=k, activation_type="swiglu",
               swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
               normalize_routing_weights=int(L.a.get("normalize", True)))[0]
    L.emit("Reshape", [y, b.node("Shape", [x[0]])[0]])


def _lower_gather(L):
    """TopK, then per expert: Gather its tokens, SwiGLU, ScatterND-add the weighted rows back."""
    b, x, k, e = L.b, L.x, L.a["k"], L.a["experts"]
    d = int(L.t_in[0].shape[-1])
    flat = b.node("Reshape", [x[0], b.i64([-1, d])])[0]
    logits = b.node("Reshape", [x[1], b.i64([-1, e])])[0]
    bf16 = L.t_in[1].dtype == "bf16"
    if bf16:  # TopK takes no bfloat16 at opset 21: the routing in fp32, the weights cast back
        logits = b.node("Cast", [logits], to=b.onnx_type("f32"))[0]
    if L.a.get("normalize") is False:  # the softmax over all E, at the top k (the same experts)
        w, idx = b.node("TopK", [b.node("Softmax", [logits], axis=-1)[0], b.i64([k])], 2, axis=-1, largest=1, sorted=1)
    else:
        vals, idx = b.node("TopK", [logits, b.i64([k])], 2, axis=-1, largest=1, sorted=1)
        w = b.node("Softmax", [vals], axis=-1)[0]
    if bf16:
        w = b.node("Cast", [w], to=b.onnx_type("bf16"))[0]
    w_flat = b.node("Reshape", [w, b.i64([-1])])[0]   # [tokens·k]
    idx_flat = b.node("Reshape", [idx, b.i64([-1])])[0]
    # the sum is kept in fp32 (onnxruntime's CPU ScatterND has no fp16 'add'; fp32 sums are better anyway)
    low = L.t_in[0].dtype != "f32"
    acc = b.node("ConstantOfShape", [b.node("Shape", [flat])[0]], value=b.tensor_value(np.zeros(1, np.float32)))[0]
    kk = b.i64(k)
    for i in range(e):
        gate, up, down = x[2 + 3 * i: 5 + 3 * i]
        hit = b.node("Equal", [idx_flat, b.i64(i)])[0]
        pos = b.node("Reshape", [b.node("NonZero", [hit])[0], b.i64([-1])])[0]            # slots routed to i
        tok = b.node("Div", [pos, kk])[0]                                                   # their tokens
        h = b.node("Gather", [flat, tok], axis=0)[0]
        g = b.node("MatMul", [h, b.node("Transpose", [gate], perm=[1, 0])[0]])[0]
        u = b.node("MatMul", [h, b.node("Transpose", [up], perm=[1, 0])[0]])[0]
        act = b.node("Mul", [b.node("Mul", [g, b.node("Sigmoid", [g])[0]])[0], u])[0]
        y = b.node("MatMul", [act, b.node("Transpose", [down], perm=[1, 0])[0]])[0]
        wy = b.node("Mul", [y, b.node("Unsqueeze", [b.node("Gather", [w_flat, pos], axis=0)[0], b.i64([1])])[0]])[0]
        if low:
            wy = b.node("Cast", [wy], to=b.onnx_type("f32"))[0]
        acc = b.node("ScatterND", [acc, b.node("Unsqueeze", [tok, b.i64([1])])[0], wy], reduction="add")[0]
    if low:
        acc = b.node("Cast", [acc], to=b.onnx_type(L.t_in[0].dtype))[0]
    L.emit("Reshape", [acc, b.node("Shape", [x[0]])[0]])


def _lower(L):
    impl = L.a.get("impl", "gather")
    if impl not in IMPLS:
        raise ValueError(f"sparse_moe impl must be one of {IMPLS}, got {impl!r}")
    (_lower_ort if impl == "moe" else _lower_gather)(L)


LOWERINGS = {"sparse_moe": _lower}
