"""The op registry: every primitive op of the IR is defined once, here, by name.

An ``OpDef`` gathers everything the compiler knows about one op, so that no
consumer keeps its own table keyed by op names:

- ``rule``: the type rule (shape inference), ``(input types, attrs) -> output types``,
  raising ``ShapeError`` with a message that says what did not fit;
- ``reference``: numpy semantics, ``(input arrays, attrs, ev) -> array``, where ``ev``
  evaluates a (symbolic) dimension at the run's bindings; the interpreter runs these;
- ``cost``: a ``Cost`` (see ``free``, ``per_element``, ``product``, ``custom``): the
  multiply-adds and FLOPs by category that analysis/cost.py reports;
- ``saved``: what the backward pass keeps (analysis/memory.py): a tuple of input
  positions and ``"out"`` (``()``: nothing), or a function ``(node, needs_grad) -> values``
  for products, whose operands are kept only when the other one needs a gradient;
- ``traits``: facts other modules ask about (see ``TRAITS``).

How an op becomes ONNX is not here but in the backend: backends/onnx/lowerings/ maps each op
name to its lowering (tests/spec/test_op_registry.py checks that it covers every op), so this package
imports no backend, no analysis and no pass.

Every facet is required: registering an op without one raises ``RegistryError``
at import, so an op can no longer be silently free in the cost report or keep
nothing in the memory estimate because a table was not updated.

How to add an op (say ``conv1d``)
---------------------------------
1. Define it once in the module of its family (``ops/linalg.py`` for products,
   ``ops/elementwise.py``, ``ops/norm.py``, ``ops/layout.py``, ``ops/attention.py``,
   ``ops/generators.py``), with ``@op("name", ...)`` on its type rule and every facet
   given; a new family module must be imported in ``ops/__init__.py``.
2. Add its ONNX lowering to the table of its family in ``backends/onnx/lowerings/``
   (``LOWERINGS["name"] = lower``, a function of ``L``, builder.Lowering).
3. If the language should expose it, add a builtin in ``frontend/builtins.py`` that
   checks the arguments, creates parameters and calls ``call.emit("name", ...)``.
4. Test it against an independent reference (tests/spec/test_op_registry.py already checks
   that every op has every facet and a lowering, and that every op the builtins and passes
   emit is registered), and document it: docs/language.md for a builtin, docs/report.md's
   cost tables for its MACs/FLOPs.
Nothing else: the interpreter, the cost and memory analyses and the structure/parameter
reports dispatch through ``get(name)`` and trait queries, the ONNX exporter through its table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, TensorType


class ShapeError(Exception):
    """An op's inputs or attributes do not fit its type rule."""


class RegistryError(Exception):
    """An op definition is incomplete or registered twice (a programming error, found at import)."""


class UnknownOp(LookupError):
    """A graph names an op that no module defines."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown op"


# Traits an op may carry; a misspelt trait is a registration error.
TRAITS = {
    "elementwise": "pointwise math: each output element depends on the same position of the inputs",
    "alias": "a view: the output shares its input's memory (ONNX Reshape/Identity/Expand)",
    "dense": "a product with weights (projections, convolutions): the N·D² work; input 1 is the weight",
    "matmul_class": "work counted as multiply-adds and run at tensor-core (matmul) peak",
    "conv": "a convolution (its parameters are reported as a convolution)",
    "quantized": "a quantised linear: input 1 the weight's integer values, input 2 their scales, input 3 the "
                 "optional bias, or with attribute zero_points 1 the zero points and input 4 the bias "
                 "(compiler/passes/quantize.py)",
}


@dataclass(frozen=True)
class Cost:
    """How analysis/cost.py counts an op. ``kind`` is one of

    - ``free``: moves or reads data, no arithmetic;
    - ``per_element``: ``per`` FLOPs of ``category`` per output element (scaled to the
      masked-in score pairs when the op sits inside a causal attention core);
    - ``product``: ``macs(c)`` multiply-adds, 2 FLOPs each, plus one bias add per output
      element when a ``dense`` op has a third (bias) input;
    - ``custom``: ``macs(c)`` (or none) and ``flops(c) -> {category: Poly}``.

    With ``per_pair`` the op's work scales with the query-key pairs a mask lets through:
    ``c.pairs`` is then that count (None: all of them) and ``c.macs`` the MACs at that count.
    ``c`` is analysis/cost.py's ``CostContext``."""

    kind: str
    category: str = ""
    per: int | Fraction = 0
    macs: Callable | None = None
    flops: Callable | None = None
    per_pair: bool = False


def free() -> Cost:
    return Cost("free")


def per_element(category: str, per: int) -> Cost:
    return Cost("per_element", category, per)


