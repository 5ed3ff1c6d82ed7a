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

Only the buffer cache without recurrent state (``check``): a scan's state cannot be rolled back; the
concat cache is fed back whole, and the sliding-window models that need it measure their window in
cache columns, which holes would break.
"""

from __future__ import annotations

import numpy as np

from tessera.runtime.generation.cached import CachedDecoder, CachedModel, Stats, check_cache_fits
from tessera.runtime.pipeline import UsageError


def slack(draft_tokens: int) -> int:
    """Columns past prompt + max_new_tokens a speculative cache holds: one round's speculative
    columns may overshoot the last token, and a compaction must leave room for the next chunk."""
    return 4 * (draft_tokens + 1)


def check(model: CachedModel, what: str) -> None:
    """Refuse, with the reason, a cached model whose cache cannot be rolled back per row."""
    if model.info.prefix_keys:
        raise UsageError(f"speculative decoding rolls rows back in a left-padded cache, whose decoding step needs "
                         f"its mask; {what} was compiled for the serving engine's layout (prefix_keys: no mask), "
                         f"which the serving engine's own speculation takes (`tessera serve --speculative`)")
    if model.info.states:
        raise UsageError(f"speculative decoding rolls each row back past its rejected drafts, which a cache of keys "
                         f"and values can (their columns are masked out again) but recurrent state cannot (the "
                         f"state after the drafts has no way back to the state before them); {what} carries "
                         f"{len(model.info.states)} scan or conv1d state(s) (a Mamba or hybrid layer): decode "
                         f"without --speculative")
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
        feeds = {info.tokens: tokens, "attention_mask": np.concatenate([self.slots, new], axis=1),
                 "position_ids": positions, **self.cache}
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
        return out[info.logits]

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
