"""The continuous-batching engine: many requests, one cached decoder, one onnxruntime call per step.

Why: ``generate`` runs a static batch -- every row until the longest ends, and nothing joins once it
started. Here requests arrive at any time; each decoding step runs every active sequence in ONE
onnxruntime call (a step reads the weights once for all its rows), a sequence that finishes leaves
at once and a waiting one joins at the next step.

The cache (allocated once, at start-up, and never again): per layer and key/value one flat array
of ``max_batch * kv_heads * capacity * hd`` elements, plus a slot mask ``[max_batch, capacity]``.
Its live view is the prefix reshaped to ``[max_batch, kv_heads, W, hd]`` -- contiguous, so a step
feeds it to onnxruntime with no copy -- where the width W is the longest active row rounded up to
``WIDTH_STEP``: a step attends over W columns, not over ``capacity`` mostly masked ones. When a row
outgrows W the view is widened in place (``_relayout``: each (row, head) block moved to its new
offset, last first; once per ``WIDTH_STEP`` tokens of growth), and narrowed when the long rows have
left. Row i of the view is slot i; the active sequences always occupy the first n slots, so a step
feeds the block ``[:n]``. When a sequence leaves, the last one moves into its slot (its filled
columns are copied, once). Each row keeps its own length: its tokens fill its columns from 0, its
positions count its own tokens, and the mask hides its unfilled columns, so rows of any lengths
share a step. A decoding step runs onnxruntime's GroupQueryAttention with one ``cache_length`` per
row (``seqlens_k``), the cache views bound in place so the kernel writes each row's new column at
its own slot; or, where a model's attention does not take it, the plain branch with the per-row
mask, the engine writing the new columns (serving/model.py ``DECODE_REASONS``).

On CUDA the same cache lives in onnxruntime OrtValues on the device (runtime/device_cache.py,
``device_cache``; with the plain branch, fp32, each step's new columns come back as device OrtValues and
``_put`` writes them in there): the views are bound by pointer,
so a step copies its token ids, positions and lengths in (the engine's CUDA variant derives its mask in the
graph: compiler/backends/onnx/prefix_mask.py) and its logits out, not the cache; a chunk's keys and
values, a leaving row's move and the relayouts run there as small onnxruntime graphs (``_put``,
``_release``, ``_relayout`` branch to it). Elsewhere the cache is numpy, as described above.

Prompts are prefilled between decoding steps in chunks of at most ``prefill_chunk`` tokens an iteration,
so a long prompt delays the running streams by at most one chunk per step. In the combined call (below)
an iteration with no row decoding (a burst's start) may take several prompts' chunks: the oldest prompt's,
then the first chunks of prompts not started yet while the budget has room (``_more_first_chunks``), so a
burst of prompts goes in by the budget, not one prompt a call. Beside decoding rows a call takes one
prompt's chunk: more would lengthen every stream's step for no gain in tokens/s (bench/engine_ab.py).
Where the model has the combined call (compiler/backends/onnx/mixed_attention.py; serving/model.py
``load`` builds it), an iteration with both a chunk and decoding rows is ONE onnxruntime call
(``_combined_step``: every weight read once for both); otherwise the chunk and the step are a call each.
``prefill_chunk`` is the iteration's token budget: each decoding row takes one token of it and the
chunk the rest (at least ``MIN_PREFILL_CHUNK``; ``chunk_for``), so the more streams run, the less a
chunk delays them; with no stream decoding a prompt goes in by up to ``IDLE_PREFILL_CHUNK`` tokens
a call (or the budget, if larger), since no stream waits for it.
A prompt's first chunk runs against an empty past (the tiled prefill kernel over the chunk alone,
exactly as ``generate`` prefills), later chunks against the row's filled columns (the tiled kernel
with the causal offset of the past and the mask hiding the unfilled columns).

Each request keeps its own sampling parameters and random generator (seeded per request, so a
sampled request gives the tokens ``generate`` gives it alone with that seed), stop tokens, stop
strings, end-of-sequence tokens and max tokens; greedy tokens equal ``generate``'s whatever else is
in the batch. Admission control: at most ``max_batch`` running and ``max_queue`` waiting; past
that ``submit`` raises ``Overloaded`` at once; after ``drain()`` it raises ``Unavailable``.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from tessera.runtime.bfloat16 import element_type
from tessera.runtime.generation.constraints import Grammar, GrammarCompiler, GrammarError, TokenMask, masked_argmax

from .device_cache import DeviceCache
from .metrics import Metrics
from .model import (COMBINED_REASONS, CachedModel, Sampling, Step, StopStrings, UsageError, check_cache_fits, choose,
                    has_combined_call, ort_message, token_logprobs)

WIDTH_STEP = 64  # attention width granularity of a decoding step (fewer distinct shapes)
MIN_PREFILL_CHUNK = 16  # prompt tokens an iteration prefills at least (Engine.chunk_for)
IDLE_PREFILL_CHUNK = 512  # prompt tokens a call takes at most while no stream decodes (Engine.chunk_for)


class RequestError(UsageError):
    """A request that can never run (an empty prompt, past the context, bad sampling values): HTTP 400."""


class Overloaded(Exception):
    """Running and waiting requests are at their bounds: refused at once (HTTP 429)."""


class Unavailable(Exception):
    """The engine is draining or closed (HTTP 503)."""


@dataclass
class Request:
    """One generation request: prompt token ids and how to continue them."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    # structured output (generation/constraints.py): the grammar the tokens must follow; ``mask`` is its
    # compiled matcher (Engine.grammar_mask, built by submit when not given: the server builds it in a
    # worker thread)
    grammar: Grammar | None = None
    mask: TokenMask | None = None


