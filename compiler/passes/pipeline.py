"""The optimisation pipeline: fuse attention, then choose each fused kernel for the target."""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.attention_kernels import ChooseAttentionKernels, Target
from tessera.compiler.passes.fuse_attention import AttentionSite, FuseAttention, find_sites

ATTENTION_CHOICES = ("auto", "gqa", "mha", "portable", "unfused")


def optimize(graph: Graph, target: Target = Target(), attention: str = "auto") -> list[AttentionSite]:
    """Rewrite the graph in place; return every attention site with what happened to it."""
    if attention == "unfused":
        return [AttentionSite(n.name, n.scope, n.origin, False, "fusion disabled (--no-fuse / --attention unfused)"
                              if m is not None else reason)
                for n, m, reason in find_sites(graph)]
    sites = FuseAttention()(graph).notes
    ChooseAttentionKernels(target, None if attention == "auto" else attention, sites)(graph)
    return sites


def explain(sites: list[AttentionSite]) -> str:
    fused = sum(s.fused for s in sites)
    lines = [f"attention sites: {len(sites)} ({fused} fused, {len(sites) - fused} not fused)"]
    lines += [f"  {s.describe()}" for s in sites]
    return "\n".join(lines)
