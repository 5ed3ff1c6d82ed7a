"""The score epilogue of fused attention, in numpy: what happens to Q·Kᵀ before the softmax.

One table, ``FEATURES``, names every option a fused_attention node may apply to its scores
(scale, logit soft-cap, additive bias, causal mask, sliding window, two-sided local window, padding mask), the node
attributes each one owns (their types and allowed values: ops/attention.py's schema is built
from them), where it sits in the epilogue (``stage``; two features of one stage must be declared
to commute, ``COMMUTING``) and what a kernel may take for granted about it (``elementwise``,
``keeps_hidden``; ``ASSUMPTIONS`` names each kernel shortcut and the features that break it:
backends/onnx/attention.py ``KERNEL_ASSUMES`` says which shortcuts each kernel takes).
``apply`` is the numpy meaning of the table, used by the interpreter (ops/attention.py's
reference of fused_attention) and by reference/flash.py's plain and tiled attention. The
ONNX kernels build the same steps in backends/onnx/score_epilogue.py, and a kernel
declares which features it computes (an allow-list): the recogniser records which feature
each score-path rule produces, so a score option this table does not know is refused by
fusion instead of being dropped by a kernel.

Attention sinks (gpt-oss) are a feature of the softmax, not of the scores: their step leaves the
scores as they are and ``softmax`` adds one logit per head to the normaliser.

A new score option is one row here, one step in backends/onnx/score_epilogue.py and one
ScoreRule in compiler/patterns/attention.py. Its row says what it is (elementwise? does a hidden
score stay hidden through it?), and the kernels that take a shortcut it breaks refuse it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Attr:
    """One attribute of the fused node: its Python type(s) and, optionally, why a value is refused."""

    types: tuple
    doc: str
    check: Callable[[object], "str | None"] | None = None
    required: bool = False

    def problem(self, value) -> str | None:
        """Why ``value`` is not allowed (None: it is). bool is not an int here, nor an int a bool."""
        ok = isinstance(value, self.types) and not (isinstance(value, bool) and bool not in self.types)
        if not ok and float in self.types and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            ok = True
        if not ok:
            names = " or ".join(t.__name__ for t in self.types)
            return f"must be {names}, got {type(value).__name__} {value!r}"
        return self.check(value) if self.check else None


def finite(v) -> str | None:
    return None if math.isfinite(float(v)) else f"must be finite, got {v}"


def positive(v) -> str | None:
    return None if math.isfinite(float(v)) and v > 0 else f"must be a finite number above 0, got {v}"


def non_negative(v) -> str | None:
    return None if v >= 0 else f"must be 0 or more, got {v}"


@dataclass
class Where:
    """Where a block of scores [..., rows, cols] lies in the whole [.., Tq, Tk] score matrix, and the
    tensors the epilogue reads there (already sliced to the block)."""

    tq: int
    tk: int
    row0: int = 0
    col0: int = 0
    key_mask: np.ndarray | None = None  # [B, cols], 0 = padding
    bias: np.ndarray | None = None      # broadcastable to the block
    sinks: np.ndarray | None = None     # one logit per head of the block, broadcastable to [.., H, 1, 1]


def _scale(s, a, w):
    return s * np.asarray(a["scale"], s.dtype)


def _softcap(s, a, w):  # Gemma 2: tanh(s)·c, its 1/c already folded into the scale
    return np.tanh(s) * np.asarray(a["softcap"], s.dtype)


def _bias(s, a, w):
    return s + w.bias


def _hidden(a, w, rows, cols) -> np.ndarray | None:
    """[rows, cols] True where the causal mask, the sliding window or the two-sided local window
    hides a key (queries are the last Tq of Tk positions)."""
    if not a.get("causal") and not a.get("local_window"):
        return None
    i = np.arange(w.row0, w.row0 + rows)[:, None] + (w.tk - w.tq)
    j = np.arange(w.col0, w.col0 + cols)[None, :]
    if a.get("local_window"):
        return np.abs(j - i) >= a["local_window"]
    hide = j > i
    if a.get("window"):
        hide |= j <= i - a["window"]
    if a.get("chunk"):
        hide |= (j // a["chunk"]) != (i // a["chunk"])
    return hide


def _masks(s, a, w):
    """Causal, sliding window and padding: hidden scores become the dtype's minimum (weight 0)."""
    fill = np.finfo(s.dtype).min
    hide = _hidden(a, w, s.shape[-2], s.shape[-1])
    if hide is not None:
        s = np.where(hide, fill, s)
    if a.get("padding"):
        s = np.where((w.key_mask != 0)[:, None, None, :], s, fill)
    return s


