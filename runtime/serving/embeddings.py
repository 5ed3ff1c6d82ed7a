"""``/v1/embeddings``: an encoder model (BERT, MiniLM) served for sentence embeddings.

`tessera serve` of a model whose graph gives hidden states ``hidden [B, T, d]`` and no logits (an
encoder: models/bert.tsr) serves this route instead of the generation routes. A request's inputs
(texts through the tokenizer, or token ids) run as one padded batch in ONE onnxruntime call; the
hidden states are pooled as the model's folder declares (sentence-transformers' ``1_Pooling/config.json``:
mean or CLS; mean by default, as ``tessera run --pool mean``) over the attention mask and
L2-normalised when the folder's ``modules.json`` has a Normalize module (or has no modules.json:
normalised by default). Calls run in the server's worker threads, one at a time (``EmbeddingEngine``
holds a lock): the event loop never waits for the model.

``EmbeddingEngine`` has what the server's shell asks of an engine (``accepting``, ``running``,
``queued``, ``drain``, ``wait_idle``, ``start``, ``close``, ``describe``, ``metrics``), so
``/health``, ``/metrics`` and the SIGTERM drain work as for a decoder.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tessera.runtime.embedding import EmbeddingError, EmbeddingModel  # noqa: F401  (re-exported)

from .metrics import Metrics

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)


class EmbeddingEngine:
    """Embedding requests, one onnxruntime call each (a request's inputs batched), one at a time."""

    def __init__(self, model: EmbeddingModel, tokenizer=None, max_queue: int = 64, metrics: Metrics | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.capacity = model.context
        self.eos_ids = frozenset()
        self._lock = threading.Lock()
        self._accepting = True
        self._busy = 0
        self._waiting = 0
        self.pad_id = 0
        if tokenizer is not None:
            from tessera.runtime.io.text import _pad_ids

            self.pad_id = _pad_ids(tokenizer)[0]
            # each text alone, whole: the batch is padded here, and a text past the context is refused (400),
            # never cut where the tokenizer.json's truncation would cut it
            tokenizer.no_padding()
            tokenizer.no_truncation()

    # what the server's shell asks of an engine
    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def running(self) -> int:
        return self._busy

    @property
    def queued(self) -> int:
        return self._waiting

    def start(self) -> "EmbeddingEngine":
        return self

    def drain(self) -> None:
        self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self._busy or self._waiting:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._accepting = False

    def describe(self) -> str:
        m = self.model
        return (f"embeddings: {m.name}, {m.dim} dimensions, {m.pooling} pooling"
                f"{', L2-normalised' if m.normalize else ''} ({m.pooling_source}); "
                f"context {m.context} tokens; one onnxruntime call per request (its inputs batched), one at a time; "
                f"routes: /v1/embeddings (the generation routes answer 400)")

    # requests
    def encode(self, inputs) -> list[list[int]]:
        """The request's ``input`` as token-id rows (EmbeddingError saying what is wrong)."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise EmbeddingError("input must be a string, a list of strings, a list of token ids or a list of lists "
                                 "of token ids, not empty")
        if len(inputs) > MAX_INPUTS:
            raise EmbeddingError(f"input has {len(inputs)} items; at most {MAX_INPUTS} a request")
        rows = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise EmbeddingError("this server has no tokenizer (--tokenizer): give the input as token ids")
                if not item:
                    raise EmbeddingError(f"input[{i}] is empty")
                ids = self.tokenizer.encode(item).ids  # special tokens ([CLS], [SEP]) as the tokenizer adds them
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                ids = list(item)
                vocab = self.model.vocab
                if not ids:
                    raise EmbeddingError(f"input[{i}] is empty")
                bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
                if bad:
                    raise EmbeddingError(f"input[{i}] holds token id {bad[0]}, outside the vocabulary"
                                         + (f" [0, {vocab})" if vocab is not None else ""))
            else:
                raise EmbeddingError("input must be a string, a list of strings, a list of token ids or a list of "
                                     "lists of token ids")
            if self.capacity is not None and len(ids) > self.capacity:
                raise EmbeddingError(f"input[{i}] has {len(ids)} tokens; the model's context is {self.capacity}")
            rows.append(ids)
        return rows

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """Embeddings [N, dim] (one call; callers wait their turn)."""
        if not self._accepting:
            from .engine import Unavailable

            raise Unavailable("the server is shutting down")
        if self._waiting >= self.max_queue:
            from .engine import Overloaded

            self.metrics.rejected += 1
            raise Overloaded(f"the server is at capacity ({self.max_queue} requests waiting); retry later")
        self._waiting += 1
        try:
            with self._lock:
                self._waiting -= 1
                self._busy += 1
                try:
                    out = self.model.run(rows, self.pad_id)
                finally:
                    self._busy -= 1
        except BaseException:
            raise
        self.metrics.prompt_tokens += sum(len(r) for r in rows)
        self.metrics.finished["stop"] += 1
        return out
