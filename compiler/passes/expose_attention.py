"""Expose the attention probabilities of chosen sites as extra model outputs (``--plot-attention``).

A fused attention kernel never forms the N×N probabilities, so they cannot be read from a fused
graph. This pass runs before fusion and makes the softmax of each chosen site a model output
``attention_probs.<index>`` ([B, heads, Tq, Tk]) through an identity node. Fusion then leaves that
site unfused on its own terms (the recogniser refuses to fuse weights that are also a model output,
and ``--explain`` says so), while every other site is fused as before; the model's other outputs
are computed by the same nodes as without this pass.

Sites are numbered in graph order over the softmaxes the recogniser (compiler/patterns/attention.py)
matches as attention over heads, i.e. with scores [B, H, Tq, Tk]; for the decoder-only and
encoder-only models in models/ site L is layer L.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.patterns import attention as pattern

PREFIX = "attention_probs."


def output_name(index: int) -> str:
    """The model output that holds the probabilities of attention site ``index``."""
    return f"{PREFIX}{index}"


@dataclass(frozen=True)
class HeadSite:
    """An attention site over heads, as numbered for --layer / --attention-probs."""

    index: int
    softmax: str
    scope: str
    pos: object
    heads: int | None

    def describe(self) -> str:
        where = f"{self.scope or '<model>'} ({self.pos})" if self.pos else (self.scope or "<model>")
        return f"{self.index}: {where}"


def head_sites(graph: Graph) -> list[HeadSite]:
    """The attention sites whose scores are [B, H, Tq, Tk] (unfused), in graph order."""
    out = []
    for cand in pattern.recognise(graph):
        n = cand.node
        if cand.match is None or n.op != "softmax" or graph.type_of(n.inputs[0]).rank != 4:
            continue
        out.append(HeadSite(len(out), n.name, n.scope, n.origin, cand.match.heads))
    return out


def describe_sites(sites: list[HeadSite]) -> str:
    if not sites:
        return "the model has no attention over heads (no softmax over [B, H, Tq, Tk] scores)"
    return f"its attention sites are {'; '.join(s.describe() for s in sites)}"


@dataclass(frozen=True)
class ExposedProbs:
    """One site whose probabilities became the model output ``output``."""

    site: HeadSite
    output: str

    def describe(self) -> str:
        return f"{self.output}: the probabilities of attention site {self.site.describe()}"


class ExposeAttentionProbs(Pass):
    """Make the probabilities of the chosen attention sites (indices, or None: all) model outputs."""

    name = "expose-attention-probs"

    def __init__(self, sites: list[int] | None):
        self.sites = sites

    def run(self, graph: Graph) -> PassResult:
        sites = head_sites(graph)
        wanted = range(len(sites)) if self.sites is None else self.sites
        notes = []
        for i in dict.fromkeys(wanted):
            if not 0 <= i < len(sites):
                raise PassError(f"no attention site {i}: {describe_sites(sites)}, numbered in graph order")
            site, name = sites[i], output_name(i)
            if name in graph.values or name in graph.nodes:
                raise PassError(f"cannot expose attention site {i}: the model already has a value named {name}")
            probs = graph.nodes[site.softmax].outputs[0]
            node = graph.add_node("identity", [probs], [graph.type_of(probs)], {}, site.scope,
                                  graph.nodes[site.softmax].pos, name=name, origin=site.pos)
            graph.outputs.append(node.outputs[0])
            notes.append(ExposedProbs(site, node.outputs[0]))
        return PassResult(graph, bool(notes), notes)


__all__ = ["PREFIX", "output_name", "HeadSite", "head_sites", "describe_sites", "ExposedProbs",
           "ExposeAttentionProbs"]
