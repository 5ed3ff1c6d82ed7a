"""A prefix cache shared across requests (``--prefix-cache-mb``): the keys and values of prompt
prefixes kept in blocks, reused by any later request that starts with the same tokens.

Why: a chat's system prompt, a few-shot preamble or a previous turn is the start of many prompts;
prefilling it again for each costs what decoding that many rows costs. Here the engine
(serving/engine.py) asks ``admit`` when a request's prefill is about to start: the longest run of whole blocks of
its prompt that is cached is copied into the slot's columns and prefill starts after it (the row's
next chunk runs against that filled past, as any later chunk of a prompt does). After every prompt
chunk (``store``) and when a request leaves (its output too: the next turn's prompt starts with it)
the row's whole blocks not yet cached are copied in. With the engine's cache on the device
(serving/device_cache.py) the pool stays in host memory: storing copies the row's new blocks
device-to-host once, admitting copies the reused blocks host-to-device once (per request, not per step).

The store. Blocks of ``BLOCK_TOKENS`` positions, every layer's keys and values of those positions
in one row of a pool of ``budget // block_bytes`` rows, allocated once (``np.empty``: its pages are
backed as blocks are first written, so the process holds what is used, never more than the budget).
A block is keyed by its parent block and its own tokens, ``(parent, tokens)`` -- the tokens
themselves, not a hash, so two different prefixes never share a block -- which makes the store a
tree: requests sharing a system prompt share its blocks, each block is held once, and no request's
whole cache is ever copied per entry. A lookup walks the tree from the root block by block.

The budget is exact: resident bytes = blocks held x ``block_bytes`` <= the budget, always (the pool
has no more rows). When the pool is full the least recently used block goes first. Every walk
touches its chain from the leaf back to the root, so a parent is always used at least as recently
as its children and the least recently used block is a leaf; evicting a block evicts what hangs
below it anyway (a block is never reachable from a reused pool row). The blocks of the chain being
stored are never evicted to make room for its own next block (a full pool of one long prefix keeps
its start).

Reusing a block gives the keys and values the row would compute (each position's depend on the
tokens up to it only); they were computed by another call, so they equal a fresh prefill's to float
rounding, as a chunked prompt's equal an unchunked one's. Tokens stay those without the cache
(tests/serving/test_serve_prefix_cache.py: greedy and seeded sampling).
"""

from __future__ import annotations

import collections

import numpy as np

from .model import UsageError

BLOCK_TOKENS = 16  # positions per block: a prompt reuses a multiple of this


