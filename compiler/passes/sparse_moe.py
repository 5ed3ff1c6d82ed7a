"""Make every dense mixture of experts sparse: one ``sparse_moe`` node (compiler/ops/experts.py).

The standard library's ``moe`` block (spec/stdlib/nn.tsr) is written densely: ``topk_gates`` of the
router logits, and for each expert ``e`` its feed-forward output times ``slice(gates, -1, e, e+1)``,
summed. compiler/patterns/experts.py recognises that form (the same recogniser the report's
structure uses), with SwiGLU experts (``linear(silu(linear(x, gate)) * linear(x, up), down)``, no
biases, every expert reading the same ``x``); this pass replaces the sum with one ``sparse_moe``
node that runs each token's top-k experts only. A mixture written sparse (the ``experts`` builtin,
already one ``sparse_moe`` node) gets the target's lowering (``impl``) here too, except where
com.microsoft.MoE cannot express its routing (sigmoid scores, a correction bias, groups, gates on the
input: ``moe_refusal``): such a node keeps the gather form, and its note says why.
The router stays a ``linear`` (the quantiser and the report see it as before). A block the pattern
does not fit stays dense, and its note says why (``--explain`` prints it). A ``topk_gates`` that weighs
no expert (used as a mask, ``topk_gates(s, k) > 0.0``, or to choose groups) is a routing step, not a
mixture: no site, as the report does not count it (patterns/experts.py ``weighs_experts``).

Run after weight quantisation: experts already quantised (``linear_nbits``) are left dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph
from tessera.compiler.ops.experts import IMPLS, describe_routing, moe_refusal
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.patterns.experts import sparse_block, weighs_experts

# Chosen by measurement (bench/moe.py, docs/benchmarks/log.md): the standard-op gather/scatter form ran a
# 2-layer Mixtral-shaped model at N = 512 2.7x faster than dense, onnxruntime's MoE kernel 2.1x (its CPU
# kernel runs each expert's products on one thread).
DEFAULT_IMPL = "gather"
DISABLED = "sparse experts disabled (--no-sparse-moe)"


@dataclass
class ExpertSite:
    """One topk_gates node the pass looked at, and what became of it."""

    gate: str
    scope: str
    experts: int
    top: int
    sparse: bool
    reason: str = ""
    node: str | None = None
    impl: str | None = None
    routing: str = ""  # the routing options beyond a softmax top k, in words (describe_routing)

    def describe(self) -> str:
        return f"{self.scope or '<model>'}: {self.verdict()}"

    def verdict(self) -> str:
        """What became of the mixture and why, without where it is: --explain groups the sites sharing one."""
        head = f"top {self.top} of {self.experts} experts" + (f" ({self.routing})" if self.routing else "")
        if self.sparse:
            return f"{head}: sparse ({self.impl})" + (f": {self.reason}" if self.reason else "")
        return f"{head}: dense: {self.reason}"


class SparseExperts(Pass):
    """Replace each dense mixture of experts with one sparse_moe node; notes: an ExpertSite each."""

    name = "sparse-experts"

    def __init__(self, enabled: bool = True, impl: str | None = None):
        impl = impl or DEFAULT_IMPL
        if impl not in IMPLS:
            raise PassError(f"sparse experts: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.enabled, self.impl = enabled, impl

    def run(self, graph: Graph) -> PassResult:
        sites = []
        changed = False
        for node in [n for n in graph.nodes.values() if n.op == "sparse_moe"]:
            # written sparse already (the `experts` builtin): the target's lowering chosen here too
            e, k = int(node.attrs["experts"]), int(node.attrs["k"])
            impl, why = self.impl, moe_refusal(node.attrs) if self.impl == "moe" else None
            if why:  # never computed as something else: the standard-op form, which takes every option
                impl = "gather"
            if node.attrs.get("impl") != impl:
                node.attrs["impl"] = impl
                changed = True
            reason = [f"com.microsoft.MoE cannot express {why}"] if why else []
            if not self.enabled:
                reason.append("written sparse (the experts builtin): --no-sparse-moe has no dense form of it")
            sites.append(ExpertSite(node.name, node.scope, e, k, True, node=node.name, impl=impl,
                                    reason="; ".join(reason), routing=describe_routing(node.attrs)))
        for g in [n for n in graph.nodes.values() if n.op == "topk_gates"]:
            if not weighs_experts(graph, g):  # a routing step (a mask, a group choice): not a mixture
                continue
            e, k = int(graph.type_of(g.inputs[0]).shape[-1]), int(g.attrs["k"])
            if not self.enabled:
                sites.append(ExpertSite(g.name, g.scope, e, k, False, DISABLED))
                continue
            m = sparse_block(graph, g)
            if not m:
                sites.append(ExpertSite(g.name, g.scope, e, k, False, m.reason))
                continue
            node = graph.replace_node(m["root"], "sparse_moe", [m["x"], m["logits"]] + m["weights"],
                                      {"k": k, "experts": e, "impl": self.impl,
                                       **({"normalize": False} if g.attrs.get("normalize") is False else {})})
            node.scope = g.scope  # the block's scope (the node keeps the last add's name and place)
            graph.remove_nodes(m["covered"])
            changed = True
            sites.append(ExpertSite(g.name, g.scope, e, k, True, node=node.name, impl=self.impl))
        if changed:
            graph.prune_constants()
            graph.sort()
        return PassResult(graph, changed, sites)


__all__ = ["SparseExperts", "ExpertSite", "DEFAULT_IMPL", "DISABLED"]