def _sinks(s, a, w):
    """Attention sinks change no score (a hidden key stays hidden, each score is its own): their
    effect is on the normaliser, in ``softmax`` below, which every kernel taking them runs."""
    return s


@dataclass(frozen=True)
class Feature:
    """One option of the score epilogue: the attributes it owns, whether a node uses it, and what the
    kernels may take for granted about it (the contract; tests/compiler/test_attention_contract_property.py
    checks every claim here numerically, so a wrong claim fails the suite, never a model).

    ``elementwise``: the step reads only its own score and that score's position, so a kernel that
    computes the scores tile by tile (KERNEL_ASSUMES "tiles_scores") gets the same result. ``keeps_hidden``:
    applied to a score the masks hid (the dtype's minimum), the result still weighs exactly 0 after the
    softmax, so a kernel that never computes hidden keys ("hidden_weigh_zero") loses nothing when this
    step runs after the masks. Both default to False: a new feature is refused by every kernel
    that takes such a shortcut until it says otherwise (and the test holds it to what it says).
    ``needs``: features that must be on for this one to do anything (a window needs causal).
    ``softmax``: the feature changes no score but the softmax's normaliser (attention sinks): it has no
    step in STEPS but one in ``softmax``, and a kernel that accumulates its softmax over key tiles
    (KERNEL_ASSUMES "keys_only_softmax") cannot take it.
    ``flops``: operations per score, by the report's categories, for the fused node's cost."""

    name: str
    stage: int                      # order in the epilogue; two features of one stage must be declared
    attrs: dict = field(default_factory=dict)   # to commute (COMMUTING) before a site may use both
    active: Callable[[dict], bool] = lambda a: True
    what: str = ""                  # in words, for --explain ("padding mask"); the name if empty
    elementwise: bool = False
    keeps_hidden: bool = False
    hides: bool = False             # the step hides keys (fills scores with the dtype's minimum)
    softmax: bool = False           # no score step: it changes the softmax's normaliser (``softmax`` below)
    # at a decoding step (one query, the last of its row's positions) every key the step hides lies past
    # the row's length, where the caller lays each row's keys from column 0 (the serving engine): a kernel
    # told the lengths (GroupQueryAttention's seqlens_k) computes it with no mask (ASSUMPTIONS "keys_by_length")
    by_length: bool = False
    needs: tuple = ()
    flops: dict = field(default_factory=lambda: {"elementwise": 1})

    @property
    def words(self) -> str:
        return self.what or self.name


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("scale", 0, {"scale": Attr((float,), "multiplies the scores", finite, required=True)}, what="scale",
            elementwise=True),
    Feature("softcap", 1, {"softcap": Attr((float,), "tanh(s)·c on the scaled scores", positive)},
            lambda a: bool(a.get("softcap")), "logit soft-capping", elementwise=True,
            flops={"elementwise": 2, "activation": 1}),  # a divide (folded into the scale), tanh, multiply
    Feature("bias", 2, {"bias": Attr((bool,), "an additive bias tensor is an input (after the mask)",
                                     required=True)},
            lambda a: bool(a.get("bias")), "additive bias", elementwise=True, keeps_hidden=True),
    Feature("causal", 2, {"causal": Attr((bool,), "hide keys after each query", required=True)},
            lambda a: bool(a.get("causal")), "causal mask", elementwise=True, keeps_hidden=True, hides=True,
            by_length=True, flops={"mask": 1}),  # at T = 1 the query is its row's last position: none hidden
    Feature("window", 2, {"window": Attr((int,), "with causal: also hide keys this far back (0: none)",
                                         non_negative, required=True)},
            lambda a: bool(a.get("window")), "sliding window", elementwise=True, keeps_hidden=True, hides=True,
            needs=("causal",), flops={}),  # the causal mask's one select covers it
    Feature("local_window", 2, {"local_window": Attr((int,), "without causal: hide keys this far from the query "
                                                     "or farther, on either side (0: none)", non_negative)},
            lambda a: bool(a.get("local_window")), "two-sided local window", elementwise=True, keeps_hidden=True,
            hides=True, flops={"mask": 1}),
    Feature("chunk", 2, {"chunk": Attr((int,), "with causal: also hide keys outside the query's block of "
                                       "this many positions (chunked attention, Llama 4; 0: none)", non_negative)},
            lambda a: bool(a.get("chunk")), "chunked attention", elementwise=True, keeps_hidden=True, hides=True,
            needs=("causal",), flops={"mask": 1}),
    Feature("padding", 2, {"padding": Attr((bool,), "a key padding mask [B, Tk] is an input (0 = padding)",
                                           required=True)},
            lambda a: bool(a.get("padding")), "padding mask", elementwise=True, keeps_hidden=True, hides=True,
            by_length=True, flops={"mask": 1}),  # by length only where its caller guarantees the layout (above)
    # gpt-oss: softmax over the keys and one learned logit per head (the sink), whose weight is dropped.
    # No score changes (so elementwise and keeps_hidden hold trivially: a hidden key still weighs 0, and a
    # row whose keys are all hidden puts its whole weight on the sink: output 0); the normaliser gains
    # exp(sink - m), m the row's maximum over keys and sink.
    Feature("sinks", 3, {"sinks": Attr((bool,), "a sinks tensor [heads] is an input: one extra logit per head "
                                                "in the softmax's normaliser, weighing no value")},
            lambda a: bool(a.get("sinks")), "attention sinks", elementwise=True, keeps_hidden=True, softmax=True,
            flops={}),  # per row, not per score: one exp and one add
)}

