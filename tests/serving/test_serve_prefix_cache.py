"""The prefix cache shared across requests (runtime/serving/prefix_cache.py, ``--prefix-cache-mb``).

Every request's tokens with the cache equal those of the same requests without it (greedy and
seeded sampling, a system prompt shared by many requests beside unshared ones, concurrent in the
engine's slots, and a second turn starting with the first's prompt and output); the budget is never
passed, however the store churns; eviction takes the least recently used block first. The engine is
stepped by hand, so nothing depends on timing.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.prefix_cache import BLOCK_TOKENS, PrefixCache

LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=128"]
GPT2 = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=128"]


@pytest.fixture(scope="module")
def llama():
    return serving_model.load("llama", sets=LLAMA, threads=1)


@pytest.fixture(scope="module")
def gpt2():
    return serving_model.load("gpt2", sets=GPT2, threads=1)


def _shared(n: int, seed: int, system: int = 40) -> list[Request]:
    """Requests of which most start with one system prompt (the rest with none), half sampled."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 50, system).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(0, 50, int(rng.integers(1, 24))).tolist()
        prompt = tail if i % 5 == 4 else head + tail
        sampling = gen.Sampling(temperature=0.8, top_k=10, top_p=0.9, seed=i) if i % 2 else gen.Sampling()
        out.append(Request(prompt, int(rng.integers(1, 12)), sampling))
    return out


def _run(model, reqs, megabytes, max_batch=4, prefill_chunk=16, check=None):
    engine = Engine(model, max_batch=max_batch, max_queue=len(reqs), prefill_chunk=prefill_chunk)
    cache = PrefixCache.for_engine(engine, megabytes)
    handles = [engine.submit(copy.deepcopy(r)) for r in reqs]
    while any(not h.finished for h in handles):
        assert engine.step()
        if check is not None:
            check(cache)
    return [h.tokens for h in handles], cache, engine


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_a_shared_system_prompt_gives_the_tokens_of_no_cache(which, request):
    model = request.getfixturevalue(which)
    reqs = _shared(20, seed=1)
    want, none, _ = _run(model, reqs, 0)
    assert none is None
    got, cache, engine = _run(model, reqs, 4)
    assert got == want
    # every request with the system prompt but those admitted before its first blocks were stored reused it
    assert cache.hits >= 12 and cache.reused_tokens >= 12 * 32
    assert cache.reused_tokens % BLOCK_TOKENS == 0
    # the prefilled tokens are the prompts' less the reused ones
    assert engine.metrics.prompt_tokens == sum(len(r.prompt) for r in reqs) - cache.reused_tokens
    assert 0 < cache.held_bytes <= cache.budget


