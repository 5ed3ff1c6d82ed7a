"""A KV cache that takes chunks of tokens per row and can forget a row's last columns again.

Why: speculative decoding (generation/speculative.py) feeds a row's last token and its k drafted
tokens in ONE cached call, then keeps only the columns whose drafts the model agreed with -- a
different count in every row. This cache is generation/cached.py's buffer cache (``CachedDecoder``:
the same preallocated buffers, prefill against an empty past, GroupQueryAttention's bound step for
single tokens) with three additions:

- ``feed(chunks)``: one call over every row's new tokens, the rows' chunks right-aligned in a
  [B, T] block (a shorter chunk's leading columns are padding, masked), positions counting each
  row's real tokens, so the last column always holds a real token (a model compiled with the logits
  of the last position only still gives each row's next-token scores);
- ``rollback(row, n)``: the row's last ``n`` real columns are masked out again and its length
  shrinks by ``n``; the column pointer falls back as far as no row still uses the columns, so
  one row (batch 1) never leaves holes and the rejected columns are simply overwritten next time;
- rows that accepted fewer drafts than others keep masked holes (the attention mask hides them,
  positions count real tokens only, so attention over them equals attention without them);
  ``compact()`` packs every row's real columns to the right again when the buffer runs out.

Recurrent state (Mamba; Jamba's Mamba layers beside its attention) has no columns to mask: the
verifying call runs every draft through the scans and conv1d windows, and the state it returns is
the state after ALL of them. Two ways to get the state after the accepted ones only: read a state
per position from the graph (its scans would return [B, T, ...] states, T times the state's bytes
per call, and the compiler's cached form would change for every model), or keep the state from
before the call and run the accepted tokens again. This cache does the second, exact and with no
change to the graph: ``feed`` keeps the states (and the mask, positions and pointer) from before
the call; ``replay(kept)`` puts a row's state back and runs the tokens it kept through the model
again, rows that kept the same number of tokens in one call (so at most one more call per distinct
count, none in a round where every row kept everything it fed). The replay reads the attention
cache as it was before the verifying call (the mask from then), and keeps only its states: the
keys and values the verifying call wrote for the kept tokens are already right (causal: they do
not depend on the tokens after them), and ``rollback`` forgets the others as for any model.
Every row's chunk must then be the same length (``feed`` refuses otherwise): a padded position
inside a chunk would enter a state-only model's recurrence (it has no mask), and a hybrid's mask
(compiler/passes/state_padding.py) zeroes a padded conv1d input, which is exact only before a row's
first token, not between its tokens. speculative.steps pads shorter chunks on the right with
filler tokens, which are never accepted and always replayed away.

Still refused (``check``): the concat cache is fed back whole, and the sliding-window models that
need it measure their window in cache columns, which holes would break; a draft MODEL with
recurrent state (its own cache would need the same replay, not written).
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.generation.cached import CachedDecoder, CachedModel, Stats, check_cache_fits
from tessera.runtime.pipeline import UsageError


def slack(draft_tokens: int) -> int:
    """Columns past prompt + max_new_tokens a speculative cache holds: one round's speculative
    columns may overshoot the last token, and a compaction must leave room for the next chunk."""
    return 4 * (draft_tokens + 1)


def check(model: CachedModel, what: str, states_ok: bool = False) -> None:
    """Refuse, with the reason, a cached model whose cache cannot be rolled back per row; with
    ``states_ok`` (the target of speculative.steps, which replays) recurrent state is taken."""
    if model.info.prefix_keys:
        raise UsageError(f"speculative decoding rolls rows back in a left-padded cache, whose decoding step needs "
                         f"its mask; {what} was compiled for the serving engine's layout (prefix_keys: no mask), "
                         f"which the serving engine's own speculation takes (`tessera serve --speculative`)")
    if model.info.states and not states_ok:
        raise UsageError(f"speculative decoding rolls each row back past its rejected drafts, which a cache of keys "
                         f"and values can (their columns are masked out again) but recurrent state cannot (the "
                         f"state after the drafts has no way back to the state before them); {what} carries "
                         f"{len(model.info.states)} scan or conv1d state(s) (a Mamba or hybrid layer): only the target "
                         f"model's state is replayed after a rejection; decode without --speculative or draft "
                         f"with ngram")
    if model.info.mode != "buffer":
        raise UsageError(f"speculative decoding needs the buffer cache (its columns are rolled back per row); "
                         f"{what} uses the {model.info.mode} cache (--cache concat, or a sliding-window model, "
                         f"whose window counts cache columns and so needs the concat cache)")


class RollbackCache(CachedDecoder):
    """The buffer cache of ``model`` for ``prompts``, fed in chunks and rolled back per row."""

    plain_device_cache = False  # its chunks and rollbacks edit the host cache (on CUDA too: see below)
    # and no bound step's buffers on the device: they would take the single-token calls' columns while the chunks
    # and rollbacks edit the host cache, and the two would part. So on CUDA every call here runs on the host cache
    # (each copies it to the device and its new columns back: correct, not fast); the serving engine's
    # speculation keeps its cache on the device (runtime/serving/device_cache.py)
    bound_on_device = False

    def __init__(self, model: CachedModel, prompts: list[list[int]], max_new_tokens: int, draft_tokens: int,
                 pad_id: int = 0, stats: Stats | None = None):
        extra = max_new_tokens + slack(draft_tokens)
        longest = max(len(p) for p in prompts)
        switch = model.info.length_switch
        if switch is not None and longest <= switch < longest + extra:
            raise UsageError(f"speculative decoding cannot cross position {switch}, where this model's longrope "
                             f"rotary switches to its long factors (its cache is recomputed there, which rolled-back "
                             f"drafts cannot follow): the prompt has {longest} tokens, so at most "
                             f"{max(switch - longest - slack(draft_tokens), 0)} new tokens, or decode without "
                             f"speculation")
        check_cache_fits(model.info, len(prompts), longest + extra, np.dtype(model.np_dtype).itemsize)
        super().__init__(model, prompts, extra, pad_id, stats if stats is not None else Stats())
        self.capacity = self.slots.shape[1]
        self.pad_id = pad_id
        self.compactions = 0

    def prefill(self) -> np.ndarray:
        """Run the prompts; the next-token scores of every row [B, V]."""
        return self.step(None)

    def feed(self, chunks: list[list[int]]) -> np.ndarray:
        """Run every row's new tokens (``chunks[r]``, possibly empty) in one call, right-aligned;
        returns the logits [B, T, V] (T = the longest chunk; [B, 1, V] for a last-only model)."""
        info, b = self.info, self.rows
        t = max(1, max(len(c) for c in chunks))
        if self.filled + t > self.capacity:
            self.compact()
        if info.states:  # the state after the call is replayed to the kept tokens (module docstring)
            if len({len(c) for c in chunks}) != 1:
                raise ValueError("a model with recurrent state takes chunks of one length, no padding inside "
                                 f"them (speculative.steps pads them): got lengths {[len(c) for c in chunks]}")
            self.before = (dict(self.states), self.slots.copy(), self.lengths.copy(), self.filled)
        tokens = np.full((b, t), self.pad_id, dtype=np.int64)
        new = np.zeros((b, t), dtype=np.int64)
        positions = np.zeros((b, t), dtype=np.int64)
        for r, chunk in enumerate(chunks):
            n = len(chunk)
            start = int(self.lengths[r])
            positions[r] = max(start - 1, 0)  # padding: any position the model has; it is masked
            if n:
                tokens[r, t - n:] = chunk
                new[r, t - n:] = 1
                positions[r, t - n:] = start + np.arange(n)
                self.lengths[r] += n
        filled = self.filled
        feeds = {info.tokens: tokens, "position_ids": positions, **self.cache, **self.states}
        if "attention_mask" in self.model.input_names:  # a model with recurrent state only has no mask
            feeds["attention_mask"] = np.concatenate([self.slots, new], axis=1)
        if info.length_input:
            feeds[info.length_input] = np.array([filled], dtype=np.int64)
        if "decode_mask" in self.model.input_names:  # CUDA: the filled slots and the new columns (CachedDecoder.step)
            feeds["decode_mask"] = np.concatenate([self.slots[:, :filled], new], axis=1)
        if self.bound is not None and t == 1:  # GroupQueryAttention writes the column at `filled` itself
            out = self.model.run(feeds, bound=self.bound)
        else:
            out = self.model.run(feeds)
            for layer in info.layers:
                self.cache[layer.past_key][:, :, filled:filled + t] = out[layer.present_key]
                self.cache[layer.past_value][:, :, filled:filled + t] = out[layer.present_value]
        self.slots[:, filled:filled + t] = new
        self.filled = filled + t
        for state in info.states:
            self.states[state.past] = out[state.present]
        return out[info.logits]

    def replay(self, kept: dict[int, list[int]]) -> int:
        """Rows whose verifying call fed more than they kept (``kept[row]``: the tokens kept, at least one):
        their states put back to before that call and the kept tokens run again from there, rows with
        the same count in one call over those rows alone. The other outputs are dropped (module
        docstring). Returns the number of calls made."""
        info = self.info
        states, slots, lengths, filled = self.before
        by_count: dict[int, list[int]] = {}
        for r, toks in kept.items():
            by_count.setdefault(len(toks), []).append(r)
        for n, rows in sorted(by_count.items()):
            idx = np.array(rows)
            feeds = {info.tokens: np.array([kept[r] for r in rows], dtype=np.int64),
                     "position_ids": lengths[idx][:, None] + np.arange(n, dtype=np.int64)[None],
                     **{name: buf[idx] for name, buf in self.cache.items()},
                     **{name: st[idx] for name, st in states.items()}}
            new = np.ones((len(rows), n), dtype=np.int64)
            if "attention_mask" in self.model.input_names:  # the past as it was before the verifying call
                feeds["attention_mask"] = np.concatenate([slots[idx], new], axis=1)
            if info.length_input:
                feeds[info.length_input] = np.array([filled], dtype=np.int64)
            if "decode_mask" in self.model.input_names:
                feeds["decode_mask"] = np.concatenate([slots[idx, :filled], new], axis=1)
            out = self.model.run(feeds)  # never the bound step: it would write every row's buffers
            for state in info.states:
                self.states[state.past] = self.states[state.past].copy()
                self.states[state.past][idx] = out[state.present]
        return len(by_count)

    def rollback(self, row: int, n: int) -> None:
        """Forget the last ``n`` real columns of ``row`` (its rejected drafts)."""
        if n <= 0:
            return
        cols = np.flatnonzero(self.slots[row, :self.filled])[-n:]
        self.slots[row, cols] = 0
        self.lengths[row] -= len(cols)
        used = np.flatnonzero(self.slots[:, :self.filled].any(axis=0))
        self.filled = int(used[-1]) + 1 if len(used) else 0

    def compact(self) -> None:
        """Pack every row's real columns to the right of a common pointer (left padding again), in
        place: the buffers stay the arrays GroupQueryAttention's binding points at."""
        counts = self.slots[:, :self.filled].sum(axis=1)
        end = int(counts.max())
        for r in range(self.rows):
            cols = np.flatnonzero(self.slots[r, :self.filled])
            n = len(cols)
            for buf in self.cache.values():
                buf[r][:, end - n:end] = buf[r][:, cols]  # the fancy index copies before the write
            self.slots[r] = 0
            self.slots[r, end - n:end] = 1
        self.filled = end
        self.compactions += 1
        if self.filled + 1 > self.capacity:  # cannot happen while slack() holds
            raise RuntimeError("speculative cache overflow after compaction")
