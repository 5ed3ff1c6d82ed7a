"""ONNX lowerings of ``sparse_moe`` (compiler/ops/experts.py), one per ``impl``: onnxruntime's
com.microsoft.MoE, or a gather/scatter per expert in standard ops. The gather form takes every option
of the op; com.microsoft.MoE takes the expert options (biases, the clamped SwiGLU), normalize and scale,
and refuses the routing it cannot express (``moe_refusal``: sigmoid scores, a correction bias, groups,
gates on the input), which the sparse pass never gives it; an option either does not know is refused
here."""

from __future__ import annotations

import numpy as np

from tessera.compiler.backends.onnx.lowerings.common import np_float
from tessera.compiler.ops.experts import ACTS, GATES_ON, IMPLS, NORM_EPS, SCORINGS, expert_inputs, head, \
    moe_refusal, plain_choice

KNOWN = {"k", "experts", "impl", "normalize", "bias", "act", "alpha", "limit",
         "scoring", "correction_bias", "groups", "top_groups", "scale", "gates_on"}


def _interleave(b, gate, up, shape):
    """gate_0, up_0, gate_1, up_1, ... along the first axis of two [f, ...] tensors, reshaped to ``shape``."""
    ax1 = b.i64([1])
    pair = b.node("Concat", [b.node("Unsqueeze", [gate, ax1])[0], b.node("Unsqueeze", [up, ax1])[0]], axis=1)[0]
    return b.node("Reshape", [pair, b.i64(shape)])[0]


def _stack(b, parts):
    ax0 = b.i64([0])
    parts = [b.node("Unsqueeze", [p, ax0])[0] for p in parts]
    return b.node("Concat", parts, axis=0)[0] if len(parts) > 1 else parts[0]


def _lower_ort(L):
    """com.microsoft.MoE on [tokens, d] and [tokens, E]; weights stacked [E, 2f, d] (gate and up rows
    interleaved, swiglu_fusion=1) and [E, d, f], biases [E, 2f] (interleaved alike) and [E, d]. Its SwiGLU
    is min(g, limit)·sigmoid(alpha·min(g, limit))·(clip(l, ±limit) + beta) (no clamp without
    swiglu_limit): silu(g)·u is alpha 1, beta 0, no limit; the clamped SwiGLU alpha, beta 1, limit."""
    b, x, k, e = L.b, L.x, L.a["k"], L.a["experts"]
    d, f = int(L.t_in[0].shape[-1]), int(L.t_in[head(L.a)].shape[0])
    flat = b.node("Reshape", [x[0], b.i64([-1, d])])[0]
    logits = b.node("Reshape", [x[1], b.i64([-1, e])])[0]
    experts = expert_inputs(x, L.a)
    w1 = _stack(b, [_interleave(b, ws[0], ws[1], [2 * f, d]) for ws in experts])
    w2 = _stack(b, [ws[2] for ws in experts])
    b1 = b2 = ""
    if L.a.get("bias"):
        b1 = _stack(b, [_interleave(b, ws[3], ws[4], [2 * f]) for ws in experts])
        b2 = _stack(b, [ws[5] for ws in experts])
    act = {"activation_alpha": 1.0, "activation_beta": 0.0}
    if L.a.get("act") == "clamped_swiglu":
        act = {"activation_alpha": float(L.a["alpha"]), "activation_beta": 1.0, "swiglu_limit": float(L.a["limit"])}
    y = b.node("MoE", [flat, logits, w1, b1, w2, b2], domain="com.microsoft", k=k, activation_type="swiglu",
               swiglu_fusion=1, normalize_routing_weights=int(L.a.get("normalize", True)), **act)[0]
    if "scale" in L.a:  # the output is linear in the gates: scaling them is scaling it
        y = b.node("Mul", [y, b.const(np.array(L.a["scale"], dtype=np_float(L.t_in[0].dtype)), "scale")])[0]
    L.emit("Reshape", [y, b.node("Shape", [x[0]])[0]])


