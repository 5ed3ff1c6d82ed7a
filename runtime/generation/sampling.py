"""Choosing the next token: greedy, or sampled, with transformers' logits processors in their order;
and the log-probabilities of what was chosen. Shared by every decoding loop (the cached and the
recurrent ones through generation/decoding.py, and the serving engine).

The order is transformers' ``_get_logits_processor``: repetition penalty (over the row's prompt and
generated tokens: a positive score is divided by the penalty, a negative one multiplied), no-repeat
n-grams (a token that would complete an n-gram already present in the row, prompt included, is
banned), min_new_tokens (the stop tokens are banned until that many tokens are new); then, only
when sampling (temperature > 0), temperature, top-k (every token scoring at least the k-th best is
kept), top-p (the smallest set of most likely tokens whose probability reaches p; the most likely
token always stays) and min-p (tokens less likely than min_p times the most likely one are
dropped). Temperature 0 is greedy (argmax of the processed scores), as transformers ignores its
sampling warpers without ``do_sample``.

Log-probabilities (``Sampling.logprobs``) are of the model's own distribution: ``log_softmax`` of
the raw logits, before any processor, as vLLM's ``logprobs`` (its default ``raw_logprobs``) and
transformers' ``output_logits`` are; so they say how likely the model found a token, whatever the decoding
settings did to the choice (a token banned by an n-gram still has its model log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tessera.runtime.errors import UsageError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass
class Sampling:
    """How each next token is chosen; temperature 0 means greedy. ``logprobs``: None for none, N for
    the chosen token's log-probability and the N most likely alternatives (0: the chosen one only)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = 0
    min_p: float = 0.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    logprobs: int | None = None

    def check(self) -> None:
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if not (_is_number(t) and np.isfinite(t) and t >= 0):
            raise UsageError(f"temperature must be a number >= 0 (0 is greedy), got {t}")
        if not (_is_int(k) and k >= 0):
            raise UsageError(f"top_k must be an integer >= 0 (0 keeps every token), got {k}")
        if not (_is_number(p) and 0 < p <= 1):
            raise UsageError(f"top_p must be in (0, 1] (1 keeps every token), got {p}")
        if not (_is_number(r) and np.isfinite(r) and r > 0):
            raise UsageError(f"repetition_penalty must be a number > 0 (1 is none), got {r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise UsageError(f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 0):
                raise UsageError(f"{name} must be an integer >= 0 (0 is none), got {v}")
        n = self.logprobs
        if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
            raise UsageError(f"logprobs must be an integer from 0 (the chosen token's only) to {MAX_LOGPROBS} "
                             f"(alternatives per token), got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def looks_back(self) -> bool:
        """Whether choosing needs the row's tokens so far (``Step``), not only the scores."""
        return self.no_repeat_ngram_size > 0 or self.min_new_tokens > 0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits is the choice, and nothing else is wanted of them (the
        serving engine then picks a whole batch at once)."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.looks_back and self.logprobs is None


@dataclass
class Step:
    """Where the rows stand when their next token is chosen: each row's tokens so far (prompt and
    new: the no-repeat n-grams look at both, as transformers does for decoder-only models), how many
    of them are new, and the ids that would end a row (min_new_tokens holds them off)."""

    tokens: list[list[int]]
    new_tokens: list[int]
    stop_ids: tuple[int, ...] = field(default_factory=tuple)


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    """The tokens that would complete an n-gram already in ``tokens``: those that followed an
    earlier occurrence of its last n - 1 tokens (transformers' NoRepeatNGramLogitsProcessor)."""
    if n < 1 or len(tokens) + 1 < n:
        return []
    if n == 1:
        return list(set(tokens))
    prefix = tuple(tokens[len(tokens) - n + 1:])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i:i + n - 1]) == prefix]


