"""Sparse mixture of experts: each token runs only the ``k`` experts its router picks.

``sparse_moe(x, logits, gate_0, up_0, down_0, ..., gate_{E-1}, up_{E-1}, down_{E-1})`` is what the
standard library's dense ``moe`` block computes (spec/stdlib/nn.tsr, with SwiGLU experts): for each
token, the top ``k`` of the ``E`` router logits, their softmax (Mixtral's softmax over all logits,
top-k, renormalised, which is the same), and the gate-weighted sum of those experts'
``down(silu(gate(x)) * up(x))``. The rewrite pass compiler/passes/sparse_moe.py makes it from the
dense block; the expert weights stay the block's own parameters (``experts.e.ffn.gate.weight`` ...),
each ``[out, in]`` as ``linear`` stores it.

Two lowerings (attribute ``impl``; the pass picks ``gather``, the faster one on this machine's CPU:
docs/benchmarks/log.md, "Sparse experts"):

- ``gather``: standard ops only: TopK and Softmax over the logits, then per expert the positions
  routed to it (NonZero), a Gather of those tokens, the SwiGLU on them alone, and a ScatterND add of
  the gate-weighted result into the output;
- ``moe``: onnxruntime's ``com.microsoft.MoE`` (CPU and CUDA), fc1 the experts' gate and up rows
  interleaved (``swiglu_fusion=1``, ``activation_alpha=1``, ``activation_beta=0``: silu(g)·u),
  ``normalize_routing_weights=1``; the stacked weights are Concat/Reshape of the parameters, which
  onnxruntime folds once when the session is created. Its top-k breaks exact ties between logits
  towards the higher expert index (TopK and the reference: the lower one).

Options (attributes; each lowering says which it takes and refuses the rest):

- ``bias`` (default False): each expert's three linears have biases, inputs ``gate_b [f]``, ``up_b
  [f]``, ``down_b [d]`` after its weights (six inputs per expert: gate, up, down, gate_b, up_b,
  down_b). gpt-oss's experts have them. A router bias is no option of this op: the router logits
  are an input, computed by a ``linear`` with or without one.
- ``act`` (default ``"swiglu"``: ``silu(g) * u``): ``"clamped_swiglu"`` is gpt-oss's
  ``(clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``
  (transformers' GptOssExperts._apply_gate), attributes ``alpha`` and ``limit`` (> 0).
- ``normalize`` (default True): the softmax over the chosen k logits, which is both Mixtral's
  "softmax over all, top k, renormalised" and gpt-oss's "top k, then softmax over them" (equal
  but for ties); False: the softmax over all E at the chosen k (Qwen-MoE's norm_topk_prob=false).

Both lowerings take every option: com.microsoft.MoE's SwiGLU is ``G * sigmoid(alpha * G) * (L +
beta)`` with ``G = min(g, limit)``, ``L = clip(l, -limit, limit)`` (its schema in onnxruntime 1.31),
so ``clamped_swiglu`` is ``activation_alpha = alpha``, ``activation_beta = 1``, ``swiglu_limit =
limit``, and the biases are its fc1 (interleaved like the weights) and fc2 biases.

The cost counts the work that runs: ``k`` experts per token, not ``E``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, custom, op

IMPLS = ("gather", "moe")
ACTS = ("swiglu", "clamped_swiglu")


def per_expert(attrs) -> int:
    """Inputs per expert: gate, up, down weights, and with ``bias`` their three biases."""
    return 6 if attrs.get("bias") else 3


def expert_inputs(inputs: list, attrs) -> list[list]:
    """The node's inputs after x and logits, one list per expert (gate, up, down[, gate_b, up_b, down_b])."""
    n = per_expert(attrs)
    rest = list(inputs[2:])
    return [rest[n * i: n * i + n] for i in range(len(rest) // n)]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)) without overflowing exp for large |z| (gates far below zero)."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1 / (1 + e), e / (1 + e)).astype(z.dtype, copy=False)


def activation(g: np.ndarray, u: np.ndarray, attrs) -> np.ndarray:
    """The experts' gated activation of gate and up projections ``g``, ``u`` (numpy, any float dtype)."""
    if attrs.get("act", "swiglu") == "clamped_swiglu":
        alpha, limit = attrs["alpha"], attrs["limit"]
        g = np.minimum(g, np.asarray(limit, g.dtype))
        u = np.clip(u, np.asarray(-limit, u.dtype), np.asarray(limit, u.dtype))
        return (u + 1) * (g * _sigmoid(g * np.asarray(alpha, g.dtype)))
    return (g * _sigmoid(g)) * u


def route(logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(experts [n, k], weights [n, k]) of flattened logits [n, E]: the k largest (ties to the lower
    index, as topk_gates), softmax over them (normalize False: the softmax over all E, at those k)."""
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    if not normalize:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return idx, np.take_along_axis(p / p.sum(-1, keepdims=True), idx, axis=-1)
    top = np.take_along_axis(logits, idx, axis=-1)
    w = np.exp(top - top.max(-1, keepdims=True))
    return idx, w / w.sum(-1, keepdims=True)


def sparse_moe(x: np.ndarray, logits: np.ndarray, weights: list[np.ndarray], k: int,
               normalize: bool = True, attrs=None) -> np.ndarray:
    """The reference: each expert runs on the tokens routed to it only (``attrs``: bias, act, alpha, limit)."""
    attrs = attrs or {}
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    idx, w = route(logits.reshape(xf.shape[0], -1), k, normalize)
    out = np.zeros_like(xf)
    for e, ws in enumerate(expert_inputs([x, logits, *weights], attrs)):
        gate, up, down = ws[:3]
        gb, ub, db = ws[3:] if len(ws) == 6 else (0, 0, 0)
        rows, slot = np.nonzero(idx == e)
        if not len(rows):
            continue
        h = xf[rows]
        y = activation(h @ gate.T + gb, h @ up.T + ub, attrs) @ down.T + db
        out[rows] += (w[rows, slot][:, None] * y).astype(out.dtype)
    return out.reshape(x.shape)


# ------------------------------------------------------------------ cost
def _tokens(c):
    return c.numel(c.type(0).shape[:-1])


def _macs(c):
    """gate, up and down of the k experts each token runs: 3·d·f multiply-adds per (token, expert)."""
    d, f = c.dim(c.type(0).shape[-1]), c.dim(c.type(2).shape[0])
    return _tokens(c) * int(c.attrs["k"]) * d * f * 3


def _flops(c):
    n, k, e = _tokens(c), int(c.attrs["k"]), int(c.attrs["experts"])
    d, f = c.dim(c.type(0).shape[-1]), c.dim(c.type(2).shape[0])
    logits = n * e
    # biases: g, u (f each) and the output (d) of each active expert; the clamps: min, clip, +1, alpha·g
    extra = (n * k * (2 * f + d) if c.attrs.get("bias") else 0) + \
        (n * k * f * 4 if c.attrs.get("act") == "clamped_swiglu" else 0)
    return {"matmul": c.macs * 2,
            "activation": n * k * f * 4,                      # silu of each active expert's gate
            "elementwise": n * k * f + n * k * d * 2 + extra,  # silu(g)·u, and weigh and sum the outputs
            "routing": logits * k + (logits * 5 if c.attrs.get("normalize") is False  # as topk_gates
                                      else logits * Fraction(5 * k, e))}


def _ref(x, a, ev):
    return sparse_moe(x[0], x[1], list(x[2:]), a["k"], a.get("normalize", True), a)


@op("sparse_moe", reference=_ref, cost=custom(_flops, macs=_macs),
    saved=(0, 1), traits=("matmul_class",))
def _sparse_moe(t, a):
    """x [..., d], router logits [..., E], then gate [f, d], up [f, d], down [d, f] (and with
    attrs["bias"] gate_b [f], up_b [f], down_b [d]) of each of the E = attrs["experts"] experts;
    attrs["k"] of them run per token (attrs["act"]: SwiGLU or gpt-oss's clamped SwiGLU);
    attrs["normalize"] False: their gates are the softmax over all E logits, not renormalised over the k."""
    x, logits = t[0], t[1]
    common.need_float(x, "sparse_moe")
    e, k = a.get("experts"), a.get("k")
    if not isinstance(e, int) or not isinstance(k, int) or not 1 <= k <= e:
        raise ShapeError(f"sparse_moe needs 1 <= k <= experts, got k={k}, experts={e}")
    if a.get("impl", "gather") not in IMPLS:
        raise ShapeError(f"sparse_moe impl must be one of {', '.join(IMPLS)}, got {a.get('impl')!r}")
    act = a.get("act", "swiglu")
    if act not in ACTS:
        raise ShapeError(f"sparse_moe act must be one of {', '.join(ACTS)}, got {act!r}")
    if act == "clamped_swiglu":
        for key in ("alpha", "limit"):
            v = a.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ShapeError(f"sparse_moe clamped_swiglu needs a finite {key} > 0, got {v!r}")
    elif "alpha" in a or "limit" in a:
        raise ShapeError("sparse_moe alpha and limit belong to act='clamped_swiglu'")
    n = per_expert(a)
    if len(t) != 2 + n * e:
        raise ShapeError(f"sparse_moe takes x, logits and {n} {'tensors' if n == 6 else 'weights'} per expert "
                         f"({2 + n * e} inputs), got {len(t)}")
    if logits.rank != x.rank or not dims.shapes_equal(logits.shape[:-1], x.shape[:-1]) \
            or not dims.equal(logits.shape[-1], e):
        raise ShapeError(f"sparse_moe logits must be {dims.fmt_shape(x.shape[:-1] + (e,))}, "
                         f"got {dims.fmt_shape(logits.shape)}")
    d = x.shape[-1]
    f = t[2].shape[0] if t[2].rank == 2 else None
    for i, ws in enumerate(expert_inputs(t, a)):
        want = [(f, d), (f, d), (d, f), (f,), (f,), (d,)][:n]
        for name, w, shape in zip(("gate", "up", "down", "gate bias", "up bias", "down bias"), ws, want):
            if f is None or w.rank != len(shape) or not dims.shapes_equal(w.shape, shape):
                raise ShapeError(f"sparse_moe expert {i} {name}{'' if 'bias' in name else ' weight'} must be {dims.fmt_shape(shape) if f is not None else '[f, d]'}, "
                                 f"got {dims.fmt_shape(w.shape)}")
            common.same_dtype(x, w, "sparse_moe")
    if not dims.is_static(d) or not dims.is_static(f):
        raise ShapeError("sparse_moe needs a fixed width and expert width")
    return [x]
