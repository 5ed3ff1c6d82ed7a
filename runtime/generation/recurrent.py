"""Decoding a recurrent encoder-decoder (models/rnnsearch.tsr): the encoder once, then one decoder
step per token, the decoder state carried from step to step.

Why not the KV-cached decoder of generation/cached.py: a recurrent decoder has no cache of keys
and values to grow; its whole history is the state s (and the encoder's outputs it attends to,
fixed once encoded). The spec provides the two graphs (``mode="encode"`` and ``mode="step"``, with
the same parameter paths as the training graph), and this module runs them in onnxruntime as a
``RecurrentDecoder``; the loop (token choice, stop tokens, finished rows) is generation/decoding.py's,
the one the cached decoder runs too.

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
from tessera.compiler.passes.pipeline import PipelineOptions, pipeline

from tessera.runtime.generation.decoding import decode_steps
from tessera.runtime.generation.sampling import Sampling
from tessera.runtime.pipeline import UsageError


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
            pipeline("full", PipelineOptions(recurrence=recurrence))(g)
            w = {p: weights[p] for p in g.params}
            model = onnx_export.to_bytes(g, w)
            self.sessions.append(ort.InferenceSession(model, providers=["CPUExecutionProvider"]))
        self.vocab = int(step.type_of("logits").shape[-1])

    def encode(self, src: np.ndarray) -> dict[str, np.ndarray]:
        outs = self.sessions[0].run(list(self.ENCODE_OUT), {"src": src.astype(np.int64)})
        return dict(zip(self.ENCODE_OUT, outs))

    def step(self, s, y_prev, enc, enc_keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.sessions[1].run(["s_next", "logits", "align"],
                                          {"s": s, "y_prev": y_prev.astype(np.int64), "enc": enc,
                                           "enc_keys": enc_keys}))


class RecurrentDecoder:
    """A RecurrentSeq2Seq as a decoding.Decoder: the source encoded once, then one step per token
    from ``bos``, the state carried; each step's attention weights and logits are kept."""

    def __init__(self, model: RecurrentSeq2Seq, src: np.ndarray, bos: int):
        self.model, self.rows = model, src.shape[0]
        self.encoded = model.encode(src)
        self.state = self.encoded["state"]
        self.bos = bos
        self.aligns: list[np.ndarray] = []
        self.logits: list[np.ndarray] = []

    def step(self, last: np.ndarray | None) -> np.ndarray:
        y = np.full(self.rows, self.bos, dtype=np.int64) if last is None else last
        self.state, lg, a = self.model.step(self.state, y, self.encoded["enc"], self.encoded["enc_keys"])
        self.aligns.append(a)
        self.logits.append(lg)
        return lg


def decode(model: RecurrentSeq2Seq, src: np.ndarray, max_new_tokens: int, bos: int,
           sampling: Sampling | None = None, eos: int | None = None) -> Decoded:
    """Encode ``src`` [B, S] once and decode up to ``max_new_tokens`` from ``bos`` (the loop of
    generation/decoding.py); rows that chose ``eos`` keep emitting it (the batch stops when every row has)."""
    sampling = sampling or Sampling()
    decoder = RecurrentDecoder(model, src, bos)
    stops = [eos] if eos is not None else []
    fill = eos if eos is not None else 0
    tokens = [[fill if t is None else t for t in emitted]
              for emitted in decode_steps(decoder, max_new_tokens, sampling, stops, pad_id=fill,
                                          seen=_penalised(model, src.shape[0], bos, sampling),
                                          prompts=[[bos]] * src.shape[0])]
    return Decoded(np.array(tokens, dtype=np.int64).T, np.stack(decoder.aligns, 1), np.stack(decoder.logits, 1))


def _penalised(model: RecurrentSeq2Seq, rows: int, bos: int, sampling: Sampling) -> np.ndarray | None:
    """The tokens the repetition penalty starts from: the start token of every row (transformers
    penalises the decoder's whole input, its start token included); None without a penalty."""
    if sampling.repetition_penalty == 1.0:
        return None
    seen = np.zeros((rows, model.vocab), dtype=bool)
    seen[:, bos] = True
    return seen


# ------------------------------------------------------------------ generate (runtime/driver.py)
def wants(spec) -> bool:
    """Whether generation runs this loop for ``spec``: a .tsr spec whose model has a ``mode``
    hyperparameter (the encode/step contract above). A spec that does not load is left to the
    ordinary path, which reports the error."""
    from pathlib import Path

    from tessera.spec import SpecError, load_program

    from tessera.runtime.pipeline import resolve_spec

    path = Path(spec)
    if path.suffix == ".onnx" or path.is_dir():
        return False
    try:
        model = load_program(resolve_spec(spec)).main_model
    except (SpecError, UsageError, OSError):
        return False
    return model is not None and any(p.name == "mode" for p in model.params)


@dataclass
class Generated:
    """What generate() decoded for a recurrent encoder-decoder, and how long it took."""

    decoded: Decoded
    rows: int
    seconds: float


def generate(ref, o) -> Generated:
    """Decode --input src=[[...]] from --start-token for a recurrent encoder-decoder (``o`` already
    checked for this kind: GenerateOptions.check("recurrent"))."""
    import time

    from tessera.compiler.ir.signature import check_limits, input_limits

    from tessera.runtime import pipeline
    from tessera.runtime.io.inputs import named_token_rows

    if any(s.partition("=")[0] == "mode" for s in ref.sets):
        raise UsageError("--set mode: generate chooses the model's modes itself (encode, then step)")
    sampling = o.sampling(ref.seed)
    built = pipeline.build(ref.spec, ref.variant, ref.sets, ref.weights)
    weights = pipeline.weights_for(built, ref.weights, ref.seed, ref.allow_large)
    encode = pipeline.build(ref.spec, ref.variant, list(ref.sets) + ["mode=encode"], ref.weights).graph
    step = pipeline.build(ref.spec, ref.variant, list(ref.sets) + ["mode=step"], ref.weights).graph
    try:
        model = RecurrentSeq2Seq(encode, step, weights)
    except ValueError as e:
        raise UsageError(f"{ref.spec} has a mode hyperparameter but not the encode/step graphs generate "
                         f"runs: {e}") from None
    given = named_token_rows(o.inputs, list(encode.inputs))
    if "src" not in given:
        raise UsageError("no source: give --input 'src=[[...]]' (one list of token ids per row)")
    rows = given["src"]
    if len({len(r) for r in rows}) != 1 or not rows[0]:
        raise UsageError("--input src: the rows must have one length, at least 1")
    src = np.array(rows, dtype=np.int64)
    check_limits(input_limits(encode), {"src": src}, {})
    vocab = int(step.type_of("logits").shape[-1])
    for what, ids in [("--start-token", [o.start_token]), ("--stop-token", o.stop_tokens)]:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"{what} {bad[0]} is outside the target vocabulary (0..{vocab - 1})")
    started = time.perf_counter()
    out = decode(model, src, o.max_new_tokens, o.start_token, sampling,
                 eos=o.stop_tokens[0] if o.stop_tokens else None)
    return Generated(out, len(rows), time.perf_counter() - started)
