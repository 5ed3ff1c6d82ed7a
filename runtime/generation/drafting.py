"""Drafters for speculative decoding: guesses of each row's next tokens, checked by the target model.

Why guesses at all: a decoding step reads every weight once to produce one token; the verifier
(generation/speculative.py) reads them once to check k guessed tokens and keeps those the model
agrees with, so good guesses turn one weight read into several tokens. A guess is never trusted:
the output is the target's own greedy choice whatever the drafter says, so a drafter only decides
the speed.

- ``NgramDrafter`` (prompt lookup): the row's last n tokens (n = 3, else 2) are looked up earlier in
  its prompt and output, and the tokens that followed the latest match are the draft. Free, and
  good exactly when the output repeats its context (editing or quoting a passage, code, extraction).
- ``ModelDrafter``: a smaller model with the same vocabulary decodes k tokens greedily on its own
  cache (generation/rollback.py's ``RollbackCache``, rolled back past the drafts the target
  rejected), catching up on the target's tokens in one chunk per round.

A drafter sees ``histories`` (each row's prompt and output so far, the newest token last) and
``budgets`` (how many tokens each row may draft: 0 for finished rows and at the end of the
budget), and after the target's verdict ``accepted`` (how many of its drafts each row kept).
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.generation.cached import CachedModel
from tessera.runtime.generation.rollback import RollbackCache, check
from tessera.runtime.pipeline import UsageError


class NgramDrafter:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the row's last n tokens."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        # a single repeated token is weak evidence: drafting on it mostly buys a verifying call that
        # costs more than a plain step and keeps only its own token
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompts: list[list[int]], max_new_tokens: int, draft_tokens: int, pad_id: int) -> None:
        pass

    def propose(self, histories: list[list[int]], budgets: list[int]) -> list[list[int]]:
        return [self.lookup(h, k) if k > 0 else [] for h, k in zip(histories, budgets)]

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the history's last n tokens,
        the longest n that occurs; none when no suffix occurs before. (A scan for the last token, then
        the candidates checked: a few microseconds, where numpy's windows cost a millisecond a round.)"""
        last, end = history[-1], len(history) - 1
        hits = [i for i in range(end - 1, -1, -1) if history[i] == last]  # latest first; not the suffix itself
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            suffix = history[end - n + 1:]
            for i in hits:
                if i >= n - 1 and history[i - n + 1:i + 1] == suffix:
                    return _copy_forward(history, i + 1, k)
        return []

    def accepted(self, counts: list[int]) -> None:
        pass


def _copy_forward(history: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on, the copy reading its own output once it passes the end
    (as LZ77 copies an overlapping match): a match just before the suffix -- a repeating pattern of
    period end - start -- then drafts the pattern's next k tokens, not the one token left after it."""
    out = list(history)
    for j in range(k):
        out.append(out[start + j])
    return out[len(history):]


class ModelDrafter:
    """A draft model decoding greedily on a cache of its own, rolled back to what the target kept."""

    name = "model"

    def __init__(self, model: CachedModel, label: str):
        self.model, self.label = model, label

    def check(self, target: CachedModel) -> None:
        if self.model.vocab != target.vocab:
            raise UsageError(f"the draft model {self.label} has a vocabulary of {self.model.vocab} tokens, the "
                             f"target {target.vocab}: drafted ids must mean the same tokens; give a draft model "
                             f"with the target's tokenizer")

    def start(self, prompts: list[list[int]], max_new_tokens: int, draft_tokens: int, pad_id: int) -> None:
        from tessera.runtime.generation.cached import check_request
        from tessera.runtime.generation.sampling import Sampling

        check(self.model, f"the draft model {self.label}")
        try:
            check_request(self.model, prompts, max_new_tokens, Sampling())
        except UsageError as e:
            raise UsageError(f"the draft model {self.label}: {e}") from None
        self.cache = RollbackCache(self.model, prompts, max_new_tokens, draft_tokens, pad_id)
        self.cache.prefill()
        self.known = [len(p) for p in prompts]  # tokens of each row's history in the draft's cache
        self.fed = [0] * len(prompts)  # this round's drafts fed back into the cache

    def propose(self, histories: list[list[int]], budgets: list[int]) -> list[list[int]]:
        rows = range(len(histories))
        chunks = [histories[r][self.known[r]:] if budgets[r] > 0 else [] for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        self.fed = [0] * len(histories)
        if not any(budgets):
            return drafts
        logits = self.cache.feed(chunks)[:, -1, :]
        for r in rows:
            if budgets[r] > 0:
                self.known[r] = len(histories[r])
                drafts[r].append(int(np.argmax(logits[r])))
        for _ in range(max(budgets) - 1):
            more = [r for r in rows if budgets[r] > len(drafts[r])]
            if not more:
                break
            logits = self.cache.feed([[drafts[r][-1]] if r in more else [] for r in rows])[:, -1, :]
            for r in more:
                self.fed[r] += 1
                drafts[r].append(int(np.argmax(logits[r])))
        return drafts

    def accepted(self, counts: list[int]) -> None:
        """Keep the drafts the target accepted (those fed: the last draft never is), forget the rest."""
        for r, n in enumerate(counts):
            keep = min(n, self.fed[r])
            self.cache.rollback(r, self.fed[r] - keep)
            self.known[r] += keep
