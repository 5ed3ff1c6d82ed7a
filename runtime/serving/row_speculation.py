"""`serve --speculative ngram` on the row engine: decoder-only models with recurrent state (Mamba, Jamba).

Why a module of its own: the KV engine's speculation (speculation.py) checks drafts in its one call
over the slots' key/value buffers and forgets a rejected draft by masking its column. A recurrent
state has no columns: the checking call runs every draft through the scans and conv1d windows, and
the state it returns is the state after ALL of them. So this does what ``tessera generate
--speculative`` does for such models (generation/rollback.py's module docstring says why a replay
and not a state per position): the state from before the checking call is kept, and a row that
kept fewer tokens than it fed has that state put back and its kept tokens run again. Each row's
state after a step is then the state after its kept tokens only, and its tokens are plain greedy
decoding's.

The row engine's two paths (row_engine.py):

- **state only** (Mamba, ``batched``): each row keeps its state arrays, which ARE the state from
  before the call (the call's outputs are new arrays). A step with drafts runs every decoding row in
  ONE call: each row's chunk (its next token and its drafts) brought to the longest one's length
  with copies of its last token (generation/speculative.py ``_filled``: a state-only model has no
  mask, so padding inside a chunk would enter the recurrence; the filler is never taken as a draft
  and is always replayed away). A row that kept everything it fed takes the call's state; the others
  run their kept tokens again from their old state, rows with the same count in one call.
  Sampled rows ride along (their chunk is their next token, chosen by the engine's own choice).
- **attention and state** (Jamba, one decoder per row): a greedy row's decoder is rollback.py's
  ``RollbackCache`` (its ``feed``, ``rollback`` and ``replay`` as generate uses them, one row);
  a step feeds the row's next token and its drafts, and the cache forgets the rejected columns and
  replays the kept tokens. Sampled rows keep their plain decoder and step.

Drafts come from prompt lookup (generation/drafting.py ``NgramDrafter``, through speculation.py's
``Speculation._drafts``) for greedy requests without a grammar (``Sampling.plain_greedy``); every
draft is checked (not the KV engine's adaptive pricing, which prices one batched call against a
plain step of its rows, not per-row calls and replays). The counters and /metrics lines are
``Speculation``'s. Encoder-decoders on the row engine are refused (``check``).
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.generation.rollback import RollbackCache
from tessera.runtime.generation.speculative import check_target

from .model import Stats, UsageError
from .speculation import Speculation


class RowSpeculation(Speculation):
    """Prompt-lookup drafts checked in the row engine's step, recurrent state replayed after a rejection."""

    def __init__(self, draft_tokens: int = Speculation.DRAFT_TOKENS):
        super().__init__(draft_tokens, adaptive=False)
        self.replays = 0  # calls that ran kept tokens again from the state before a checking call
        self.replayed_rows = 0

    @staticmethod
    def check(engine, draft_tokens: int = Speculation.DRAFT_TOKENS) -> None:
        """Refuse, with the reason, what the row engine cannot check drafts for."""
        if engine.seq2seq is not None:
            raise UsageError("--speculative is not built for encoder-decoders (T5, BART: the row engine runs one "
                             "decoder per row with its own encoder outputs, and prompt lookup drafts from the "
                             "prompt, which is the source, in another vocabulary): drop --speculative")
        Speculation.check(engine.model, draft_tokens)  # every position's logits
        check_target(engine.model)  # a buffer cache that rolls back (rollback.check)

    def describe(self) -> str:
        return (f"speculative decoding: prompt lookup (ngram), up to {self.k} drafted tokens per greedy request "
                f"per step, every draft checked; the row engine keeps each row's recurrent state from before "
                f"the checking call and runs the kept tokens again after a rejection (serving/row_speculation.py)")

    def metric_lines(self) -> list[str]:
        name = "tessera_speculative_replayed_rows_total"
        return super().metric_lines() + [
            f"# HELP {name} Rows whose recurrent state was put back and their kept tokens run again.",
            f"# TYPE {name} counter", f"{name} {self.replayed_rows}"]

    # ------------------------------------------------------------------ the engine's hooks
    def decoder(self, engine, row, prompt: list[int]):
        """A greedy row's decoder on the per-row path: a RollbackCache (None: the engine's plain decoder)."""
        req = row.handle.request
        if engine.batched or not req.sampling.plain_greedy or row.mask is not None:
            return None
        return RollbackCache(engine.model, [prompt], req.max_tokens, self.k, 0, Stats())

    def decode(self, engine, rows: list) -> list:
        """One decoding step for ``rows`` with their drafts checked; returns the rows left for the
        engine's plain step (all of them when none has a draft on the state-only path)."""
        unmasked = {r.slot for r in rows if r.mask is None}  # a grammar's rows take the engine's own choice
        drafts = {slot: d for slot, d in self._drafts(engine, rows).items() if slot in unmasked}
        if engine.batched:
            if not drafts:
                return rows
            self._batched(engine, rows, drafts)
            self.calls += 1
            return []
        spec = [r for r in rows if isinstance(r.decoder, RollbackCache)]
        for row in spec:
            self._per_row(engine, row, drafts.get(row.slot, []))
        if any(r.slot in drafts for r in spec):
            self.calls += 1
        return [r for r in rows if r not in spec]

    # ------------------------------------------------------------------ the two paths
    def _per_row(self, engine, row, draft: list[int]) -> None:
        cache = row.decoder
        chunk = [row.next_token] + draft
        logits = cache.feed([chunk])[0]  # [len(chunk), vocab]
        kept = self._settle(engine, row, chunk, logits, draft)
        cache.rollback(0, len(chunk) - kept)
        if kept < len(chunk) and not row.handle.finished:
            self.replays += cache.replay({0: chunk[:kept]})
            self.replayed_rows += 1

    def _batched(self, engine, rows: list, drafts: dict[int, list[int]]) -> None:
        info = engine.info
        chunks = [[r.next_token] + drafts.get(r.slot, []) for r in rows]
        t = max(len(c) for c in chunks)
        fed = [c + [c[-1]] * (t - len(c)) for c in chunks]  # filler, replayed away (module docstring)
        out = self._run(engine, rows, fed)
        logits = out[info.logits]  # [rows, t, vocab]
        replay: dict[int, list] = {}
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            if row.slot in drafts:
                kept = self._settle(engine, row, chunk, logits[i, :len(chunk)], drafts[row.slot])
            else:  # the engine's own choice (sampling, penalties, a grammar) from the first position
                kept = 1
                engine._take(row, logits[i:i + 1, 0])
            if kept == t:
                row.states = {s.past: out[s.present][i:i + 1] for s in info.states}
            elif not row.handle.finished:  # row.states is still the state from before the call
                replay.setdefault(kept, []).append((row, fed[i][:kept]))
            row.position += kept
        for n, group in sorted(replay.items()):
            rs = [r for r, _ in group]
            for r in rs:
                r.position -= n  # the replay starts where the checking call did
            out = self._run(engine, rs, [toks for _, toks in group])
            for i, r in enumerate(rs):
                r.states = {s.past: out[s.present][i:i + 1] for s in info.states}
                r.position += n
            self.replays += 1
            self.replayed_rows += len(rs)

    @staticmethod
    def _run(engine, rows: list, tokens: list[list[int]]) -> dict:
        """The state-only model over ``rows`` from their states, each fed its ``tokens`` (one length)."""
        info, model = engine.info, engine.model
        t = len(tokens[0])
        feeds = {info.tokens: np.array(tokens, dtype=np.int64),
                 "position_ids": np.array([[r.position + j for j in range(t)] for r in rows], dtype=np.int64),
                 **{s.past: np.concatenate([r.states[s.past] for r in rows], axis=0) for s in info.states}}
        return model.run({k: v for k, v in feeds.items() if k in model.input_names})

    def _settle(self, engine, row, chunk: list[int], logits: np.ndarray, draft: list[int]) -> int:
        """A greedy row's tokens from its chunk's logits [len(chunk), vocab] (position j's choose the
        token after chunk[j]): the drafts the model agrees with, then its own next token; emitted until
        the request ends. Returns how many of the chunk's tokens are kept (its next token and the
        accepted drafts)."""
        emitted, kept = [], 1
        for j in range(len(chunk)):
            tok = int(np.argmax(logits[j]))
            emitted.append(tok)
            if j == len(chunk) - 1 or tok != draft[j]:
                break
            kept += 1
        done = 0
        for tok in emitted:
            row.history.append(tok)
            row.next_token = tok
            engine._emit(row, tok)
            done += 1
            if row.handle.finished:
                break
        if draft:
            self.drafted += len(draft)
            self.accepted += min(kept - 1, done)
        return kept
