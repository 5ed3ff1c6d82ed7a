"""Fuse every recognised attention into one ``fused_attention`` node (kernel chosen later).

The matching is not here: compiler/patterns/attention.py is the one recogniser
(the report's structure analysis uses it too). This pass is its rewrite: for
each match with no reason against it, put the fused node in the ·V matmul's
place and drop the nodes the match covers; for every other softmax, keep the
reason as an ``AttentionSite`` note, which ``--explain`` prints. A match whose score
epilogue no kernel computes (passes/attention_kernels.py ``no_kernel``: each kernel's
allow-list of score features) stays unfused too, with that reason.

Grouped-query attention is recognised by ``repeat_kv`` feeding both K and V;
the fused node then takes the un-repeated K and V and records kv_heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.compiler.ir.graph import DTYPES, Graph
from tessera.compiler.passes.attention_kernels import no_kernel
from tessera.compiler.passes.base import Pass, PassResult
from tessera.compiler.patterns import attention as pattern


@dataclass
class AttentionSite:
    """One softmax the matcher looked at, and what became of it."""

    softmax: str
    scope: str
    pos: object
    fused: bool
    reason: str = ""
    node: str | None = None  # the fused_attention node, when fused
    impl: str | None = None  # chosen lowering (set from the kernel-selection pass's notes)
    impl_reason: str = ""
    at: object = None  # where in the spec the reason arose, when not at the softmax (a node's origin)

    def describe(self) -> str:
        where = f"{self.scope or '<model>'} ({self.pos})" if self.pos else (self.scope or "<model>")
        return f"{where}: {self.verdict()}"

    def verdict(self) -> str:
        """What became of the site and why, without where it is: --explain groups the sites sharing one."""
        if not self.fused:
            return f"not fused: {self.reason}" + (f" (at {self.at})" if self.at and self.at != self.pos else "")
        return f"fused -> {self.impl}: {self.impl_reason}" if self.impl else "fused"


DISABLED = "fusion disabled (--no-fuse / --attention unfused)"
IN_STEP = "inside the step of a recurrence (scan): fusion rewrites the model's graph, not step bodies"


def _in_steps(graph: Graph, where: str = "") -> list[AttentionSite]:
    """The softmaxes inside scan bodies (compiler/ops/recurrence.py), not fused, each with its reason:
    the recogniser's (additive attention: "not a dot product"), or that fusion does not enter a step."""
    sites = []
    for node in graph.nodes.values():
        if node.op != "scan":
            continue
        body = node.attrs["body"].graph
        inner = f"{where}{node.name} step: "
        sites += _in_steps(body, inner)
        for cand in pattern.recognise(body):
            n = cand.node
            reason = cand.reason if not cand.fusable else IN_STEP
            sites.append(AttentionSite(n.name, f"{inner}{n.scope}", n.origin, False, reason,
                                       at=_origin(body, cand.at) if not cand.fusable else None))
    return sites


def _origin(graph: Graph, node: str):
    """The spec position of the node a match failed at (None: the softmax, or no such node)."""
    return graph.nodes[node].origin if node and node in graph.nodes else None


def _scalar_bias(graph: Graph, m: pattern.AttentionMatch) -> str:
    """A constant holding the scalar the scores are shifted by (``s - c`` -> -c), in the scores' dtype."""
    dtype = graph.type_of(graph.nodes[m.anchor].inputs[0]).dtype
    return graph.add_const(f"{m.anchor}/bias", np.array(m.bias_const, dtype=DTYPES.get(dtype) or np.float32), dtype).name


class FuseAttention(Pass):
    """Replace every fusable attention with one fused_attention node; notes: an AttentionSite per softmax."""

    name = "fuse-attention"

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def run(self, graph: Graph) -> PassResult:
        sites = _in_steps(graph)
        changed = False
        for cand in pattern.recognise(graph):
            n, m = cand.node, cand.match
            if n.op == pattern.FUSED_OP:
                continue
            reason = cand.reason if not cand.fusable else (DISABLED if not self.enabled else
                                                          no_kernel(pattern.attributes(m)))
            if reason:
                at = _origin(graph, cand.at) if not cand.fusable else None
                sites.append(AttentionSite(n.name, n.scope, n.origin, False, reason, at=at))
                continue
            if m.bias_const is not None:
                m.bias = _scalar_bias(graph, m)
            op, inputs, attrs = pattern.rewrite(m)
            fused = graph.replace_node(m.value, op, inputs, attrs)
            graph.remove_nodes(m.covered)
            changed = True
            sites.append(AttentionSite(n.name, n.scope, n.origin, True, node=fused.name))
        if changed:
            graph.prune_constants()
            graph.sort()  # the fused node sits where ·V was, after all its inputs: a no-op kept as a guarantee
        return PassResult(graph, changed, sites)
