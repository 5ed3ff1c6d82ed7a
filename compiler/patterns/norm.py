"""Normalisations recognised by their pattern, not by the builtin that made them.

Why: the report labels a parameter by what it does (params.role). A norm written from
primitives -- ``x / sqrt(mean(x * x, -1, keepdims=true) + eps) * w`` with ``w = parameter([d])``,
Gemma's ``* (1.0 + w)``, or a layer norm with a shift -- is still a norm, and calling it
"(parameter)" because no ``rmsnorm`` node uses the weight would be a label taken from the
builtin rather than the computation.

The pattern: a value is *normalised* when it is ``a / s`` or ``a * (c / s)`` and ``s`` is
``sqrt`` of a ``mean`` over the last axis (plus, optionally, a constant eps). A rank-1
parameter multiplied with a normalised value (directly or as ``w + c``) is a norm's scale; one
added to such a product is its shift.
"""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph


def _producer(g: Graph, value: str):
    return g.producer(value)


def _is_statistic(g: Graph, value: str) -> bool:
    """sqrt(mean(..., last axis) [+ constant])."""
    p = _producer(g, value)
    if p is None or p.op != "sqrt":
        return False
    inner = _producer(g, p.inputs[0])
    if inner is not None and inner.op == "add":
        stat = [_producer(g, v) for v in inner.inputs if v not in g.consts]
        if len(stat) != 1:
            return False
        inner = stat[0]
    if inner is None or inner.op != "mean":
        return False
    rank = g.type_of(inner.inputs[0]).rank
    return [a % rank for a in inner.attrs["axes"]] == [rank - 1]


def _is_normalised(g: Graph, value: str) -> bool:
    p = _producer(g, value)
    if p is None:
        return False
    if p.op == "div":
        return _is_statistic(g, p.inputs[1])
    if p.op == "mul":  # a * (c / s)
        for v in p.inputs:
            q = _producer(g, v)
            if q is not None and q.op == "div" and q.inputs[0] in g.consts and _is_statistic(g, q.inputs[1]):
                return True
    return False


def _vector_param(g: Graph, value: str) -> str | None:
    """A rank-1 parameter, itself or plus a constant (Gemma's 1 + w)."""
    if value in g.params and len(g.params[value].shape) == 1:
        return value
    p = _producer(g, value)
    if p is not None and p.op == "add":
        params = [v for v in p.inputs if v in g.params and len(g.params[v].shape) == 1]
        if len(params) == 1 and all(v in g.consts for v in p.inputs if v != params[0]):
            return params[0]
    return None


def norm_parameters(g: Graph) -> set[str]:
    """Paths of the parameters that scale or shift a normalised value (hand-written norms)."""
    found: set[str] = set()
    scaled: set[str] = set()
    for n in g.nodes.values():
        if n.op != "mul" or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        for x, w in ((a, b), (b, a)):
            path = _vector_param(g, w)
            if path is not None and _is_normalised(g, x):
                found.add(path)
                scaled.add(n.outputs[0])
    for n in g.nodes.values():
        if n.op == "add" and len(n.inputs) == 2:
            for x, w in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
                if x in scaled and w in g.params and len(g.params[w].shape) == 1:
                    found.add(w)
    return found
