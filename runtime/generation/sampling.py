"""Choosing the next token: greedy, or sampled with transformers' logits processors (see
runtime/generation/cached.py's docstring for their order). Shared by every decoding loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.runtime.pipeline import UsageError


@dataclass
class Sampling:
    """How each next token is chosen; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = 0

    def check(self) -> None:
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if not (isinstance(t, (int, float)) and np.isfinite(t) and t >= 0):
            raise UsageError(f"temperature must be a number >= 0 (0 is greedy), got {t}")
        if not (isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0):
            raise UsageError(f"top_k must be an integer >= 0 (0 keeps every token), got {k}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise UsageError(f"top_p must be in (0, 1] (1 keeps every token), got {p}")
        if not (isinstance(r, (int, float)) and np.isfinite(r) and r > 0):
            raise UsageError(f"repetition_penalty must be a number > 0 (1 is none), got {r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: np.ndarray, seen: np.ndarray | None, s: Sampling) -> np.ndarray:
    """Scores [B, V] after repetition penalty, temperature, top-k and top-p (filtered entries -inf)."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if seen is not None and s.repetition_penalty != 1.0:
        pen = np.float32(s.repetition_penalty)
        x = np.where(seen, np.where(x < 0, x * pen, x / pen), x)
    if s.greedy:
        return x
    x = x / np.float32(s.temperature)
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
    return x


def choose(logits: np.ndarray, seen: np.ndarray | None, s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """The next token of every row [B]."""
    x = process_logits(logits, seen, s)
    if s.greedy:
        return np.argmax(x, axis=-1).astype(np.int64)
    x = x.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(x)) * cdf[:, -1]
    picked = np.array([np.searchsorted(cdf[i], u[i], side="right") for i in range(len(x))], dtype=np.int64)
    return np.minimum(picked, x.shape[-1] - 1)