def _route(L, logits: str, corr: str | None) -> tuple[str, str]:
    """(gates, experts), each [tokens, k], from the logits [tokens, E] (and the correction bias [E]) as
    ops/experts.py's ``route``: TopK on the logits, or on the scores plus the bias with the groups masked."""
    b, a, k, e = L.b, L.a, L.a["k"], L.a["experts"]
    sigmoid = a.get("scoring", "softmax") == "sigmoid"
    if not sigmoid and plain_choice(a):
        if a.get("normalize") is False:  # the softmax over all E, at the top k (the same experts)
            return tuple(b.node("TopK", [b.node("Softmax", [logits], axis=-1)[0], b.i64([k])], 2, axis=-1,
                                largest=1, sorted=1))
        vals, idx = b.node("TopK", [logits, b.i64([k])], 2, axis=-1, largest=1, sorted=1)
        return b.node("Softmax", [vals], axis=-1)[0], idx
    dt = np_float("f32" if L.t_in[1].dtype == "bf16" else L.t_in[1].dtype)
    scores = b.node("Sigmoid" if sigmoid else "Softmax", [logits], **({} if sigmoid else {"axis": -1}))[0]
    if plain_choice(a):
        choice = logits
    else:
        choice = b.node("Add", [scores, corr])[0] if corr else scores
    if a.get("groups"):  # each group's two best summed; the experts outside the best top_groups groups at -inf
        g = int(a["groups"])
        grouped = b.node("Reshape", [choice, b.i64([-1, g, e // g])])[0]
        best2 = b.node("TopK", [grouped, b.i64([2])], 2, axis=-1, largest=1, sorted=1)[0]
        group_scores = b.node("ReduceSum", [best2, b.i64([-1])], keepdims=0)[0]
        top_groups = b.node("TopK", [group_scores, b.i64([int(a["top_groups"])])], 2, axis=-1, largest=1,
                            sorted=1)[1]
        none = b.node("ConstantOfShape", [b.node("Shape", [group_scores])[0]],
                      value=b.tensor_value(np.zeros(1, np.bool_)))[0]
        every = b.node("ConstantOfShape", [b.node("Shape", [top_groups])[0]],
                       value=b.tensor_value(np.ones(1, np.bool_)))[0]
        keep = b.node("ScatterElements", [none, top_groups, every], axis=-1)[0]            # [tokens, groups]
        masked = b.node("Where", [b.node("Unsqueeze", [keep, b.i64([2])])[0], grouped,
                                  b.const(np.array(-np.inf, dt), "neg_inf")])[0]
        choice = b.node("Reshape", [masked, b.i64([-1, e])])[0]
    idx = b.node("TopK", [choice, b.i64([k])], 2, axis=-1, largest=1, sorted=1)[1]
    w = b.node("GatherElements", [scores, idx], axis=-1)[0]
    if a.get("normalize", True):
        total = b.node("ReduceSum", [w, b.i64([-1])], keepdims=1)[0]
        if sigmoid:
            total = b.node("Add", [total, b.const(np.array(NORM_EPS, dt), "norm_eps")])[0]
        w = b.node("Div", [w, total])[0]
    return w, idx


def _lower_gather(L):
    """TopK, then per expert: Gather its tokens, SwiGLU, ScatterND-add the weighted rows back."""
    b, x, k, e = L.b, L.x, L.a["k"], L.a["experts"]
    d = int(L.t_in[0].shape[-1])
    flat = b.node("Reshape", [x[0], b.i64([-1, d])])[0]
    logits = b.node("Reshape", [x[1], b.i64([-1, e])])[0]
    bf16 = L.t_in[1].dtype == "bf16"
    if bf16:  # TopK takes no bfloat16 at opset 21: the routing in fp32, the weights cast back
        logits = b.node("Cast", [logits], to=b.onnx_type("f32"))[0]
    corr = x[2] if head(L.a) == 3 else None
    if corr and bf16:
        corr = b.node("Cast", [corr], to=b.onnx_type("f32"))[0]
    w, idx = _route(L, logits, corr)
    if "scale" in L.a:
        dt = np_float("f32" if bf16 else L.t_in[1].dtype)
        w = b.node("Mul", [w, b.const(np.array(L.a["scale"], dt), "scale")])[0]
    if bf16:
        w = b.node("Cast", [w], to=b.onnx_type("bf16"))[0]
    w_flat = b.node("Reshape", [w, b.i64([-1])])[0]   # [tokens·k]
    idx_flat = b.node("Reshape", [idx, b.i64([-1])])[0]
    # the sum is kept in fp32 (onnxruntime's CPU ScatterND has no fp16 'add'; fp32 sums are better anyway)
    low = L.t_in[0].dtype != "f32"
    acc = b.node("ConstantOfShape", [b.node("Shape", [flat])[0]], value=b.tensor_value(np.zeros(1, np.float32)))[0]
    kk = b.i64(k)
    on_input = L.a.get("gates_on", "output") == "input"
    clamped = L.a.get("act") == "clamped_swiglu"
    if clamped:  # constants at the experts' precision
        np_dt = np_float(L.t_in[0].dtype)
        limit, alpha, neg_limit, one = (b.const(np.array(v, dtype=np_dt), "clamped_swiglu") for v in
                                        (L.a["limit"], L.a["alpha"], -L.a["limit"], 1.0))
    for i, ws in enumerate(expert_inputs(x, L.a)):
        gate, up, down = ws[:3]
        hit = b.node("Equal", [idx_flat, b.i64(i)])[0]
        pos = b.node("Reshape", [b.node("NonZero", [hit])[0], b.i64([-1])])[0]            # slots routed to i
        tok = b.node("Div", [pos, kk])[0]                                                   # their tokens
        h = b.node("Gather", [flat, tok], axis=0)[0]
        gate_w = b.node("Unsqueeze", [b.node("Gather", [w_flat, pos], axis=0)[0], b.i64([1])])[0]
        if on_input:  # Llama 4: the expert runs on its gated input
            h = b.node("Mul", [h, gate_w])[0]
        g = b.node("MatMul", [h, b.node("Transpose", [gate], perm=[1, 0])[0]])[0]
        u = b.node("MatMul", [h, b.node("Transpose", [up], perm=[1, 0])[0]])[0]
        if len(ws) == 6:
            g, u = b.node("Add", [g, ws[3]])[0], b.node("Add", [u, ws[4]])[0]
        if clamped:  # (clip(u, ±limit) + 1) · g'·sigmoid(alpha·g'), g' = min(g, limit)
            g = b.node("Min", [g, limit])[0]
            u = b.node("Add", [b.node("Clip", [u, neg_limit, limit])[0], one])[0]
            act = b.node("Mul", [b.node("Mul", [g, b.node("Sigmoid", [b.node("Mul", [g, alpha])[0]])[0]])[0], u])[0]
        else:
            act = b.node("Mul", [b.node("Mul", [g, b.node("Sigmoid", [g])[0]])[0], u])[0]
        y = b.node("MatMul", [act, b.node("Transpose", [down], perm=[1, 0])[0]])[0]
        if len(ws) == 6:
            y = b.node("Add", [y, ws[5]])[0]
        wy = y if on_input else b.node("Mul", [y, gate_w])[0]
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
    unknown = set(L.a) - KNOWN
    if unknown or L.a.get("act", "swiglu") not in ACTS or L.a.get("scoring", "softmax") not in SCORINGS \
            or L.a.get("gates_on", "output") not in GATES_ON:  # an option added to the op but not lowered here
        raise ValueError(f"sparse_moe's {impl} lowering does not implement "
                         f"{sorted(unknown) or [L.a.get(o) for o in ('act', 'scoring', 'gates_on')]!r}")
    why = moe_refusal(L.a) if impl == "moe" else None
    if why:  # never computed as something else: the sparse pass gives such a node the gather form
        raise ValueError(f"sparse_moe's moe lowering (com.microsoft.MoE) cannot express {why}; use impl='gather'")
    (_lower_ort if impl == "moe" else _lower_gather)(L)


LOWERINGS = {"sparse_moe": _lower}
