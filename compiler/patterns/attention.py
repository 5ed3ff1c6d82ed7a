"""The one attention recogniser: what is scaled-dot-product attention, and can one kernel replace it.

Used by the fusion pass (passes/fuse_attention.py), the kernel choice
(passes/attention_kernels.py) and the report's structure analysis
(analysis/structure.py), so ``--explain`` and the report always agree on which
softmax is attention and what it covers. It lives in patterns/, below both
passes/ and analysis/, so that both read the one recogniser.

A match starts at a softmax. Forward, the weights must reach a matmul as its
left operand (the ·V matmul), optionally through pass-through ops. Backward,
the walk follows the scores through ``SCORE_RULES`` to the Q·Kᵀ matmul. The
table is tinygrad-pattern-matcher style, one row per op that may sit on the
score path: (op, check, absorb, scores, feature), where

- ``check`` says why the fused kernel cannot absorb that node (None: it can),
- ``absorb`` records what the node contributes to the fused node (the
  rewrite description: scale, causal window, padding mask, additive bias),
- ``scores`` names the operand that carries the scores, so the walk goes on,
- ``feature`` names the score-epilogue feature (compiler/reference/score_epilogue.py
  ``FEATURES``) the absorbed node becomes. A feature the epilogue does not know, a
  rule with none, an absorb that records nothing, features in an order the
  epilogue does not apply them in, or two features of one stage not declared to
  commute keep the site unfused with that reason, so a new
  rule can never be fused into a kernel that would ignore it (the kernels' allow-lists
  and passes/attention_kernels.py ``no_kernel`` do the rest).

An op missing from the table ends the walk: that softmax is not attention
(``NoMatch`` with the reason). A failed ``check`` does not: the site is still
attention (the report counts its N² work and its KV cache) but the match keeps
the first reason no fused kernel can replace it, which ``--explain`` prints.

``s - c`` with a scalar constant c is fused as an additive bias of -c: IEEE
subtraction of c equals addition of -c, so the bias step is exact and the fused
site differs from the unfused graph only as every fused site does (the order the
scale is applied in). Refusing it instead would be wrong in the other direction:
softmax is shift-invariant, so the site is attention either way. A tensor
subtracted from the scores is refused (the kernel adds its bias), by fusion and
report alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import numpy as np

from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, Node
from tessera.compiler.patterns.matcher import Pat
from tessera.compiler.patterns.matcher import match as match_pattern
from tessera.compiler.reference import score_epilogue

# Local op traits (kept here until ops/ has a registry). Ops that only convert or relabel a tensor:
# the weights may pass through them on the way to ·V (the site is still attention, not fusable).
PASS_THROUGH = {"cast", "identity"}
# The op a fused kernel is made into, and the one a fused site is read back from.
FUSED_OP = "fused_attention"


@dataclass
class AttentionMatch:
    """One attention: scores = Q·Kᵀ, then the score path, softmax, then ·V."""

    anchor: str                  # the softmax (the fused_attention node itself once fused)
    score: str = ""              # the Q·Kᵀ matmul (the fused node once fused)
    value: str = ""              # the ·V matmul (the fused node once fused)
    q: str = ""
    k: str = ""                  # keys as the fused kernel takes them (no transpose, no absorbed repeat_kv)
    v: str = ""
    scale: float = 1.0
    causal: bool = False
    window: int = 0
    mask: str | None = None      # padding mask [B, Tk]
    bias: str | None = None      # additive bias tensor
    bias_const: float | None = None  # a scalar added to the scores (``s - c``: -c); rewrite makes a constant
    heads: int | None = None
    kv_heads: int | None = None
    path: list[str] = field(default_factory=list)      # score-path nodes, Q·Kᵀ side first
    forward: list[str] = field(default_factory=list)   # pass-through nodes between softmax and ·V
    internal: list[str] = field(default_factory=list)  # the score-shaped values (scores ... weights)
    covered: list[str] = field(default_factory=list)   # nodes a fused node replaces (besides ·V, whose place it takes)
    fused: bool = False          # already one fused_attention node
    reason: str = ""             # the first reason no fused kernel can replace it ("" when one can)
    scaled: bool = False         # walking back, a scale was passed (a bias before it is not absorbable)
    softcap: float | None = None  # tanh(s)·c on the scaled scores (logit soft-capping): c
    features: list[str] = field(default_factory=list)  # score-epilogue features the path's rules produced
    attrs: dict = field(default_factory=dict)  # fused-node attributes of features with no field above
    failed_at: str = ""          # the node where ``reason`` arose ("" : the softmax), for --explain's spec line
    sinks: str | None = None     # attention sinks: the value holding one logit per head (the fused node's last input)
    sink_nodes: list[str] = field(default_factory=list)  # the sink column's concat, the weights' slice, and the
                                                          # expand/reshape nodes read only on the way to the concat

    @property
    def fusable(self) -> bool:
        return not self.fused and not self.reason

    @property
    def core_nodes(self) -> list[str]:
        """Q·Kᵀ, the score path, softmax, pass-throughs and ·V, in graph order."""
        if self.fused:
            return [self.anchor]
        return [self.score, *self.path, self.anchor, *self.forward, self.value]

    def fail(self, reason: str | None, at: str = "") -> None:
        if reason and not self.reason:
            self.reason, self.failed_at = reason, at


class NoMatch(Exception):
    """The softmax is not attention; the message says why, ``at`` names the node where the walk stopped."""

    def __init__(self, reason: str, at: str = ""):
        super().__init__(reason)
        self.at = at


@dataclass
class Candidate:
    """A softmax (or fused_attention node) the recogniser looked at, and its verdict."""

    node: Node
    match: AttentionMatch | None
    reason: str = ""  # why it is not attention, or why it cannot be fused
    at: str = ""      # the node where that reason arose ("": the softmax itself)

    @property
    def fusable(self) -> bool:
        return self.match is not None and self.match.fusable


# ------------------------------------------------------------------ score rules: (op, check, absorb, scores)
def _scalar_const(g: Graph, value: str) -> float | None:
    arr = g.consts.get(value)
    if arr is None or arr.size != 1:
        return None
    return float(np.asarray(arr).reshape(()))


def _looks_like_scores(g: Graph, n: Node, value: str) -> bool:
    p = g.producer(value)
    return dims.shapes_equal(g.type_of(value).shape, g.type_of(n.outputs[0]).shape) and p is not None \
        and (p.op in SCORE_RULES or p.op == "matmul")


def _scores_of_binary(g: Graph, n: Node) -> str:
    """The operand of an elementwise op that carries the scores (the left one when both could)."""
    if _scalar_const(g, n.inputs[1]) is not None:
        return n.inputs[0]
    if _scalar_const(g, n.inputs[0]) is not None:
        return n.inputs[1]
    if _looks_like_scores(g, n, n.inputs[0]) or not _looks_like_scores(g, n, n.inputs[1]):
        return n.inputs[0]
    return n.inputs[1]


def _first(g: Graph, n: Node) -> str:
    return n.inputs[0]


def _check_scale(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if _scalar_const(g, n.inputs[1]) is None and _scalar_const(g, n.inputs[0]) is None:
        return f"scores are {'multiplied' if n.op == 'mul' else 'divided'} by a tensor, not a constant " \
               f"(a multiplicative mask is not additive)"
    if n.op == "div" and _scalar_const(g, n.inputs[1]) is None:
        return "scores divide a constant (not a scale)"
    c = _scalar_const(g, n.inputs[1])
    c = _scalar_const(g, n.inputs[0]) if c is None else c
    if c == 0.0 or not np.isfinite(c):  # 1 / 0 in _absorb_scale; a kernel scale of 0, inf or nan means nothing
        return f"scores are {'multiplied' if n.op == 'mul' else 'divided'} by {c} (no scale a kernel can apply)"
    return None


def _absorb_scale(g: Graph, n: Node, m: AttentionMatch) -> None:
    c = _scalar_const(g, n.inputs[1])
    c = _scalar_const(g, n.inputs[0]) if c is None else c
    m.scale *= (1.0 / c) if n.op == "div" else c
    m.scaled = True


def _before_cap(m: AttentionMatch, what: str) -> str | None:
    """Walking back past a soft-cap, what comes next was applied before it: the kernel caps first."""
    if m.softcap is not None:
        return f"{what} is applied before the scores are soft-capped (tanh); the fused kernel caps first"
    return None


def _check_causal(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if _before_cap(m, "a causal mask"):
        return _before_cap(m, "a causal mask")
    if "local_window" in m.attrs:
        return "a causal mask on scores with a two-sided local window"
    return "two causal masks on one score matrix" if m.causal else None


def _absorb_causal(g: Graph, n: Node, m: AttentionMatch) -> None:
    m.causal, m.window = True, int(n.attrs.get("window") or 0)
    if n.attrs.get("chunk"):  # chunked attention: the chunk feature
        m.attrs["chunk"] = int(n.attrs["chunk"])


def _check_local(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if _before_cap(m, "a local window"):
        return _before_cap(m, "a local window")
    if "local_window" in m.attrs:
        return "two local windows on one score matrix"
    return "a two-sided local window on causal scores" if m.causal else None


def _absorb_local(g: Graph, n: Node, m: AttentionMatch) -> None:
    m.attrs["local_window"] = int(n.attrs["window"])


def _check_padding(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if _before_cap(m, "a padding mask"):
        return _before_cap(m, "a padding mask")
    return "two padding masks on one score matrix" if m.mask else None


def _absorb_padding(g: Graph, n: Node, m: AttentionMatch) -> None:
    m.mask = n.inputs[1]


def _check_one_bias(m: AttentionMatch) -> str | None:
    if _before_cap(m, "an additive bias"):
        return _before_cap(m, "an additive bias")
    if m.bias is not None or m.bias_const is not None:
        return "two additive biases on one score matrix"
    if m.scaled:  # walking backwards: a scale seen already comes after this bias in the graph
        return "a bias is added before the scores are scaled"
    return None


def _check_bias(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    reason = _check_one_bias(m)
    if reason:
        return reason
    scores = _scores_of_binary(g, n)
    other = n.inputs[1] if scores == n.inputs[0] else n.inputs[0]
    if g.type_of(other).rank > g.type_of(n.outputs[0]).rank:
        return "the added tensor is larger than the scores"
    return None


def _absorb_bias(g: Graph, n: Node, m: AttentionMatch) -> None:
    scores = _scores_of_binary(g, n)
    m.bias = n.inputs[1] if scores == n.inputs[0] else n.inputs[0]


def _check_sub(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if _scores_of_binary(g, n) != n.inputs[0]:
        return "the scores are subtracted from a tensor (negated), which the fused kernel cannot express"
    if _scalar_const(g, n.inputs[1]) is None:
        return f"a tensor ({n.inputs[1]}) is subtracted from the scores; the fused kernel adds a bias, " \
               f"it does not subtract one"
    return _check_one_bias(m)


def _absorb_sub(g: Graph, n: Node, m: AttentionMatch) -> None:
    m.bias_const = -_scalar_const(g, n.inputs[1])  # s - c == s + (-c), bit for bit


def _check_softcap(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    if m.softcap is not None:
        return "two tanh soft-caps on one score matrix"
    return None


def _absorb_softcap(g: Graph, n: Node, m: AttentionMatch) -> None:
    """tanh(s)·c: the scale gathered so far (walking back) is the cap c; the walk then gathers the
    scale applied before the tanh (Gemma 2: s·scaling / c)."""
    m.softcap, m.scale, m.scaled = m.scale, 1.0, False


def _check_pass_through(g: Graph, n: Node, m: AttentionMatch) -> str | None:
    return f"the scores pass through {n.op} ({n.name}), which the fused kernel cannot express"


def _absorb_nothing(g: Graph, n: Node, m: AttentionMatch) -> None:
    return None


Check = Callable[[Graph, Node, AttentionMatch], "str | None"]
Absorb = Callable[[Graph, Node, AttentionMatch], None]
Scores = Callable[[Graph, Node], str]


@dataclass(frozen=True)
class ScoreRule:
    check: Check    # why the fused kernel cannot absorb this node (None: it can)
    absorb: Absorb  # what the node contributes to the fused node: the attributes of its feature
    scores: Scores  # the operand carrying the scores: where the walk goes next
    # The score-epilogue feature (compiler/reference/score_epilogue.py FEATURES) an absorbed node
    # becomes; None: never absorbed. A feature the epilogue does not know, or one whose attributes
    # ``absorb`` did not set, keeps the site unfused (with that reason) instead of letting a kernel drop it.
    feature: str | None


SCORE_RULES: dict[str, ScoreRule] = {
    "mul": ScoreRule(_check_scale, _absorb_scale, _scores_of_binary, "scale"),
    "div": ScoreRule(_check_scale, _absorb_scale, _scores_of_binary, "scale"),
    "causal_mask": ScoreRule(_check_causal, _absorb_causal, _first, "causal"),  # its window: the window feature
    "padding_mask": ScoreRule(_check_padding, _absorb_padding, _first, "padding"),
    "local_mask": ScoreRule(_check_local, _absorb_local, _first, "local_window"),  # ModernBERT's local attention
    "add": ScoreRule(_check_bias, _absorb_bias, _scores_of_binary, "bias"),
    "sub": ScoreRule(_check_sub, _absorb_sub, _scores_of_binary, "bias"),
    "tanh": ScoreRule(_check_softcap, _absorb_softcap, _first, "softcap"),   # logit soft-capping: tanh(s / c) · c
    # attention all the same, but no fused kernel converts or renames its scores
    "cast": ScoreRule(_check_pass_through, _absorb_nothing, _first, None),
    "identity": ScoreRule(_check_pass_through, _absorb_nothing, _first, None),
}


def _unknown_feature(rule: ScoreRule, n: Node) -> str | None:
    """Why an absorbable node still cannot be fused: its rule names no feature the epilogue computes."""
    if rule.feature is None:
        return f"the scores pass through {n.op} ({n.name}), which is no feature of the score epilogue"
    if rule.feature not in score_epilogue.FEATURES:
        return f"the scores pass through {n.op} ({n.name}): {rule.feature}, which the score epilogue " \
               f"(compiler/reference/score_epilogue.py) does not compute"
    return None


def _epilogue_order(features: list[str]) -> str | None:
    """Why features applied in this graph order (scale aside: it folds anywhere before a bias) differ
    from the epilogue's order: a later stage first, or two features of one stage whose commutation is
    not declared (score_epilogue.COMMUTING; the epilogue applies a stage's steps in its own order)."""
    staged = [f for f in features if f != "scale"]
    reason = score_epilogue.not_commuting(staged)
    if reason:
        return reason
    for before, after in zip(staged, staged[1:]):
        if score_epilogue.FEATURES[after].stage < score_epilogue.FEATURES[before].stage:
            return f"the {score_epilogue.words([before])} is applied before the {score_epilogue.words([after])}; " \
                   f"the score epilogue applies the {score_epilogue.words([after])} first"
    return None


def _unrecorded(m: AttentionMatch) -> str | None:
    """Why the fused node would not say what the path does: a feature a rule produced that its
    attributes do not turn on (the rule's ``absorb`` recorded nothing)."""
    on = set(score_epilogue.used(attributes(m)))
    lost = [f for f in m.features if f not in on]
    if lost:
        return f"the score path's {score_epilogue.words(lost)} left no attribute on the fused node " \
               f"(its ScoreRule's absorb records nothing)"
    return None


# ------------------------------------------------------------------ checks on the whole match
def _exposed(g: Graph, value: str, what: str) -> str | None:
    """Why ``value`` cannot stay inside a fused kernel: a model output, or read by more than one node."""
    users = g.consumers(value)
    outputs = [u.outputs[0] for u in users if u.op == "identity" and u.outputs[0] in g.outputs]
    if value in g.outputs or outputs:
        return f"{what}: also a model output ({', '.join(outputs) or value}), which a fused kernel never forms"
    if len(users) != 1:
        return f"{what}: read by {len(users)} nodes ({', '.join(u.name for u in users)}), not only by " \
               f"the next step of attention"
    return None


def _only_user(g: Graph, value: str) -> bool:
    return len(g.consumers(value)) == 1 and value not in g.outputs


def _escapes(g: Graph, m: AttentionMatch) -> str | None:
    """Reachability on the graph's networkx view: the covered nodes must be read only inside the match,
    and the mask and bias must not depend on them (the fused node would feed itself)."""
    inside = set(m.covered) | {m.value}
    for name in m.covered:
        for out in g.nodes[name].outputs:
            for _, user in g.nx.successors(("v", out)):
                if user not in inside:
                    return f"{out} is read by {user}, outside the attention"
    for extra in (m.mask, m.bias, m.sinks):
        if extra is not None and any(kind == "n" and name in inside
                                     for kind, name in nx.ancestors(g.nx, ("v", extra))):
            return f"{extra} is computed from the attention's own scores"
    return None


# Views a score vector passes through between additive attention's v·tanh(...) and its softmax.
_VIEWS = ("reshape", "squeeze", "select", "transpose", "identity")


def _additive(g: Graph, value: str) -> bool:
    """Whether ``value`` is additive attention's scores: a linear (v) of the tanh of a sum
    (W·q + U·k), through views; so --explain can say "not a dot product" instead of naming an op."""
    node = g.producer(value)
    while node is not None and node.op in _VIEWS:
        node = g.producer(node.inputs[0])
    if node is None or node.op != "linear":
        return False
    act = g.producer(node.inputs[0])
    if act is None or act.op != "tanh":
        return False
    total = g.producer(act.inputs[0])
    return total is not None and total.op == "add"


# ------------------------------------------------------------------ the matcher
def _swaps_last_two(g: Graph, value: str, node: Node | None) -> str | None:
    rank = g.type_of(value).rank
    if node is None or node.op != "transpose" or list(node.attrs["perm"][-2:]) != [rank - 1, rank - 2] \
            or list(node.attrs["perm"][:-2]) != list(range(rank - 2)):
        return "the scores are not Q·Kᵀ: the right operand is not K with its last two axes swapped"
    return None


# The ends of the score path, on the one matcher (patterns/matcher.py):
# Q·Kᵀ -- a matmul of the queries and the keys with their last two axes swapped
QK = Pat("matmul", (Pat(name="q"), Pat("transpose", (Pat(name="k"),), name="kt", check=_swaps_last_two)))
# grouped-query attention: keys (and values) repeated from fewer heads, read by nothing else
REPEATED = Pat("repeat_kv", (Pat(name="grouped"),), private=True)


def match(g: Graph, softmax: Node) -> AttentionMatch:
    """The attention around one softmax (its ``reason`` set when no fused kernel can replace it),
    or raise NoMatch(reason) when it is not attention. In four steps: the weights forward to ·V
    (``_to_values``), the softmax's axis and rank, the score path back through ``SCORE_RULES``
    (``_score_path``), then Q·Kᵀ and the heads (``_keys_and_heads``); a site whose every step fits
    is checked once more for values escaping it (``_escapes``)."""
    if _additive(g, softmax.inputs[0]):
        raise NoMatch(f"not a dot product: the scores ({softmax.inputs[0]}) are v·tanh(W·q + U·k), additive "
                      f"attention (Bahdanau et al.), which the fused kernel softmax(Q·Kᵀ)·V cannot express")
    m = AttentionMatch(anchor=softmax.name)
    rank = g.type_of(softmax.inputs[0]).rank
    sink = _sink_form(g, softmax)
    pv = _to_values(g, softmax, m, sink[1] if sink else None)
    m.value, m.v = pv.name, pv.inputs[1]
    if rank < 2:
        raise NoMatch("softmax over a vector, not a score matrix")
    axis = softmax.attrs["axis"] % rank
    if axis == rank - 2:
        m.fail("softmax over the query axis (attention normalises over the key axis, -1)")
    elif axis != rank - 1:
        m.fail(f"softmax over axis {softmax.attrs['axis']}, not the key axis (-1)")
    if rank != 4:
        m.fail(f"scores of rank {rank}; the fused kernel takes heads: [B, H, Tq, Tk]")
    if sink:
        _absorb_sinks(g, softmax, sink, m, rank)
    qk = _score_path(g, softmax, m, sink[0].inputs[0] if sink else None)
    if sink:
        m.features.append("sinks")  # at the softmax: after every score step, in graph order
    m.covered = [qk.name, *m.path, softmax.name, *m.forward, *m.sink_nodes]
    _keys_and_heads(g, qk, m, rank)
    if not m.reason:
        m.fail(_escapes(g, m))
    return m


def _sink_form(g: Graph, softmax: Node) -> tuple[Node, Node] | None:
    """Attention sinks written from primitives (gpt-oss, transformers' eager_attention_forward):
    ``slice(softmax(concat([s, sink_column], -1)), -1, 0, Tk)``, the softmax over the keys and one more
    column, that column's weight dropped. (concat, slice) when the softmax has that form, else None
    (a concat on the score path is then no rule's, and the softmax not attention)."""
    cat = g.producer(softmax.inputs[0])
    if cat is None or cat.op != "concat" or len(cat.inputs) != 2:
        return None
    rank = g.type_of(cat.outputs[0]).rank
    col = g.type_of(cat.inputs[1]).shape
    if rank < 2 or cat.attrs["axis"] % rank != rank - 1 or not (dims.is_static(col[-1]) and int(col[-1]) == 1):
        return None
    users = g.consumers(softmax.outputs[0])
    if len(users) != 1 or users[0].op != "slice" or softmax.outputs[0] in g.outputs:
        return None
    sl, tk = users[0], g.type_of(cat.inputs[0]).shape[-1]
    if sl.attrs["axis"] % rank != rank - 1 or not dims.equal(dims.dim(sl.attrs["start"]), dims.dim(0)) \
            or not dims.equal(dims.dim(sl.attrs["end"]), tk):
        return None
    return cat, sl


def _absorb_sinks(g: Graph, softmax: Node, sink: tuple[Node, Node], m: AttentionMatch, rank: int) -> None:
    """The sink column [.., H, Tq, 1] back through expand and reshape to one learned logit per head: the
    expanded tensor must be [1, H, 1, 1] (right-aligned; reshapes keep the values' order, so what it
    was reshaped from holds them in head order). That source is the fused node's sinks input; the
    expand and reshapes read by nothing else are covered. A column varying over batch or queries, or
    computed from the scores, keeps the site unfused with the reason."""
    cat, sl = sink
    m.attrs["sinks"] = True
    m.sink_nodes = [cat.name, sl.name]
    m.internal += [cat.outputs[0], sl.outputs[0]]
    m.fail(_exposed(g, cat.outputs[0], "the scores with the sink column"), cat.name)
    m.fail(_exposed(g, sl.outputs[0], "the attention weights"), sl.name)
    heads = g.type_of(softmax.inputs[0]).shape[-3] if rank >= 3 else None
    chain, value = [], cat.inputs[1]
    while (node := g.producer(value)) is not None and node.op in ("expand", "reshape"):
        chain.append(node)
        value = node.inputs[0]
    # an expand next to the concat (or none, the column already [1, H, 1, 1]), then only reshapes
    spread = chain[0].inputs[0] if chain and chain[0].op == "expand" else cat.inputs[1]
    shape = tuple(g.type_of(spread).shape)
    shape = (1,) * (4 - len(shape)) + shape if len(shape) <= 4 else shape
    ones = all(dims.is_static(dims.dim(d)) and int(d) == 1 for d in (shape[0], shape[2], shape[3])) \
        if len(shape) == 4 else False
    if rank != 4 or not ones or heads is None or not dims.equal(dims.dim(shape[1]), heads) \
            or any(n.op == "expand" for n in chain[1:]):
        m.fail(f"the sink column ({cat.inputs[1]}) is not one learned logit per head broadcast over batch and "
               f"queries (an expand of a [1, heads, 1, 1] tensor)", cat.name)
        m.sinks = cat.inputs[1]
        return
    m.sinks = value  # what the reshapes start from: one value per head, in head order
    value = cat.inputs[1]
    for n in chain:  # covered while each is read only on the way to the concat
        if len(g.consumers(value)) != 1 or value in g.outputs:
            break
        m.sink_nodes.append(n.name)
        value = n.inputs[0]


def _to_values(g: Graph, softmax: Node, m: AttentionMatch, sink_slice: Node | None = None) -> Node:
    """Forward from the softmax: the weights must reach a matmul as its left operand (the ·V matmul),
    through at most three pass-through ops (attention still, but not fusable). Returns the ·V matmul.
    With attention sinks the weights are the slice dropping the sink's column (``_sink_form``)."""
    probs = softmax.outputs[0] if sink_slice is None else sink_slice.outputs[0]
    m.internal.append(probs)
    what = "the attention weights"
    for _ in range(4):
        m.fail(_exposed(g, probs, what))
        users = g.consumers(probs)
        pv = next((u for u in users if u.op == "matmul" and u.inputs[0] == probs), None)
        if pv is not None:
            return pv
        through = [u for u in users if u.op in PASS_THROUGH and u.outputs[0] not in g.outputs]
        if len(through) != 1:
            raise NoMatch(f"{what} feed {users[0].op if users else 'nothing'}, not a matmul with V")
        m.fail(f"the attention weights pass through {through[0].op} ({through[0].name}) before the matmul with V",
               through[0].name)
        m.forward.append(through[0].name)
        probs = through[0].outputs[0]
        m.internal.append(probs)
        what = f"the attention weights ({probs})"
    raise NoMatch("the attention weights reach no matmul with V")


def _score_path(g: Graph, softmax: Node, m: AttentionMatch, start: str | None = None) -> Node:
    """Backward from the softmax (or from ``start``: the scores beside the sink column) through
    ``SCORE_RULES`` (each node checked, then absorbed into the fused node's features) to the matmul that
    computes the scores, which it returns. An op with no rule is not attention (NoMatch); a failed check
    keeps the site, unfused, with the reason."""
    cur = start or softmax.inputs[0]
    path = []
    while True:
        node = g.producer(cur)
        if node is None:
            raise NoMatch(f"the scores are a graph input or constant ({cur}), not computed from Q and K")
        m.internal.append(cur)
        m.fail(_exposed(g, cur, f"the scores ({cur})"), node.name)
        if node.op == "matmul":
            break
        rule = SCORE_RULES.get(node.op)
        if rule is None:
            raise NoMatch(f"the scores pass through {node.op} ({node.name}), which the fused kernel cannot express",
                          node.name)
        _absorb(g, node, rule, m)
        path.append(node.name)
        cur = rule.scores(g, node)
    m.features.reverse()  # graph order
    m.fail(_epilogue_order(m.features))
    m.fail(_unrecorded(m))
    m.score, m.path = node.name, path[::-1]
    return node


def _absorb(g: Graph, node: Node, rule: ScoreRule, m: AttentionMatch) -> None:
    """One score-path node into the match: its rule's check, else its absorb and feature (a rule whose
    absorb records nothing keeps the site unfused: the fused node would not say what the node does)."""
    reason = rule.check(g, node, m) or _unknown_feature(rule, node)
    if reason:
        m.fail(reason, node.name)
        return
    before = (attributes(m), m.scaled)
    rule.absorb(g, node, m)
    m.features.append(rule.feature)
    if (attributes(m), m.scaled) == before:
        m.fail(f"the scores pass through {node.op} ({node.name}), but its ScoreRule's absorb records "
               f"nothing on the fused node ({rule.feature})", node.name)


def _keys_and_heads(g: Graph, qk: Node, m: AttentionMatch, rank: int) -> None:
    """Q·Kᵀ (``QK``), the lengths, the padding mask's shape and the heads, grouped (``REPEATED`` on both
    keys and values, the same times) or not."""
    found = match_pattern(g, QK, qk.outputs[0])
    m.q = qk.inputs[0]
    if found:
        m.k = found["k"]
        if _only_user(g, found["kt"]):
            m.covered.append(found["kt.node"].name)
    else:
        m.fail(found.reason, found.node.name if found.node is not None else "")
        m.k = qk.inputs[1]
    q_t, k_t, v_t = g.type_of(m.q), g.type_of(m.k), g.type_of(m.v)
    if not dims.equal(k_t.shape[-2], v_t.shape[-2]):
        m.fail("K and V have different lengths")
    if m.causal and not (dims.dim(k_t.shape[-2]) - dims.dim(q_t.shape[-2])).is_nonnegative:
        m.fail(f"a causal mask where the keys ({dims.fmt(k_t.shape[-2])}) may be fewer than the queries "
               f"({dims.fmt(q_t.shape[-2])}): leading rows would see no key")
    if m.mask is not None and g.type_of(m.mask).rank != 2:
        m.fail("the padding mask is not [B, Tk]")
    if rank != 4:
        return
    if q_t.rank != 4:
        m.fail("the queries are not [B, H, Tq, hd]")
        return
    if not dims.is_static(q_t.shape[1]):
        m.fail("the number of heads is not fixed")
        return
    m.heads = m.kv_heads = int(q_t.shape[1])
    rk, rv = match_pattern(g, REPEATED, m.k), match_pattern(g, REPEATED, m.v)
    if rk and rv and rk.nodes[0].attrs["times"] == rv.nodes[0].attrs["times"]:
        m.k, m.v = rk["grouped"], rv["grouped"]
        m.kv_heads = m.heads // rk.nodes[0].attrs["times"]
        m.covered += [rk.nodes[0].name, rv.nodes[0].name]


def from_fused(g: Graph, n: Node) -> AttentionMatch:
    """A fused_attention node read back as a match (its attributes are the match's fields)."""
    a = n.attrs
    extra = list(n.inputs[3:])
    mask = extra.pop(0) if a.get("padding") else None
    bias = extra.pop(0) if a.get("bias") else None
    sinks = extra.pop(0) if a.get("sinks") else None
    return AttentionMatch(
        anchor=n.name, score=n.name, value=n.name, q=n.inputs[0], k=n.inputs[1], v=n.inputs[2],
        scale=float(a.get("scale", 1.0)), causal=bool(a.get("causal")),
        window=int(a.get("window") or 0), mask=mask, bias=bias, heads=a.get("heads"),
        kv_heads=a.get("kv_heads"), covered=[n.name], fused=True,
        softcap=float(a["softcap"]) if a.get("softcap") else None, features=score_epilogue.used(a),
        attrs={k: v for k, v in a.items() if k in _extra_attrs()}, sinks=sinks)


def _extra_attrs() -> set[str]:
    """Epilogue attributes of features added after the ones AttentionMatch has fields for."""
    return {name for f in score_epilogue.FEATURES.values() for name in f.attrs} - \
        {"scale", "causal", "window", "padding", "bias", "softcap"}


def recognise(g: Graph) -> list[Candidate]:
    """Every softmax and fused_attention node in graph order, with its verdict."""
    out = []
    for n in list(g.nodes.values()):
        if n.op == FUSED_OP:
            out.append(Candidate(n, from_fused(g, n)))
        elif n.op == "softmax":
            try:
                m = match(g, n)
                out.append(Candidate(n, m, m.reason, m.failed_at))
            except NoMatch as e:
                out.append(Candidate(n, None, str(e), e.at))
    return out


def rewrite(m: AttentionMatch) -> tuple[str, list[str], dict]:
    """The fused node that replaces a fusable match: (op, inputs, attrs). A scalar bias
    (``bias_const``) must first be made a constant by the caller and passed as ``m.bias``."""
    if m.bias_const is not None and m.bias is None:
        raise ValueError("make the scalar bias a constant first")
    inputs = [m.q, m.k, m.v] + ([m.mask] if m.mask else []) + ([m.bias] if m.bias else []) + \
        ([m.sinks] if m.attrs.get("sinks") else [])
    return FUSED_OP, inputs, attributes(m)


def attributes(m: AttentionMatch) -> dict:
    """The fused node's attributes for a match (ops/attention.py FUSED_ATTRS is their schema)."""
    attrs = {"scale": m.scale, "causal": m.causal, "window": m.window, "padding": m.mask is not None,
             "bias": m.bias is not None or m.bias_const is not None, "heads": m.heads, "kv_heads": m.kv_heads}
    if m.softcap is not None:  # only when capped: the fused nodes of other models keep their attributes
        attrs["softcap"] = m.softcap
    return {**attrs, **m.attrs}


__all__ = ["AttentionMatch", "Candidate", "NoMatch", "SCORE_RULES", "ScoreRule", "attributes", "match",
           "from_fused", "recognise", "rewrite"]