def check_request_types(req) -> None:
    """What ``submit`` takes, by type, before anything looks inside it: a Request (else TypeError)
    whose prompt is a list of ids (text is the tokenizer's to encode), sampling a Sampling, stop
    tokens and strings tuples or lists of ids and of valid Unicode strings, ignore_eos a bool (else
    RequestError saying which)."""
    if not isinstance(req, Request):
        raise TypeError(f"submit takes a Request (tessera.runtime.serving.engine.Request), got "
                        f"{type(req).__name__}")
    p = req.prompt
    if isinstance(p, (str, bytes)):
        raise RequestError(f"the prompt must be a list of integer token ids, got text ({type(p).__name__}); "
                           f"encode it with the tokenizer first (serving.model.encode_prompts)")
    if not isinstance(p, (list, tuple)):
        raise RequestError(f"the prompt must be a list of integer token ids, got {type(p).__name__}")
    if not isinstance(req.sampling, Sampling):
        raise RequestError(f"sampling must be a Sampling (tessera.runtime.generate.Sampling), got "
                           f"{type(req.sampling).__name__}")
    for name, kind in (("stop_tokens", "integer token ids"), ("stop_strings", "strings")):
        v = getattr(req, name)
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise RequestError(f"{name} must be a tuple or list of {kind}, got {type(v).__name__}")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in req.stop_tokens):
        raise RequestError("stop_tokens must be integer token ids")
    for s in req.stop_strings:
        if not isinstance(s, str):
            raise RequestError(f"stop_strings must be strings, got {type(s).__name__}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("a stop string is not valid Unicode (a lone surrogate such as \\ud800)") from None
    if not isinstance(req.ignore_eos, bool):
        raise RequestError(f"ignore_eos must be a bool, got {type(req.ignore_eos).__name__}")
    if req.grammar is not None and not isinstance(req.grammar, Grammar):
        raise RequestError(f"grammar must be a Grammar (tessera.runtime.generation.constraints.Grammar), got "
                           f"{type(req.grammar).__name__}")
    if req.mask is not None and not isinstance(req.mask, TokenMask):
        raise RequestError(f"mask must be a TokenMask (Engine.grammar_mask), got {type(req.mask).__name__}")


class Handle:
    """A submitted request as it runs: its new tokens so far, and why it finished.

    Iterate it (blocking) for the token ids as they come; ``add_listener(fn)`` calls ``fn()`` (from the
    engine's thread) after each change, which is how an asyncio server wakes up; ``cancel()`` ends it
    and frees its slot at the next step. ``finish_reason``: "stop" (a stop token, stop string or the
    end-of-sequence token), "length" (max_tokens), "cancelled", "error" (``error`` says why)."""

    _ids = itertools.count(1)

    def __init__(self, request: Request):
        self.id = next(self._ids)
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[dict] = []  # per token, with request.sampling.logprobs (sampling.token_logprobs)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_listener(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._listeners.append(fn)
        fn()  # whatever happened before the listener came

    def cancel(self) -> None:
        self.cancelled = True
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine._wake()

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def _push(self, token: int) -> None:
        self.tokens.append(token)
        self._changed()

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._changed()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished (or timeout); returns whether it finished."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout)

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.tokens) > seen or self.finished)
                new, done = self.tokens[seen:], self.finished
            yield from new
            seen += len(new)
            if done and seen == len(self.tokens):
                return


def _committed(elements: int, dtype) -> np.ndarray:
    """A zeroed array whose every page is written now. np.zeros maps pages the kernel backs only
    when they are first touched, so the cache's first widening to many rows paid for hundreds of MB
    of page faults inside steps. How much depends on the machine: on the benchmark VM (memory its
    host had not backed yet) the w8a8 server at 16 streams ran 343-345 tokens/s with np.zeros
    against 445-446 written at start, time to first token p99 5.4-5.6 s against 1.6 s (docs/
    benchmarks/table.md S14, ab1); where the pages were recycled from the process's own freed memory, widenings
    took 13-47 ms either way. Written at start, whatever they cost is paid before the first request."""
    arr = np.empty(elements, dtype=dtype)
    arr.fill(0)
    return arr


