"""Recurrence: ``scan``, a step function carried over the sequence axis (axis 1, batch first).

A ``scan`` node holds its step function as an IR graph of its own (``Body``), elaborated once
from a block (the ``scan`` builtin, compiler/frontend/recurrence.py). The body's inputs are, in
order, the carried states, one slice of each per-step input (the sequence axis removed) and the
captured tensors (the step's parameters, and tensors passed with ``args=``, the same at every
step); its outputs are the new states and then the per-step outputs. The node's inputs follow the
same order (initial states, whole sequences, captured tensors) and its outputs are the final
states and then the per-step outputs stacked along axis 1, as ONNX's ``Scan``.

Why a body graph and not an unrolled loop: the sequence length ``T`` is symbolic, so the step
cannot be repeated at compile time; one body serves every length and is costed once (× T).

Lowering (backends/onnx/recurrence.py; attribute ``lowering``, set by compiler/passes/recurrence.py):
onnx's own ``RNN``/``GRU``/``LSTM`` op when the body is exactly the standard library's cell
(compiler/patterns/recurrence.py says when), otherwise ONNX ``Scan`` with the body lowered op by
op through the lowering table.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, TensorType
from tessera.compiler.ops.execute import execute
from tessera.compiler.ops.registry import ShapeError, custom, op


class Body:
    """A scan's step function: an IR graph (inputs: states, step inputs, captured; outputs: new
    states, step outputs). Listed by its size and a digest of its contents, so two bodies that
    differ never share a memoised cost."""

    def __init__(self, graph: Graph):
        self.graph = graph

    def digest(self) -> str:
        return hashlib.sha1(self.graph.dump().encode()).hexdigest()[:10]

    def __repr__(self) -> str:
        return f"<body {self.graph.name}: {len(self.graph.nodes)} nodes, {self.digest()}>"

    __str__ = __repr__

    def __deepcopy__(self, memo):
        return Body(self.graph.copy())


def parts(attrs: dict, items: list) -> tuple[list, list, list]:
    """(states, per-step inputs, captured) of a scan node's inputs (or their types, or arrays)."""
    k, m = attrs["n_state"], attrs["n_seq"]
    return items[:k], items[k:k + m], items[k + m:]


def step_type(t: TensorType) -> TensorType:
    """One step's slice of a per-step input [B, T, ...]: [B, ...]."""
    return TensorType(t.dtype, t.shape[:1] + t.shape[2:])


def _same(a: TensorType, b: TensorType) -> bool:
    return a.dtype == b.dtype and dims.shapes_equal(a.shape, b.shape)


# ------------------------------------------------------------------ type rule
def _scan_rule(t, a):
    """Carry ``n_state`` states over axis 1 of ``n_seq`` per-step inputs through the body."""
    body = a["body"].graph
    states, seqs, caps = parts(a, list(t))
    if len(t) != len(body.inputs):
        raise ShapeError(f"scan has {len(t)} inputs but its step takes {len(body.inputs)}")
    if not seqs:
        raise ShapeError("scan needs at least one per-step input (a tensor [B, T, ...])")
    for s in seqs:
        if s.rank < 2:
            raise ShapeError(f"a per-step input must be [B, T, ...] (the sequence on axis 1), got {s}")
        if not dims.equal(s.shape[1], seqs[0].shape[1]):
            raise ShapeError(f"per-step inputs have different lengths on axis 1: {seqs[0]} and {s}")
    want = [body.type_of(v) for v in body.inputs]
    for i, (have, w) in enumerate(zip(states + [step_type(s) for s in seqs] + caps, want)):
        if not _same(have, w):
            raise ShapeError(f"scan input {i} is {have}, its step expects {w}")
    outs = [body.type_of(v) for v in body.outputs]
    k = a["n_state"]
    for i, (new, old) in enumerate(zip(outs[:k], states)):
        if not _same(new, old):
            raise ShapeError(f"the step returns state {i} as {new}, but it carries {old}: a state must keep "
                             f"its shape and dtype from step to step")
    for y in outs[k:]:
        if y.rank < 1:
            raise ShapeError(f"a per-step output must have a batch axis, got {y}")
    length = seqs[0].shape[1]
    return list(states) + [TensorType(y.dtype, y.shape[:1] + (length,) + y.shape[1:]) for y in outs[k:]]


# ------------------------------------------------------------------ numpy reference
def _scan_ref(x, a, ev):
    body = a["body"].graph
    states, seqs, caps = parts(a, list(x))
    k = a["n_state"]
    length = seqs[0].shape[1]
    steps = range(length - 1, -1, -1) if a["reverse"] else range(length)
    ys: list[list] = [[None] * length for _ in body.outputs[k:]]
    for t in steps:
        feeds = dict(zip(body.inputs, [*states, *[s[:, t] for s in seqs], *caps]))
        outs = execute(body, feeds, ev)
        states = outs[:k]
        for j, y in enumerate(outs[k:]):
            ys[j][t] = y
    return [*states, *[np.stack(y, axis=1) for y in ys]]


# ------------------------------------------------------------------ cost: the body's, once per step
# (analysis/cost.py counts a scan node from its body itself, splitting its MACs by kind; these
# facets give the same totals through the cost context's ``subgraph``)
def _steps(c):
    return c.dim(c.type(c.attrs["n_state"]).shape[1])


def _scan_macs(c):
    macs, _ = c.subgraph(c.attrs["body"].graph)
    return macs * _steps(c)


def _scan_flops(c):
    _, flops = c.subgraph(c.attrs["body"].graph)
    return {k: v * _steps(c) for k, v in flops.items()}


def _scan_saved(node, needs_grad) -> list:
    """Backward through time keeps every step's states and outputs (the stacked outputs) and the inputs."""
    k, m = node.attrs["n_state"], node.attrs["n_seq"]
    return list(node.inputs[:k + m]) + list(node.outputs)


@op("scan", reference=_scan_ref, cost=custom(_scan_flops, macs=_scan_macs),
    saved=_scan_saved, traits=("matmul_class",))
def _scan(t, a):
    """Carry attrs["n_state"] states over axis 1 of attrs["n_seq"] per-step inputs through attrs["body"];
    outputs: the final states, then the per-step outputs stacked on axis 1."""
    return _scan_rule(t, a)