def test_a_second_turn_reuses_the_first_turns_prompt_and_output(llama):
    rng = np.random.default_rng(3)
    first = Request(rng.integers(0, 50, 37).tolist(), 20)
    engine = Engine(llama, max_batch=2, prefill_chunk=16)
    cache = PrefixCache.for_engine(engine, 1)
    h = engine.submit(copy.deepcopy(first))
    while not h.finished:
        engine.step()
    second = Request(first.prompt + h.tokens + rng.integers(0, 50, 5).tolist(), 8,
                     gen.Sampling(temperature=0.7, seed=5))
    reused = cache.reused_tokens
    h2 = engine.submit(copy.deepcopy(second))
    while not h2.finished:
        engine.step()
    # the first turn's prompt and the output fed back (all but its last token) are cached: 56 columns
    assert cache.reused_tokens - reused == (37 + 20 - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    plain, _, _ = _run(llama, [second], 0)
    assert h2.tokens == plain[0]


def test_the_budget_is_never_passed_under_churn_and_tokens_stay(llama):
    """A budget of 3 blocks against many prefixes: blocks are evicted all the time; the bytes held never
    pass it, checked after every step, and the tokens are those without the cache."""
    rng = np.random.default_rng(2)
    heads = [rng.integers(0, 50, 35).tolist() for _ in range(4)]
    reqs = [Request(heads[int(rng.integers(0, 4))] + rng.integers(0, 50, int(rng.integers(1, 10))).tolist(),
                    int(rng.integers(1, 8)), gen.Sampling(temperature=0.9, seed=i) if i % 3 == 0 else gen.Sampling())
            for i in range(24)]
    probe = Engine(llama, max_batch=2)
    block_bytes = PrefixCache(probe, 0).block_bytes
    budget_mb = (3 * block_bytes + block_bytes // 2) / 2**20  # room for 3 blocks and a half: 3 held at most
    held = []

    def check(cache):
        assert cache.held_bytes <= cache.budget
        assert cache.pool.nbytes <= cache.budget
        assert len(cache.lru) == len(cache.key) == len(cache.index) == cache.held_blocks
        held.append(cache.held_blocks)

    want, _, _ = _run(llama, reqs, 0, max_batch=3)
    got, cache, _ = _run(llama, reqs, budget_mb, max_batch=3, check=check)
    assert got == want
    assert cache.capacity == 3 and max(held) == 3
    assert cache.evicted_blocks > 0 and cache.hits > 0


def test_eviction_takes_the_least_recently_used_block_first(llama):
    """Three one-block prefixes fill a pool of three; the first is used again; a fourth evicts the
    second (the least recently used), and a two-block chain's start outlives its end."""
    engine = Engine(llama, max_batch=1, prefill_chunk=64)
    cache = PrefixCache(engine, 3 * PrefixCache(engine, 0).block_bytes).attach(engine)
    rng = np.random.default_rng(4)
    a, b, c, d = (rng.integers(0, 50, BLOCK_TOKENS).tolist() for _ in range(4))

    def serve(prompt):
        h = engine.submit(Request(prompt + [1], 1))
        while not h.finished:
            engine.step()

    def cached(block):
        return bool(cache._walk(block, 1))

    for p in (a, b, c):
        serve(p)
    assert all(cached(p) for p in (a, b, c)) and cache.held_blocks == 3
    serve(a)  # a hit: a is now the most recently used
    assert cache.hits == 1
    serve(d)
    assert cached(a) and not cached(b) and cached(c) and cached(d)
    assert cache.evicted_blocks == 1
    serve(a + c[:5])  # touches a; c is now the least recently used
    serve(b)
    assert not cached(c) and cached(a) and cached(b) and cached(d)
    # a chain: its blocks are touched leaf first, so the leaf goes before its parent
    serve(a + b)  # a hit on a, then a's child (a, b) stored in place of the least recently used (d)
    assert not cached(d) and len(cache._walk(a + b, 2)) == 2
    serve(c)  # evicts the least recently used: b alone (a's chain was used after it)
    assert len(cache._walk(a + b, 2)) == 2 and not cached(b)
    assert cache.held_bytes == 3 * cache.block_bytes <= cache.budget


def test_the_option_the_explain_and_the_metrics(capsys, llama):
    from conftest import cli, cli_error

    sets = [a for s in LLAMA for a in ("--set", s)]
    rc, out, err = cli(capsys, "serve", "llama", *sets, "--prefix-cache-mb", "2", "--explain")
    assert rc == 0 and "prefix cache: up to 2.0 MiB (2,097,152 bytes, never more)" in err
    rc, out, err = cli(capsys, "serve", "llama", *sets, "--explain")
    assert rc == 0 and "prefix cache: off" in err
    for bad in ("-1", "nan", "inf"):
        err = cli_error(capsys, "serve", "llama", *sets, "--prefix-cache-mb", bad, "--explain")
        assert "--prefix-cache-mb must be a number of MiB >= 0" in err
    engine = Engine(llama, max_batch=2)
    PrefixCache.for_engine(engine, 1)
    h = engine.submit(Request(list(range(40)), 2))
    while not h.finished:
        engine.step()
    text = engine.metrics.render()
    for line in ("tessera_prefix_cache_lookups_total 1", "tessera_prefix_cache_hits_total 0",
                 "tessera_prefix_cache_reused_tokens_total 0", "tessera_prefix_cache_bytes ",
                 "tessera_prefix_cache_budget_bytes 1048576", "tessera_prefix_cache_evicted_blocks_total 0"):
        assert line in text
    assert f"tessera_prefix_cache_bytes {2 * PrefixCache(engine, 0).block_bytes}" in text


def test_the_row_engine_refuses_it():
    from tessera.runtime import driver
    from tessera.runtime.options import EngineOptions
    from tessera.runtime.serving.model import UsageError
    from tessera.runtime.serving.row_engine import engine_for

    opts = EngineOptions(spec="mamba", variant="tiny", threads=1)
    model = driver.serve_model(opts.model, opts)
    with pytest.raises(UsageError, match="--prefix-cache-mb applies to the KV-cache engine"):
        engine_for(model, prefix_cache_mb=1)


def test_batch_takes_the_option_and_gives_the_same_rows(capsys, tmp_path):
    """`tessera batch --prefix-cache-mb`: rows sharing a prefix give the lines they give without it."""
    import json

    from conftest import cli

    sets = [a for s in LLAMA for a in ("--set", s)]
    head = list(range(3, 43))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": head + [i, i + 1], "max_tokens": 5}) + "\n" for i in range(6)))
    outs = []
    for mb in ("0", "1"):
        out = tmp_path / f"out{mb}.jsonl"
        rc, _, err = cli(capsys, "batch", "llama", *sets, "--input", src, "--output", out, "--threads", "1",
                         "--max-batch", "2", "--prefix-cache-mb", mb)
        assert rc == 0, err
        outs.append(out.read_text())
    assert outs[0] == outs[1] and outs[0].count("tokens") == 6


def test_with_speculation_the_tokens_stay():
    """Prefix blocks reused by rows whose steps check drafts (every draft: no timing in the path), and
    rows' outputs stored after verifying calls: the tokens of the same engine without the cache."""
    from tessera.runtime.serving.speculation import Speculation

    model = serving_model.load("llama", sets=LLAMA, threads=1, last_only=False)
    rng = np.random.default_rng(6)
    passage = rng.integers(0, 50, 20).tolist()
    reqs = [Request(passage + passage + rng.integers(0, 50, int(rng.integers(1, 6))).tolist(), 16) for _ in range(8)]
    runs = []
    for mb in (0, 1):
        engine = Engine(model, max_batch=3, max_queue=8, prefill_chunk=16)
        Speculation(4, adaptive=False).attach(engine)
        cache = PrefixCache.for_engine(engine, mb)
        handles = [engine.submit(copy.deepcopy(r)) for r in reqs]
        while any(not h.finished for h in handles):
            engine.step()
        runs.append([h.tokens for h in handles])
        if cache is not None:
            assert cache.hits > 0 and engine.speculation.calls > 0
    assert runs[0] == runs[1]
