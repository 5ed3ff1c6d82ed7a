"""The one decoding loop: a Decoder gives each step's logits, this loop chooses, stops and emits.

Why one loop: the cached decoder (decoder-only, or an encoder-decoder's decoder with the encoder's
outputs fed to every step: generation/cached.py ``CachedDecoder``; what it carries from step to step
is a cache of keys and values, recurrent state, or both), the speculative loop and the serving
engines differ only in how a step is run. Token choice
(generation/sampling.py), stop tokens and texts, finished rows and timing are the same for all of
them, so they live here once.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import numpy as np

from tessera.runtime.generation.sampling import Sampling, Step, choose, token_logprobs


class Decoder(Protocol):
    rows: int

    def step(self, last: np.ndarray | None) -> np.ndarray:
        """The logits [rows, vocab] of the next token: the first call runs the prompt (``last`` None),
        each later one the tokens chosen last [rows] (a finished row's is the pad id)."""


def decode_steps(decoder: Decoder, max_new_tokens: int, sampling: Sampling, stop_tokens=(), stats=None,
                 should_stop: Callable[[int, list[int]], bool] | None = None,
                 on_logits: Callable[[int, np.ndarray], None] | None = None, seen: np.ndarray | None = None,
                 pad_id: int = 0, prompts: list[list[int]] | None = None,
                 logprobs: list[list[dict]] | None = None, masks: list | None = None) -> Iterator[list[int | None]]:
    """Yield, step by step, the new token of every row (None for rows already finished). ``seen``
    [rows, vocab] marks the tokens the repetition penalty applies to (updated as tokens are chosen);
    ``prompts`` are the rows' first tokens, which the no-repeat n-grams look at with the new ones;
    ``logprobs`` (one list per row), when given and ``sampling.logprobs`` is set, gets each emitted
    token's log-probabilities (sampling.token_logprobs); ``stats`` (generation/cached.Stats), when
    given, gets the prefill and decoding times. Until ``sampling.min_new_tokens`` are new, a row
    chooses no stop token and ``should_stop`` is not asked. ``masks`` (structured output: one
    generation/constraints.TokenMask or None per row): a row's tokens outside its grammar are at -inf
    before the choice, and the row ends when its grammar does."""
    rng = np.random.default_rng(sampling.seed)
    stop = set(int(t) for t in stop_tokens)
    b = decoder.rows
    generated: list[list[int]] = [[] for _ in range(b)]
    history = [list(p) for p in prompts] if prompts is not None else [[] for _ in range(b)]
    done = np.zeros(b, dtype=bool)
    last = None
    for step in range(max_new_tokens):
        start = time.perf_counter()
        logits = decoder.step(last)
        if on_logits is not None:
            on_logits(step, logits)
        raw = logits  # the model's, for the log-probabilities (as without a grammar)
        if masks is not None:
            logits = np.array(logits, copy=True)
            for r, m in enumerate(masks):
                if m is not None and not done[r]:
                    logits[r] = m.apply(logits[r:r + 1])[0]
        where = Step(history, [step] * b, tuple(sorted(stop))) if sampling.looks_back else None
        nxt = choose(logits, seen, sampling, rng, where)
        chosen_logprobs = (token_logprobs(raw, nxt, sampling.logprobs)
                           if logprobs is not None and sampling.logprobs is not None else None)
        if stats is not None:
            elapsed = time.perf_counter() - start
            if step == 0:
                stats.prefill_s = elapsed
            else:
                stats.decode_s.append(elapsed)
        emitted: list[int | None] = []
        for r in range(b):
            if done[r]:
                emitted.append(None)
                continue
            tok = int(nxt[r])
            generated[r].append(tok)
            history[r].append(tok)
            emitted.append(tok)
            if chosen_logprobs is not None:
                logprobs[r].append(chosen_logprobs[r])
            if seen is not None:
                seen[r, tok] = True
            if masks is not None and masks[r] is not None:
                masks[r].consume(tok)
                if masks[r].done:
                    done[r] = True
            if tok in stop or (should_stop is not None and len(generated[r]) >= sampling.min_new_tokens
                               and should_stop(r, generated[r])):
                done[r] = True
        if stats is not None:
            stats.new_tokens += sum(e is not None for e in emitted)
        yield emitted
        if done.all() or step == max_new_tokens - 1:
            return
        last = np.where(done, pad_id, nxt).astype(np.int64)
