"""Speculative decoding in the serving engine (``tessera serve --speculative ngram``).

Why: a decoding step of a small batch is bound by reading the weights; a step over k + 1 tokens
of a row reads them once too. So when a greedy request's output repeats its context (editing or
quoting a passage, code, extraction), prompt lookup (generation/drafting.py's ``NgramDrafter``)
guesses its next k tokens and one engine step checks them all, emitting up to k + 1 tokens.

How it fits the engine (serving/engine.py): ``Engine._decode_step`` asks ``step(engine)`` first.
When no greedy row has a draft it returns False and the engine's own step runs (one token a row,
the GroupQueryAttention in-place kernel and all). Otherwise this step replaces it: ONE call of the
model over every decoding row, each row's chunk right-aligned in a [n, T] block -- a speculating
row's next token and its drafts, any other row's next token alone (sampled rows decode as usual,
their token chosen by the engine's ``_choose`` from their last column), a row still prefilling
an empty chunk (masked, its outputs dropped). T > 1 runs the graph's prompt branch against the
rows' cache views (as a prompt chunk does), so every position's logits come back; the model is
compiled with them (serving/model.py ``load(last_only=False)``).

Each row's new columns are written at its ``filled``; the row keeps its next token and the
longest prefix of drafts equal to the model's greedy choices, plus the model's own choice after
them (the correction, or a bonus when all were right). Rejected columns stay masked (the slot mask
is set for the kept ones only) and the next step overwrites them: a row's columns stay contiguous,
so the engine needs no rollback of its own. Every token is the one plain greedy decoding gives
(the same argmax; the attention kernel differs, as a prompt's last logits differ from a step's, by
rounding). Only greedy requests with nothing else asked of the logits (``Sampling.plain_greedy``:
no repetition penalty, no logprobs, no look-back processors) speculate.
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.options import GenerateOptions

from . import model as serving_model
from tessera.runtime.generation.constraints import masked_argmax

from .model import UsageError


class Speculation:
    """Prompt-lookup drafting and one verifying call per engine step; counts what it drafted."""

    DRAFT_TOKENS = GenerateOptions.NGRAM_DRAFT_TOKENS  # --draft-tokens' default: generate's with prompt lookup

    def __init__(self, draft_tokens: int = DRAFT_TOKENS):
        if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or draft_tokens < 1:
            raise UsageError(f"--draft-tokens must be an integer >= 1, got {draft_tokens}")
        self.k = draft_tokens
        self.drafter = serving_model.NgramDrafter()
        self.drafted = self.accepted = self.calls = 0

    @staticmethod
    def check(model) -> None:
        """The model must give the logits of every position of a chunk."""
        if model.info.last_only:
            raise UsageError("--speculative needs the logits of every position; this file was compiled with the "
                             "last position's only (--kv-cache does that): serve the .tsr spec or checkpoint folder")

    def attach(self, engine) -> "Speculation":
        """Make this the engine's speculation: its decoding steps ask ``step`` first, its /metrics
        show the counters."""
        engine.speculation = self
        engine.metrics.sections.append(self.metric_lines)
        return self

    def describe(self) -> str:
        return (f"speculative decoding: prompt lookup (ngram), up to {self.k} drafted tokens per greedy request "
                f"per step, checked in the step's one call (the model gives every position's logits)")

    def metric_lines(self) -> list[str]:
        """Prometheus counters (serving/metrics.py renders them after its own)."""
        out = []
        for name, help_, value in (
                ("tessera_speculative_drafted_tokens_total", "Tokens drafted by prompt lookup.", self.drafted),
                ("tessera_speculative_accepted_tokens_total", "Drafted tokens the model agreed with.", self.accepted),
                ("tessera_speculative_steps_total", "Engine steps that checked drafts.", self.calls)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        return out

    def _drafts(self, engine, decoding) -> dict[int, list[int]]:
        out = {}
        for s in decoding:
            h, req = s.handle, s.handle.request
            if not req.sampling.plain_greedy:
                continue
            # room for the drafts: in the request's budget (the correction or bonus is one more token) and
            # in the slot's columns (the chunk is the next token and the drafts)
            budget = min(self.k, req.max_tokens - len(h.tokens) - 1, engine.capacity - s.filled - 1)
            if budget > 0:
                d = self.drafter.lookup(req.prompt + h.tokens, budget)
                if d and s.mask is not None:  # structured output: drafts past the grammar are rejected unchecked
                    d = d[:s.mask.valid_prefix(d)]
                if d:
                    out[s.slot] = d
        return out

    def step(self, engine) -> bool:
        """The engine's decoding step with drafts checked (see the module docstring); False, having
        run nothing, when no row has a draft."""
        info, rows = engine.info, engine.rows
        decoding = [s for s in rows if not s.prefilling]
        drafts = self._drafts(engine, decoding)
        if not drafts:
            return False
        chunks = {s.slot: [s.next_token] + drafts.get(s.slot, []) for s in decoding}
        n = max(chunks) + 1
        t = max(len(c) for c in chunks.values())
        engine._fit(max(s.filled + len(chunks[s.slot]) for s in decoding))
        views, width = engine._views(), engine.width
        tokens = np.zeros((n, t), dtype=np.int64)
        new = np.zeros((n, t), dtype=np.int64)
        positions = np.zeros((n, t), dtype=np.int64)
        for s in rows[:n]:
            c = chunks.get(s.slot, [])
            m = len(c)
            positions[s.slot] = max(s.filled - 1, 0)  # padding: any position; it is masked
            if m:
                tokens[s.slot, t - m:] = c
                new[s.slot, t - m:] = 1
                positions[s.slot, t - m:] = s.filled + np.arange(m)
        feeds = {info.tokens: tokens, "attention_mask": np.concatenate([engine.slots[:n, :width], new], axis=1),
                 "position_ids": positions, **{name: v[:n] for name, v in views.items()}}
        if info.length_input:  # read by the one-token branch only; T > 1 takes the prompt branch
            feeds[info.length_input] = np.array([s.filled for s in rows[:n]], dtype=np.int64)
        out = engine.model.run(feeds)
        engine.steps += 1
        self.calls += 1
        logits = out[info.logits]
        finished = []
        for s in decoding:
            c, r = chunks[s.slot], s.slot
            m, f = len(c), s.filled
            for layer in info.layers:  # every new column at the row's end; only the kept ones are unmasked
                views[layer.past_key][r, :, f:f + m] = out[layer.present_key][r, :, t - m:]
                views[layer.past_value][r, :, f:f + m] = out[layer.present_value][r, :, t - m:]
            if r not in drafts:  # one token, as the engine's own step chooses it
                tok = engine._choose(s, logits[r:r + 1, t - 1])
                kept, emitted = 1, [tok]
            else:
                d, emitted, kept, mask = drafts[r], [], 1, s.mask
                for j in range(m):  # position j's logits choose the token after chunk[j]
                    if mask is None:
                        tok = int(np.argmax(logits[r, t - m + j]))
                    else:  # the greedy choice among the tokens the grammar allows after the drafts so far
                        tok = masked_argmax(logits[r, t - m + j], mask.allowed())
                    emitted.append(tok)
                    if j == m - 1 or tok != d[j]:
                        break
                    kept += 1
                    if mask is not None:
                        mask.consume(d[j])
                if mask is not None:  # back to the row's state: _emit advances it over the emitted tokens
                    mask.rollback(kept - 1)
                self.drafted += len(d)
            engine.slots[r, f:f + kept] = 1
            s.filled += kept
            done = 0
            for tok in emitted:
                s.next_token = tok
                engine._emit(s, tok)
                done += 1
                if s.handle.finished:
                    break
            if r in drafts:
                self.accepted += min(kept - 1, done)
            if s.handle.finished:
                finished.append(s)
        for s in sorted(finished, key=lambda s: -s.slot):
            engine._release(s)
        return True
