"""The ``scan`` builtin: a block carried over the sequence axis as one ``scan`` node.

``scan(step, init, xs, args=[], reverse=false)`` elaborates the block ``step`` once, into a graph of
its own (the node's body, compiler/ops/recurrence.py), called as ``step(state..., x_t..., arg...)``:
the states (``init``: a tensor or a list), one step's slice of each per-step input (``xs``: a tensor
[B, T, ...] or a list of them, the sequence on axis 1) and then ``args`` (tensors, the same at every
step, e.g. the encoder states an attention decoder reads, and compile-time values). The step returns
the new state (a tensor) or a list: the new states first, then the per-step outputs; without
per-step outputs the states themselves are the outputs. ``scan`` returns a list: the per-step
outputs stacked on axis 1 ([B, T, ...]), then the final states.

Why elaborate once into a separate graph: the length ``T`` is symbolic, so the step cannot be
unrolled, and one body is what ONNX's Scan and the RNN/GRU/LSTM ops take. builtins.py registers it,
so the dependency runs one way (builtins -> recurrence). The step's parameters
(its linears) are created once, in the scan's scope, and belong to the model; inside the body they
are captured inputs.
"""

from __future__ import annotations

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph
from tessera.compiler.frontend.values import REQUIRED, BlockRef, Tensor, describe
from tessera.compiler.ops.recurrence import Body, step_type

# The standard library's cells, which the ONNX lowering may replace by onnx's own op
# (compiler/patterns/recurrence.py checks that the body is exactly that cell).
STDLIB_CELLS = {"rnn_cell": "rnn", "gru_cell": "gru", "lstm_cell": "lstm"}


def _tensors(call, arg, what: str, allow_empty: bool = False) -> list[Tensor]:
    value, pos = arg
    items = value if isinstance(value, list) else [value]
    if not items and not allow_empty:
        raise call.error(f"'{what}' must be a tensor or a non-empty list of tensors, got an empty list", pos)
    for v in items:
        if not isinstance(v, Tensor):
            raise call.error(f"'{what}' must be a tensor or a list of tensors, got {describe(v)}", pos)
    return items


# the parameters of the ``scan`` builtin, which builtins.py registers (this module does not import it)
PARAMS = (("step", REQUIRED), ("init", REQUIRED), ("xs", REQUIRED), ("args", []), ("reverse", False))


def scan(call, step, init, xs, args, reverse):
    """Carry the block `step` over axis 1 of `xs` from the state(s) `init` (reverse=true: from the end). Returns [per-step outputs stacked on axis 1..., final states...]."""
    elab = call.elab
    block, bpos = step
    if not isinstance(block, BlockRef):
        raise call.error(f"'step' must be a block (the step function), got {describe(block)}", bpos)
    rev, rpos = reverse
    if not isinstance(rev, bool):
        raise call.error(f"'reverse' must be true or false, got {describe(rev)}", rpos)
    states = _tensors(call, init, "init")
    seqs = _tensors(call, xs, "xs")
    for s in seqs:
        if s.type.rank < 2:
            raise call.error(f"'xs' must be [B, T, ...] (the sequence on axis 1), got {s.type}", xs[1])
        if not dims.equal(s.type.shape[1], seqs[0].type.shape[1]):
            raise call.error(f"the per-step inputs differ in length: {seqs[0].type} and {s.type}", xs[1])
    extra, epos = args
    if not isinstance(extra, list):
        raise call.error(f"'args' must be a list, got {describe(extra)}", epos)

    outer = elab.graph
    body = Graph(f"{block.block.name}_step")
    arg_values = [Tensor(body.add_input(f"state{i}", s.type).name, s.type) for i, s in enumerate(states)]
    arg_values += [Tensor(body.add_input(f"x{i}", step_type(s.type)).name, step_type(s.type))
                   for i, s in enumerate(seqs)]
    captured: list[Tensor] = []
    for i, v in enumerate(extra):
        if isinstance(v, Tensor):
            captured.append(v)
            arg_values.append(Tensor(body.add_input(f"arg{i}", v.type).name, v.type))
        else:
            arg_values.append(v)
    elab.outer_graphs.append(outer)
    elab.graph = body
    try:
        result = elab.call_block(block.block, [(v, call.pos) for v in arg_values], {}, call.pos,
                                 call.explicit_name, None)
    finally:
        elab.graph = outer
        elab.outer_graphs.pop()

    outs = result if isinstance(result, list) else [result]
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        raise call.error(f"the step block {block.block.name} must return a tensor or a list of tensors "
                         f"(new states, then per-step outputs), got {describe(result)}")
    k = len(states)
    if len(outs) < k:
        raise call.error(f"the step block {block.block.name} returns {len(outs)} tensor(s) but carries "
                         f"{k} state(s): return the new states first")
    for i, (new, old) in enumerate(zip(outs[:k], states)):
        if new.type.dtype != old.type.dtype or not dims.shapes_equal(new.type.shape, old.type.shape):
            raise call.error(f"the step block {block.block.name} returns state {i} as {new.type}, but it "
                             f"carries {old.type}: a state must keep its shape and dtype from step to step")
    step_outs = outs[k:] or outs[:k]
    body.outputs = [o.name for o in outs[:k] + step_outs]

    # The step's parameters belong to the model; in the body they become captured inputs.
    params = []
    for path, p in list(body.params.items()):
        v = outer.add_param(p)
        params.append(Tensor(v.name, v.type))
        del body.params[path]
        body.values[path].kind = "input"
        body.inputs.append(path)
    cell = STDLIB_CELLS.get(block.block.name) if block.block.pos.file.startswith("<stdlib>") else None
    attrs = {"body": Body(body), "n_state": k, "n_seq": len(seqs), "reverse": rev}
    if cell:
        attrs["cell"] = cell
    # elab.emit, not call.emit: the block call above already claimed this call's name= segment
    name = elab.scope_path(call.explicit_name[0]) if call.explicit_name else None  # dec, enc.fwd.cell
    if name is not None and (name in elab.graph.values or name in elab.graph.nodes):
        name = None
    nodes = elab.emit("scan", states + seqs + captured + params, attrs, call.pos, n_out=k + len(step_outs),
                      name=name)
    return nodes[k:] + nodes[:k]

