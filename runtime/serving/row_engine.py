"""Serving for the models the KV-cache Engine cannot batch: recurrent state and encoder-decoders.

Why a second engine: ``Engine`` (engine.py) keeps one preallocated key/value buffer per layer with one
slot per row, which is exactly what a decoder-only transformer needs and nothing else. Two kinds of
model fall outside it, and ``RowEngine`` serves them with the same requests, handles, admission
control, metrics and token choice (it is an ``Engine`` with its own slots and step):

- **Recurrent state only** (Mamba, any ``scan`` or causal ``conv1d`` over time:
  compiler/passes/recurrent_state.py): a row's whole past is a fixed-size state, whatever its length.
  Each slot keeps its own state arrays; a prompt runs alone (against zeros), then every decoding row
  shares ONE onnxruntime call per step: the rows' states stacked on the batch axis, the new states
  split back. Continuous batching, as the KV engine does, with no cache to grow.
- **Encoder-decoders** (BART, RNNsearch; any spec ``tessera generate`` splits into an encoder part and
  a cached decoder, generation/loop.py ``EncoderDecoder``): the request's prompt is the SOURCE (token
  ids, or text through the tokenizer); it is encoded once when the request is admitted, and the
  decoder starts from ``--start-token`` (or the checkpoint's ``decoder_start_token_id``). Each row has
  its own decoder (generation/cached.py ``CachedDecoder``: its own KV cache or state, and its own
  encoder outputs, whose source lengths differ from row to row), so a step runs ONE ONNXRUNTIME CALL
  PER ROW: requests are served concurrently and each gets exactly the tokens it gets alone, but a
  step's weights are read once per row, not once per step. A decoder-only model with attention AND
  recurrent state (a hybrid) is served the same way, one call per row.

With ``serve --speculative ngram`` a decoder-only model's greedy rows check prompt-lookup drafts in
their steps, the state from before the checking call put back and the kept tokens run again after a
rejection (row_speculation.py, ``self.speculation``); encoder-decoders refuse it.

Sources the HTTP API cannot carry are refused when the server starts (``served_sources``): the API
takes text or token ids, so an encoder whose input is float features (Whisper's log-mel spectrogram)
is a UsageError saying to use ``tessera generate --input features=FILE.npy``. A source that is too long
for the encoder's position table (BART's ``arange(S) + 2``: compiler/ir/affine_index.py) is a
RequestError (HTTP 400) before the request takes a place.
"""

from __future__ import annotations


import numpy as np

from tessera.compiler.ir.signature import InputError, bind_inputs
from tessera.runtime.embedding import EmbeddingModel
from tessera.runtime.generation.loop import MAX_SOURCE_TOKENS

from .engine import Engine, Handle, Request, RequestError, _Sequence
from .metrics import Metrics
from .prefix_cache import PrefixCache
from .model import NO_CONTEXT_CAP, CachedDecoder, Stats, UsageError, check_cache_fits, ort_message, served_sources


class _Row(_Sequence):
    """A request in a slot, with its own decoder (per-row path) or its state arrays (batched path).
    Not _Sequence's constructor: its repetition mask is over the prompt, which for an encoder-decoder
    is the source (another vocabulary), not what the decoder has read."""

    def __init__(self, handle: Handle, slot: int, vocab: int, start: int | None):
        req = handle.request
        self.handle, self.slot = handle, slot
        self.filled, self.next_token, self.last_token_at = 0, None, 0.0
        self.rng = np.random.default_rng(req.sampling.seed)
        # what the decoder has read: an encoder-decoder's decoder starts from the start token alone
        self.history = [start] if start is not None else list(req.prompt)
        self.seen = None
        if req.sampling.repetition_penalty != 1.0:  # as transformers: over the decoder's input, start token included
            self.seen = np.zeros((1, vocab), dtype=bool)
            self.seen[0, self.history] = True
        self.decoder = None  # per-row path: a CachedDecoder over this row alone
        self.states: dict[str, np.ndarray] = {}  # batched path: the row's state, [1, ...] each
        self.position = 0  # batched path: the positions read so far


