"""``/v1/embeddings``: an encoder model (BERT, MiniLM) served for sentence embeddings.

`tessera serve` of a model whose graph gives hidden states ``hidden [B, T, d]`` and no logits (an
encoder: models/bert.tsr) serves this route instead of the generation routes. A request's inputs
(texts through the tokenizer, or token ids) and those of the other requests waiting run as one
batch (up to MAX_ROWS inputs): its rows in one onnxruntime call per group of similar lengths, each
padded to its own longest row (runtime/embedding.py ``length_groups``; short batches: one call); the
hidden states are pooled as the model's folder declares (sentence-transformers' ``1_Pooling/config.json``:
mean or CLS; mean by default, as ``tessera run --pool mean``) over the attention mask and
L2-normalised when the folder's ``modules.json`` has a Normalize module (or has no modules.json:
normalised by default). The calls run in the engine's own thread: the event loop awaits each
request's future and never waits for the model.

``EmbeddingEngine`` has what the server's shell asks of an engine (``accepting``, ``running``,
``queued``, ``drain``, ``wait_idle``, ``start``, ``close``, ``describe``, ``metrics``), so
``/health``, ``/metrics`` and the SIGTERM drain work as for a decoder.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np

from tessera.runtime.embedding import EmbeddingError, EmbeddingModel  # noqa: F401  (re-exported)

from .metrics import Metrics

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)
MAX_ROWS = 64  # inputs of several requests run together in one batch (a larger request runs alone)


class EmbeddingEngine:
    """Embedding requests, batched: a thread of its own takes every waiting request (up to
    ``MAX_ROWS`` inputs together; a larger request runs alone) and runs them as one batch (one onnxruntime
    call per group of rows of similar lengths, each padded to its longest); each request's rows come back
    to its future."""

    def __init__(self, model: EmbeddingModel, tokenizer=None, max_queue: int = 64, metrics: Metrics | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.capacity = model.context
        self.eos_ids = frozenset()
        self._cond = threading.Condition()
        self._pending: list[tuple[list[list[int]], Future]] = []
        self._accepting, self._closed = True, False
        self._busy = 0
        self._thread: threading.Thread | None = None
        self.calls = 0  # batches run (the tests check that requests share them)
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
        return len(self._pending)

    def start(self) -> "EmbeddingEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tessera-embeddings", daemon=True)
            self._thread.start()
        return self

    def drain(self) -> None:
        self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self._busy or self._pending:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        from .engine import Unavailable

        with self._cond:
            self._accepting, self._closed = False, True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for _, fut in pending:
            fut.set_exception(Unavailable("the request was cancelled: the server is shutting down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def describe(self) -> str:
        m = self.model
        return (f"embeddings: {m.name}, {m.dim} dimensions, {m.pooling} pooling"
                f"{', L2-normalised' if m.normalize else ''} ({m.pooling_source}); "
                f"context {m.context} tokens; the waiting requests' inputs (up to {MAX_ROWS}) in one batch, one "
                f"onnxruntime call per group of rows of similar lengths; routes: /v1/embeddings (the generation "
                f"routes answer 400)")

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

    def submit(self, rows: list[list[int]]) -> Future:
        """Queue a request's rows; its future gives their embeddings [N, dim]. Overloaded past
        ``max_queue`` waiting requests, Unavailable once draining."""
        from .engine import Overloaded, Unavailable

        fut: Future = Future()
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                self.metrics.rejected += 1
                raise Overloaded(f"the server is at capacity ({self.max_queue} requests waiting); retry later")
            self._pending.append((rows, fut))
            self.metrics.queue_depth = len(self._pending)
            self._cond.notify_all()
        if self._thread is None:  # driven by hand (tests): run now
            self.step()
        return fut

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """Embeddings [N, dim], waiting for the batch that runs them."""
        return self.submit(rows).result()

    def _take(self) -> list[tuple[list[list[int]], Future]]:
        """Under the lock: the waiting requests whose inputs together are at most MAX_ROWS (at least one)."""
        batch, rows = [], 0
        while self._pending and (not batch or rows + len(self._pending[0][0]) <= MAX_ROWS):
            item = self._pending.pop(0)
            batch.append(item)
            rows += len(item[0])
        self.metrics.queue_depth = len(self._pending)
        return batch

    def step(self) -> bool:
        """Run one batch of waiting requests; whether there was any."""
        with self._cond:
            batch = self._take()
            self._busy += len(batch)
        if not batch:
            return False
        try:
            rows = [r for item, _ in batch for r in item]
            try:
                out = self.model.run(rows, self.pad_id)
            except Exception as e:  # onnxruntime failed: these requests end with it, the engine goes on
                from .model import ort_message

                for _, fut in batch:
                    fut.set_exception(RuntimeError(f"the model could not run: {ort_message(e)}"))
                return True
            self.calls += 1
            at = 0
            for item, fut in batch:
                fut.set_result(out[at:at + len(item)])
                at += len(item)
                self.metrics.finished["stop"] += 1
            self.metrics.prompt_tokens += sum(len(r) for r in rows)
        finally:
            with self._cond:
                self._busy -= len(batch)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending)
                if self._closed:
                    return
            self.step()
