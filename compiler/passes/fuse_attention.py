"""Fuse attention: Q·Kᵀ -> [scale] -> [masks, bias] -> softmax(keys) -> ·V  =>  one fused_attention node.

Every softmax in the graph is a candidate attention site, whether it came
from the standard library or was written by hand. The matcher walks from the
softmax back to the score matmul through a table of *score rules*, one per op
that may sit between them (a scalar scale, a causal or sliding-window mask, a
padding mask, an additive bias), then forward to the matmul with V. Each rule
is (op, check, absorb): ``check`` returns why the node cannot be absorbed, or
None; ``absorb`` records what it contributes to the fused node. When a
candidate does not match, the reason is kept and shown by ``--explain``.

Grouped-query attention is recognised by ``repeat_kv`` feeding both K and V;
the fused node then takes the un-repeated K and V and records kv_heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.passes.base import Pass, PassResult


@dataclass
class AttentionSite:
    """One softmax the matcher looked at, and what became of it."""

    softmax: str
    scope: str
    pos: object
    fused: bool
    reason: str = ""
    node: str | None = None  # the fused_attention node, when fused
    impl: str | None = None  # chosen lowering (set by the kernel-selection pass)
    impl_reason: str = ""

    def describe(self) -> str:
        where = f"{self.scope or '<model>'} ({self.pos})" if self.pos else (self.scope or "<model>")
        if not self.fused:
            return f"{where}: not fused: {self.reason}"
        impl = f" -> {self.impl}: {self.impl_reason}" if self.impl else ""
        return f"{where}: fused{impl}"


@dataclass
class _Match:
    q: str = ""
    k: str = ""
    v: str = ""
    scale: float = 1.0
    causal: bool = False
    window: int = 0
    mask: str | None = None
    bias: str | None = None
    kv_heads: int | None = None
    scaled: bool = False
    dead: list[str] = field(default_factory=list)  # nodes the fused node replaces


class NoMatch(Exception):
    pass


# ------------------------------------------------------------------ score rules: (op, check, absorb)
def _scalar_const(g: Graph, value: str) -> float | None:
    arr = g.consts.get(value)
    if arr is None or arr.size != 1:
        return None
    return float(np.asarray(arr).reshape(()))


def _check_scale(g: Graph, n: Node, m: _Match) -> str | None:
    if _scalar_const(g, n.inputs[1]) is None and _scalar_const(g, n.inputs[0]) is None:
        return f"scores are {'multiplied' if n.op == 'mul' else 'divided'} by a tensor, not a constant " \
               f"(a multiplicative mask is not additive)"
    if n.op == "div" and _scalar_const(g, n.inputs[1]) is None:
        return "scores divide a constant (not a scale)"
    return None


def _absorb_scale(g: Graph, n: Node, m: _Match) -> str:
    const_left = _scalar_const(g, n.inputs[1]) is None
    c = _scalar_const(g, n.inputs[0] if const_left else n.inputs[1])
    m.scale *= (1.0 / c) if n.op == "div" else c
    m.scaled = True
    return n.inputs[1] if const_left else n.inputs[0]


def _check_causal(g: Graph, n: Node, m: _Match) -> str | None:
    return "two causal masks on one score matrix" if m.causal else None


def _absorb_causal(g: Graph, n: Node, m: _Match) -> str:
    m.causal, m.window = True, n.attrs["window"]
    return n.inputs[0]


def _check_padding(g: Graph, n: Node, m: _Match) -> str | None:
    return "two padding masks on one score matrix" if m.mask else None


def _absorb_padding(g: Graph, n: Node, m: _Match) -> str:
    m.mask = n.inputs[1]
    return n.inputs[0]


def _check_bias(g: Graph, n: Node, m: _Match) -> str | None:
    if m.bias is not None:
        return "two additive biases on one score matrix"
    if m.scaled:  # walking backwards: a scale seen already comes after this bias in the graph
        return "a bias is added before the scores are scaled"
    s_type = g.type_of(n.outputs[0])
    a, b = (g.type_of(v) for v in n.inputs)
    other = b if dims.shapes_equal(a.shape, s_type.shape) else a
    if other.rank > s_type.rank:
        return "the added tensor is larger than the scores"
    return None


def _absorb_bias(g: Graph, n: Node, m: _Match) -> str:
    s_type = g.type_of(n.outputs[0])
    first_is_scores = dims.shapes_equal(g.type_of(n.inputs[0]).shape, s_type.shape) and \
        g.producer(n.inputs[0]) is not None and g.producer(n.inputs[0]).op in SCORE_OPS | {"matmul"}
    scores, bias = (n.inputs[0], n.inputs[1]) if first_is_scores else (n.inputs[1], n.inputs[0])
    m.bias = bias
    return scores


ScoreRule = tuple[Callable[[Graph, Node, _Match], str | None], Callable[[Graph, Node, _Match], str]]
SCORE_RULES: dict[str, ScoreRule] = {
    "mul": (_check_scale, _absorb_scale),
    "div": (_check_scale, _absorb_scale),
    "causal_mask": (_check_causal, _absorb_causal),
    "padding_mask": (_check_padding, _absorb_padding),
    "add": (_check_bias, _absorb_bias),
}
SCORE_OPS = set(SCORE_RULES)


# ------------------------------------------------------------------ the matcher
def _single_user(g: Graph, value: str, what: str) -> Node:
    """The one node reading ``value``; a fused kernel cannot expose its intermediates."""
    users = g.consumers(value)
    outputs = [u.outputs[0] for u in users if u.op == "identity" and u.outputs[0] in g.outputs]
    if value in g.outputs or outputs:
        raise NoMatch(f"{what}: also a model output ({', '.join(outputs) or value}), which a fused kernel "
                      f"never forms")
    if len(users) != 1:
        raise NoMatch(f"{what}: read by {len(users)} nodes ({', '.join(u.name for u in users)}), not only by "
                      f"the next step of attention")
    return users[0]


def match_attention(g: Graph, softmax: Node) -> _Match:
    """Match the attention around one softmax node, or raise NoMatch(reason)."""
    m = _Match()
    s_type = g.type_of(softmax.inputs[0])
    rank = s_type.rank
    axis = softmax.attrs["axis"] % rank
    # forward: the weights must feed exactly one matmul, as its left operand
    pv = _single_user(g, softmax.outputs[0], "the attention weights")
    if pv.op != "matmul" or pv.inputs[0] != softmax.outputs[0]:
        raise NoMatch(f"the attention weights feed {pv.op}, not a matmul with V")
    m.v = pv.inputs[1]
    if rank < 2:
        raise NoMatch("softmax over a vector, not a score matrix")
    if axis == rank - 2:
        raise NoMatch("softmax over the query axis (attention normalises over the key axis, -1)")
    if axis != rank - 1:
        raise NoMatch(f"softmax over axis {softmax.attrs['axis']}, not the key axis (-1)")
    if rank != 4:
        raise NoMatch(f"scores of rank {rank}; the fused kernel takes heads: [B, H, Tq, Tk]")
    # backward: through the score rules to the Q·Kᵀ matmul
    cur = softmax.inputs[0]
    m.dead = [softmax.name]
    while True:
        node = g.producer(cur)
        if node is None:
            raise NoMatch(f"the scores are a graph input or constant ({cur}), not computed from Q and K")
        _single_user(g, cur, f"the scores ({cur})")
        if node.op == "matmul":
            break
        rule = SCORE_RULES.get(node.op)
        if rule is None:
            raise NoMatch(f"the scores pass through {node.op} ({node.name}), which the fused kernel cannot express")
        check, absorb = rule
        reason = check(g, node, m)
        if reason:
            raise NoMatch(reason)
        m.dead.append(node.name)
        cur = absorb(g, node, m)
    qk = node
    kt = g.producer(qk.inputs[1])
    if kt is None or kt.op != "transpose" or list(kt.attrs["perm"][-2:]) != [rank - 1, rank - 2] \
            or list(kt.attrs["perm"][:-2]) != list(range(rank - 2)):
        raise NoMatch("the scores are not Q·Kᵀ: the right operand is not K with its last two axes swapped")
    m.q, m.k = qk.inputs[0], kt.inputs[0]
    m.dead.append(qk.name)
    if len(g.consumers(kt.outputs[0])) == 1 and kt.outputs[0] not in g.outputs:
        m.dead.append(kt.name)
    q_t, k_t, v_t = g.type_of(m.q), g.type_of(m.k), g.type_of(m.v)
    if not dims.equal(k_t.shape[-2], v_t.shape[-2]):
        raise NoMatch("K and V have different lengths")
    if m.causal and not (dims.dim(k_t.shape[-2]) - dims.dim(q_t.shape[-2])).is_nonnegative:
        raise NoMatch(f"a causal mask where the keys ({dims.fmt(k_t.shape[-2])}) may be fewer than the queries "
                      f"({dims.fmt(q_t.shape[-2])}): leading rows would see no key")
    if m.mask is not None and g.type_of(m.mask).rank != 2:
        raise NoMatch("the padding mask is not [B, Tk]")
    # grouped-query attention: K and V both repeated from fewer heads
    heads = int(q_t.shape[1])
    m.kv_heads = heads
    rk, rv = g.producer(m.k), g.producer(m.v)
    if rk is not None and rv is not None and rk.op == rv.op == "repeat_kv" and \
            rk.attrs["times"] == rv.attrs["times"]:
        single = all(len(g.consumers(r.outputs[0])) == 1 and r.outputs[0] not in g.outputs for r in (rk, rv))
        if single:
            m.k, m.v = rk.inputs[0], rv.inputs[0]
            m.kv_heads = heads // rk.attrs["times"]
            m.dead += [rk.name, rv.name]
    return m


def find_sites(g: Graph) -> list[tuple[Node, _Match | None, str]]:
    out = []
    for n in list(g.nodes.values()):
        if n.op != "softmax":
            continue
        try:
            out.append((n, match_attention(g, n), ""))
        except NoMatch as e:
            out.append((n, None, str(e)))
    return out


class FuseAttention(Pass):
    """Replace every matched attention with one fused_attention node (kernel chosen later)."""

    name = "fuse-attention"

    def run(self, graph: Graph) -> PassResult:
        sites = []
        changed = False
        for softmax, m, reason in find_sites(graph):
            if m is None:
                sites.append(AttentionSite(softmax.name, softmax.scope, softmax.origin, False, reason))
                continue
            inputs = [m.q, m.k, m.v] + ([m.mask] if m.mask else []) + ([m.bias] if m.bias else [])
            q_t = graph.type_of(m.q)
            attrs = {"scale": m.scale, "causal": m.causal, "window": m.window, "padding": m.mask is not None,
                     "bias": m.bias is not None, "heads": int(q_t.shape[1]), "kv_heads": m.kv_heads}
            pv = graph.consumers(softmax.outputs[0])[0]
            fused = graph.replace_node(pv.name, "fused_attention", inputs, attrs)
            graph.remove_nodes(m.dead)
            changed = True
            sites.append(AttentionSite(softmax.name, softmax.scope, softmax.origin, True, node=fused.name))
        if changed:
            graph.prune_constants()
        return PassResult(graph, changed, sites)
