"""When a scan's body is exactly one of onnx's recurrent cells (RNN with tanh, GRU, LSTM).

The ONNX export can then emit onnx's own ``RNN``/``GRU``/``LSTM`` op, which onnxruntime runs as one
kernel (docs/benchmarks/log.md measures it against the ``Scan`` lowering). The op only computes its own
equations, so the body must be that cell and nothing else: the standard library's block (the
``cell`` attribute the ``scan`` builtin sets), with the primitive ops that block elaborates to, one
per-step input [B, I], states [B, H] and exactly the four parameters W_ih [g·H, I], b_ih [g·H],
W_hh [g·H, H], b_hh [g·H] in f32 (onnxruntime's CPU kernels are fp32). ``match`` gives a
``MatchResult`` (patterns/matcher.py): the ``cell`` on success, else the reason a scan does not
qualify and the node (the scan, or the body node that is not the cell's) for ``--explain``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.ops.recurrence import parts
from tessera.compiler.patterns.matcher import MatchResult

# gates per cell, and the primitive ops of the standard library's cell (spec/stdlib/nn.tsr);
# tests/compiler/test_recurrence.py checks these against a fresh elaboration of each block.
GATES = {"rnn": 1, "gru": 3, "lstm": 4}
STATES = {"rnn": 1, "gru": 1, "lstm": 2}
CELL_OPS = {
    "rnn": Counter({"linear": 2, "add": 1, "tanh": 1}),
    "gru": Counter({"linear": 2, "slice": 6, "add": 4, "sigmoid": 2, "tanh": 1, "mul": 3, "sub": 1}),
    "lstm": Counter({"linear": 2, "add": 2, "slice": 4, "sigmoid": 3, "tanh": 2, "mul": 3}),
}


@dataclass(frozen=True)
class CellMatch:
    cell: str          # rnn | gru | lstm
    hidden: int
    w_ih: str          # the scan node's inputs holding the four parameters
    b_ih: str
    w_hh: str
    b_hh: str


def match(graph: Graph, node: Node) -> MatchResult:
    """``cell``: the CellMatch when onnx's op computes exactly this scan; else the reason why not."""
    a = node.attrs
    cell = a.get("cell")
    if cell not in GATES:
        return MatchResult.fail("the step is not one of the standard library's cells (rnn_cell, gru_cell, lstm_cell)",
                                node)
    body = a["body"].graph
    ops = Counter(n.op for n in body.nodes.values())
    if ops != CELL_OPS[cell]:
        extra = ops - CELL_OPS[cell]
        odd = next((n for n in body.nodes.values() if n.op in extra), node)
        return MatchResult.fail(f"the body is not exactly {cell}_cell (its ops differ: {dict(ops)})", odd)
    states, seqs, caps = parts(a, list(node.inputs))
    if len(states) != STATES[cell] or len(seqs) != 1 or len(caps) != 4:
        return MatchResult.fail(f"{cell}_cell takes {STATES[cell]} state(s), one per-step input and four parameters", node)
    t_x, t_h = graph.type_of(seqs[0]), graph.type_of(states[0])
    if t_x.rank != 3 or t_h.rank != 2 or not dims.is_static(t_h.shape[1]):
        return MatchResult.fail(f"onnx's {cell.upper()} takes x [B, T, I] and states [B, H], got {t_x} and {t_h}",
                                node)
    if any(graph.type_of(v).dtype != "f32" for v in [*states, *seqs, *caps]):
        return MatchResult.fail(f"onnxruntime's {cell.upper()} kernel is fp32 only", node)
    h, g = int(t_h.shape[1]), GATES[cell]
    w_ih, b_ih, w_hh, b_hh = caps
    want = {w_ih: (g * h, t_x.shape[2]), b_ih: (g * h,), w_hh: (g * h, h), b_hh: (g * h,)}
    for v, shape in want.items():
        if not dims.shapes_equal(graph.type_of(v).shape, tuple(dims.dim(s) for s in shape)):
            return MatchResult.fail(f"parameter {v} is {graph.type_of(v)}, onnx's {cell.upper()} wants {list(shape)}",
                                    node)
    return MatchResult(True, {"cell": CellMatch(cell, h, w_ih, b_ih, w_hh, b_hh)}, [node])
