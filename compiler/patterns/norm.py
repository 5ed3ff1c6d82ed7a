"""Normalisations recognised by their pattern, not by the builtin that made them.

Why: the report labels a parameter by what it does (params.role). A norm written from
primitives -- ``x / sqrt(mean(x * x, -1, keepdims=true) + eps) * w`` with ``w = parameter([d])``,
Gemma's ``* (1.0 + w)``, or a layer norm with a shift -- is still a norm, and calling it
"(parameter)" because no ``rmsnorm`` node uses the weight would be a label taken from the
builtin rather than the computation.

The patterns (patterns/matcher.py): a value is *normalised* when it is ``a / s`` or ``a * (c / s)`` and ``s`` is
``sqrt`` of a ``mean`` over the last axis (plus, optionally, a constant eps). A rank-1
parameter multiplied with a normalised value (directly or as ``w + c``) is a norm's scale; one
added to such a product is its shift.
"""

from __future__ import annotations

from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.patterns.matcher import Pat, any_of, match


def _constant(g: Graph, value: str, node: Node | None) -> str | None:
    return None if value in g.consts else f"{value} is not a constant"


def _vector(g: Graph, value: str, node: Node | None) -> str | None:
    return None if value in g.params and len(g.params[value].shape) == 1 else f"{value} is not a rank-1 parameter"


def _last_axis(g: Graph, value: str, node: Node | None) -> str | None:
    if node is None or node.op != "mean":
        return None  # the op itself is Pat's to judge
    rank = g.type_of(node.inputs[0]).rank
    return None if [a % rank for a in node.attrs["axes"]] == [rank - 1] else "the mean is not over the last axis"


_MEAN = Pat("mean", check=_last_axis)
# sqrt(mean(..., last axis) [+ constant])
STATISTIC = Pat("sqrt", (any_of(_MEAN, Pat("add", (_MEAN, Pat(check=_constant)), commutative=True)),))
# a / s, or a * (c / s)
NORMALISED = any_of(Pat("div", (Pat(), STATISTIC)),
                    Pat("mul", (Pat(), Pat("div", (Pat(check=_constant), STATISTIC))), commutative=True))
# a normalised value times a rank-1 parameter, itself or plus a constant (Gemma's 1 + w)
SCALED = Pat("mul", (NORMALISED, any_of(Pat(name="scale", check=_vector),
                                        Pat("add", (Pat(name="scale", check=_vector), Pat(check=_constant)),
                                            commutative=True))), commutative=True)


def norm_parameters(g: Graph) -> set[str]:
    """Paths of the parameters that scale (``SCALED``) or then shift (a rank-1 parameter added to a
    scaled value) a normalised value: the norms written by hand."""
    found: set[str] = set()
    scaled: set[str] = set()
    for n in g.nodes.values():
        if n.op == "mul" and len(n.inputs) == 2:
            m = match(g, SCALED, n.outputs[0])
            if m:
                found.add(m["scale"])
                scaled.add(n.outputs[0])

    def _scaled(graph: Graph, value: str, node: Node | None) -> str | None:
        return None if value in scaled else f"{value} is not a scaled normalised value"

    shifted = Pat("add", (Pat(check=_scaled), Pat(name="shift", check=_vector)), commutative=True)
    for n in g.nodes.values():
        if n.op == "add" and len(n.inputs) == 2:
            m = match(g, shifted, n.outputs[0])
            if m:
                found.add(m["shift"])
    return found
