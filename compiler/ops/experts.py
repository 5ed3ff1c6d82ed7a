"""Sparse mixture of experts: each token runs only the ``k`` experts its router picks.

``sparse_moe(x, logits[, correction_bias], gate_0, up_0, down_0, ..., gate_{E-1}, up_{E-1}, down_{E-1})``,
with its default routing, is what the
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

Routing options (DeepSeek-V3's DeepseekV3TopkRouter and Llama 4's Llama4Router/Llama4TextMoe in
transformers, followed step by step):

- ``scoring`` (default ``"softmax"``): ``"sigmoid"``: each expert's score is sigmoid(logit), on its own.
- ``correction_bias`` (default False): one more input after the logits, ``[E]``, added to the scores
  for choosing only; the gates are the scores without it (DeepSeek's ``e_score_correction_bias``).
- ``groups``, ``top_groups`` (absent: no grouping): the E experts in ``groups`` equal groups of
  consecutive experts, each group scored by the sum of its two best choosing scores; only the experts
  of the best ``top_groups`` groups may be chosen (DeepSeek's n_group, topk_group).
- ``normalize`` (default True): the chosen gates renormalised to sum to 1 (softmax scores: the softmax
  over the chosen k logits, which is both Mixtral's "softmax over all, top k, renormalised" and
  gpt-oss's "top k, then softmax over them", equal but for ties; sigmoid scores: divided by their sum
  + 1e-20, as DeepSeek); False: the scores as they are (softmax: over all E, at the chosen k, as
  Qwen-MoE's norm_topk_prob=false).
- ``scale`` (absent: 1): the gates times it, after normalising (DeepSeek's routed_scaling_factor).
- ``gates_on`` (default ``"output"``): ``"input"``: each chosen expert runs on ``x * gate`` and its
  output is summed unweighted (Llama 4: sigmoid of the chosen logit times the expert's input).

What is chosen: the top ``k`` of the logits themselves while there is no correction bias and no
grouping (the order of the scores, which both scorings keep, without the ties a saturated sigmoid
makes: Llama 4 chooses on logits); otherwise of the scores plus the correction bias, as DeepSeek.
Ties go to the lower expert index (ONNX TopK's rule).

Both lowerings take the expert options: com.microsoft.MoE's SwiGLU is ``G * sigmoid(alpha * G) * (L +
beta)`` with ``G = min(g, limit)``, ``L = clip(l, -limit, limit)`` (its schema in onnxruntime 1.31),
so ``clamped_swiglu`` is ``activation_alpha = alpha``, ``activation_beta = 1``, ``swiglu_limit =
limit``, and the biases are its fc1 (interleaved like the weights) and fc2 biases. Its routing is a
softmax over ``router_probs``, top k, renormalised or not, and nothing else; ``scale`` is a product
after it (the output is linear in the gates); sigmoid scores, a correction bias, groups and gates on
the input it cannot express: ``moe_refusal`` says why, and the sparse pass gives such nodes the gather
lowering with that reason in its note (--explain).

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
SCORINGS = ("softmax", "sigmoid")
GATES_ON = ("output", "input")
NORM_EPS = 1e-20  # DeepSeek-V3's renormalisation of sigmoid gates: sum + 1e-20


def per_expert(attrs) -> int:
    """Inputs per expert: gate, up, down weights, and with ``bias`` their three biases."""
    return 6 if attrs.get("bias") else 3


def head(attrs) -> int:
    """Inputs before the experts': x, logits, and with ``correction_bias`` the bias [E]."""
    return 3 if attrs.get("correction_bias") else 2


