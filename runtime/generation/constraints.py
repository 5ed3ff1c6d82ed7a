"""Constrained decoding: a per-request token mask from a grammar (JSON schema, regex, Lark), applied to
the logits before the token is chosen.

Why llguidance (PyPI ``llguidance``, the ``structured`` extra) and not xgrammar: llguidance is one
7.6 MB abi3 wheel with no Python dependencies (its tokenizer takes a ``tokenizers`` tokenizer.json
string directly, which is what Tessera loads); xgrammar's wheel requires torch, transformers and
triton. llguidance takes Lark grammars (Tessera's own grammar language), JSON schema and regular
expressions, computes a mask lazily (a few microseconds a step on a small vocabulary; on SmolLM2's
49,152 tokens ~15 us in the median state of a JSON schema, ~110 us on average, hundreds inside a
string: bench/grammar_mask.py) and releases the GIL while it does, so the next step's mask is computed
in a worker thread while the model runs (``TokenMask.consume`` starts it, ``TokenMask.apply`` waits for
it). docs/serve.md compares the two.

``Grammar`` is what a request asks for (kind and source); ``GrammarCompiler`` turns it into an
llguidance grammar against one tokenizer (cached, checked: a bad schema, regex or grammar is a
``GrammarError``, a UsageError, before the request takes a place); ``TokenMask`` is one request's
matcher: ``apply(logits)`` gives the logits with every token outside the grammar at -inf,
``consume(token)`` advances it, ``done`` says the grammar has ended (the request stops there).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tessera.runtime.errors import UsageError

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON without free whitespace: a sampled model cannot spend its tokens on spaces and newlines
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar's text; past it the request is refused
_pool: ThreadPoolExecutor | None = None
# a mask byte (llguidance's bitmask, little-endian bits) -> its 8 tokens' additive mask: 0 allowed, -inf not
_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
                 np.float32(0), np.float32(-np.inf)).astype(np.float32)
_pool_lock = threading.Lock()


class GrammarError(UsageError):
    """A schema, regex or grammar that cannot be compiled, or constrained decoding that cannot run."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output (a JSON schema, regex or grammar) needs llguidance: "
                           "pip install 'tessera[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a request is held to: ``kind`` one of KINDS, ``source`` the schema (a dict or its JSON
    text), the regular expression or the Lark grammar (``json_object``: any JSON object, no source)."""

    kind: str
    source: object = None

    @staticmethod
    def json_schema(schema) -> "Grammar":
        return Grammar("json_schema", schema)

    @staticmethod
    def json_object() -> "Grammar":
        return Grammar("json_object")

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        return Grammar("regex", pattern)

    @staticmethod
    def lark(text: str) -> "Grammar":
        return Grammar("lark", text)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text (not yet checked against a tokenizer); GrammarError if the
        request's own form is wrong."""
        ll = _llguidance()
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: one of {', '.join(KINDS)}")
        src = self.source
        if self.kind == "json_object":
            src = {"type": "object"}
        if self.kind in ("json_schema", "json_object"):
            if isinstance(src, str):
                if len(src) > MAX_GRAMMAR_CHARS:
                    raise GrammarError(f"the JSON schema is {len(src)} characters; at most {MAX_GRAMMAR_CHARS}")
                try:
                    src = json.loads(src)
                except (ValueError, RecursionError) as e:
                    raise GrammarError(f"the JSON schema is not JSON: {e}") from None
            if isinstance(src, bool):
                src = {} if src else {"not": {}}
            if not isinstance(src, dict):
                raise GrammarError(f"a JSON schema must be an object, got {type(src).__name__}")
            try:
                return ll.LLMatcher.grammar_from_json_schema(src, defaults=JSON_OPTIONS)
            except (ValueError, TypeError, RecursionError) as e:
                raise GrammarError(f"invalid JSON schema: {e}") from None
        if not isinstance(src, str) or not src:
            raise GrammarError(f"a {'regular expression' if self.kind == 'regex' else 'Lark grammar'} must be a "
                               f"non-empty string")
        if len(src) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {self.kind} is {len(src)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(src)
        return ll.LLMatcher.grammar_from_lark(src)


class GrammarCompiler:
    """One tokenizer's llguidance form (built once) and the grammars checked against it."""

    def __init__(self, tokenizer, vocab: int, eos_ids=()):
        ll = _llguidance()
        if tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer (--tokenizer)")
        eos = sorted(int(t) for t in eos_ids)
        try:
            self.lltok = ll.LLTokenizer(tokenizer.to_str(), n_vocab=vocab,
                                        eos_token=(eos[0] if len(eos) == 1 else eos) if eos else None)
        except Exception as e:  # llguidance raises plain exceptions for a tokenizer it cannot read
            raise GrammarError(f"llguidance cannot use this tokenizer for structured output: {e}") from None
        self.vocab = vocab
        self.eos_ids = frozenset(eos)

    def compile(self, grammar: Grammar) -> str:
        """The checked llguidance grammar; GrammarError saying what is wrong."""
        if not isinstance(grammar, Grammar):
            raise GrammarError(f"a grammar must be a Grammar (tessera.runtime.generation.constraints.Grammar), "
                               f"got {type(grammar).__name__}")
        text = grammar.llguidance_grammar()
        ll = _llguidance()
        err = ll.LLMatcher.validate_grammar(text, self.lltok)
        if err:
            what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
                    "lark": "Lark grammar"}[grammar.kind]
            raise GrammarError(f"invalid {what}: {err.strip()}")
        return text

    def mask(self, grammar: Grammar) -> "TokenMask":
        return TokenMask(self, self.compile(grammar))