def _round_up(columns: int) -> int:
    return -(-columns // WIDTH_STEP) * WIDTH_STEP


def device_cache_reason(model) -> str | None:
    """Why ``model`` cannot keep the engine's cache on its device (serving/device_cache.py), or None. A decoding
    step either writes every layer's new column into the bound buffer itself (GroupQueryAttention with a buffer
    output at every layer) or none (the plain MatMul/Softmax branch, fp32 on CUDA: its new columns come back as
    device OrtValues and the device cache's graphs write them in: ``_decode_step`` through ``_put``); a model mixing
    the two has no device path (runtime/driver.py serve_model compiles such a model all plain)."""
    info = model.info
    if info.length_input and not all(layer.buffer_key for layer in info.layers):
        return "some layers have no GroupQueryAttention buffer output, so their new columns would be copied per step"
    return None


class _Sequence:
    """A request in a slot: how much of its prompt is in the cache, the token to feed next."""

    def __init__(self, handle: Handle, slot: int, vocab: int):
        self.handle, self.slot = handle, slot
        req = handle.request
        self.filled = 0  # cache columns written (prompt and fed tokens)
        self.next_token: int | None = None  # None while the prompt is being prefilled
        self.rng = np.random.default_rng(req.sampling.seed)
        self.seen = None
        if req.sampling.repetition_penalty != 1.0:  # as generate: over the prompt and the new tokens
            self.seen = np.zeros((1, vocab), dtype=bool)
            self.seen[0, req.prompt] = True
        self.last_token_at = 0.0

    @property
    def prefilling(self) -> bool:
        return self.next_token is None

    @property
    def mask(self) -> TokenMask | None:
        """The request's grammar matcher (structured output), or None."""
        return self.handle.request.mask


class Engine:
    """The scheduler, the slots and the step; see the module docstring.

    ``start()`` runs the loop in a thread of its own; ``step()`` runs one iteration by hand instead
    (tests, offline batches). ``capacity``: cache columns per slot (default the model's context);
    every request needs prompt + max_tokens <= capacity."""

    def __init__(self, model: CachedModel, max_batch: int = 8, max_queue: int = 64, capacity: int | None = None,
                 prefill_chunk: int = 256, tokenizer=None, eos_ids=(), metrics: Metrics | None = None,
                 device_cache: bool | None = None):
        """``device_cache``: keep the cache in onnxruntime OrtValues on the session's device
        (runtime/device_cache.py); None (the default) where the model runs on CUDA (GroupQueryAttention writing
        every layer's buffer in place, or the plain branch at every layer: fp32), else the numpy cache. True
        on a CPU session runs that path on CPU OrtValues (how the tests check its numerics)."""
        info = model.info
        if info.states:  # its slots hold keys and values only; a row's recurrent state has no slot here
            raise UsageError(f"the engine does not carry recurrent state ({len(info.states)} scan or conv1d "
                             f"state(s): an attention-free or recurrent model); the row engine serves it "
                             f"(row_engine.py engine_for), `tessera generate` generates it")
        self._setup(model, max_batch, max_queue, capacity, None, prefill_chunk, tokenizer, eos_ids, metrics)
        capacity = self.capacity
        self.dims: dict[str, tuple[int, int]] = {}  # (kv_heads, hd)
        self.empty: dict[str, np.ndarray] = {}  # [1, kv_heads, 0, hd]: a prompt's first chunk's past
        for layer in info.layers:
            for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size)):
                self.dims[name] = (layer.kv_heads, size)
                self.empty[name] = np.zeros((1, layer.kv_heads, 0, size), dtype=model.np_dtype)
        # the device cache: GroupQueryAttention writing every layer's new column in place, or the plain branch at
        # every layer (its columns written in by the cache's graphs); not a mix of the two
        self.device_reason = device_cache_reason(model)
        if device_cache is None:  # on CUDA, whichever branch decodes (device_cache_reason)
            device_cache = model.session.get_providers()[0] == "CUDAExecutionProvider" and self.device_reason is None
        if device_cache and self.device_reason is not None:
            raise UsageError(f"the engine's device cache does not fit this model: {self.device_reason}")
        # ---- the cache, once: max_batch x kv_heads x capacity x hd elements per layer and key/value
        self.device_cache: DeviceCache | None = None
        self.cache: dict[str, np.ndarray] | None = None  # flat; viewed as [max_batch, kv_heads, width, hd]
        if device_cache:  # in OrtValues on the session's device (the numpy cache is None then)
            self.device_cache = DeviceCache(model.session, self.dims, max_batch, capacity, model.np_dtype)
        else:
            check_cache_fits(info, max_batch, capacity, np.dtype(model.np_dtype).itemsize,
                             "the engine's KV cache (--max-batch slots x --max-context positions)")
            self.cache = {name: _committed(max_batch * kv * capacity * hd, model.np_dtype)
                          for name, (kv, hd) in self.dims.items()}
        self.width = min(WIDTH_STEP, capacity)  # columns of the live view
        self.relayouts = 0
        self.slots = np.zeros((max_batch, capacity), dtype=np.int64)
        self.cache_allocations = 1  # the tests check that no step adds to it
        # GroupQueryAttention decoding (runtime/driver.py DECODE): the kernel writes the new columns in place
        self.in_place = bool(info.length_input)
        self._buffer_output = {}
        for layer in info.layers:
            self._buffer_output.update({layer.past_key: layer.buffer_key, layer.past_value: layer.buffer_value})
        # the layers whose new columns the engine writes into the cache itself after a step
        self._copied = [layer for layer in info.layers if not (self.in_place and layer.buffer_key)]
        self._wanted = [info.logits] + [o for layer in self._copied for o in (layer.present_key, layer.present_value)]
        self._bindings = {}  # kind -> (shape key, IOBinding): the decoding step's and the combined call's
        # a graph compiled for CUDA (compiler/passes/kv_cache.py DECODE_MASK): its GroupQueryAttention decoding
        # step takes the rows' mask of the filled slots and the new column, [rows, longest + 1]
        self.decode_mask = "decode_mask" in model.input_names
        # the same without the mask's values (the engine's variant, CacheInfo.prefix_keys: seqlens_k alone, no
        # attention_bias, so onnxruntime may choose flash decoding): decode_span [0, longest + 1], its width alone
        self.decode_span = "decode_span" in model.input_names
        # the engine's variant on CUDA derives the attention mask in the graph from cache_length (each row's keys
        # its columns 0..filled and the call's own tokens: compiler/backends/onnx/prefix_mask.py): not fed at all
        self.feeds_mask = "attention_mask" in model.input_names
        # the combined call (compiler/backends/onnx/mixed_attention.py): an iteration's decoding rows and
        # prompt chunk in one onnxruntime call, where the model has it (serving/model.py load builds it)
        self.combined = self.in_place and info.last_only and not self._copied and has_combined_call(model)
        self.combined_calls = 0  # iterations run as one call (the tests check mixed iterations happen)
        self.prompts_in_combined_calls = 0  # the prompt segments those calls took (several a call: a burst)
        self._wanted_combined = [info.logits] + [o for layer in info.layers for o in (layer.present_key,
                                                                                    layer.present_value)]
        self.metrics.cache_bytes = self.memory_bytes

    def _setup(self, model, max_batch, max_queue, capacity, no_context_capacity, prefill_chunk, tokenizer,
               eos_ids, metrics) -> None:
        """What every engine checks and holds (this one and row_engine.py's): the bounds, the capacity
        (the model's context by default; ``no_context_capacity`` for a model without one, else an
        error), the token choice's settings, the queue and the lock. ``model`` is the decoder."""
        for name, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise UsageError(f"max_queue must be an integer >= 0, got {max_queue}")
        ctx, switch = model.info.context, model.info.length_switch
        if switch is not None:
            # longrope: past the switch every cached key would be rotated again, and a batch of unrelated
            # requests has no one length to switch on; below it the short factors hold for every request
            if capacity is not None and capacity > switch:
                raise UsageError(f"--max-context {capacity} is past {switch} positions, where this model's longrope "
                                 f"rotary switches to its long factors: the serving engine batches unrelated "
                                 f"requests and cannot recompute their caches there, so it serves up to {switch} "
                                 f"positions (tessera generate runs longer sequences exactly)")
            ctx = switch if ctx is None else min(ctx, switch)
        if capacity is None:
            capacity = ctx if ctx is not None else no_context_capacity
            if capacity is None:
                raise UsageError("the model has no context length of its own; give the engine a capacity "
                                 "(--max-context N)")
        if not isinstance(capacity, int) or capacity < 2:
            raise UsageError(f"the capacity must be an integer >= 2, got {capacity}")
        if ctx is not None and capacity > ctx:
            raise UsageError(f"--max-context {capacity} is past the model's context of {ctx} positions")
        self.model, self.info = model, model.info
        self.max_batch, self.max_queue, self.capacity = max_batch, max_queue, capacity
        self.prefill_chunk = prefill_chunk
        self.idle_chunk = IDLE_PREFILL_CHUNK  # a prompt's chunk with no stream decoding (chunk_for)
        self.tokenizer, self.eos_ids = tokenizer, frozenset(int(t) for t in eos_ids)
        self.metrics = metrics or Metrics()
        self.vocab = model.vocab
        self.rows: list[_Sequence] = []  # slot i holds rows[i]; the active ones are the first len(rows)
        self.waiting: collections.deque[Handle] = collections.deque()
        self._cond = threading.Condition()
        self._accepting, self._closed = True, False
        self._thread: threading.Thread | None = None
        self.steps = 0  # decoding iterations run
        self.speculation = None  # serving/speculation.py's Speculation (serve --speculative), set by build_server
        self._grammars: GrammarCompiler | None = None  # the tokenizer's llguidance form, built at the first grammar
        self._grammar_lock = threading.Lock()
        self.prefix_cache = None  # serving/prefix_cache.py's PrefixCache (--prefix-cache-mb), set by engine_for

    # ------------------------------------------------------------------ what it holds
    @property
    def cache_bytes(self) -> int:
        if self.device_cache is not None:
            return self.device_cache.nbytes
        return sum(a.nbytes for a in self.cache.values())

    @property
    def memory_bytes(self) -> int:
        """The engine's whole preallocated state: the cache and the slot mask (the stated budget)."""
        return self.cache_bytes + self.slots.nbytes

    def describe(self) -> str:
        """The start-up statement: slots, capacity, the memory budget and the decoding kernel."""
        from .model import DECODE_REASONS, decode_kernel, weights_line

        per_slot = self.cache_bytes // self.max_batch
        where = ", the KV cache in OrtValues on the model's device," if self.device_cache is not None else ""
        return (f"engine: {self.max_batch} slots x {self.capacity} positions, up to {self.max_queue} queued; "
                f"prefill chunk {self.prefill_chunk} tokens an iteration (a prompt with no stream decoding: "
                f"{max(self.prefill_chunk, self.idle_chunk)})\n"
                f"memory budget: {self.memory_bytes / 2**20:.1f} MiB allocated once at start"
                f"{where} "
                f"(KV cache {self.cache_bytes / 2**20:.1f} MiB{self._stored_at()} = {self.max_batch} slots x "
                f"{per_slot / 2**20:.2f} MiB over {len(self.info.layers)} layers, viewed {WIDTH_STEP} "
                f"columns at a time as the longest row grows); no step allocates cache; per request only its "
                f"tokens (and a vocabulary-sized mask with repetition_penalty)\n"
                f"{weights_line(self.model)}\n"
                f"{self.placement()}\n"
                f"{DECODE_REASONS[decode_kernel(self.info)]}\n"
                f"{COMBINED_REASONS[self.combined]}\n"
                + (self.prefix_cache.describe() if self.prefix_cache is not None else
                   "prefix cache: off (--prefix-cache-mb 0): every prompt is prefilled whole")
                + (f"\n{self.speculation.describe()}" if self.speculation is not None else "")
                + (f"\n{self.model.compile_cache.line()}" if getattr(self.model, "compile_cache", None) is not None
                   else ""))

    def _stored_at(self) -> str:
        """`` at fp16`` where the cache is stored at fp16 (--kv-cache-dtype fp16, or --dtype fp16), else ""."""
        return " at fp16" if np.dtype(self.model.np_dtype) == np.float16 else ""

    def view_row_bytes(self, width: int | None = None) -> int:
        """The bytes of one row of the cache's live view at ``width`` columns (default the current), every
        layer's keys and values: what a step on CUDA moves each way per row (``placement``)."""
        w = self.width if width is None else width
        return sum(kv * w * hd for kv, hd in self.dims.values()) * np.dtype(self.model.np_dtype).itemsize

    def placement(self) -> str:
        """Where the model and the cache are, and on CUDA the bytes a decoding step copies (docs/serve.md)."""
        provider = self.model.session.get_providers()[0]
        dc = self.device_cache
        if dc is not None:
            where = "device memory" if dc.device == "cuda" else "CPU OrtValues (the device cache's path, forced)"
            masks = ("no mask (the decoding step has no mask of its own: GroupQueryAttention takes each row's keys "
                     "from seqlens_k alone, none hidden in columns 0..filled as the engine lays rows, so "
                     "onnxruntime's CUDA kernel may choose flash decoding; the prompt's mask is derived in the "
                     "graph from cache_length)"
                     if getattr(self.info, "prefix_keys", False) and not self.feeds_mask else
                     "its attention mask (n x (W + 1) x 8 B; the decoding step has no mask of its own: "
                     "GroupQueryAttention takes each row's keys from seqlens_k alone, none hidden in columns "
                     "0..filled as the engine lays rows, so onnxruntime's CUDA kernel may choose flash decoding)"
                     if getattr(self.info, "prefix_keys", False) else
                     "its masks (n x (2 x W + 2) x 8 B at most; the decoding step's mask goes to GroupQueryAttention "
                     "as attention_bias, with which onnxruntime's CUDA kernel chose MATH)" if self.in_place else
                     "its attention mask (n x (W + 1) x 8 B)" if self.feeds_mask else
                     "no mask (derived in the graph from the first position ids: a row's filled columns)")
            writes = ("GroupQueryAttention writes each row's new column into the shared buffer" if self.in_place else
                      "the plain MatMul/Softmax branch (no CUDA GroupQueryAttention for this decoding step: fp32, or "
                      "attention sinks beside the mask, --explain says which) reads the bound buffers and "
                      "gives each row's new column on the device, which the cache's graphs write into its row")
            return (f"placement: {provider}; the KV cache in {where}, allocated once (onnxruntime OrtValues, "
                    f"serving/device_cache.py) and bound in place: a decoding step of n rows at a view W columns "
                    f"wide copies only its token ids, positions{' and cache lengths' if self.in_place else ''} "
                    f"(n x {24 if self.in_place else 16} B) and {masks} "
                    f"in and n x {self.vocab} x 4 B of logits out; {writes}; a prompt chunk copies its tokens in and "
                    f"its logits out, its keys and values written into the row on the device; rows are moved, "
                    f"widened and narrowed there; the prefix cache copies a block device-to-host when it stores it "
                    f"and host-to-device when a request reuses it; speculation's check brings back every checked "
                    f"position's logits" + ("" if self.combined else
                                            "; the combined call has no CUDA lowering (a chunk and a step are "
                                            "two calls)"))
        if provider != "CUDAExecutionProvider":
            return f"placement: {provider}, the KV cache in host memory"
        full = self.view_row_bytes(WIDTH_STEP)
        why = self.device_reason or "the engine was built with device_cache=False"
        return (f"placement: CUDAExecutionProvider (the model compiled for CUDA); the KV cache stays in host memory "
                f"({why}), so a decoding step of n rows at a view "
                f"W columns wide copies the rows' live cache to the device and back: 2 x n x "
                f"{full / WIDTH_STEP:,.0f} B x W (e.g. {2 * full / 2**10:,.1f} KiB a row at W = {WIDTH_STEP}, "
                f"{2 * self.view_row_bytes(self.capacity) / 2**20:,.2f} MiB a row at the capacity of {self.capacity}), "
                f"plus the token ids and masks in and n x {self.vocab} x 4 B of logits out; the combined call "
                f"has no CUDA lowering (a chunk and a step are two calls)")

    @property
    def accepting(self) -> bool:
        """False once draining or closed (new requests get Unavailable)."""
        return self._accepting

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ requests
    def check(self, req: Request) -> None:
        """Every reason a request can never run, as a RequestError (before it takes a place)."""
        p = req.prompt
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError("the prompt is empty: generation needs at least one token to start from")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise RequestError("the prompt must be a list of integer token ids")
        bad = [t for t in p if t < 0 or t >= self.vocab]
        if bad:
            raise RequestError(f"the prompt holds token id {bad[0]}, outside the vocabulary [0, {self.vocab})")
        m = req.max_tokens
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {m}")
        if len(p) >= self.capacity:
            raise RequestError(f"the prompt has {len(p)} tokens; this server's context is {self.capacity} positions "
                               f"(prompt and new tokens together)")
        if len(p) + m > self.capacity:
            raise RequestError(f"max_tokens={m} goes past the context: the prompt has {len(p)} tokens and the "
                               f"server's context is {self.capacity} positions, so at most {self.capacity - len(p)}")
        try:
            req.sampling.check()
        except UsageError as e:
            raise RequestError(str(e)) from None
        seed = req.sampling.seed
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0):
            raise RequestError(f"seed must be an integer >= 0, got {seed}")
        for t in req.stop_tokens:
            if not isinstance(t, (int, np.integer)) or t < 0 or t >= self.vocab:
                raise RequestError(f"unknown stop token {t}: ids are in [0, {self.vocab})")
        if req.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need the server to have a tokenizer (--tokenizer)")
        if req.grammar is not None or req.mask is not None:
            # these take tokens away after the grammar's mask, and could leave none
            if req.sampling.min_new_tokens or req.sampling.no_repeat_ngram_size:
                raise RequestError("min_tokens and no_repeat_ngram_size cannot be combined with structured output "
                                   "(a JSON schema, regex or grammar)")

    def grammar_mask(self, grammar: Grammar) -> TokenMask:
        """A request's matcher for ``grammar`` over this engine's tokenizer (RequestError if the grammar
        is bad or the engine has no tokenizer). Compiling a large schema can take a while: the server
        calls this in a worker thread and passes the result as ``Request.mask``."""
        try:
            with self._grammar_lock:
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab, self.eos_ids)
            return self._grammars.mask(grammar)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def submit(self, req: Request) -> Handle:
        """Queue a request; raises RequestError (never runnable), Overloaded (bounds reached) or
        Unavailable (draining or closed) at once; a TypeError for anything but a Request."""
        check_request_types(req)
        self.check(req)
        req.prompt = [int(t) for t in req.prompt]
        if req.grammar is not None and req.mask is None:
            req.mask = self.grammar_mask(req.grammar)
        handle = Handle(req)
        handle._engine = self
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self.waiting) + len(self.rows) >= self.max_batch + self.max_queue:
                self.metrics.rejected += 1
                raise Overloaded(f"the server is at capacity ({self.max_batch} running, {self.max_queue} queued); "
                                 f"retry later")
            self.waiting.append(handle)
            self.metrics.queue_depth = len(self.waiting)
            self._cond.notify_all()
        return handle

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the loop
    def start(self) -> "Engine":
        """Run the scheduling loop in a daemon thread until ``close()``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tessera-engine", daemon=True)
            self._thread.start()
        return self

    def _has_work(self) -> bool:
        return bool(self.waiting or self.rows)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._has_work())
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # a bug: the requests in hand end with it, the loop goes on
                for seq in list(self.rows):
                    seq.handle._finish("error", f"internal error: {type(e).__name__}: {e}")
                self.rows.clear()

    def drain(self) -> None:
        """Refuse new requests (Unavailable); the running and queued ones go on."""
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing runs or waits (or timeout); returns whether it is idle."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._has_work():
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the loop; whatever still runs or waits ends as "cancelled"."""
        with self._cond:
            self._accepting, self._closed = False, True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for seq in self.rows:
            seq.handle._finish("cancelled")
        self.rows.clear()
        while self.waiting:
            self.waiting.popleft()._finish("cancelled")

    def _drop_cancelled(self) -> None:
        """Under the lock, at the start of a step: cancelled waiting requests finish, cancelled rows
        (their clients gone) free their slots for this step's admissions."""
        for h in [h for h in self.waiting if h.cancelled]:
            self.waiting.remove(h)
            h._finish("cancelled")
            self.metrics.finished["cancelled"] += 1
        for row in [r for r in self.rows if r.handle.cancelled]:
            row.handle._finish("cancelled")
            self._release(row)

    def step(self) -> bool:
        """One iteration: drop cancelled requests, admit waiting ones into free slots, prefill one chunk
        of the oldest prompt not yet in the cache, then one decoding step for every row that has its
        next token. Returns whether anything ran."""
        with self._cond:
            self._drop_cancelled()
            while self.waiting and len(self.rows) < self.max_batch:
                seq = _Sequence(self.waiting.popleft(), len(self.rows), self.vocab)
                self.slots[seq.slot] = 0
                self.rows.append(seq)
            self.metrics.queue_depth, self.metrics.running = len(self.waiting), len(self.rows)
        if not self.rows:
            return False
        try:
            prefilling = [s for s in self.rows if s.prefilling]
            decoding = len(self.rows) - len(prefilling)
            if prefilling and self.prefix_cache is not None:  # as its prefill starts (so it sees the blocks the
                self.prefix_cache.admit(self, prefilling[0])  # prompts before it stored): a cached prefix goes in
            budget = self.chunk_for(decoding)
            # with no row decoding, a burst's prompts share a call within the iteration's budget, not the idle
            # chunk: the combined call's attention is one block over all its segments' tokens (O(T^2))
            # with speculation, rows checking drafts this iteration take a call of their own (speculation.py)
            plan = self.speculation.plan(self) if prefilling and self.combined and self.speculation is not None \
                and decoding else None
            if plan:
                self._prefill_chunk(prefilling[0], budget)
                self.speculation.run(self, plan)
            elif prefilling and self.combined and (decoding or self._room_for_more(prefilling, self.prefill_chunk)):
                self._combined_step(prefilling[0], budget if decoding else self.prefill_chunk)
            else:
                if prefilling:
                    self._prefill_chunk(prefilling[0], budget)
                if any(not s.prefilling for s in self.rows):
                    self._decode_step()
        except Exception as e:  # onnxruntime failed: every running request ends with the reason, the engine goes on
            msg = f"the model could not run a step: {ort_message(e)}"
            for seq in list(self.rows):
                seq.handle._finish("error", msg)
            self.rows.clear()
        self.metrics.running = len(self.rows)
        return True

    # ------------------------------------------------------------------ prefill and decode
    def chunk_for(self, decoding: int) -> int:
        """The prompt tokens of an iteration that also decodes ``decoding`` rows: ``prefill_chunk`` is
        the iteration's token budget, each decoding row takes one, the chunk the rest, and at least
        ``MIN_PREFILL_CHUNK`` (so a prompt always advances). Why: on CPU a prompt token costs about
        what a decoding row does, and the running streams wait for the whole iteration; so the more
        streams run, the smaller the chunk that delays them. With none running (a lone request, the
        start of a burst) no stream waits, and a small budget would only cost calls (each reads
        every weight: a lone 150-token prompt in chunks of 32 took 1.6x the time to its first token
        of one chunk of 128, docs/benchmarks/table.md S11): the prompt goes in by ``idle_chunk`` tokens
        (``IDLE_PREFILL_CHUNK``, or the budget if larger), a bound that keeps one call's activations
        and the wait of a request arriving meanwhile in proportion."""
        if decoding == 0:
            return max(self.prefill_chunk, self.idle_chunk)
        return max(min(MIN_PREFILL_CHUNK, self.prefill_chunk), self.prefill_chunk - decoding)

    def _prefill_chunk(self, seq: _Sequence, size: int) -> None:
        info, req = self.info, seq.handle.request
        start = seq.filled
        chunk = req.prompt[start:start + size]
        t, r = len(chunk), seq.slot
        ones = np.ones((1, t), dtype=np.int64)
        self._fit(start + t)
        # the past: empty for a prompt's first chunk (the tiled kernel over the chunk alone, as generate
        # prefills), else the row's own buffer (a contiguous block), its filled columns unmasked; the numpy
        # cache's views go in the feeds, the device cache's are bound by _run_chunk
        mask = ones if start == 0 else np.concatenate([self.slots[r:r + 1, :self.width], ones], axis=1)
        past = {} if self.device_cache is not None else self.empty if start == 0 else \
            {name: v[r:r + 1] for name, v in self._views().items()}
        feeds = {info.tokens: np.array([chunk], dtype=np.int64),
                 "position_ids": np.arange(start, start + t, dtype=np.int64)[None], **past}
        if self.feeds_mask:
            feeds["attention_mask"] = mask
        if info.length_input:  # the filled slots: a chunk of one token runs the decoding branch (T = 1)
            feeds[info.length_input] = np.array([start], dtype=np.int64)
        if self.decode_mask:  # CUDA: the decoding branch's filled slots and new column (T > 1: unread)
            feeds["decode_mask"] = (np.concatenate([self.slots[r:r + 1, :start], ones], axis=1) if t == 1
                                    else np.ones((1, 1), dtype=np.int64))
        if self.decode_span:  # CUDA, no mask: their count alone (T > 1: unread)
            feeds["decode_span"] = np.zeros((0, start + 1 if t == 1 else 1), dtype=np.int64)
        if self.device_cache is not None:
            out = self._run_chunk(feeds, None if start == 0 else r, 1)
        else:
            out = self.model.run(feeds)
        if self._chunk_in(seq, t, out, 0, out[info.logits][:, -1, :]):
            self._release(seq)

    def _chunk_in(self, seq: _Sequence, t: int, out: dict, first: int, last_logits: np.ndarray) -> bool:
        """After a call that ran ``t`` prompt tokens of ``seq`` (a chunk alone, or in the combined call):
        their keys and values (columns ``first`` to ``first + t`` of each cache output's token axis) into
        its row, and when the whole prompt is in, its first token from ``last_logits`` (the chunk's last
        position). Returns whether the request finished there (the caller releases it once nothing
        indexes by slot)."""
        r, start = seq.slot, seq.filled
        self._put(r, start, out, 0, first, first + t)
        self.slots[r, start:start + t] = 1
        seq.filled += t
        self.metrics.prompt_tokens += t
        if self.prefix_cache is not None:  # its whole blocks, for later requests starting the same way
            self.prefix_cache.store(self, seq, seq.handle.request.prompt[:seq.filled])
        if seq.filled < len(seq.handle.request.prompt):
            return False
        tok = self._choose(seq, last_logits)  # the whole prompt is in: its last logits give the first token
        seq.next_token = tok
        self._emit(seq, tok)
        return seq.handle.finished

    def _decode_step(self) -> None:
        if self.speculation is not None and self.speculation.step(self):  # greedy rows had drafts: checked
            return
        info, rows = self.info, self.rows
        decoding = [s for s in rows if not s.prefilling]
        n = max(s.slot for s in decoding) + 1  # rows past the last decoding one (new prompts) stay out
        # each row's new column goes at its `filled` (a prefilling row among the first n too: the
        # GroupQueryAttention kernel writes its ignored column there, which its next chunk overwrites)
        self._fit(max(s.filled for s in rows[:n]) + 1)
        views, width = (self._views() if self.cache is not None else None), self.width
        tokens = np.zeros((n, 1), dtype=np.int64)
        positions = np.zeros((n, 1), dtype=np.int64)
        for s in decoding:  # a row still prefilling among them rides along masked; its outputs are dropped
            tokens[s.slot, 0], positions[s.slot, 0] = s.next_token, s.filled
        idx = np.array([s.slot for s in decoding])
        cols = np.array([s.filled for s in decoding])
        mask = np.concatenate([self.slots[:n, :width], np.ones((n, 1), dtype=np.int64)], axis=1)
        feeds = {info.tokens: tokens, "position_ids": positions}
        if self.feeds_mask:  # the same array, completed below for the in-place kernel
            feeds["attention_mask"] = mask
        if self.in_place:
            # GroupQueryAttention: row r attends over its slots 0..filled[r] (cache_length[r] + 1), the
            # last its new token's, written there by the kernel; its mask column says so
            mask[idx, cols] = 1
            feeds[info.length_input] = np.array([s.filled for s in rows[:n]], dtype=np.int64)
            if self.decode_mask:  # CUDA: the columns up to the longest row's new one (the kernel's total length)
                feeds["decode_mask"] = np.ascontiguousarray(mask[:, :max(s.filled for s in rows[:n]) + 1])
            if self.decode_span:  # CUDA, no mask (each row's keys are its columns 0..filled): their count alone
                feeds["decode_span"] = np.zeros((0, max(s.filled for s in rows[:n]) + 1), dtype=np.int64)
            started = time.perf_counter()
            out = self._run_in_place(feeds, n)
        elif self.device_cache is not None:  # the plain branch over the device buffers: new columns stay there
            started = time.perf_counter()
            out = self._run_chunk(feeds, 0, n, "a decoding step")
        else:  # the plain branch over the numpy cache
            feeds.update({name: v[:n] for name, v in views.items()})
            started = time.perf_counter()
            out = self.model.run(feeds)
        if self.speculation is not None:  # its price of the plain step (speculation.py, adaptive)
            self.speculation.observe_plain(n, time.perf_counter() - started)
        self.steps += 1
        if self._copied and self.device_cache is not None:  # each decoding row's column, on the device
            for s in decoding:
                self._put(s.slot, s.filled, out, s.slot, 0, 1)
        for layer in self._copied if self.device_cache is None else ():
            views[layer.past_key][idx, :, cols] = out[layer.present_key][idx, :, 0]
            views[layer.past_value][idx, :, cols] = out[layer.present_value][idx, :, 0]
        self.slots[idx, cols] = 1
        for s in sorted(self._decoded(decoding, out[info.logits][:, -1, :]), key=lambda s: -s.slot):
            self._release(s)

    def _decoded(self, decoding: list[_Sequence], logits: np.ndarray) -> list[_Sequence]:
        """After a decoding step (or the combined call): each decoding row's next token from its row of
        ``logits`` [rows, vocab] (by slot), emitted; returns the rows that finished (released by the
        caller, last slot first, once nothing indexes by slot any more)."""
        greedy = [s for s in decoding if s.handle.request.sampling.plain_greedy and s.mask is None]
        picks = {}
        if greedy:
            g = np.array([s.slot for s in greedy])
            picks = dict(zip(g.tolist(), np.argmax(logits[g], axis=-1).tolist()))
        finished = []
        for s in decoding:
            s.filled += 1
            tok = picks[s.slot] if s.slot in picks else self._choose(s, logits[s.slot:s.slot + 1])
            s.next_token = tok
            self._emit(s, tok)
            if s.handle.finished:
                finished.append(s)
        return finished

    def _combined_step(self, seq: _Sequence, size: int) -> None:
        """One iteration as ONE onnxruntime call (compiler/backends/onnx/mixed_attention.py): the tokens
        [1, n + T] are one per row of the view's first n (the decoding rows' next tokens; a dummy for a
        row not decoding, which rides along as in ``_decode_step``) and then the iteration's T prompt
        tokens: ``seq``'s chunk, whose row is among the n and marked by a 0 in the mask's last column,
        and, when no row decodes and the budget ``size`` has room, the first chunks of later prompts (``_more_first_chunks``),
        each a segment whose positions start again at 0 (the graph keeps every segment's queries to its
        own keys, and ``seq``'s past to ``seq``'s). The decoding part is ``_decode_step``'s
        (GroupQueryAttention writing each row's new column in place: the same feeds); each segment
        attends over its row's filled columns (``seq``'s; none for a first chunk) and itself, as
        ``_prefill_chunk``'s; the segments' keys and values come back as the cache outputs' last T
        columns and are written into their rows here, as there, and a segment that completes its prompt
        gets its first token from the logits at its last token. Why several prompts in one call: every
        call reads every weight, and a burst of short prompts would otherwise take one iteration each
        (bench/engine_ab.py). A prompt finished here takes its first decoding
        step at the next iteration."""
        info, rows, req = self.info, self.rows, seq.handle.request
        decoding = [s for s in rows if not s.prefilling]
        start = seq.filled
        chunk = req.prompt[start:start + size]
        # later prompts' first chunks only while no row decodes (a burst's start): beside decoding rows they would
        # lengthen every stream's step for no gain in tokens/s (bench/engine_ab.py at 16 streams: 0.87-0.97x)
        more = self._more_first_chunks(seq, size - len(chunk)) if not decoding else []
        segments = [(seq, start, chunk)] + [(s, 0, c) for s, c in more]
        t = sum(len(c) for _, _, c in segments)
        n = max([s.slot for s in decoding] + [s.slot for s, _, _ in segments]) + 1
        self._fit(max(max(s.filled for s in rows[:n]) + 1, max(at + len(c) for _, at, c in segments)))
        width = self.width
        tokens = np.zeros((1, n + t), dtype=np.int64)
        positions = np.zeros((1, n + t), dtype=np.int64)
        for s in decoding:
            tokens[0, s.slot], positions[0, s.slot] = s.next_token, s.filled
        offsets, at_token = [], n
        for s, at, c in segments:
            tokens[0, at_token:at_token + len(c)] = c
            positions[0, at_token:at_token + len(c)] = np.arange(at, at + len(c))
            offsets.append(at_token)
            at_token += len(c)
        idx = np.array([s.slot for s in decoding], dtype=np.int64)  # none in a burst's first call
        cols = np.array([s.filled for s in decoding], dtype=np.int64)
        mask = np.concatenate([self.slots[:n, :width], np.ones((n, 1), dtype=np.int64)], axis=1)
        mask[idx, cols] = 1  # the chunk's row keeps its filled columns only: its mask row is its past's
        mask[seq.slot, -1] = 0  # the combined call's marker: the first segment's row (mixed_attention.py ``_marker``)
        feeds = {info.tokens: tokens, "attention_mask": mask, "position_ids": positions,
                 info.length_input: np.array([s.filled for s in rows[:n]], dtype=np.int64)}
        out = self._run_in_place(feeds, n, "combined", len(segments))
        self.steps += 1
        self.combined_calls += 1
        self.prompts_in_combined_calls += len(segments)
        self.slots[idx, cols] = 1  # the decoding rows' new columns (written in place by the kernel)
        logits = out[info.logits][0]  # [n + segments, vocab]: the n row tokens, then each segment's last
        finished = self._decoded(decoding, logits[:n])
        # each segment's keys and values: the cache outputs' columns from its first token's
        for k, ((s, _, c), first) in enumerate(zip(segments, offsets)):
            if self._chunk_in(s, len(c), out, first, logits[n + k:n + k + 1]):
                finished.append(s)
        for s in sorted(finished, key=lambda s: -s.slot):
            self._release(s)

    @staticmethod
    def _room_for_more(prefilling: list[_Sequence], budget: int) -> bool:
        """With no row decoding: whether the first prompt's chunk leaves room in the budget for another's
        (then the combined call takes both; else the prompt goes in alone, by the prefill kernel)."""
        first = prefilling[0]
        return len(prefilling) > 1 and budget - (len(first.handle.request.prompt) - first.filled) >= MIN_PREFILL_CHUNK

    def _more_first_chunks(self, seq: _Sequence, room: int) -> list[tuple[_Sequence, list[int]]]:
        """The prompts whose first chunks join ``seq``'s in a combined call, oldest first, within ``room``
        tokens: each not started (no filled column: its segment has no past) and given at least
        ``MIN_PREFILL_CHUNK`` tokens (or its whole prompt, if shorter). With the prefix cache, a prompt
        whose first block is also another unfinished prompt's waits (the blocks that prompt stores are
        its own prefix: run together, neither could reuse the other's), and one joins only once its
        lookup found nothing to reuse (a hit gives it filled columns: it goes in later as a first segment)."""
        chosen = []
        pc = self.prefix_cache
        for s in self.rows:
            if room < MIN_PREFILL_CHUNK:
                break
            if s is seq or not s.prefilling or s.filled:
                continue
            prompt = s.handle.request.prompt
            if pc is not None:
                ahead = [o for o in self.rows if o is not s and o.prefilling and (o.slot < s.slot or o is seq or o.filled)]
                if any(o.handle.request.prompt[:pc.block] == prompt[:pc.block] for o in ahead):
                    continue
                pc.admit(self, s)
                if s.filled:
                    continue
            take = min(room, len(prompt))
            if take < len(prompt) and take < MIN_PREFILL_CHUNK:
                break
            chosen.append((s, prompt[:take]))
            room -= take
        return chosen

    def _run_in_place(self, feeds: dict[str, np.ndarray], n: int, kind: str = "decode", segments: int = 1) -> dict:
        """A decoding step of a GroupQueryAttention graph over the view's first ``n`` rows: each past
        view is bound (IOBinding) as both its input and its buffer output, so the kernel writes every
        row's new column into the engine's cache where it lies (no copy of the cache); the logits and
        the new columns of the layers it does not write (``_copied``) come back as arrays. ``kind``
        "combined": the combined call, whose cache outputs (every layer's new keys and values) come back
        too, and whose logits have a row per decoding row and ``segments``; each kind keeps its binding. With the device cache the views are its buffers on the
        device and the combined call's cache outputs stay there (OrtValues, ``_put`` writes them in)."""
        from .model import RunError, ort_message

        wanted = self._wanted if kind == "decode" else self._wanted_combined
        key = (n, self.width)  # rows and width: the views' shapes (their memory never moves)
        if kind != "decode":  # and the tokens and segments (the logits' rows): the outputs onnxruntime
            key += (feeds[self.info.tokens].shape[1], segments)  # allocates keep their first shape
        binding = self._bindings.get(kind)
        dc = self.device_cache
        if binding is None or binding[0] != key:  # bound again only when the shapes change
            io = self.model.session.io_binding()
            for name in wanted:  # bound first: get_outputs gives the outputs in the order bound
                if dc is not None and name != self.info.logits:  # cache outputs: left on the device
                    io.bind_output(name, dc.device, dc.device_id)
                else:
                    io.bind_output(name, "cpu")
            if dc is not None:
                for name in self.dims:
                    dc.bind(io, name, 0, n, self.width, self._buffer_output.get(name))
            else:
                for name, view in self._views().items():
                    view = view[:n]
                    io.bind_input(name, "cpu", 0, element_type(view.dtype), list(view.shape), view.ctypes.data)
                    out = self._buffer_output.get(name)
                    if out:
                        io.bind_output(out, "cpu", 0, element_type(view.dtype), list(view.shape), view.ctypes.data)
            if kind == "decode":  # the graph's bound step, if it has one: no cache columns
                self.model.bind_step_inputs(io)
            binding = self._bindings[kind] = (key, io)
        io = binding[1]
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        try:
            self.model.session.run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            what = "a decoding step" if kind == "decode" else "a combined prefill and decoding call"
            raise RunError(f"onnxruntime could not run {what}: {ort_message(e)}") from None
        outs = io.get_outputs()  # OrtValues, no copy; the buffer outputs (the cache itself) are not read
        return {name: outs[i].numpy() if dc is None or name == self.info.logits else outs[i]
                for i, name in enumerate(wanted)}

    def _history(self, seq: _Sequence) -> list[int]:
        """The tokens the decoder has read, for the processors that look back: prompt and output."""
        return seq.handle.request.prompt + seq.handle.tokens

    def _choose(self, seq: _Sequence, logits: np.ndarray) -> int:
        """The sequence's next token, by generation/sampling.py as generate chooses it (its tokens so
        far and its stop ids for the processors that look back; its log-probabilities if asked)."""
        h, req = seq.handle, seq.handle.request
        sampling, step = req.sampling, None
        raw = logits  # the model's, for the log-probabilities (as without a grammar)
        if seq.mask is not None:  # structured output: the tokens outside the grammar at -inf, first
            try:
                logits = seq.mask.apply(logits)
            except GrammarError as e:  # this request's matcher failed (a limit of llguidance's): it alone ends
                h._finish("error", str(e))
        if sampling.looks_back:
            stops = tuple(req.stop_tokens) + (() if req.ignore_eos else tuple(self.eos_ids))
            step = Step([self._history(seq)], [len(h.tokens)], stops)
        chosen = choose(logits, seq.seen, sampling, seq.rng, step)
        tok = int(chosen[0])
        if sampling.logprobs is not None:
            h.logprobs.append(token_logprobs(raw, chosen, sampling.logprobs)[0])
        if seq.seen is not None:
            seq.seen[0, tok] = True
        return tok

    def _emit(self, seq: _Sequence, tok: int) -> None:
        h, req, now = seq.handle, seq.handle.request, time.perf_counter()
        if h.finished:  # ended while its token was chosen (its grammar failed): nothing more to emit
            return
        if h.first_token_at is None:
            h.first_token_at = now
            self.metrics.ttft.observe(now - h.submitted)
        else:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.generated_tokens += 1
        h._push(tok)
        grammar_done = False
        if seq.mask is not None:  # advanced past the token; the next step's mask starts computing now
            try:
                seq.mask.consume(tok)
            except GrammarError as e:
                h._finish("error", str(e))
                return
            grammar_done = seq.mask.done
        if tok in req.stop_tokens or (tok in self.eos_ids and not req.ignore_eos) or grammar_done:
            reason = "stop"
        elif req.stop_strings and len(h.tokens) >= req.sampling.min_new_tokens and \
                StopStrings(req.stop_strings).hit(self.tokenizer, h.tokens):
            reason = "stop"
        elif len(h.tokens) >= req.max_tokens:
            reason = "length"
        else:
            return
        h._finish(reason)

    def _release(self, seq: _Sequence) -> None:
        """Free seq's slot: the last active row moves into it (its filled columns copied), so the
        active rows stay the first n slots."""
        r, last = seq.slot, len(self.rows) - 1
        self.metrics.finished[seq.handle.finish_reason or "cancelled"] += 1
        if self.prefix_cache is not None and seq.handle.finish_reason != "error":  # prompt and output: a next turn
            self.prefix_cache.store(self, seq, self._history(seq)[:seq.filled])
        if r != last:
            moved = self.rows[last]
            f = moved.filled
            if self.device_cache is not None:  # on the device: the whole row (the columns past f are masked)
                self.device_cache.move_row(last, r, self.width)
            for v in self._views().values() if self.cache is not None else ():
                v[r, :, :f] = v[last, :, :f]
            self.slots[r] = self.slots[last]
            moved.slot = r
            self.rows[r] = moved
        self.slots[last] = 0
        self.rows.pop()
        longest = max((s.filled + 1 for s in self.rows), default=1)
        if _round_up(longest) <= self.width // 2:  # the long rows left: attend over fewer columns
            self._relayout(_round_up(longest))

    # ------------------------------------------------------------------ the live view
    def _put(self, r: int, at: int, out: dict, src_row: int, s0: int, s1: int,
             views: dict[str, np.ndarray] | None = None) -> None:
        """Columns [s0, s1) of row ``src_row`` of a call's cache outputs (``out``, by present name: arrays,
        or the device cache's OrtValues) into row ``r``'s columns from ``at``: a prompt chunk's keys and
        values, speculation's checked columns."""
        layers = self.info.layers
        if self.device_cache is not None:
            sources = {}
            for layer in layers:
                sources[layer.past_key], sources[layer.past_value] = out[layer.present_key], out[layer.present_value]
            self.device_cache.put(r, self.width, at, sources, src_row, s0, s1)
            return
        views = views if views is not None else self._views()
        for layer in layers:
            views[layer.past_key][r, :, at:at + s1 - s0] = out[layer.present_key][src_row, :, s0:s1]
            views[layer.past_value][r, :, at:at + s1 - s0] = out[layer.present_value][src_row, :, s0:s1]

    def _run_chunk(self, feeds: dict[str, np.ndarray], row: int | None, rows: int, what: str = "a prompt chunk") -> dict:
        """The device cache's call of the graph's prompt branch (a prompt chunk; speculation's check; a plain
        branch's decoding step, whose one new column per row ``_decode_step`` then writes in with ``_put``):
        ``feeds`` without the past, which is bound from the device buffers -- rows [row, row + rows) of
        the view, or an empty past when ``row`` is None. The logits come back as an array, the cache
        outputs stay on the device as OrtValues (``_put`` writes them into the rows)."""
        from .model import RunError, ort_message

        dc, info = self.device_cache, self.info
        io = self.model.session.io_binding()
        io.bind_output(info.logits, "cpu")
        presents = [o for layer in info.layers for o in (layer.present_key, layer.present_value)]
        for name in presents:
            io.bind_output(name, dc.device, dc.device_id)
        for name in self.dims:
            if row is None:
                dc.bind_empty(io, name)
            else:
                dc.bind(io, name, row, rows, self.width)
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        try:
            self.model.session.run_with_iobinding(io)
        except Exception as e:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime could not run {what}: {ort_message(e)}") from None
        outs = io.get_outputs()
        return {info.logits: outs[0].numpy(), **dict(zip(presents, outs[1:]))}

    def _views(self) -> dict[str, np.ndarray]:
        """Every cache array's live view [max_batch, kv_heads, width, hd] (a contiguous prefix)."""
        w, b = self.width, self.max_batch
        return {name: flat[:b * kv * w * hd].reshape(b, kv, w, hd)
                for name, flat in self.cache.items() for kv, hd in [self.dims[name]]}

    def _fit(self, columns: int) -> None:
        """Widen the view to hold ``columns`` columns per row."""
        if columns > self.width:
            self._relayout(min(self.capacity, _round_up(columns)))

    def _relayout(self, width: int) -> None:
        """Re-lay the active rows' columns for a view ``width`` wide, in place: every (row, head) block
        of ``min(old, new)`` columns moves to its new offset -- last block first when widening (its new
        place lies at or after its old one and past every earlier block's old place), first block first
        when narrowing -- so nothing is overwritten before it has moved."""
        old, n = self.width, len(self.rows)
        if width == old:
            return
        keep = min(old, width)
        if self.device_cache is not None:  # the same moves, on the device (device_cache.py)
            self.device_cache.relayout(n, old, width)
        for name, flat in self.cache.items() if self.cache is not None else ():
            kv, hd = self.dims[name]
            blocks = range(n * kv - 1, 0, -1) if width > old else range(1, n * kv)
            for i in blocks:
                flat[i * width * hd:(i * width + keep) * hd] = flat[i * old * hd:(i * old + keep) * hd]
        self.width = width
        self.relayouts += 1
