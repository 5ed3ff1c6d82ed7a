"""Speculative decoding: a drafter guesses k tokens per row, the target checks them in ONE cached call.

Why: a decoding step of a small batch is bound by reading the weights, not by arithmetic; a call
over k + 1 new tokens reads them once too and costs little more than a call over one. Each round
feeds every row its last token and its drafted tokens (generation/drafting.py) to the target's
cache (generation/rollback.py), takes the target's greedy choice at every position, and keeps the
longest prefix of drafts that equals those choices plus one more token, the target's own choice
after that prefix (a correction, or a bonus when every draft was right). The cache then forgets
each row's rejected columns. So every round emits between 1 and k + 1 tokens per row, and each
token is exactly the one plain decoding would choose: the same logits processors in the same
order (the repetition penalty sees each accepted token before the next is chosen), the same stop
tokens and texts. Only the attention kernel differs (the tiled prompt kernel for k + 1 tokens
instead of the single-token one), so logits agree to rounding, as a prompt's last logits agree
with a decoding step's.

A model with recurrent state (Mamba, Jamba) gets the same loop: its rows' chunks are made one
length (``_filled``), and a row that kept fewer tokens than it fed has its state put back and its
kept tokens run again (rollback.py's ``replay``: its docstring says why a replay and not per-position
states), so its state is always the state after the tokens it emitted.

Sampling (temperature > 0) is refused: the rejection-sampling acceptance rule that keeps the
sampled distribution exact is not implemented (options.GenerateOptions.check says so).

Rows advance at their own pace: ``steps`` yields, per round, as many lists as the most tokens any
row emitted; in list j a row has its j-th new token of the round, or None when it emitted fewer (or
has finished) -- the same shape ``decode_steps`` yields, so every caller reads both alike.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np

from tessera.runtime.generation.cached import CachedModel, Stats
from tessera.runtime.generation.rollback import RollbackCache, check
from tessera.runtime.generation.sampling import Sampling, choose
from tessera.runtime.pipeline import UsageError


def check_target(model: CachedModel) -> None:
    """The target must give the logits of every new position, in a cache that rolls back per row."""
    if model.info.last_only:
        raise UsageError("speculative decoding needs the target's logits at every position of a chunk; this model "
                         "was compiled with the logits of the last position only (compile --kv-cache does that): "
                         "generate from the .tsr spec or checkpoint folder instead")
    check(model, "the target model", states_ok=True)


def steps(model: CachedModel, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, drafter,
          draft_tokens: int, stop_tokens=(), stats: Stats | None = None,
          should_stop: Callable[[int, list[int]], bool] | None = None,
          pad_id: int = 0) -> Iterator[list[int | None]]:
    """Yield the new tokens of every row as they are accepted (see the module docstring); ``prompts``
    already checked (cached.check_request). ``stats`` gets the prefill and decoding times and the
    drafted and accepted counts."""
    if not sampling.greedy:
        raise UsageError("speculative decoding is greedy only (temperature 0): sampling would need the "
                         "rejection-sampling acceptance rule, which is not implemented")
    check_target(model)
    stats = stats if stats is not None else Stats()
    stats.drafted = stats.accepted = stats.rounds = stats.round_tokens = 0
    stats.replays = stats.replayed_rows = 0
    stats.prompt_tokens = sum(len(p) for p in prompts)
    rng = np.random.default_rng(sampling.seed)  # unused by greedy choice; choose() takes one
    stop = {int(t) for t in stop_tokens}
    b = len(prompts)
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = np.zeros((b, model.vocab), dtype=bool)
        for r, p in enumerate(prompts):
            seen[r, p] = True
    history = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b

    def take(r: int, tok: int) -> bool:
        """Emit ``tok`` for row r; True when the row has now finished."""
        generated[r].append(tok)
        history[r].append(tok)
        if seen is not None:
            seen[r, tok] = True
        done[r] = (tok in stop or len(generated[r]) >= max_new_tokens
                   or (should_stop is not None and should_stop(r, generated[r])))
        return done[r]

    start = time.perf_counter()
    cache = RollbackCache(model, prompts, max_new_tokens, draft_tokens, pad_id, stats)
    first = choose(cache.prefill(), seen, sampling, rng)
    drafter.start(prompts, max_new_tokens, draft_tokens, pad_id)
    for r in range(b):
        take(r, int(first[r]))
    stats.prefill_s = time.perf_counter() - start
    stats.new_tokens += b
    yield [int(t) for t in first]
    while not all(done):
        start = time.perf_counter()
        budgets = [0 if done[r] else min(draft_tokens, max_new_tokens - len(generated[r]) - 1) for r in range(b)]
        drafts = drafter.propose(history, budgets)
        chunks = [[] if done[r] else [history[r][-1]] + drafts[r] for r in range(b)]
        fed = _filled(chunks, history) if model.info.states else chunks
        logits = cache.feed(fed)
        t = logits.shape[1]
        emitted: list[list[int]] = [[] for _ in range(b)]
        accepted = [0] * b
        replay = {}
        for r in range(b):
            n, at = len(chunks[r]), t - len(fed[r])  # the row's chunk starts at column `at`
            was_done = done[r]
            for j in range(n):  # position j's scores choose the token after chunk[j]
                tok = int(choose(logits[r:r + 1, at + j], None if seen is None else seen[r:r + 1],
                                 sampling, rng)[0])
                emitted[r].append(tok)
                if take(r, tok) or j == n - 1 or tok != drafts[r][j]:
                    break
                accepted[r] += 1
            kept = accepted[r] + 1 if n else 0  # the last token and the accepted drafts
            cache.rollback(r, len(fed[r]) - kept)
            if model.info.states and not was_done and not done[r] and kept < len(fed[r]):
                replay[r] = fed[r][:kept]
        if replay:  # recurrent state: back to the state after the kept tokens (rollback.py's docstring)
            stats.replays += cache.replay(replay)
            stats.replayed_rows += len(replay)
        drafter.accepted(accepted)
        stats.rounds += 1
        stats.drafted += sum(len(d) for d in drafts)
        stats.accepted += sum(accepted)
        width = max(len(e) for e in emitted)
        stats.new_tokens += sum(len(e) for e in emitted)
        stats.round_tokens += sum(len(e) for e in emitted)
        share = (time.perf_counter() - start) / width
        for j in range(width):
            stats.decode_s.append(share)
            yield [e[j] if j < len(e) else None for e in emitted]


def _filled(chunks: list[list[int]], history: list[list[int]]) -> list[list[int]]:
    """Every row's chunk brought to the longest one's length, for a model with recurrent state (no
    padding inside a chunk: rollback.py): a shorter chunk is followed by copies of its last token
    (a finished row's: of its last token), filler that is never taken as a draft (the accepting loop
    reads only the chunk's own positions) and always replayed away or forgotten."""
    t = max(len(c) for c in chunks)
    return [c + [c[-1] if c else h[-1]] * (t - len(c)) for c, h in zip(chunks, history)]


def explain(stats: Stats, drafter_name: str, draft_tokens: int) -> str:
    """--explain's line: how many drafted tokens the target accepted."""
    rate = stats.accepted / stats.drafted if stats.drafted else 0.0
    per_round = stats.round_tokens / stats.rounds if stats.rounds else 0.0
    return (f"speculative decoding ({drafter_name}, up to {draft_tokens} drafted tokens a round): "
            f"{stats.accepted} of {stats.drafted} drafted tokens accepted ({rate:.1%}), {stats.rounds} verifying "
            f"calls, {per_round:.2f} new tokens per call (all rows)"
            + (f"; recurrent state replayed after a rejection: {stats.replayed_rows} row(s) in {stats.replays} more "
               f"call(s)" if stats.replays else ""))
