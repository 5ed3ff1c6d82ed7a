"""One small pattern matcher over the IR's dataflow: patterns are data, a failed match says why.

A ``Pat`` describes a value by the node that produces it: the op (or ops) it must be, the patterns
of that node's inputs, and conditions on the value (a parameter, read by nothing outside the
match). ``match(graph, pat, value)`` walks the producers and returns a ``MatchResult``: on success
the captured values and the matched nodes, on failure the reason and the node where it failed, so
``--explain`` can point at that node's spec line instead of only saying "no".

The models are tinygrad's ``UPat`` (a tree of op names with named captures; a name captured twice
must be the same value) and onnxscript's rewriter (``MatchResult.fail(reason, node)``). What this
does not do: search. A recogniser picks the value to start from (a topk_gates node's consumers,
a scan's body) and the pattern is checked from there, so a failure is always about that site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tessera.compiler.ir.graph import Graph, Node

Check = Callable[[Graph, str, "Node | None"], "str | None"]


@dataclass(frozen=True)
class Pat:
    """A pattern for one value.

    ``op``: the producer's op name or names (None: any value, a leaf); ``inputs``: the producer's
    input patterns in order (None: not looked at), the last ``optional`` of which may be absent;
    ``commutative``: two inputs that may come in either order; ``name``: capture the value (and its
    producer as ``name + ".node"``); ``param``: the value must be a parameter; ``private``: nothing
    outside the match reads it (one reading node, not a graph output); ``check(graph, value, node)``
    returns a reason when a further condition fails, and runs first, so it may word the failure of
    ``op`` itself; ``why``: the reason when the op, the inputs' count or ``param`` do not fit
    (``{op}`` is the producer's op, ``{value}`` the value); ``outside``: when ``private`` does not
    hold; ``differs``: when ``name`` is already bound to another value."""

    op: str | tuple[str, ...] | None = None
    inputs: tuple["Pat", ...] | None = None
    name: str | None = None
    optional: int = 0
    commutative: bool = False
    param: bool = False
    private: bool = False
    check: Check | None = None
    why: str = "{value} is {op}"
    outside: str = "{value} is used outside the pattern"
    differs: str = "'{name}' is two different values ({a} and {b})"


@dataclass(frozen=True)
class AnyOf(Pat):
    """One of several patterns for the same value, tried in order: the first that matches wins (its
    captures kept); when none does, the failure of the option that matched the most nodes before it
    failed is the reason (the first such; at a node rather than a graph input), as for the two orders
    of a commutative pattern."""

    options: tuple[Pat, ...] = ()


def any_of(*options: Pat) -> AnyOf:
    return AnyOf(options=tuple(options))


@dataclass
class MatchResult:
    """A match, or a failure with its reason and the node that did not fit (None: a graph input)."""

    ok: bool
    captured: dict = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    reason: str = ""
    node: Node | None = None

    @classmethod
    def fail(cls, reason: str, node: Node | None = None) -> "MatchResult":
        return cls(False, reason=reason, node=node)

    def __bool__(self) -> bool:
        return self.ok

    def __getitem__(self, name: str):
        return self.captured[name]

    @property
    def where(self):
        """The spec position of the node that failed (its user-level origin first), or None."""
        if self.node is None:
            return None
        return self.node.origin or self.node.pos


def private(graph: Graph, value: str) -> bool:
    """Whether exactly one node reads ``value`` and it is not a graph output."""
    return len(graph.consumers(value)) == 1 and value not in graph.outputs


def match(graph: Graph, pat: Pat, value: str, captured: dict | None = None) -> MatchResult:
    """Match ``pat`` at ``value``; ``captured`` (updated on success) holds names already bound."""
    captured = dict(captured or {})
    nodes: list[Node] = []
    fail = _walk(graph, pat, value, captured, nodes)
    return fail if fail is not None else MatchResult(True, captured, nodes)


def _walk(graph: Graph, pat: Pat, value: str, captured: dict, nodes: list[Node]) -> MatchResult | None:
    if isinstance(pat, AnyOf):
        return _walk_any(graph, pat, value, captured, nodes)
    node = graph.producer(value)
    where = node
    if pat.check is not None:
        reason = pat.check(graph, value, node)
        if reason:
            return MatchResult.fail(reason, where)
    op = node.op if node is not None else "an input"
    if pat.param and value not in graph.params:
        return MatchResult.fail(pat.why.format(op=op, value=value), where)
    if pat.private and not private(graph, value):
        users = graph.consumers(value)
        return MatchResult.fail(pat.outside.format(value=value), users[-1] if users else where)
    if pat.name is not None:
        if pat.name in captured and captured[pat.name] != value:
            return MatchResult.fail(pat.differs.format(name=pat.name, a=captured[pat.name], b=value), where)
        captured[pat.name] = value
        if node is not None:
            captured[pat.name + ".node"] = node
    if pat.op is None:
        return None
    wanted = (pat.op,) if isinstance(pat.op, str) else pat.op
    if node is None or node.op not in wanted:
        return MatchResult.fail(pat.why.format(op=op, value=value), where)
    nodes.append(node)
    if pat.inputs is None:
        return None
    n = len(node.inputs)
    if not len(pat.inputs) - pat.optional <= n <= len(pat.inputs):
        return MatchResult.fail(pat.why.format(op=f"{op} of {n} inputs", value=value), where)
    orders = [list(node.inputs)]
    if pat.commutative and n == 2:
        orders.append(list(reversed(node.inputs)))
    first_failure = None
    for order in orders:
        trial_captured, trial_nodes = dict(captured), list(nodes)
        failure = None
        for sub, v in zip(pat.inputs, order):
            failure = _walk(graph, sub, v, trial_captured, trial_nodes)
            if failure is not None:
                break
        if failure is None:
            captured.clear()
            captured.update(trial_captured)
            nodes[:] = trial_nodes
            return None
        depth = (len(trial_nodes), failure.node is not None)  # how far it got: a node beats a graph input
        if first_failure is None or depth > first_failure[1]:
            first_failure = (failure, depth)
    return first_failure[0]


def _walk_any(graph: Graph, pat: AnyOf, value: str, captured: dict, nodes: list[Node]) -> MatchResult | None:
    first_failure = None
    for option in pat.options:
        trial_captured, trial_nodes = dict(captured), list(nodes)
        failure = _walk(graph, option, value, trial_captured, trial_nodes)
        if failure is None:
            captured.clear()
            captured.update(trial_captured)
            nodes[:] = trial_nodes
            return None
        depth = (len(trial_nodes), failure.node is not None)  # how far it got: a node beats a graph input
        if first_failure is None or depth > first_failure[1]:
            first_failure = (failure, depth)
    if first_failure is None:
        return MatchResult.fail(f"{value}: no option given", graph.producer(value))
    return first_failure[0]
