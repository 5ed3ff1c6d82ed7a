"""What one device holds and sends when a model is split (Megatron-style tensor and pipeline
parallelism, data parallelism, expert parallelism).

Why these rules: they are what Megatron-LM and DeepSpeed do, so a user can size a
cluster from them. Parameters are read from the graph and placed by what uses them:

- inside a repeated layer: norms are replicated on every tensor-parallel rank,
  experts are spread over the expert-parallel ranks and then split T ways, every
  other parameter (attention projections, MLP, router, biases) is split T ways;
- outside the layers: the token embedding (and an untied output head) is split T
  ways by vocabulary rows; other parameters (position tables, the final norm) are
  replicated. What runs before the first layer sits on the first pipeline stage,
  the rest on the last; a weight used at both ends (GPT-2's tied embedding and
  head) is held by both when P > 1, as Megatron does;
- layers go to P consecutive stages, the first L mod P stages one layer more.

A split that does not divide a parameter evenly (a vocabulary of 50,257 rows over 8
ranks) is rounded up, as padded vocabularies are. Every figure is for the largest
device (the stage that holds the most) and is a polynomial in B (the micro-batch of
one data-parallel replica) and N.
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, field

from tessera.compiler.analysis import memory
from tessera.compiler.analysis.plan import ModelShape, Plan
from tessera.compiler.analysis.poly import Poly
from tessera.compiler.analysis.structure import Structure, layer_key, node_layer
from tessera.compiler.ir.graph import Graph

_NORM_OPS = {"layernorm", "rmsnorm"}


def stages(layers: list[str], pp: int) -> list[list[str]]:
    """Consecutive layers on pp stages; the first len % pp stages get one more."""
    q, r = divmod(len(layers), pp)
    out, i = [], 0
    for s in range(pp):
        n = q + (s < r)
        out.append(layers[i:i + n])
        i += n
    return out


@dataclass
class Split:
    stage_of: dict[str, int]            # layer key -> stage
    params: list[int]                   # parameters held by one device of each stage
    kv_cache: list[Poly]                # KV cache bytes of one device of each stage
    layers: list[int]                   # layers of each stage
    moe_layers: list[int] = field(default_factory=list)


def _norm_params(graph: Graph, st: Structure) -> set[str]:
    out = set(st.norm_params)
    for n in graph.nodes.values():
        if n.op in _NORM_OPS:
            out.update(v for v in n.inputs[1:] if v in graph.params)
    return out


def split(graph: Graph, st: Structure, shape: ModelShape, plan: Plan, act_bytes: int,
          kv_bytes: int | None = None) -> Split:
    """The plan's split of the weights and the KV cache (``kv_bytes`` per element, default ``act_bytes``)."""
    groups = stages(shape.layers, plan.pp)
    stage_of = {k: s for s, g in enumerate(groups) for k in g}
    last = plan.pp - 1
    norms = _norm_params(graph, st)
    experts = {p for e in st.experts for ps in e.params for p in ps}
    # where each parameter outside the layers is used: before the first layer, after, or both
    order = list(graph.nodes.values())
    first_layered = next((i for i, n in enumerate(order) if node_layer(n)), len(order))
    users: dict[str, set[str]] = {}
    split_by_vocab: set[str] = set()
    for i, n in enumerate(order):
        for v in n.inputs:
            if v in graph.params and layer_key(v) is None:
                users.setdefault(v, set()).add("first" if i < first_layered else "last")
        if n.op == "embedding" and n.inputs[1] in graph.params:
            ids = graph.values[n.inputs[0]].producer
            if not (ids and graph.nodes[ids].op == "arange"):
                split_by_vocab.add(n.inputs[1])
        if n.name in st.head:
            split_by_vocab.update(v for v in n.inputs if v in graph.params)
    params = [0] * plan.pp
    for path, p in graph.params.items():
        numel = math.prod(p.shape)
        key = layer_key(path)
        if key is not None:
            div = 1 if path in norms else plan.tp * plan.ep if path in experts else plan.tp
            params[stage_of[key]] += -(-numel // div)
            continue
        div = plan.tp if path in split_by_vocab else 1
        where = users.get(path, {"last"})
        held = {0 if w == "first" else last for w in where}
        for s in held:
            params[s] += -(-numel // div)
    kv = [Poly() for _ in range(plan.pp)]
    seen: set[str] = set()
    for a in st.attention:
        if not (a.causal or a.cross):
            continue
        s = stage_of.get(node_layer(graph.nodes[a.score]) or "", 0)
        for v in (a.k, a.v):
            if v is not None and v not in seen:
                seen.add(v)
                kv[s] = kv[s] + memory.value_bytes(graph, v, kv_bytes or act_bytes) / plan.tp
    moe_keys = {node_layer(graph.nodes[e.gate]) for e in st.experts}
    return Split(stage_of, params, kv, [len(g) for g in groups],
                 [sum(1 for k in g if k in moe_keys) for g in groups])


def comm_bytes(sp: Split, shape: ModelShape, plan: Plan, b: Poly, s: Poly, act_bytes: int,
               params_per_device: int) -> dict[str, Poly]:
    """Bytes one device sends in one step (one forward pass; with training, forward and backward
    and the gradient synchronisation), for the stage with the most layers:

    - tensor parallel: two all-reduces of the layer's output (B·N·h) per layer forward, two more
      backward; a ring all-reduce sends 2(T−1)/T of the message from each device (with sequence
      parallelism it is a reduce-scatter plus an all-gather: the same bytes);
    - pipeline: the activations B·N·h to the next stage (and their gradient back, training);
    - data parallel (training only): the gradients, ring all-reduce 2(D−1)/D of them; ZeRO-3
      also all-gathers the weights for forward and backward, 3(D−1)/D in all (ZeRO paper, 1.5x);
    - expert parallel: each token's h values to its top-k experts and back, the (E−1)/E share of
      them that leaves the device, per MoE layer (twice more backward)."""
    e = act_bytes
    passes = 2 if plan.train else 1
    layers = max(sp.layers)
    msg = b * s * (shape.hidden * e)
    out: dict[str, Poly] = {}
    t = plan.tp
    out["tensor_parallel"] = msg * _ratio(2 * 2 * passes * layers * (t - 1), t) if t > 1 else Poly()
    out["pipeline"] = msg * passes if plan.pp > 1 else Poly()
    d = plan.dp
    if plan.train and d > 1:
        grads = params_per_device * e
        factor = 3 if plan.zero == 3 else 2
        out["data_parallel"] = Poly.const(_ratio(factor * (d - 1) * grads, d))
    else:
        out["data_parallel"] = Poly()
    ep = plan.ep
    if ep > 1:
        moe = max(sp.moe_layers)
        out["expert_parallel"] = msg * _ratio(2 * passes * moe * shape.top * (ep - 1), ep)
    else:
        out["expert_parallel"] = Poly()
    out["total"] = Poly.sum(out.values())
    return out


def _ratio(num: int, den: int) -> int | Fraction:
    f = Fraction(num, den)
    return int(f) if f.denominator == 1 else f