# Pairs of features of one stage that give the same weights in either order (a site may apply them in
# any order the recogniser accepts). Declared, never assumed: a site using two features of one stage
# that are not listed here stays unfused, and tests/compiler/test_attention_contract_property.py checks every
# pair listed here in both orders on random scores. Mask fills commute with each other; an added
# bias commutes with a fill because min + b rounds to min (|b| < 1e30 in fp32).
COMMUTING: frozenset[frozenset[str]] = frozenset(frozenset(p) for p in (
    ("bias", "causal"), ("bias", "window"), ("bias", "local_window"), ("bias", "padding"),
    ("causal", "window"), ("causal", "padding"), ("window", "padding"), ("local_window", "padding"),
    ("causal", "local_window"), ("window", "local_window"),
    ("bias", "chunk"), ("causal", "chunk"), ("window", "chunk"), ("chunk", "padding"),
))


def not_commuting(features) -> str | None:
    """Why features used together cannot be applied in the epilogue's order: two of one stage whose
    commutation is not declared in COMMUTING (None: every such pair is)."""
    fs = [f for f in features if f in FEATURES]
    for i, f in enumerate(fs):
        for g in fs[i + 1:]:
            if f != g and FEATURES[f].stage == FEATURES[g].stage and frozenset((f, g)) not in COMMUTING:
                return (f"the {words([f])} and the {words([g])} share stage {FEATURES[f].stage} of the score "
                        f"epilogue but are not declared to commute (COMMUTING in "
                        f"compiler/reference/score_epilogue.py)")
    return None


@dataclass(frozen=True)
class Assumption:
    """A structural shortcut a kernel takes, and what it takes for granted about the score epilogue."""

    name: str
    what: str                                         # the shortcut, in words
    broken_by: Callable[[list], "str | None"]        # why these used features break it (None: they don't)


def _mask_stage() -> int:
    return min(f.stage for f in FEATURES.values() if f.hides)


def _hidden_may_weigh(features) -> str | None:
    late = [f for f in features if f in FEATURES and FEATURES[f].stage > _mask_stage()
            and not FEATURES[f].keeps_hidden]
    if late:
        return f"the {words(late)} runs after the masks and may give a hidden key weight (it is not " \
               f"declared keeps_hidden)"
    return None


def _normaliser(features) -> str | None:
    extra = [f for f in features if f in FEATURES and FEATURES[f].softmax]
    if extra:
        return f"the {words(extra)} change the softmax's normaliser, which it takes over the keys alone"
    return None


def _not_elementwise(features) -> str | None:
    loose = [f for f in features if f in FEATURES and not FEATURES[f].elementwise]
    if loose:
        return f"the {words(loose)} is not declared elementwise (a score's result may depend on other scores)"
    return None


def _not_by_length(features) -> str | None:
    """Why a decoding step whose keys are given by each row's length alone (no mask, no bias) cannot
    compute these features: a step of the masks' stage (what GroupQueryAttention's attention_bias carried)
    not declared ``by_length`` -- a sliding window or chunk hides keys at a row's start, a two-sided window
    by distance, an additive bias is a value per score, none of which a length says."""
    late = [f for f in features if f in FEATURES and FEATURES[f].stage == _mask_stage() and not FEATURES[f].by_length]
    if late:
        return f"the {words(late)} is not given by each row's length (not declared by_length)"
    return None