class RowEngine(Engine):
    """See the module docstring. ``model``: a CachedModel with recurrent state (decoder-only) or a
    generation/loop.py EncoderDecoder; ``start_token``: an encoder-decoder's decoder start token."""

    def __init__(self, model, max_batch: int = 8, max_queue: int = 64, capacity: int | None = None,
                 prefill_chunk: int = 256, tokenizer=None, eos_ids=(), metrics: Metrics | None = None,
                 start_token: int | None = None):
        self.seq2seq = model if hasattr(model, "s2s") else None
        decoder = self.seq2seq.s2s.decoder if self.seq2seq is not None else model
        info = decoder.info
        if self.seq2seq is None and not info.states:
            raise UsageError("this model has a KV cache only: the KV-cache Engine serves it "
                             "(engine_for below)")
        if self.seq2seq is not None:
            self.source, self.masks = served_sources(self.seq2seq)
            if start_token is None:
                raise UsageError("an encoder-decoder needs the decoder's start token: --start-token ID (a "
                                 "checkpoint's decoder_start_token_id is taken when it has one)")
            if not isinstance(start_token, int) or isinstance(start_token, bool) or \
                    not 0 <= start_token < (decoder.vocab or 0):
                raise UsageError(f"--start-token {start_token} is outside the decoder's vocabulary "
                                 f"[0, {decoder.vocab})")
            self.source_vocab = self.seq2seq.limits.ids[self.source][0]
        elif start_token is not None:
            raise UsageError("--start-token applies to encoder-decoders; a decoder-only model starts from its prompt")
        if decoder.vocab is None:
            raise UsageError("the model's vocabulary size is not static; the engine needs it")
        self._setup(decoder, max_batch, max_queue, capacity, NO_CONTEXT_CAP, prefill_chunk, tokenizer, eos_ids,
                    metrics)
        capacity, self.start_token = self.capacity, start_token
        # batched: every decoding row in one call (state only, no per-row encoder outputs)
        self.batched = self.seq2seq is None and not info.layers
        itemsize = np.dtype(decoder.np_dtype).itemsize
        check_cache_fits(info, max_batch, capacity, itemsize,
                         "the engine's per-row state and caches (--max-batch rows x --max-context positions)")
        self.row_bytes = sum(int(np.prod(s.shape)) for s in info.states) * itemsize + sum(
            layer.kv_heads * capacity * (layer.head_size + layer.value_size) * itemsize for layer in info.layers)
        self.cache_allocations = 0
        self.metrics.cache_bytes = self.memory_bytes

    # ------------------------------------------------------------------ what it holds
    @property
    def cache_bytes(self) -> int:
        return self.row_bytes * len(self.rows)

    @property
    def memory_bytes(self) -> int:
        """The state and caches of the rows running now (each row's, allocated when it is admitted)."""
        return self.cache_bytes

    def describe(self) -> str:
        if self.batched:
            how = ("recurrent state only: each slot keeps its own state; a prompt runs alone, then every decoding "
                   "row shares one onnxruntime call per step (the slots' states stacked on the batch axis)")
        elif self.seq2seq is not None:
            how = (f"encoder-decoder: the prompt is the source ('{self.source}'"
                   + (f", its mask {', '.join(repr(m) for m in self.masks)} all ones" if self.masks else "")
                   + f"), encoded once per request; the decoder starts from token {self.start_token}. "
                   "Each row has its own decoder (its own cache and encoder outputs), so a step runs one "
                   "onnxruntime call per row: requests run concurrently, each exactly as alone, but a step "
                   "reads the weights once per row")
        else:
            how = ("attention and recurrent state together: each row has its own decoder, one onnxruntime call "
                   "per row per step")
        return (f"engine: rows ({type(self).__name__}, serving/row_engine.py): {self.max_batch} slots x "
                f"{self.capacity} positions, up to {self.max_queue} queued; a prompt runs whole when admitted "
                f"(no chunking)\n"
                f"memory budget: {self.row_bytes / 2**10:.1f} KiB of state and cache per running row, allocated "
                f"when it is admitted (at most {self.max_batch * self.row_bytes / 2**20:.2f} MiB)"
                + (", plus each row's encoder outputs (their size follows its source length)" if self.seq2seq else "")
                + f"\n{how}" + (f"\n{self.speculation.describe()}" if self.speculation is not None else ""))

    # ------------------------------------------------------------------ requests
    def check(self, req: Request) -> None:
        """Every reason a request can never run, as a RequestError (an encoder-decoder's prompt is its
        source: checked against the encoder's inputs and their tables, then the decoder's context)."""
        if self.seq2seq is None:
            return super().check(req)
        p = req.prompt
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError("the prompt is empty: an encoder-decoder needs a source of at least one token")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise RequestError("the prompt must be a list of integer token ids")
        if len(p) > MAX_SOURCE_TOKENS:
            raise RequestError(f"the prompt (the source) has {len(p):,} tokens; an encoder-decoder's source is "
                               f"capped at {MAX_SOURCE_TOKENS:,}")
        try:
            bind_inputs(self.seq2seq.specs, self._source_feeds(p), self.seq2seq.limits)
        except InputError as e:
            raise RequestError(f"the prompt (the encoder's '{self.source}'): {e}") from None
        # the decoder's own checks (sampling, stop tokens, max_tokens against its context) on its prompt
        start = list(req.prompt)
        try:
            req.prompt = [self.start_token]
            super().check(req)
        finally:
            req.prompt = start

    def _source_feeds(self, prompt) -> dict[str, np.ndarray]:
        ids = np.array([list(prompt)], dtype=np.int64)
        return {self.source: ids, **{m: np.ones_like(ids) for m in self.masks}}

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One iteration: drop cancelled requests, admit waiting ones (each runs its prompt, or its
        source through the encoder, at once and gives its first token), then one decoding step for
        every row. Returns whether anything ran."""
        with self._cond:
            self._drop_cancelled()
            admitted = []
            while self.waiting and len(self.rows) < self.max_batch:
                row = _Row(self.waiting.popleft(), len(self.rows), self.vocab, self.start_token)
                self.rows.append(row)
                admitted.append(row)
            self.metrics.queue_depth, self.metrics.running = len(self.waiting), len(self.rows)
        if not self.rows:
            return False
        decoding = [r for r in self.rows if r not in admitted]
        try:
            for row in admitted:
                self._start(row)
            if decoding:
                self._decode(decoding)
        except Exception as e:  # onnxruntime failed: every running request ends with the reason, the engine goes on
            msg = f"the model could not run a step: {ort_message(e)}"
            for row in list(self.rows):
                row.handle._finish("error", msg)
            self.rows.clear()
        for row in sorted([r for r in self.rows if r.handle.finished], key=lambda r: -r.slot):
            self._release(row)
        self.metrics.running = len(self.rows)
        self.metrics.cache_bytes = self.memory_bytes
        return True

    def _start(self, row: _Row) -> None:
        """The row's prompt (decoder-only) or its source encoded and the start token (encoder-decoder),
        run alone; its first token chosen."""
        req = row.handle.request
        self.cache_allocations += 1
        if self.batched:
            info = self.info
            feeds = {info.tokens: np.array([req.prompt], dtype=np.int64),
                     "position_ids": np.arange(len(req.prompt), dtype=np.int64)[None],
                     **{s.past: np.zeros((1, *s.shape), dtype=self.model.np_dtype) for s in info.states}}
            out = self.model.run({k: v for k, v in feeds.items() if k in self.model.input_names})
            row.states = {s.past: out[s.present] for s in info.states}
            row.position = len(req.prompt)
            logits = out[info.logits][:, -1, :]
        else:
            if self.seq2seq is not None:
                fixed = self.seq2seq.s2s.encode(self._source_feeds(req.prompt))
                prompt = [self.start_token]
            else:
                fixed, prompt = None, list(req.prompt)
            # serve --speculative: a greedy row's decoder rolls back (row_speculation.py)
            row.decoder = self.speculation.decoder(self, row, prompt) if self.speculation is not None else None
            if row.decoder is None:
                row.decoder = CachedDecoder(self.model, [prompt], req.max_tokens, 0, Stats(), fixed)
            logits = row.decoder.step(None)
        self.metrics.prompt_tokens += len(req.prompt)
        self._take(row, logits)

    def _decode(self, rows: list[_Row]) -> None:
        self.steps += 1
        if self.speculation is not None:  # serve --speculative: rows with drafts checked (row_speculation.py)
            rows = self.speculation.decode(self, rows)
            if not rows:
                return
        if not self.batched:
            for row in rows:
                self._take(row, row.decoder.step(np.array([row.next_token], dtype=np.int64)))
            return
        info = self.info
        feeds = {info.tokens: np.array([[r.next_token] for r in rows], dtype=np.int64),
                 "position_ids": np.array([[r.position] for r in rows], dtype=np.int64),
                 **{s.past: np.concatenate([r.states[s.past] for r in rows], axis=0) for s in info.states}}
        out = self.model.run({k: v for k, v in feeds.items() if k in self.model.input_names})
        logits = out[info.logits][:, -1, :]
        for i, row in enumerate(rows):
            row.states = {s.past: out[s.present][i:i + 1] for s in info.states}
            row.position += 1
            self._take(row, logits[i:i + 1])

    def _take(self, row: _Row, logits: np.ndarray) -> None:
        """Choose the row's next token from its logits [1, vocab] and emit it."""
        req = row.handle.request
        if req.sampling.plain_greedy and row.mask is None:
            tok = int(np.argmax(logits[0]))
        else:
            tok = self._choose(row, logits)
        row.history.append(tok)
        row.next_token = tok
        self._emit(row, tok)

    def _history(self, seq: _Row) -> list[int]:
        """What the decoder has read (an encoder-decoder's start token and its tokens, not the source),
        for the processors that look back; Engine._choose does the rest."""
        return list(seq.history)

    def _release(self, seq: _Row) -> None:
        """Free seq's slot (its decoder or state goes with it); the last row takes its place."""
        if seq not in self.rows:
            return
        self.metrics.finished[seq.handle.finish_reason or "cancelled"] += 1
        r, last = seq.slot, len(self.rows) - 1
        if r != last:
            moved = self.rows[last]
            moved.slot = r
            self.rows[r] = moved
        self.rows.pop()


