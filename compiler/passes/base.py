"""The pass contract, after onnx-ir's: requires -> run -> ensures.

A pass checks its preconditions (``requires``), rewrites the graph in place
(``run``) and returns a PassResult saying whether anything changed, then
checks its postconditions (``ensures``; by default every node's type rule
still holds). Calling the pass object runs all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.compiler.ops import rules as ops
from tessera.compiler.ir.graph import Graph


class PassError(Exception):
    """A pass's precondition or postcondition does not hold."""


@dataclass
class PassResult:
    graph: Graph
    changed: bool
    notes: list = field(default_factory=list)  # what the pass found, for --explain


class Pass:
    name = "pass"

    def requires(self, graph: Graph) -> None:
        """Raise PassError if the pass cannot run on this graph."""

    def run(self, graph: Graph) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def ensures(self, graph: Graph) -> None:
        try:
            ops.check_graph(graph)
        except ops.ShapeError as e:
            raise PassError(f"{self.name} left an ill-typed graph: {e}") from None

    def __call__(self, graph: Graph) -> PassResult:
        self.requires(graph)
        result = self.run(graph)
        self.ensures(result.graph)
        return result


def run_passes(graph: Graph, passes: list[Pass]) -> list[PassResult]:
    return [p(graph) for p in passes]