ASSUMPTIONS: dict[str, Assumption] = {a.name: a for a in (
    # Every such kernel also assumes that each query sees at least one key: a row the masks hide
    # entirely has no defined weights (unfused: uniform over all keys; tiled: over the keys computed).
    Assumption("hidden_weigh_zero", "keys the masks hide weigh exactly 0, so they are skipped or never "
                                    "computed (causal tiles end at their last row, windows start late, cache "
                                    "slots past the positions, flash kernels' skipped blocks)", _hidden_may_weigh),
    Assumption("tiles_scores", "the scores are computed tile by tile, so each step must be elementwise",
               _not_elementwise),
    # a contrib op's softmax, or a flash kernel's online softmax (running max and sum over key tiles) that
    # does not add exp(sink - m) to its sum at the end
    Assumption("keys_only_softmax", "the softmax normalises over the keys alone (its own softmax, or an online "
                                    "softmax over key tiles)", _normaliser),
    # Taken only by the serving engine's variant of the gqa decoding step (passes/kv_cache.py ``prefix_keys``):
    # GroupQueryAttention with seqlens_k alone, so onnxruntime may choose its flash decoding kernel. The
    # layout is its caller's guarantee, not a feature's: the engine fills each row from column 0 (its slot
    # mask is 1 exactly on columns 0..filled-1); ``tessera generate`` left-pads prompts of different
    # lengths, so its rows' first columns are hidden and it never takes this variant.
    Assumption("keys_by_length", "each row's keys are its columns 0..seqlens_k, none hidden among them, so the "
                                 "lengths alone say which keys a decoding step sees (no mask, no bias)",
               _not_by_length),
)}


def broken(assumptions, attrs: dict) -> list[str]:
    """Why a kernel taking these shortcuts cannot compute the epilogue these attributes ask for."""
    on = used(attrs)
    return [f"it assumes {ASSUMPTIONS[a].what}, but {why}" for a in sorted(assumptions)
            if (why := ASSUMPTIONS[a].broken_by(on))]


def flops_per_score(attrs: dict) -> dict[str, int]:
    """The epilogue's operations per score for these attributes, by category (ops/attention.py's cost)."""
    total: dict[str, int] = {}
    for f in used(attrs):
        for kind, n in FEATURES[f].flops.items():
            total[kind] = total.get(kind, 0) + n
    return total


def only(attrs: dict, features) -> dict:
    """These attributes with every feature but ``features`` (and what they need) turned off: for
    applying one feature's step alone (the contract's tests)."""
    keep = set(features)
    for f in list(keep):
        keep |= set(FEATURES[f].needs)
    out = dict(attrs)
    for f in FEATURES.values():
        if f.name in keep:
            continue
        for name, attr in f.attrs.items():
            if bool in attr.types:
                out[name] = False
            elif int in attr.types and f.name != "scale":
                out[name] = 0
            elif f.name != "scale":
                out.pop(name, None)
    return out


# The epilogue in order: (features a step computes, the step). Every feature has exactly one step.
STEPS: list[tuple[tuple[str, ...], Callable]] = [
    (("scale",), _scale),
    (("softcap",), _softcap),
    (("bias",), _bias),
    (("causal", "window", "chunk", "local_window", "padding"), _masks),
    (("sinks",), _sinks),
]


def used(attrs: dict) -> list[str]:
    """The features a fused node's attributes turn on, in epilogue order."""
    return [f.name for f in sorted(FEATURES.values(), key=lambda f: f.stage) if f.active(attrs)]


def words(features) -> str:
    """Features in words: "padding mask, additive bias"."""
    return ", ".join(FEATURES[f].words if f in FEATURES else f for f in features)


def sink_logits(sinks: np.ndarray, heads: int) -> np.ndarray:
    """A sinks input ([heads], or any shape of that many values in head order) as [1, heads, 1, 1]."""
    return np.asarray(sinks).reshape(1, heads, 1, 1)


def softmax(s: np.ndarray, attrs: dict, where: Where) -> np.ndarray:
    """The weights from a block of epilogued scores [.., H, rows, Tk] holding whole rows: a softmax over
    the keys, with attention sinks (``where.sinks``, broadcastable to [.., H, 1, 1]) one more logit per
    row in the normaliser, whose weight is dropped (gpt-oss: softmax(concat(s, sink))[..., :-1])."""
    m = s.max(-1, keepdims=True)
    if attrs.get("sinks"):
        sink = np.broadcast_to(np.asarray(where.sinks, s.dtype), m.shape)
        m = np.maximum(m, sink)
        e = np.exp(s - m)
        return e / (e.sum(-1, keepdims=True) + np.exp(sink - m))
    e = np.exp(s - m)
    return e / e.sum(-1, keepdims=True)


def apply(s: np.ndarray, attrs: dict, where: Where) -> np.ndarray:
    """The epilogue on a block of raw scores q·kᵀ: every step whose features the node uses."""
    on = set(used(attrs))
    for feats, step in STEPS:
        if on & set(feats):
            s = step(s, attrs, where)
    return s
