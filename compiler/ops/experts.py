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

The cost counts the work that runs: ``k`` experts per token, not ``E``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ops import common
from tessera.compiler.ops.registry import ShapeError, custom, op

IMPLS = ("gather", "moe")


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
               normalize: bool = True) -> np.ndarray:
    """The reference: each expert runs on the tokens routed to it only."""
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    idx, w = route(logits.reshape(xf.shape[0], -1), k, normalize)
    out = np.zeros_like(xf)
    for e in range(len(weights) // 3):
        gate, up, down = weights[3 * e: 3 * e + 3]
        rows, slot = np.nonzero(idx == e)
        if not len(rows):
            continue
        h = xf[rows]
        g = h @ gate.T
        y = ((g / (1 + np.exp(-g))) * (h @ up.T)) @ down.T
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
    return {"matmul": c.macs * 2,
            "activation": n * k * f * 4,                      # silu of each active expert's gate
            "elementwise": n * k * f + n * k * d * 2,         # silu(g)·u, and weigh and sum the outputs
            "routing": logits * k + (logits * 5 if c.attrs.get("normalize") is False  # as topk_gates
                                      else logits * Fraction(5 * k, e))}


def _ref(x, a, ev):
    return sparse_moe(x[0], x[1], list(x[2:]), a["k"], a.get("normalize", True))


@op("sparse_moe", reference=_ref, cost=custom(_flops, macs=_macs),
    saved=(0, 1), traits=("matmul_class",))
def _sparse_moe(t, a):
    """x [..., d], router logits [..., E], then gate [f, d], up [f, d], down [d, f] of each of the
    E = attrs["experts"] experts; attrs["k"] of them run per token (SwiGLU experts); attrs["normalize"]
    False: their gates are the softmax over all E logits, not renormalised over the k."""
    x, logits = t[0], t[1]
    common.need_float(x, "sparse_moe")
    e, k = a.get("experts"), a.get("k")
    if not isinstance(e, int) or not isinstance(k, int) or not 1 <= k <= e:
        raise ShapeError(f"sparse_moe needs 1 <= k <= experts, got k={k}, experts={e}")
    if a.get("impl", "gather") not in IMPLS:
        raise ShapeError(f"sparse_moe impl must be one of {', '.join(IMPLS)}, got {a.get('impl')!r}")
    if len(t) != 2 + 3 * e:
        raise ShapeError(f"sparse_moe takes x, logits and 3 weights per expert ({2 + 3 * e} inputs), got {len(t)}")
    if logits.rank != x.rank or not dims.shapes_equal(logits.shape[:-1], x.shape[:-1]) \
            or not dims.equal(logits.shape[-1], e):
        raise ShapeError(f"sparse_moe logits must be {dims.fmt_shape(x.shape[:-1] + (e,))}, "
                         f"got {dims.fmt_shape(logits.shape)}")
    d = x.shape[-1]
    f = t[2].shape[0] if t[2].rank == 2 else None
    for i in range(e):
        gate, up, down = t[2 + 3 * i: 5 + 3 * i]
        want = [(f, d), (f, d), (d, f)]
        for name, w, shape in zip(("gate", "up", "down"), (gate, up, down), want):
            if f is None or w.rank != 2 or not dims.shapes_equal(w.shape, shape):
                raise ShapeError(f"sparse_moe expert {i} {name} weight must be {dims.fmt_shape(shape) if f is not None else '[f, d]'}, "
                                 f"got {dims.fmt_shape(w.shape)}")
            common.same_dtype(x, w, "sparse_moe")
    if not dims.is_static(d) or not dims.is_static(f):
        raise ShapeError("sparse_moe needs a fixed width and expert width")
    return [x]
