"""Memory a graph needs, computed from its shapes before anything runs.

Weights are the parameter table; the KV cache is the keys and values that
attention reads, found in the graph before any grouped-query repeat; peak
inference memory is a liveness sweep over the nodes in execution order; the
training figure adds gradients, Adam's two moments and the activations the
backward pass keeps. Fused attention is modelled by not materialising the
N x N values between the score and weighting matmuls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tessera.compiler import ops
from tessera.compiler.ir.graph import PRECISION_BYTES, Graph
from tessera.compiler.analysis.poly import Poly, numel
from tessera.compiler.analysis.structure import Structure

# Ops whose output is a view of their input (no new memory): ONNX Reshape, Identity, Expand.
ALIAS_OPS = ops.with_trait("alias")
INT_BYTES = {"i64": 8, "i32": 4, "bool": 1}
DTYPE_BYTES = PRECISION_BYTES


def saved_values(node, needs_grad) -> list[str]:
    """The values the backward pass of ``node`` keeps, from its op's ``saved`` facet: input
    positions and "out", or (products) a function of which operands need a gradient.
    A node whose op is not registered keeps nothing (the cost report lists it as uncounted)."""
    if not ops.is_registered(node.op):
        return []
    saved = ops.get(node.op).saved
    if callable(saved):
        return saved(node, needs_grad)
    return [node.outputs[0] if pos == "out" else node.inputs[pos] for pos in saved
            if pos == "out" or pos < len(node.inputs)]


def value_bytes(graph: Graph, value: str, act_bytes: int) -> Poly:
    t = graph.type_of(value)
    return _bytes(t.shape, INT_BYTES.get(t.dtype, act_bytes))


@lru_cache(maxsize=8192)
def _bytes(shape: tuple, nbytes: int) -> Poly:
    return numel(shape) * nbytes


class Sizer:
    """Bytes of each value at fixed bindings, cached per value (shapes recur in every layer)."""

    def __init__(self, graph: Graph, act_bytes: int, bindings: dict[str, int]):
        self.values, self.act_bytes, self.bindings = graph.values, act_bytes, dict(bindings)
        self._by_type: dict[tuple, int] = {}
        self._by_name: dict[str, int] = {}

    def __call__(self, value: str) -> int:
        n = self._by_name.get(value)
        if n is None:
            t = self.values[value].type
            key = (t.shape, t.dtype)
            n = self._by_type.get(key)
            if n is None:
                n = self._by_type[key] = int(_bytes(t.shape, INT_BYTES.get(t.dtype, self.act_bytes))
                                             .evaluate(self.bindings))
            self._by_name[value] = n
        return n


def param_total(graph: Graph) -> int:
    """Number of parameters (math.prod: this runs on every parameter of GPT-3-sized graphs)."""
    return sum(math.prod(p.shape) for p in graph.params.values())


def storage_roots(graph: Graph, views: set[str] = frozenset()) -> dict[str, str]:
    """value -> the value whose memory it shares: itself, unless produced by a view op
    (or by one of the nodes in `views`, treated as views)."""
    root: dict[str, str] = {}
    for n in graph.nodes.values():
        view = (ops.has_trait(n.op, "alias") or n.name in views) and n.inputs
        for o in n.outputs:
            root[o] = root.get(n.inputs[0], n.inputs[0]) if view else o
    return root


def weights_bytes(graph: Graph, weight_bytes: int) -> int:
    return param_total(graph) * weight_bytes


def constants_bytes(graph: Graph) -> int:
    return int(sum(a.nbytes for a in graph.consts.values()))


@dataclass
class KVCache:
    bytes: Poly          # K and V of every cached attention at the graph's symbols
    attentions: int      # how many attentions keep a cache


def kv_cache(graph: Graph, st: Structure, act_bytes: int) -> KVCache:
    """K and V that decoding keeps: causal self-attention, and cross-attention's keys and values
    (computed once from the encoder's output). Bidirectional self-attention is never decoded."""
    seen: set[str] = set()
    total = Poly()
    attentions = 0
    for a in st.attention:
        if not (a.causal or a.cross):
            continue
        pair = []
        for v in (a.k, a.v):
            if v is not None and v not in seen:
                seen.add(v)
                total = total + value_bytes(graph, v, act_bytes)
                pair.append(v)
        if pair:
            attentions += 1
    return KVCache(total, attentions)


def _internal_values(st: Structure) -> set[str]:
    """What a fused attention kernel never writes out: the N x N scores and probabilities."""
    return {v for a in st.attention if a.value is not None and (a.fused or a.fusable) for v in a.internal}


def _fused_layout(st: Structure) -> set[str]:
    """Transposes and head repeats of k and v that a fused kernel reads through in place."""
    return {n for a in st.attention if a.value is not None and (a.fused or a.fusable) for n in a.layout}


@dataclass
class Peak:
    bytes: int
    node: str            # the node running when the peak is reached
    live: Poly           # the live set at that moment, as a polynomial (its formula)


def peak_activations(graph: Graph, st: Structure, bindings: dict[str, int], act_bytes: int,
                     fused: bool) -> Peak:
    """Largest total size of live tensors during one forward pass in graph order.

    A tensor is live from the node that makes it to its last reader (outputs to the end);
    views share their source's memory. Parameters and constants are not activations."""
    root = storage_roots(graph, _fused_layout(st) if fused else set())
    skip = _internal_values(st) if fused else set()
    order = list(graph.nodes.values())
    last = len(order)
    birth: dict[str, int] = {v: -1 for v in graph.inputs}
    death: dict[str, int] = {}
    for i, n in enumerate(order):
        for v in n.inputs:
            r = root.get(v, v)
            if r in birth:
                death[r] = max(death.get(r, -1), i)
        for o in n.outputs:
            if root[o] == o and o not in skip:
                birth[o] = i
    for o in graph.outputs:
        death[root.get(o, o)] = last
    size = Sizer(graph, act_bytes, bindings)
    sizes = {v: size(v) for v in birth}
    add: dict[int, list[str]] = {}
    drop: dict[int, list[str]] = {}
    for v, b in birth.items():
        add.setdefault(b, []).append(v)
        drop.setdefault(death.get(v, b), []).append(v)
    live = sum(sizes[v] for v in add.get(-1, []))
    live_set = set(add.get(-1, []))
    best, best_i, best_set = live, -1, set(live_set)
    for i in range(len(order)):
        for v in add.get(i, []):
            live += sizes[v]
            live_set.add(v)
        if live > best:
            best, best_i, best_set = live, i, set(live_set)
        for v in drop.get(i, []):
            live -= sizes[v]
            live_set.discard(v)
    formula = Poly.sum(value_bytes(graph, v, act_bytes) for v in best_set)
    return Peak(best, order[best_i].name if best_i >= 0 else "(inputs)", formula)


def saved_for_backward(graph: Graph, st: Structure, act_bytes: int, fused: bool, debug: list | None = None) -> Poly:
    """Bytes of the activations the backward pass needs, each tensor counted once.

    With fused attention (FlashAttention) the N x N scores and probabilities are not kept;
    the kernel keeps q, k, v, its output and one fp32 log-sum-exp per query row."""
    root = storage_roots(graph, _fused_layout(st) if fused else set())
    keep_from = set(graph.inputs) | st.data
    skip = _internal_values(st) if fused else set()
    fused_cores = {a.score: a for a in st.attention if a.value is not None and (a.fused or a.fusable) and (fused or a.fused)}
    in_core = {n for a in fused_cores.values() for n in a.core_nodes}
    saved: set[str] = set()
    extra = Poly()
    def needs_grad(v: str) -> bool:
        return v in graph.params or v in st.data

    for n in graph.nodes.values():
        if n.name in in_core:
            continue
        for v in saved_values(n, needs_grad):
            if v not in keep_from:
                continue
            r = root.get(v, v)
            if r not in skip:
                saved.add(r)
    for a in fused_cores.values():
        value_node = graph.nodes[a.value]
        for v in (a.q, a.k, a.v, value_node.outputs[0]):
            saved.add(root.get(v, v))
        rows = numel(graph.type_of(graph.nodes[a.score].outputs[0]).shape[:-1])
        extra = extra + rows * 4  # log-sum-exp, fp32
    if debug is not None:
        debug.extend(sorted(saved))
    return Poly.sum(value_bytes(graph, v, act_bytes) for v in saved) + extra


@dataclass
class Training:
    weights: int
    gradients: int
    optimizer: int          # Adam's first and second moments, fp32
    master_weights: int     # fp32 copy kept by mixed-precision training (0 for fp32)
    activations: Poly
    activations_fused: Poly

    @property
    def states(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.master_weights


def training_memory(graph: Graph, st: Structure, dtype: str) -> Training:
    b = DTYPE_BYTES[dtype]
    p = param_total(graph)
    return Training(weights=p * b, gradients=p * b, optimizer=p * 8, master_weights=0 if b == 4 else p * 4,
                    activations=saved_for_backward(graph, st, b, fused=False),
                    activations_fused=saved_for_backward(graph, st, b, fused=True))
