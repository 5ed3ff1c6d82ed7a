"""The pass contract, after onnx-ir's: requires -> call -> ensures, run by one manager.

A pass checks its preconditions (``requires``), rewrites the graph in place
(``run``) and returns a PassResult: the graph, whether anything changed, and its
notes (what it found, for ``--explain`` and the report). Then ``ensures`` checks
its postconditions; by default that the graph has no cycle, that its node order
is topological, and that every node's type rule still holds.

Passes never talk to each other through constructors: a ``PassManager`` runs a
declared list of them and returns a ``PipelineResult`` holding every pass's
result, so a later reader (``--explain``, the report) finds each pass's notes
there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.compiler import ops
from tessera.compiler.ir.graph import Graph


class PassError(Exception):
    """A pass's precondition or postcondition does not hold."""


@dataclass
class PassResult:
    graph: Graph
    changed: bool
    notes: list = field(default_factory=list)  # what the pass found, for --explain
    name: str = ""


class Pass:
    name = "pass"

    def requires(self, graph: Graph) -> None:
        """Raise PassError if the pass cannot run on this graph."""

    def run(self, graph: Graph) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def ensures(self, graph: Graph) -> None:
        cycle = graph.cycle()
        if cycle:
            raise PassError(f"{self.name} left a cycle: {' -> '.join(cycle)}")
        if not graph.in_topological_order():
            raise PassError(f"{self.name} left the nodes out of topological order")
        try:
            ops.check_graph(graph)
        except ops.ShapeError as e:
            raise PassError(f"{self.name} left an ill-typed graph: {e}") from None

    def __call__(self, graph: Graph) -> PassResult:
        self.requires(graph)
        result = self.run(graph)
        result.name = result.name or self.name
        self.ensures(result.graph)
        return result


@dataclass
class PipelineResult:
    """Every pass's result, in order; ``graph`` is the graph after the last pass."""

    graph: Graph
    results: list[PassResult]

    @property
    def changed(self) -> bool:
        return any(r.changed for r in self.results)

    def notes(self, name: str) -> list:
        """The notes of the pass called ``name`` (empty when it did not run)."""
        return [n for r in self.results if r.name == name for n in r.notes]


class PassManager:
    """Runs passes in order, each under its contract; the declared pipeline is its ``passes``."""

    def __init__(self, passes: list[Pass], model_passes: list | None = None):
        self.passes = list(passes)
        self.model_passes = list(model_passes or [])  # passes/model_passes.py: over the exported ONNX model

    def __call__(self, graph: Graph) -> PipelineResult:
        results = []
        for p in self.passes:
            results.append(p(graph))
            graph = results[-1].graph
        return PipelineResult(graph, results)

    def after_export(self, exported) -> list[PassResult]:
        """The model passes on the exported model (a passes/model_passes.Exported), in place, in order,
        each under its contract; their notes that are words (for --explain) gathered on ``exported.notes``."""
        results = []
        for p in self.model_passes:
            results.append(p(exported))
            exported.notes += [n for n in results[-1].notes if isinstance(n, str)]
        return results

    def describe(self) -> str:
        text = " -> ".join(p.name for p in self.passes)
        if self.model_passes:
            text += " | after export: " + " -> ".join(p.name for p in self.model_passes)
        return text


def run_passes(graph: Graph, passes: list[Pass]) -> list[PassResult]:
    return PassManager(passes)(graph).results


class EliminateDeadNodes(Pass):
    """Drop nodes that no graph output depends on (networkx reachability), e.g. left by a rewrite."""

    name = "eliminate-dead-nodes"

    def run(self, graph: Graph) -> PassResult:
        dead = graph.eliminate_dead_nodes()
        return PassResult(graph, bool(dead), dead)
