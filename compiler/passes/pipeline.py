"""The one declared optimisation pipeline: fuse attention, drop dead nodes, choose each fused kernel
for the target, quantise weights (--quantize), make mixtures of experts sparse (unless
--no-sparse-moe), and (for export at a lower precision) lower the precision.

Every pass runs under its contract in a PassManager; the attention sites ``--explain`` prints are read
from the passes' results (the fusion pass's AttentionSite notes, completed by the kernel pass's
KernelChoice notes), never handed from one pass to the next.
"""

from __future__ import annotations

import dataclasses

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.attention_kernels import ChooseAttentionKernels, Target
from tessera.compiler.passes.base import EliminateDeadNodes, PassManager, PipelineResult
from tessera.compiler.passes.expose_attention import ExposeAttentionProbs
from tessera.compiler.passes.fuse_attention import AttentionSite, FuseAttention
from tessera.compiler.passes.precision import LowerPrecision
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.passes.recurrence import ChooseRecurrenceLowering
from tessera.compiler.passes.sparse_moe import SparseExperts

ATTENTION_CHOICES = ("auto", "gqa", "mha", "block", "portable", "unfused")


def build_pipeline(target: Target = Target(), attention: str = "auto", lower_precision: bool = False,
                   quantize: QuantConfig | None = None, attention_probs: list[int] | None = None,
                   all_probs: bool = False, recurrence: str = "auto", sparse_moe: bool = True) -> PassManager:
    """The passes, in order, for a target and an --attention choice; ``lower_precision`` adds the
    fp32 -> target.dtype lowering (export does; analyses that only ask what fuses do not);
    ``quantize`` the weight-only quantisation of the linears (before the precision is lowered);
    ``attention_probs`` (site indices) or ``all_probs`` first makes those sites' probabilities model
    outputs, which keeps them unfused (passes/expose_attention.py); ``recurrence`` how scans are
    lowered (auto: onnx's RNN/GRU/LSTM op where the body is that cell; scan: always a Scan);
    ``sparse_moe`` False (--no-sparse-moe) keeps mixtures of experts dense."""
    fuse = attention != "unfused"
    passes = [FuseAttention(enabled=fuse), EliminateDeadNodes()]
    if attention_probs or all_probs:
        passes.insert(0, ExposeAttentionProbs(None if all_probs else list(attention_probs)))
    if fuse:
        passes.append(ChooseAttentionKernels(target, None if attention == "auto" else attention))
    if quantize is not None:
        passes.append(QuantizeWeights(quantize))
    passes.append(SparseExperts(enabled=sparse_moe))  # after quantisation: quantised experts stay dense
    if lower_precision and target.dtype != "fp32":
        passes.append(LowerPrecision(target.dtype))
    passes.append(ChooseRecurrenceLowering(recurrence))  # last: onnx's cell ops are fp32 only
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
             lower_precision: bool = False, quantize: QuantConfig | None = None,
             sparse_moe: bool = True) -> list[AttentionSite]:
    """Run the pipeline on the graph (in place); return every attention site with what happened to it."""
    return attention_sites(build_pipeline(target, attention, lower_precision, quantize, sparse_moe=sparse_moe)(graph))


def expert_sites(result: PipelineResult) -> list:
    """Every mixture of experts the sparse-experts pass looked at, sparse or dense and why."""
    return result.notes(SparseExperts.name)


def explain(sites: list[AttentionSite], exposed: list | None = None) -> str:
    fused = sum(s.fused for s in sites)
    lines = [f"attention sites: {len(sites)} ({fused} fused, {len(sites) - fused} not fused)"]
    lines += [f"  {s.describe()}" for s in sites]
    if exposed:
        lines.append(f"attention probabilities exposed as outputs: {len(exposed)}")
        lines += [f"  {e.describe()}" for e in exposed]
    return "\n".join(lines)


def explain_experts(sites: list) -> str:
    """--explain's lines for the mixtures of experts ("" when the model has none)."""
    if not sites:
        return ""
    sparse = sum(s.sparse for s in sites)
    lines = [f"mixtures of experts: {len(sites)} ({sparse} sparse, {len(sites) - sparse} dense)"]
    return "\n".join(lines + [f"  {s.describe()}" for s in sites])
