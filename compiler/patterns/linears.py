"""A linear whose weights (and bias) are parameters of its own: what passes/fuse_linears.py may
concatenate with the other linears reading the same input.

One pattern per op (``OWN_WEIGHT_LINEAR``): ``linear`` (x, weight, optional bias) and
the quantised forms ``linear_nbits`` and ``linear_int8`` (x, quantised weight, scales, optional bias). Each weight must be
a parameter that nothing but this one linear reads, once (a tied head is left alone: the token
table is also gathered by the embedding); the bias, when there is one, a vector parameter of its
own likewise. Captured: ``x``, the weights ``w0`` (and ``w1``), and ``bias`` when present."""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.patterns.matcher import Pat


def _own_param(graph: Graph, value: str, node: Node | None) -> str | None:
    v = graph.values.get(value)
    if v is None or v.kind != "param":
        return f"{value} is not a parameter"
    users = graph.consumers(value)
    if len(users) != 1 or users[0].inputs.count(value) != 1:
        return f"{value} is read by more than this linear"
    return None


def _own_vector(graph: Graph, value: str, node: Node | None) -> str | None:
    return _own_param(graph, value, node) or (None if len(graph.params[value].shape) == 1 else f"{value} is not a vector")


_X = Pat(name="x")
OWN_WEIGHT_LINEAR = {
    "linear": Pat("linear", (_X, Pat(name="w0", check=_own_param), Pat(name="bias", check=_own_vector)), optional=1),
    "linear_int8": Pat("linear_int8", (_X, Pat(name="w0", check=_own_param), Pat(name="w1", check=_own_param),
                                       Pat(name="bias", check=_own_vector)), optional=1),
    # zero points (or a bias) third, then a bias (after zero points): both parameters of this linear alone
    # (block mins, compiler/passes/stored_codes.py, fourth after the zero points)
    "linear_nbits": Pat("linear_nbits", (_X, Pat(name="w0", check=_own_param), Pat(name="w1", check=_own_param),
                                         Pat(name="w2", check=_own_param), Pat(name="w3", check=_own_param),
                                         Pat(name="bias", check=_own_vector)),
                        optional=3),
}