def expert_inputs(inputs: list, attrs) -> list[list]:
    """The node's inputs after the routing ones, one list per expert (gate, up, down[, gate_b, up_b, down_b])."""
    n = per_expert(attrs)
    rest = list(inputs[head(attrs):])
    return [rest[n * i: n * i + n] for i in range(len(rest) // n)]


def plain_choice(attrs) -> bool:
    """Whether the experts are chosen on the logits themselves (no correction bias, no groups)."""
    return not attrs.get("correction_bias") and not attrs.get("groups")


def describe_routing(attrs) -> str:
    """The routing options a node has beyond the default softmax top k, in words ("" for none), for --explain."""
    parts = []
    if attrs.get("scoring", "softmax") != "softmax":
        parts.append(f"{attrs['scoring']} scores")
    if attrs.get("correction_bias"):
        parts.append("correction bias")
    if attrs.get("groups"):
        parts.append(f"best {attrs['top_groups']} of {attrs['groups']} groups")
    if attrs.get("normalize") is False:
        parts.append("not renormalised")
    if "scale" in attrs:
        parts.append(f"scaled by {attrs['scale']:g}")
    if attrs.get("gates_on", "output") != "output":
        parts.append(f"gates on the {attrs['gates_on']}")
    return ", ".join(parts)


def moe_refusal(attrs) -> str | None:
    """Why com.microsoft.MoE cannot compute this node (None: it can). Its routing is softmax(router_probs),
    top k, renormalised or not: it has no other scoring, no separate choosing scores, no groups, and it
    weighs the experts' outputs."""
    if attrs.get("scoring", "softmax") != "softmax":
        return f"{attrs['scoring']} scores (com.microsoft.MoE's routing is a softmax)"
    if attrs.get("correction_bias"):
        return "a correction bias for choosing only (com.microsoft.MoE chooses on the gates' own logits)"
    if attrs.get("groups"):
        return "group-limited choice (com.microsoft.MoE has no groups)"
    if attrs.get("gates_on", "output") != "output":
        return "gates on the experts' input (com.microsoft.MoE weighs their outputs)"
    return None


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


def _top(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, largest first, ties to the lower index (ONNX TopK)."""
    return np.argsort(-v, axis=-1, kind="stable")[..., :k]


def route(logits: np.ndarray, k: int, normalize: bool = True, attrs=None,
          bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(experts [n, k], gates [n, k]) of flattened logits [n, E] under ``attrs``' routing options (the
    module docstring); ``bias`` the correction bias [E] where ``attrs["correction_bias"]``."""
    attrs = attrs or {}
    sigmoid = attrs.get("scoring", "softmax") == "sigmoid"
    if sigmoid:
        scores = _sigmoid(logits)
    else:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        scores = p / p.sum(-1, keepdims=True)
    if plain_choice(attrs):
        idx = _top(logits, k)
    else:
        choice = scores + bias if bias is not None else scores
        groups = attrs.get("groups")
        if groups:  # DeepSeek: each group's two best summed; only the best top_groups groups eligible
            n, e = choice.shape
            grouped = choice.reshape(n, groups, e // groups)
            best2 = np.take_along_axis(grouped, _top(grouped, 2), axis=-1).sum(-1)
            keep = np.zeros((n, groups), bool)
            np.put_along_axis(keep, _top(best2, attrs["top_groups"]), True, axis=-1)
            choice = np.where(np.repeat(keep, e // groups, axis=-1), choice, -np.inf)
        idx = _top(choice, k)
    gates = np.take_along_axis(scores, idx, axis=-1)
    if normalize and not sigmoid and plain_choice(attrs):  # the softmax over the chosen logits
        top = np.take_along_axis(logits, idx, axis=-1)
        w = np.exp(top - top.max(-1, keepdims=True))
        gates = w / w.sum(-1, keepdims=True)
    elif normalize:
        gates = gates / (gates.sum(-1, keepdims=True) + (np.asarray(NORM_EPS, gates.dtype) if sigmoid else 0))
    if "scale" in attrs:
        gates = gates * np.asarray(attrs["scale"], gates.dtype)
    return idx, gates.astype(logits.dtype, copy=False)


def sparse_moe(x: np.ndarray, logits: np.ndarray, weights: list[np.ndarray], k: int,
               normalize: bool = True, attrs=None, bias: np.ndarray | None = None) -> np.ndarray:
    """The reference: each expert runs on the tokens routed to it only (``attrs``: the expert options bias,
    act, alpha, limit and the routing options; ``bias``: the correction bias)."""
    attrs = attrs or {}
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    idx, w = route(logits.reshape(xf.shape[0], -1), k, normalize, attrs, bias)
    on_input = attrs.get("gates_on", "output") == "input"
    out = np.zeros_like(xf)
    n = per_expert(attrs)
    for e in range(len(weights) // n):
        ws = weights[n * e: n * e + n]
        gate, up, down = ws[:3]
        gb, ub, db = ws[3:] if len(ws) == 6 else (0, 0, 0)
        rows, slot = np.nonzero(idx == e)
        if not len(rows):
            continue
        h = xf[rows]
        if on_input:  # Llama 4: the expert runs on the gated input, its output summed as it is
            h = (h * w[rows, slot][:, None]).astype(h.dtype)
        y = activation(h @ gate.T + gb, h @ up.T + ub, attrs) @ down.T + db
        out[rows] += (y if on_input else w[rows, slot][:, None] * y).astype(out.dtype)
    return out.reshape(x.shape)


# ------------------------------------------------------------------ cost
def _tokens(c):
    return c.numel(c.type(0).shape[:-1])


def _macs(c):
    """gate, up and down of the k experts each token runs: 3·d·f multiply-adds per (token, expert)."""
    d, f = c.dim(c.type(0).shape[-1]), c.dim(c.type(head(c.attrs)).shape[0])
    return _tokens(c) * int(c.attrs["k"]) * d * f * 3


def _routing_flops(c, n: int, k: int, e: int):
    """The router's choice and gates: as topk_gates for the softmax on logits; sigmoid scores 4 per logit,
    the correction bias 1, groups their top-2 sums (3 per expert), each extra choice k per logit,
    renormalising and scaling 2k per token."""
    a = c.attrs
    logits = n * e
    if a.get("scoring", "softmax") == "softmax" and plain_choice(a):
        return logits * k + (logits * 5 if a.get("normalize") is False else logits * Fraction(5 * k, e))
    score = logits * (4 if a.get("scoring") == "sigmoid" else 5)
    extra = (logits if a.get("correction_bias") else 0) + (logits * 3 + n * int(a["groups"]) * int(a["top_groups"])
                                                           if a.get("groups") else 0)
    return score + extra + logits * k + n * k * ((2 if a.get("normalize", True) else 0) + (1 if "scale" in a else 0))


def _flops(c):
    n, k, e = _tokens(c), int(c.attrs["k"]), int(c.attrs["experts"])
    d, f = c.dim(c.type(0).shape[-1]), c.dim(c.type(head(c.attrs)).shape[0])
    # biases: g, u (f each) and the output (d) of each active expert; the clamps: min, clip, +1, alpha·g
    extra = (n * k * (2 * f + d) if c.attrs.get("bias") else 0) + \
        (n * k * f * 4 if c.attrs.get("act") == "clamped_swiglu" else 0)
    return {"matmul": c.macs * 2,
            "activation": n * k * f * 4,                      # silu of each active expert's gate
            # silu(g)·u, weigh (the output, or the input with gates_on="input": d each) and sum the outputs
            "elementwise": n * k * f + n * k * d * 2 + extra,
            "routing": _routing_flops(c, n, k, e)}


def _ref(x, a, ev):
    h = head(a)
    return sparse_moe(x[0], x[1], list(x[h:]), a["k"], a.get("normalize", True), a, x[2] if h == 3 else None)


@op("sparse_moe", reference=_ref, cost=custom(_flops, macs=_macs),
    saved=(0, 1), traits=("matmul_class",))
def _sparse_moe(t, a):
    """x [..., d], router logits [..., E], with attrs["correction_bias"] the bias [E], then gate [f, d],
    up [f, d], down [d, f] (and with attrs["bias"] gate_b [f], up_b [f], down_b [d]) of each of the E =
    attrs["experts"] experts; attrs["k"] of them run per token (attrs["act"]: SwiGLU or gpt-oss's clamped
    SwiGLU); the routing options (scoring, groups, top_groups, normalize, scale, gates_on) as the module
    docstring says."""
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
    _check_routing(a, e, k)
    n, h = per_expert(a), head(a)
    if len(t) != h + n * e:
        raise ShapeError(f"sparse_moe takes x, logits{', the correction bias' if h == 3 else ''} and {n} "
                         f"{'tensors' if n == 6 else 'weights'} per expert ({h + n * e} inputs), got {len(t)}")
    if logits.rank != x.rank or not dims.shapes_equal(logits.shape[:-1], x.shape[:-1]) \
            or not dims.equal(logits.shape[-1], e):
        raise ShapeError(f"sparse_moe logits must be {dims.fmt_shape(x.shape[:-1] + (e,))}, "
                         f"got {dims.fmt_shape(logits.shape)}")
    if h == 3:
        if t[2].rank != 1 or not dims.equal(t[2].shape[0], e):
            raise ShapeError(f"sparse_moe correction bias must be [{e}], got {dims.fmt_shape(t[2].shape)}")
        common.same_dtype(logits, t[2], "sparse_moe")
    d = x.shape[-1]
    f = t[h].shape[0] if t[h].rank == 2 else None
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


def _check_routing(a, e: int, k: int) -> None:
    """The routing options' values (the builtin checks them first, with positions; this guards the op)."""
    if a.get("scoring", "softmax") not in SCORINGS:
        raise ShapeError(f"sparse_moe scoring must be one of {', '.join(SCORINGS)}, got {a.get('scoring')!r}")
    if a.get("gates_on", "output") not in GATES_ON:
        raise ShapeError(f"sparse_moe gates_on must be one of {', '.join(GATES_ON)}, got {a.get('gates_on')!r}")
    if "scale" in a:
        v = a["scale"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ShapeError(f"sparse_moe scale must be a finite number > 0, got {v!r}")
    g, tg = a.get("groups"), a.get("top_groups")
    if g is None and tg is None:
        return
    if not isinstance(g, int) or not isinstance(tg, int) or isinstance(g, bool) or isinstance(tg, bool):
        raise ShapeError(f"sparse_moe groups and top_groups go together, as ints, got {g!r} and {tg!r}")
    why = group_problem(e, k, g, tg)
    if why:
        raise ShapeError(f"sparse_moe {why}")


def group_problem(e: int, k: int, groups: int, top_groups: int) -> str | None:
    """Why ``groups``/``top_groups`` do not fit ``e`` experts choosing ``k`` (None: they do)."""
    if groups < 2:
        return f"groups must be at least 2 (1 is no grouping), got {groups}"
    if e % groups:
        return f"groups={groups} must divide the {e} experts"
    if e // groups < 2:
        return f"each group must hold at least 2 experts (a group is scored by its two best), got {e // groups}"
    if not 1 <= top_groups <= groups:
        return f"top_groups must be 1..groups={groups}, got {top_groups}"
    if top_groups * (e // groups) < k:
        return (f"top_groups={top_groups} groups of {e // groups} experts hold fewer than the {k} experts "
                f"each token chooses")
    return None