def engine_for(model, max_batch: int = 8, max_queue: int = 64, capacity: int | None = None,
               prefill_chunk: int = 256, tokenizer=None, eos_ids=(), start_token: int | None = None,
               prefix_cache_mb: float = 0):
    """The engine that serves ``model`` (what ``load`` gave): the KV-cache Engine (engine.py) for a
    decoder-only transformer, one onnxruntime call per step for every row; the RowEngine
    (this module) for what that cannot batch: recurrent state (per-slot state, one call per step)
    and encoder-decoders (one decoder per row, one call per row per step). ``prefix_cache_mb`` > 0:
    the KV-cache engine's prefix cache (prefix_cache.py), refused for the row engine."""
    if isinstance(model, EmbeddingModel):  # serve's build_server gives it the embeddings engine instead
        raise UsageError("this model is an encoder (hidden states, no logits): it generates no tokens; "
                         "`tessera serve` serves it on /v1/embeddings")
    if hasattr(model, "s2s") or model.info.states:
        if prefix_cache_mb:
            raise UsageError("--prefix-cache-mb applies to the KV-cache engine (decoder-only transformers); this "
                             "model is served by the row engine (recurrent state or an encoder-decoder): drop it")
        return RowEngine(model, max_batch, max_queue, capacity, prefill_chunk, tokenizer, eos_ids,
                         start_token=start_token)
    if start_token is not None:
        raise UsageError("--start-token applies to encoder-decoders; a decoder-only model starts from its prompt")
    engine = Engine(model, max_batch, max_queue, capacity, prefill_chunk, tokenizer, eos_ids)
    PrefixCache.for_engine(engine, prefix_cache_mb)
    return engine