def product(macs: Callable) -> Cost:
    return Cost("product", macs=macs)


def custom(flops: Callable, macs: Callable | None = None, per_pair: bool = False) -> Cost:
    return Cost("custom", flops=flops, macs=macs, per_pair=per_pair)


Rule = Callable[[list[TensorType], dict], list[TensorType]]


@dataclass(frozen=True)
class OpDef:
    name: str
    rule: Rule
    reference: Callable
    cost: Cost
    saved: tuple | Callable
    traits: frozenset = field(default_factory=frozenset)
    doc: str = ""


_OPS: dict[str, OpDef] = {}
_MISSING = object()


def op(*names: str, reference=_MISSING, cost=_MISSING, saved=_MISSING, traits=()):
    """Decorate a type rule to register ops under ``names`` with the given facets.

    Several names may share a rule; a facet (or ``traits``) may then be a dict {name: facet}
    to differ per op."""
    def deco(rule: Rule) -> Rule:
        for n in names:
            tr = traits.get(n, ()) if isinstance(traits, dict) else traits
            facets = {"reference": reference, "cost": cost, "saved": saved}
            facets = {k: (v.get(n, _MISSING) if isinstance(v, dict) else v) for k, v in facets.items()}
            missing = [k for k, v in facets.items() if v is _MISSING]
            if missing:
                raise RegistryError(f"op '{n}' is missing its {', '.join(missing)} facet(s)")
            register(OpDef(n, rule, facets["reference"], facets["cost"], facets["saved"],
                           frozenset(tr), (rule.__doc__ or "").strip()))
        return rule
    return deco


def register(d: OpDef) -> OpDef:
    if d.name in _OPS:
        raise RegistryError(f"op '{d.name}' is defined twice")
    bad = set(d.traits) - set(TRAITS)
    if bad:
        raise RegistryError(f"op '{d.name}': unknown trait(s) {sorted(bad)}; known: {sorted(TRAITS)}")
    if not isinstance(d.cost, Cost) or d.cost.kind not in ("free", "per_element", "product", "custom"):
        raise RegistryError(f"op '{d.name}': cost must be a registry.Cost, got {d.cost!r}")
    if (d.cost.kind == "product" and d.cost.macs is None) or (d.cost.kind == "custom" and d.cost.flops is None):
        raise RegistryError(f"op '{d.name}': a {d.cost.kind} cost needs its counting function")
    if not (callable(d.saved) or (isinstance(d.saved, tuple)
                                  and all(p == "out" or isinstance(p, int) for p in d.saved))):
        raise RegistryError(f"op '{d.name}': saved must be a tuple of input positions and 'out', or a function")
    for facet in ("rule", "reference"):
        if not callable(getattr(d, facet)):
            raise RegistryError(f"op '{d.name}': its {facet} facet is not callable")
    _OPS[d.name] = d
    return d


def get(name: str) -> OpDef:
    """The definition of an op; ``UnknownOp`` names it when no module defines it."""
    d = _OPS.get(name)
    if d is None:
        raise UnknownOp(f"unknown op '{name}': no definition in tessera.compiler.ops "
                        f"(known ops: {', '.join(sorted(_OPS))})")
    return d


def is_registered(name: str) -> bool:
    return name in _OPS


def all_ops() -> dict[str, OpDef]:
    return dict(_OPS)


def with_trait(trait: str) -> frozenset[str]:
    """Names of the ops carrying a trait (e.g. ``with_trait("dense")``)."""
    if trait not in TRAITS:
        raise KeyError(f"unknown trait '{trait}'; known: {sorted(TRAITS)}")
    return frozenset(n for n, d in _OPS.items() if trait in d.traits)


def has_trait(name: str, trait: str) -> bool:
    """Whether op ``name`` carries ``trait``; an unknown op carries none."""
    d = _OPS.get(name)
    return d is not None and trait in d.traits


# ------------------------------------------------------------------ type checking entry points
def infer(op_name: str, types: list[TensorType], attrs: dict) -> list[TensorType]:
    return get(op_name).rule(types, attrs)


def check_graph(graph: Graph) -> None:
    """Re-run every node's type rule; raise ShapeError naming the first node that fails."""
    for node in graph.nodes.values():
        types = [graph.type_of(v) for v in node.inputs]
        try:
            out = infer(node.op, types, node.attrs)
        except (ShapeError, UnknownOp) as e:
            raise ShapeError(f"node {node.name}: {e}") from None
        for o, t in zip(node.outputs, out):
            have = graph.type_of(o)
            if have.dtype != t.dtype or not dims.shapes_equal(have.shape, t.shape):
                raise ShapeError(f"node {node.name}: output {o} is {have}, rules give {t}")