def _worker() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-grammar")
        return _pool


class TokenMask:
    """One request's matcher. The mask of the next step is computed in a worker thread as soon as the
    previous token is consumed (llguidance releases the GIL), so it overlaps the model's call."""

    def __init__(self, compiler: GrammarCompiler, grammar_text: str):
        ll = _llguidance()
        self.compiler = compiler
        self.matcher = ll.LLMatcher(compiler.lltok, grammar_text, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab = compiler.vocab
        self._pending: Future | None = None
        # every call into the matcher holds this lock: llguidance's matcher is a Rust object that refuses
        # a second borrow while the worker thread computes a mask ("Already mutably borrowed")
        self._lock = threading.Lock()
        self.done = False  # the grammar has ended (nothing may follow): the request stops
        self._prefetch()

    def _compute(self) -> tuple[np.ndarray, np.ndarray]:
        """In the worker: llguidance's bitmask (uint8, bit i of byte j: token 8j + i allowed) and the same as
        an additive mask (float32 [vocab], 0 where allowed, -inf elsewhere), so that ``apply`` on the
        engine's thread is one add. (``np.take`` of the byte table's rows: ~20 us at 49,152 tokens, where
        indexing the table with the bytes took ~190 us.)"""
        with self._lock:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return bits, np.take(_BIAS, bits, axis=0).reshape(-1)[:self.vocab]

    def _prefetch(self) -> None:
        self._pending = _worker().submit(self._compute)

    def _mask(self) -> tuple[np.ndarray, np.ndarray]:
        if self._pending is None:
            self._prefetch()
        return self._pending.result()

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, a bool array [vocab]."""
        bits = self._mask()[0]
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` [..., vocab] with every token the grammar does not allow next at -inf (a new array).

        One add of the mask the worker made (0 / -inf) rather than a copy and a boolean-indexed store:
        at a 49,152-token vocabulary that is ~15 µs a row instead of ~250-500 µs, on the engine's thread
        (bench/grammar_mask.py)."""
        bits, bias = self._mask()
        v = min(logits.shape[-1], bias.shape[0])
        if not (bits.any() if v == self.vocab else (bias[:v] == 0).any()):  # nothing allowed: a matcher error
            with self._lock:
                why = self.matcher.get_error() or "no way on"
            raise GrammarError(f"the grammar allows no token here: {why}")
        x = np.asarray(logits, dtype=np.float64 if logits.dtype == np.float64 else np.float32)
        out = x[..., :v] + bias[:v]
        if x.shape[-1] > v:  # logits past the grammar's vocabulary: never allowed
            out = np.concatenate([out, np.full(x.shape[:-1] + (x.shape[-1] - v,), -np.inf, dtype=out.dtype)], -1)
        return out

    def consume(self, token: int, prefetch: bool = True) -> None:
        """Advance past ``token`` (one the mask allowed) and start the next mask."""
        if self._pending is not None:
            self._pending.result()
        with self._lock:
            ok = self.matcher.consume_token(int(token))
            why = "" if ok else self.matcher.get_error()
            self.done = self.matcher.is_stopped()
        if not ok:
            raise GrammarError(f"token {token} is outside the grammar: {why}")
        self._pending = None
        if prefetch and not self.done:
            self._prefetch()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar takes from here (drafts past them are rejected)."""
        if self._pending is not None:
            self._pending.result()
        with self._lock:
            return int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def rollback(self, count: int) -> None:
        if count:
            if self._pending is not None:
                self._pending.result()
            with self._lock:
                self.matcher.rollback(count)
                self.done = self.matcher.is_stopped()
            self._pending = None


def masked_argmax(logits: np.ndarray, allowed: np.ndarray) -> int:
    """The greedy choice among the allowed tokens (what the tests compute by hand)."""
    out = np.where(allowed[:logits.shape[-1]], logits, -np.inf)
    return int(np.argmax(out))
