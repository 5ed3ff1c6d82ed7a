"""ONNX lowering of ``scan`` (compiler/ops/recurrence.py): onnx's RNN/GRU/LSTM op or a Scan.

``lowering`` (set by compiler/passes/recurrence.py) says which; without it the cell op is used
whenever compiler/patterns/recurrence.py matches. The cell ops run time-major ([T, B, I]; layout=1
is not implemented by onnxruntime's CPU kernels), so the lowering transposes around them and
reorders PyTorch's gates into onnx's (GRU: r z n -> z r h; LSTM: i f g o -> i o f c) with
Split/Concat on the weights, which onnxruntime folds once at session start.

The Scan lowering builds the body as an ONNX subgraph through the same lowerings (``L.lower_node``).
Body values are renamed under the scan node's name (ONNX names are one scope across subgraphs); the captured
parameters and tensors keep their outer names and are read from the enclosing graph, and the body's
constants become initializers of the main graph.
"""

from __future__ import annotations


from onnx import helper

from tessera.compiler.backends.onnx.builder import Builder, value_info
from tessera.compiler.ir.graph import Graph, Node, Value
from tessera.compiler.ops.recurrence import parts
from tessera.compiler.patterns.recurrence import CellMatch, match

# onnx's gate order as chunks of PyTorch's
_ORDER = {"rnn": [0], "gru": [1, 0, 2], "lstm": [0, 3, 1, 2]}


def choice(graph: Graph, node: Node) -> tuple[str, str]:
    """("rnn" | "gru" | "lstm" | "scan", why) for a scan node, honouring its ``lowering`` attribute."""
    m = match(graph, node)
    if node.attrs.get("lowering") == "scan":
        return "scan", "Scan forced" if m else m.reason
    if not m:
        return "scan", m.reason
    return m["cell"].cell, f"the body is exactly {m['cell'].cell}_cell"


def lower_scan(L) -> None:
    kind, _ = choice(L.b.graph, L.node)
    if kind == "scan":
        _lower_as_scan(L)
    else:
        _lower_cell(L, match(L.b.graph, L.node)["cell"])


# ------------------------------------------------------------------ onnx's RNN / GRU / LSTM
def _gates(b, w: str, m: CellMatch) -> str:
    """PyTorch's gate chunks of a weight or bias reordered into onnx's, with a leading direction axis."""
    order = _ORDER[m.cell]
    if len(order) > 1:
        chunks = b.node("Split", [w, b.i64([m.hidden] * len(order))], len(order), axis=0)
        w = b.node("Concat", [chunks[i] for i in order], axis=0)[0]
    return b.node("Unsqueeze", [w, b.i64([0])])[0]


def _lower_cell(L, m: CellMatch) -> None:
    b, a = L.b, L.a
    states, seqs, _ = parts(a, list(L.x))
    x = b.node("Transpose", [seqs[0]], perm=[1, 0, 2])[0]                    # [T, B, I]
    w, r = _gates(b, m.w_ih, m), _gates(b, m.w_hh, m)
    bias = b.node("Concat", [_gates(b, m.b_ih, m), _gates(b, m.b_hh, m)], axis=1)[0]
    init = [b.node("Unsqueeze", [s, b.i64([0])])[0] for s in states]         # [1, B, H]
    attrs = {"hidden_size": m.hidden, "direction": "reverse" if a["reverse"] else "forward"}
    if m.cell == "gru":
        attrs["linear_before_reset"] = 1
    n_out = 1 + len(states)
    outs = b.node(m.cell.upper(), [x, w, r, bias, "", *init], n_out, **attrs)
    y, finals = outs[0], outs[1:]
    for f, name in zip(finals, L.outs[:len(states)]):
        b.node("Squeeze", [f, b.i64([0])], [name])
    y = b.node("Squeeze", [y, b.i64([1])])[0]                                   # [T, B, H]
    b.node("Transpose", [y], [L.outs[len(states)]], perm=[1, 0, 2])


# ------------------------------------------------------------------ Scan
def _lower_as_scan(L) -> None:
    b, node, a = L.b, L.node, L.a
    body = a["body"].graph
    k, m = a["n_state"], a["n_seq"]
    prefix = f"{node.name}/body/"
    rename: dict[str, str] = {}
    for i, v in enumerate(body.inputs):
        rename[v] = node.inputs[i] if i >= k + m else prefix + v   # captured: the outer value itself
    for c, arr in body.consts.items():
        rename[c] = b.const(arr, "scan_const")
    for v in body.values:
        rename.setdefault(v, prefix + v)
    g = Graph(prefix.rstrip("/"))
    for old, v in body.values.items():
        g.values[rename[old]] = Value(rename[old], v.type, v.kind, prefix + v.producer if v.producer else None)
    for n in body.nodes.values():
        g.nodes[prefix + n.name] = Node(prefix + n.name, n.op, [rename[i] for i in n.inputs],
                                        [rename[o] for o in n.outputs], n.attrs, n.scope, n.pos, n.origin)
    g.symbols = b.graph.symbols
    g.reindex()

    sub = Builder(g)
    sub._names, sub._consts, sub.initializers = b._names, b._consts, b.initializers  # one name scope
    sub._names.update(g.values)
    sub._dims = {}  # sizes are read inside the body from the graph inputs (Shape), so the body stands alone
    for n in g.nodes.values():
        sub.current = n.name
        L.lower_node(sub, n, n.outputs[0])
    sub.current = prefix + "out"
    outs = []
    for i, v in enumerate(body.outputs):
        outs.append(sub.node("Identity", [rename[v]], [sub.fresh(f"{i}")])[0])
    step_inputs = [prefix + v for v in body.inputs[:k + m]]
    onnx_body = helper.make_graph(
        sub.nodes, prefix + "step",
        inputs=[value_info(n, g.type_of(n)) for n in step_inputs],
        outputs=[value_info(o, body.type_of(v)) for o, v in zip(outs, body.outputs)])
    n_y = len(body.outputs) - k
    direction = 1 if a["reverse"] else 0
    b.node("Scan", list(node.inputs[:k + m]), list(L.outs), body=onnx_body, num_scan_inputs=m,
           scan_input_axes=[1] * m, scan_output_axes=[1] * n_y,
           scan_input_directions=[direction] * m, scan_output_directions=[direction] * n_y)



