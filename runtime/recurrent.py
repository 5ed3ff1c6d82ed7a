"""Decoding a recurrent encoder-decoder (models/rnnsearch.tsr): the encoder once, then one decoder
step per token, the decoder state carried from step to step.

Why not the KV-cache loop of generate.py: a recurrent decoder has no cache of keys and values to
grow; its whole history is the state s (and the encoder's outputs it attends to, fixed once
encoded). The spec provides the two graphs (``mode="encode"`` and ``mode="step"``, with the same
parameter paths as the training graph), and this module runs them in onnxruntime. The next token
is chosen by generate.py's ``choose`` (greedy at temperature 0, or its sampling), so the token
rules are shared with transformer decoding and the loop can move into generate.py when that grows
a state-carrying model kind.

The step graph's contract (names as rnnsearch.tsr declares them): inputs ``s`` [B, dec],
``y_prev`` [B], ``enc`` and ``enc_keys`` (the encode graph's outputs of the same names); outputs
``s_next``, ``logits`` [B, vocab] and ``align`` [B, S]. The encode graph maps ``src`` to ``enc``,
``enc_keys`` and ``state`` (s_0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.ir.graph import Graph
from tessera.compiler.passes.pipeline import build_pipeline

from .generate import Sampling, choose


@dataclass
class Decoded:
    tokens: np.ndarray     # [B, n] the chosen tokens, the start token not included
    align: np.ndarray      # [B, n, S] each step's attention weights over the source
    logits: np.ndarray     # [B, n, vocab] each step's logits


class RecurrentSeq2Seq:
    """An encode session and a step session of one model, with its weights."""

    ENCODE_OUT = ("enc", "enc_keys", "state")
    STEP_IN = ("s", "y_prev", "enc", "enc_keys")

    def __init__(self, encode: Graph, step: Graph, weights: Mapping[str, np.ndarray], recurrence: str = "auto"):
        import onnxruntime as ort

        for g, want, what in [(encode, self.ENCODE_OUT, "outputs"), (step, self.STEP_IN, "inputs")]:
            have = g.outputs if what == "outputs" else g.inputs
            if sorted(have) != sorted(want):
                raise ValueError(f"graph {g.name} must have the {what} {', '.join(want)}, has {', '.join(have)}")
        self.sessions = []
        for g in (encode, step):
            g = g.copy()
            build_pipeline(recurrence=recurrence)(g)
            w = {p: weights[p] for p in g.params}
            model = onnx_export.to_bytes(g, w)
            self.sessions.append(ort.InferenceSession(model, providers=["CPUExecutionProvider"]))

    def encode(self, src: np.ndarray) -> dict[str, np.ndarray]:
        outs = self.sessions[0].run(list(self.ENCODE_OUT), {"src": src.astype(np.int64)})
        return dict(zip(self.ENCODE_OUT, outs))

    def step(self, s, y_prev, enc, enc_keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.sessions[1].run(["s_next", "logits", "align"],
                                          {"s": s, "y_prev": y_prev.astype(np.int64), "enc": enc,
                                           "enc_keys": enc_keys}))


def decode(model: RecurrentSeq2Seq, src: np.ndarray, max_new_tokens: int, bos: int,
           sampling: Sampling | None = None, eos: int | None = None) -> Decoded:
    """Encode ``src`` [B, S] once and decode up to ``max_new_tokens`` from ``bos``; rows that chose
    ``eos`` keep emitting it (the batch stops when every row has)."""
    sampling = sampling or Sampling()
    rng = np.random.default_rng(sampling.seed)
    e = model.encode(src)
    s = e["state"]
    y = np.full(src.shape[0], bos, dtype=np.int64)
    done = np.zeros(src.shape[0], dtype=bool)
    tokens, aligns, logits = [], [], []
    for _ in range(max_new_tokens):
        s, lg, a = model.step(s, y, e["enc"], e["enc_keys"])
        y = choose(lg, None, sampling, rng)
        if eos is not None:
            y = np.where(done, eos, y)
            done |= y == eos
        tokens.append(y)
        aligns.append(a)
        logits.append(lg)
        if eos is not None and done.all():
            break
    return Decoded(np.stack(tokens, 1), np.stack(aligns, 1), np.stack(logits, 1))