class PrefixCache:
    """Blocks of prompt prefixes' keys and values in a pool of at most ``budget_bytes``; see the module
    docstring. ``attach(engine)`` makes the engine use it."""

    def __init__(self, engine, budget_bytes: int, block: int = BLOCK_TOKENS):
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise UsageError(f"the prefix cache's budget must be a whole number of bytes >= 0, got {budget_bytes}")
        self.block, self.budget = block, budget_bytes
        dtype = np.dtype(engine.model.np_dtype)  # the cache's own: fp16 with --kv-cache-dtype fp16 (half a block)
        self.layout = []  # (cache name, kv heads, head size, offset in a pool row)
        offset = 0
        for name, (kv, hd) in engine.dims.items():  # the cache's buffers, in its order
            self.layout.append((name, kv, hd, offset))
            offset += kv * block * hd
        self.block_elems = offset
        self.block_bytes = offset * dtype.itemsize
        self.capacity = budget_bytes // self.block_bytes  # pool rows: blocks * block_bytes <= budget
        if self.capacity:
            from tessera.runtime.pipeline import available_memory

            avail = available_memory()
            if avail is not None and self.capacity * self.block_bytes > avail:
                raise UsageError(f"--prefix-cache-mb {budget_bytes / 2**20:g} is more than the "
                                 f"{avail / 2**20:,.0f} MiB of memory available")
        self.pool = np.empty((self.capacity, offset), dtype=dtype)
        self.free = list(range(self.capacity - 1, -1, -1))  # pool rows not holding a block
        self.index: dict[tuple, int] = {}  # (parent row or -1, tokens) -> pool row
        self.key: dict[int, tuple] = {}  # pool row -> its key
        self.children: dict[int, set[int]] = collections.defaultdict(set)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recent first
        self.lookups = self.hits = self.reused_tokens = self.stored_blocks = self.evicted_blocks = 0

    @classmethod
    def for_engine(cls, engine, megabytes) -> "PrefixCache | None":
        """The cache of ``--prefix-cache-mb`` MB (MiB: 2**20 bytes) attached to ``engine``, or None for 0."""
        if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)) or not megabytes >= 0 \
                or megabytes == float("inf"):
            raise UsageError(f"--prefix-cache-mb must be a number of MiB >= 0, got {megabytes}")
        if megabytes == 0:
            return None
        if engine.info.states or not hasattr(engine, "cache"):
            raise UsageError("--prefix-cache-mb applies to the KV-cache engine (decoder-only transformers); this "
                             "model is served by the row engine (recurrent state or an encoder-decoder): drop it")
        return cls(engine, int(megabytes * 2**20)).attach(engine)

    def attach(self, engine) -> "PrefixCache":
        engine.prefix_cache = self
        engine.metrics.sections.append(self.metric_lines)
        return self

    # ------------------------------------------------------------------ what it holds
    @property
    def held_blocks(self) -> int:
        return len(self.key)

    @property
    def held_bytes(self) -> int:
        return self.held_blocks * self.block_bytes

    def describe(self) -> str:
        return (f"prefix cache: up to {self.budget / 2**20:.1f} MiB ({self.budget:,} bytes, never more): "
                f"{self.capacity} blocks of {self.block} positions x {self.block_bytes / 2**10:.1f} KiB "
                f"(every layer's keys and values), shared across requests, least recently used evicted first")

    def metric_lines(self) -> list[str]:
        out = []
        for name, kind, help_, value in (
                ("tessera_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.",
                 self.lookups),
                ("tessera_prefix_cache_hits_total", "counter", "Prompts that reused cached prefix blocks.", self.hits),
                ("tessera_prefix_cache_reused_tokens_total", "counter", "Prompt tokens not prefilled: their keys "
                 "and values came from the prefix cache.", self.reused_tokens),
                ("tessera_prefix_cache_stored_blocks_total", "counter", "Blocks stored.", self.stored_blocks),
                ("tessera_prefix_cache_evicted_blocks_total", "counter", "Blocks evicted (least recently used).",
                 self.evicted_blocks),
                ("tessera_prefix_cache_bytes", "gauge", "Bytes of keys and values held.", self.held_bytes),
                ("tessera_prefix_cache_budget_bytes", "gauge", "The budget (--prefix-cache-mb).", self.budget)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return out

    # ------------------------------------------------------------------ the tree
    def _walk(self, tokens, blocks: int) -> list[int]:
        """The pool rows of the cached chain of ``tokens``' first ``blocks`` blocks (as far as cached)."""
        chain, parent, b = [], -1, self.block
        for i in range(blocks):
            row = self.index.get((parent, tuple(tokens[i * b:(i + 1) * b])))
            if row is None:
                break
            chain.append(row)
            parent = row
        return chain

    def _touch(self, chain: list[int]) -> None:
        for row in reversed(chain):  # leaf first, root last: a parent is never older than its children
            self.lru.move_to_end(row)

    def _evict(self, row: int) -> None:
        for child in list(self.children.get(row, ())):
            self._evict(child)
        key = self.key.pop(row)
        del self.index[key]
        self.children.pop(row, None)
        if key[0] != -1:
            self.children[key[0]].discard(row)
        del self.lru[row]
        self.free.append(row)
        self.evicted_blocks += 1

    def _allocate(self, protected: set[int]) -> int | None:
        """A free pool row, evicting the least recently used block if needed (never one of
        ``protected``: the chain being stored); None when nothing can go."""
        if not self.free:
            victim = next((row for row in self.lru if row not in protected), None)
            if victim is None:
                return None
            self._evict(victim)
        return self.free.pop()

    # ------------------------------------------------------------------ the engine's calls
    def admit(self, engine, seq) -> None:
        """As ``seq``'s prefill starts (once; the engine asks for the prompt whose chunk runs next, so a
        prompt admitted with others finds the blocks those before it stored): its prompt's longest
        cached run of whole blocks, leaving at least one token to run (its logits give the first new
        token), copied into its row's columns."""
        if seq.filled or getattr(seq, "prefix_looked_up", False):
            return
        seq.prefix_looked_up = True
        prompt = seq.handle.request.prompt
        self.lookups += 1
        chain = self._walk(prompt, (len(prompt) - 1) // self.block)
        if not chain:
            return
        self._touch(chain)
        m, b, r = len(chain) * self.block, self.block, seq.slot
        engine._fit(m)
        if engine.device_cache is not None:  # the blocks gathered on the host, then copied to the device once
            blocks = {name: np.concatenate([self.pool[row, off:off + kv * b * hd].reshape(kv, b, hd) for row in chain],
                                           axis=1)[None] for name, kv, hd, off in self.layout}
            engine.device_cache.put(r, engine.width, 0, blocks, 0, 0, m)
        else:
            views = engine._views()
            for i, row in enumerate(chain):
                for name, kv, hd, off in self.layout:
                    views[name][r, :, i * b:(i + 1) * b] = self.pool[row, off:off + kv * b * hd].reshape(kv, b, hd)
        engine.slots[r, :m] = 1
        seq.filled = m
        self.hits += 1
        self.reused_tokens += m

    def store(self, engine, seq, tokens) -> None:
        """``seq``'s row holds the keys and values of ``tokens`` (its first columns): keep its whole
        blocks that are not cached yet."""
        if not self.capacity:
            return
        b, r = self.block, seq.slot
        blocks = len(tokens) // b
        chain = self._walk(tokens, blocks)
        if len(chain) == blocks:
            self._touch(chain)
            return
        protected = set(chain)
        views, first, dc = None, len(chain), engine.device_cache
        parent = chain[-1] if chain else -1
        for i in range(len(chain), blocks):
            row = self._allocate(protected)
            if row is None:
                break
            if views is None:  # the numpy cache's views; the device cache's new blocks, copied to the host once
                views = engine._views() if dc is None else dc.read(r, engine.width, first * b, blocks * b)
            for name, kv, hd, off in self.layout:
                block = views[name][r, :, i * b:(i + 1) * b] if dc is None else \
                    views[name][:, (i - first) * b:(i - first + 1) * b]
                self.pool[row, off:off + kv * b * hd].reshape(kv, b, hd)[...] = block
            key = (parent, tuple(tokens[i * b:(i + 1) * b]))
            self.index[key], self.key[row] = row, key
            if parent != -1:
                self.children[parent].add(row)
            self.lru[row] = None
            self.stored_blocks += 1
            chain.append(row)
            protected.add(row)
            parent = row
        self._touch(chain)
