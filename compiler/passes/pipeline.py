"""The one declared optimisation pipeline: fuse attention, drop dead nodes, choose each fused kernel
for the target, and (for export at a lower precision) lower the precision.

Every pass runs under its contract in a PassManager; the attention sites ``--explain`` prints are read
from the passes' results (the fusion pass's AttentionSite notes, completed by the kernel pass's
KernelChoice notes), never handed from one pass to the next.
"""

from __future__ import annotations

import dataclasses

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.attention_kernels import ChooseAttentionKernels, Target
from tessera.compiler.passes.base import EliminateDeadNodes, PassManager, PipelineResult
from tessera.compiler.passes.fuse_attention import AttentionSite, FuseAttention
from tessera.compiler.passes.precision import LowerPrecision
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights

ATTENTION_CHOICES = ("auto", "gqa", "mha", "block", "portable", "unfused")


def build_pipeline(target: Target = Target(), attention: str = "auto", lower_precision: bool = False,
                   quantize: QuantConfig | None = None) -> PassManager:
    """The passes, in order, for a target and an --attention choice; ``lower_precision`` adds the
    fp32 -> target.dtype lowering (export does; analyses that only ask what fuses do not);
    ``quantize`` the weight-only quantisation of the linears (before the precision is lowered)."""
    fuse = attention != "unfused"
    passes = [FuseAttention(enabled=fuse), EliminateDeadNodes()]
    if fuse:
        passes.append(ChooseAttentionKernels(target, None if attention == "auto" else attention))
    if quantize is not None:
        passes.append(QuantizeWeights(quantize))
    if lower_precision and target.dtype != "fp32":
        passes.append(LowerPrecision(target.dtype))
    return PassManager(passes)


def attention_sites(result: PipelineResult) -> list[AttentionSite]:
    """Every attention site with what happened to it: fusion's notes, with the kernel chosen for each."""
    choices = {c.node: c for c in result.notes(ChooseAttentionKernels.name)}
    sites = []
    for s in result.notes(FuseAttention.name):
        c = choices.get(s.node) if s.fused else None
        sites.append(dataclasses.replace(s, impl=c.impl, impl_reason=c.reason) if c else s)
    return sites


def optimize(graph: Graph, target: Target = Target(), attention: str = "auto",
             lower_precision: bool = False, quantize: QuantConfig | None = None) -> list[AttentionSite]:
    """Run the pipeline on the graph (in place); return every attention site with what happened to it."""
    return attention_sites(build_pipeline(target, attention, lower_precision, quantize)(graph))


def explain(sites: list[AttentionSite]) -> str:
    fused = sum(s.fused for s in sites)
    lines = [f"attention sites: {len(sites)} ({fused} fused, {len(sites) - fused} not fused)"]
    lines += [f"  {s.describe()}" for s in sites]
    return "\n".join(lines)