def process_logits(logits: np.ndarray, seen: np.ndarray | None, s: Sampling, step: Step | None = None) -> np.ndarray:
    """Scores [B, V] after every processor of ``s`` (filtered entries -inf); ``step`` is needed by
    the ones that look back (Sampling.looks_back)."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if seen is not None and s.repetition_penalty != 1.0:
        pen = np.float32(s.repetition_penalty)
        x = np.where(seen, np.where(x < 0, x * pen, x / pen), x)
    if step is not None and s.no_repeat_ngram_size:
        for r, row in enumerate(step.tokens):
            banned = [t for t in banned_ngram_tokens(row, s.no_repeat_ngram_size) if t < x.shape[-1]]
            x[r, banned] = -np.inf
    if step is not None and s.min_new_tokens and step.stop_ids:
        stops = [t for t in step.stop_ids if t < x.shape[-1]]
        for r, new in enumerate(step.new_tokens):
            if new < s.min_new_tokens:
                x[r, stops] = -np.inf
    if s.greedy:
        return x
    x = _apply_temperature(x, s.temperature)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = np.partition(x, -s.top_k, axis=-1)[:, -s.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if s.top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")
        sorted_x = np.take_along_axis(x, order, axis=-1).astype(np.float64)
        probs = np.exp(sorted_x - sorted_x[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        drop_sorted = before >= s.top_p
        drop_sorted[:, 0] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        x = np.where(drop, -np.inf, x)
    if s.min_p > 0:
        probs = _softmax(x.astype(np.float64))
        x = np.where(probs < s.min_p * probs.max(-1, keepdims=True), -np.inf, x)
    return x


def _apply_temperature(x: np.ndarray, temperature: float) -> np.ndarray:
    """``x / temperature`` in float32, as transformers divides. Where float32 cannot hold that -- a
    temperature that is 0 or infinite in float32, quotients that overflow, or ones that underflow
    into subnormals (which ties distinct scores) -- the scores relative to each row's best, divided
    in float64: as T -> 0 every token below the best goes to -inf (the choice is the argmax:
    greedy), as T -> inf every kept token goes to 0 (uniform) while their order stays for top-k and
    top-p. Filtered entries stay -inf; no NaN is made."""
    tiny = np.finfo(np.float32).tiny
    with np.errstate(over="ignore", under="ignore"):
        t32 = np.float32(temperature)
        if np.isfinite(t32) and t32 >= tiny:
            y = x / t32
            finite = np.isfinite(x)
            if np.array_equal(np.isfinite(y), finite) and bool(((np.abs(y) >= tiny) | (x == 0) | ~finite).all()):
                return y
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    best = np.where(finite, x64, -np.inf).max(-1, keepdims=True)
    best = np.where(np.isfinite(best), best, 0.0)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.where(finite, (x64 - best) / float(temperature), x64)


def _softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def choose(logits: np.ndarray, seen: np.ndarray | None, s: Sampling, rng: np.random.Generator,
           step: Step | None = None) -> np.ndarray:
    """The next token of every row [B]."""
    x = process_logits(logits, seen, s, step)
    if s.greedy:
        return np.argmax(x, axis=-1).astype(np.int64)
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(x - x.max(-1, keepdims=True))
    p = np.where(np.isnan(p), 0.0, p)  # a row of NaN or +inf logits (a broken model) picks by argmax below
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(x)) * cdf[:, -1]
    picked = np.array([np.searchsorted(cdf[i], u[i], side="right") for i in range(len(x))], dtype=np.int64)
    bad = ~(np.isfinite(cdf[:, -1]) & (cdf[:, -1] > 0))
    if bad.any():  # no probability mass to draw from: the best score (NaN counted lowest)
        picked[bad] = np.argmax(np.where(np.isnan(x[bad]), -np.inf, x[bad]), axis=-1)
    return np.minimum(picked, x.shape[-1] - 1)


def token_logprobs(logits: np.ndarray, chosen: np.ndarray, top: int) -> list[dict]:
    """Per row: the chosen token's log-probability under the model's distribution (log_softmax of
    the raw ``logits`` [B, V], computed in float64) and the ``top`` most likely tokens with theirs,
    most likely first (ties: the lower id first)::

        {"token": 464, "logprob": -1.25, "top": [{"token": 262, "logprob": -0.9}, ...]}
    """
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    out = []
    for r in range(len(x)):
        tok = int(chosen[r])
        entry = {"token": tok, "logprob": float(lp[r, tok]), "top": []}
        if top:
            order = np.argsort(-lp[r], kind="stable")[:top]
            entry["top"] = [{"token": int(t), "logprob": float(lp[r, t])} for t in order]
        out.append(entry)
    return out
