"""Choose how each ``scan`` is lowered: onnx's own RNN/GRU/LSTM op, or a Scan of its body.

``auto`` takes the cell op whenever compiler/patterns/recurrence.py says the body is exactly that
cell (onnxruntime runs it as one kernel); ``scan`` forces the Scan lowering everywhere (the
``recurrence="scan"`` pipeline option, ``--recurrence scan``), so both lowerings can be tested and
measured on the same model. The choice is the node's ``lowering`` attribute, shown by the IR
listing after the passes; the notes say why, for ``--explain``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.base import Pass, PassError, PassResult
from tessera.compiler.patterns.recurrence import match

CHOICES = ("auto", "scan")


@dataclass(frozen=True)
class RecurrenceChoice:
    node: str
    lowering: str  # rnn | gru | lstm | scan
    reason: str

    def describe(self) -> str:
        op = "Scan" if self.lowering == "scan" else f"onnx {self.lowering.upper()}"
        return f"{self.node}: {op} ({self.reason})"


class ChooseRecurrenceLowering(Pass):
    name = "choose-recurrence-lowering"

    def __init__(self, mode: str = "auto"):
        if mode not in CHOICES:
            raise PassError(f"recurrence lowering must be one of {', '.join(CHOICES)}, got {mode!r}")
        self.mode = mode

    def run(self, graph: Graph) -> PassResult:
        notes = []
        for node in graph.nodes.values():
            if node.op != "scan":
                continue
            m = match(graph, node)
            if self.mode == "scan":
                lowering, reason = "scan", "Scan forced (--recurrence scan)" + (f"; {m.reason}" if m.reason else "")
            elif not m:
                lowering, reason = "scan", m.reason
            else:
                lowering, reason = m["cell"].cell, f"the body is exactly {m['cell'].cell}_cell"
            node.attrs["lowering"] = lowering
            notes.append(RecurrenceChoice(node.name, lowering, reason))
        return PassResult(graph, bool(notes), notes)


def explain(choices: list[RecurrenceChoice]) -> str:
    lines = [f"recurrences: {len(choices)}"]
    lines += [f"  {c.describe()}" for c in choices]
    return "\n".join(lines)
