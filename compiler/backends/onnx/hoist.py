"""Shape arithmetic out of If branches, into the main graph (CUDA).

Why: onnxruntime places the nodes of an If branch by the kernels they have, not by where their values
live. A branch that computes from the run-time dimensions (``Shape`` in the main graph, then Squeeze,
Sub, Range ... inside the branch: a sliding window's key positions in a cached decoding step) gets
that arithmetic placed on the CUDA device, and onnxruntime then inserts a Memcpy inside the branch
for each value that crosses between host and device (a Range's bounds are host inputs): a copy and a
stream sync in every decoding step, inside a subgraph where nothing else can overlap it.

What: every node of a main-graph If's branches that reads no data -- its inputs are initializers,
values computed in the main graph from ``Shape`` outputs and initializers alone, or outputs of nodes
moved before it -- moves to the main graph, just before the If. In the main graph onnxruntime keeps
shape arithmetic on the host (its CPU-preferred placement of shape subgraphs), and what crosses to the
device (a mask built from the positions) crosses there, once per call, outside any branch.

Assumes: the exporter's value names are unique across the whole model, subgraphs included (Builder's
``fresh``), so a node moves without renaming. What it costs: a moved node runs whichever branch the
If takes; it computes from dimensions only, so its size is that of the call (a mask over the call's
keys), the same order as the branch's own work. Used for CUDA targets only (passes/pipeline.py): on
the CPU provider nothing is copied and the graphs stay as they are.
"""

from __future__ import annotations

import onnx


# integer initializers are shape arithmetic's constants (axes, one, zero); float ones are data (weights)
INTEGERS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL}


def _reads_no_data(node, dataless: set[str], known: set[str]) -> bool:
    """Whether ``node`` computes from dimensions alone: a Shape of a value ``known`` in the main graph, or
    a node whose inputs are all ``dataless``."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    if node.op_type == "Shape":
        return node.input[0] in known
    return all(i in dataless for i in node.input)


def hoist_dataless(model: onnx.ModelProto) -> int:
    """Move every node of the main graph's If branches that reads no data in front of its If (repeated
    until none moves). Returns how many nodes moved. An If nested in a branch is left as it is."""
    graph = model.graph
    moved = 0
    while True:
        dataless = {t.name for t in graph.initializer if t.data_type in INTEGERS} | {""}
        known = {t.name for t in graph.initializer} | {""} | {i.name for i in graph.input}  # written before
        for n in graph.node:
            if n.op_type != "If" and _reads_no_data(n, dataless, known):
                dataless.update(n.output)
            known.update(n.output)
        known = {t.name for t in graph.initializer} | {""} | {i.name for i in graph.input}
        out, step = [], 0
        for n in graph.node:
            if n.op_type == "If":
                for attr in n.attribute:
                    if attr.type != onnx.AttributeProto.GRAPH:
                        continue
                    branch = attr.g
                    local = dataless | {t.name for t in branch.initializer if t.data_type in INTEGERS}
                    kept, outputs = [], {o.name for o in branch.output}
                    for m in branch.node:
                        if _reads_no_data(m, local, known) and not set(m.output) & outputs:
                            out.append(m)
                            local.update(m.output)
                            dataless.update(m.output)
                            known.update(m.output)
                            step += 1
                        else:
                            kept.append(m)
                    if len(kept) != len(branch.node):
                        inits = [t for t in branch.initializer]  # a moved node may read one: move them all up
                        graph.initializer.extend(inits)
                        del branch.initializer[:]
                        del branch.node[:]
                        branch.node.extend(kept)
            out.append(n)
            known.update(n.output)
        del graph.node[:]
        graph.node.extend(out)
        moved += step
        if not step:
            return moved
