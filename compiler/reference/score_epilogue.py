"""The score epilogue of fused attention, in numpy: what happens to Q·Kᵀ before the softmax.

One table, ``FEATURES``, names every option a fused_attention node may apply to its scores
(scale, logit soft-cap, additive bias, causal mask, sliding window, two-sided local window, padding mask), the node
attributes each one owns (their types and allowed values: ops/attention.py's schema is built
from them) and where it sits in the epilogue (``stage``: features of one stage commute).
``apply`` is the numpy meaning of the table, used by the interpreter (ops/attention.py's
reference of fused_attention) and by reference/flash.py's plain and tiled attention. The
ONNX kernels build the same steps in backends/onnx/score_epilogue.py, and a kernel
declares which features it computes (an allow-list): the recogniser records which feature
each score-path rule produces, so a score option this table does not know is refused by
fusion instead of being dropped by a kernel.

A new score option is one row here, one step in backends/onnx/score_epilogue.py and one
ScoreRule in compiler/patterns/attention.py.
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


@dataclass(frozen=True)
class Feature:
    """One option of the score epilogue: the attributes it owns and whether a node uses it."""

    name: str
    stage: int                      # order in the epilogue; features of one stage commute
    attrs: dict = field(default_factory=dict)
    active: Callable[[dict], bool] = lambda a: True
    what: str = ""                  # in words, for --explain ("padding mask"); the name if empty

    @property
    def words(self) -> str:
        return self.what or self.name


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("scale", 0, {"scale": Attr((float,), "multiplies the scores", finite, required=True)}, what="scale"),
    Feature("softcap", 1, {"softcap": Attr((float,), "tanh(s)·c on the scaled scores", positive)},
            lambda a: bool(a.get("softcap")), "logit soft-capping"),
    Feature("bias", 2, {"bias": Attr((bool,), "an additive bias tensor is an input (after the mask)",
                                     required=True)},
            lambda a: bool(a.get("bias")), "additive bias"),
    Feature("causal", 2, {"causal": Attr((bool,), "hide keys after each query", required=True)},
            lambda a: bool(a.get("causal")), "causal mask"),
    Feature("window", 2, {"window": Attr((int,), "with causal: also hide keys this far back (0: none)",
                                         non_negative, required=True)},
            lambda a: bool(a.get("window")), "sliding window"),
    Feature("local_window", 2, {"local_window": Attr((int,), "without causal: hide keys this far from the query "
                                                     "or farther, on either side (0: none)", non_negative)},
            lambda a: bool(a.get("local_window")), "two-sided local window"),
    Feature("padding", 2, {"padding": Attr((bool,), "a key padding mask [B, Tk] is an input (0 = padding)",
                                           required=True)},
            lambda a: bool(a.get("padding")), "padding mask"),
)}

# The epilogue in order: (features a step computes, the step). Every feature has exactly one step.
STEPS: list[tuple[tuple[str, ...], Callable]] = [
    (("scale",), _scale),
    (("softcap",), _softcap),
    (("bias",), _bias),
    (("causal", "window", "local_window", "padding"), _masks),
]


def used(attrs: dict) -> list[str]:
    """The features a fused node's attributes turn on, in epilogue order."""
    return [f.name for f in sorted(FEATURES.values(), key=lambda f: f.stage) if f.active(attrs)]


def words(features) -> str:
    """Features in words: "padding mask, additive bias"."""
    return ", ".join(FEATURES[f].words if f in FEATURES else f for f in features)


def apply(s: np.ndarray, attrs: dict, where: Where) -> np.ndarray:
    """The epilogue on a block of raw scores q·kᵀ: every step whose features the node uses."""
    on = set(used(attrs))
    for feats, step in STEPS:
        if on & set(feats):
            s = step(s, attrs, where)
    return s
