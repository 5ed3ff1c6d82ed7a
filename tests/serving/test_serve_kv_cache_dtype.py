"""The serving engine with its KV cache at fp16 (``serve --kv-cache-dtype fp16``; compiler/passes/kv_cache_dtype.py).

The reference is the same engine over the fp32 cache (same spec, weights, requests and schedule): its
greedy tokens, request for request, with several concurrent requests of different lengths, prompts
longer than a chunk (chunked prefill and the combined call), the prefix cache and speculation; the
memory from the engine's buffers themselves (their nbytes), not from a formula. The engine is stepped by
hand, so nothing depends on timing.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import cli
from tessera.runtime.generation import cached as gen
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.serving.prefix_cache import PrefixCache

LLAMA = ["layers=2", "d=64", "heads=4", "kv_heads=2", "d_ff=128", "vocab=50", "ctx=128"]
GPT2 = ["layers=2", "d=64", "heads=4", "vocab=50", "ctx=128"]
SPECS = {"llama": LLAMA, "gpt2": GPT2}


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(spec, kv, last_only=True):
        key = (spec, kv, last_only)
        if key not in made:
            made[key] = serving_model.load(spec, sets=SPECS[spec], threads=1, kv_cache_dtype=kv, last_only=last_only)
        return made[key]
    return get


def _requests(n: int, seed: int) -> list[Request]:
    """Greedy requests: two in three start with one 40-token system prompt, each with its own tail (1 to 50
    tokens), 1 to 30 new tokens."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 50, 40).tolist()
    return [Request((head if i % 3 else []) + rng.integers(0, 50, int(rng.integers(1, 50))).tolist(),
                    int(rng.integers(1, 30)), gen.Sampling(logprobs=2)) for i in range(n)]


def _run(model, reqs, megabytes=0.0, speculate=False, **kw):
    engine = Engine(model, **{"max_batch": 4, "max_queue": len(reqs), "prefill_chunk": 16, **kw})
    if speculate:
        from tessera.runtime.serving.speculation import Speculation

        Speculation(4, adaptive=False).attach(engine)
    cache = PrefixCache.for_engine(engine, megabytes) if megabytes else None
    handles = [engine.submit(copy.deepcopy(r)) for r in reqs]
    while any(not h.finished for h in handles):
        assert engine.step()
    return handles, engine, cache


# the fp16 cache's logits lie within 1e-3 of the fp32 cache's range (tests/generation/test_kv_cache_dtype.py); the
# tiny models' logits span about 1, so a top-two gap under TIE is a near-tie, where either token is right
TIE = 2e-3


def tokens(handles) -> list[list[int]]:
    return [h.tokens for h in handles]


def agree(want, got) -> int:
    """Requests whose tokens are equal, checking that each other one first differs at a near-tie (the top
    two log-probabilities, of either run, within TIE: the fp32 cache's choice is no more right there).
    Returns how many were equal."""
    equal = 0
    for w, g in zip(want, got):
        if w.tokens == g.tokens:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(w.tokens, g.tokens)) if a != b)
        gaps = [h.logprobs[at]["top"][0]["logprob"] - h.logprobs[at]["top"][1]["logprob"] for h in (w, g)]
        assert min(gaps) <= TIE, (w.tokens, g.tokens, at, gaps)
    return equal


@pytest.mark.parametrize("spec", ["llama", "gpt2"])
def test_concurrent_chunked_requests_give_the_fp32_caches_tokens(models, spec):
    """12 requests through 4 slots, prompts up to 90 tokens in 16-token chunks (the combined call with
    the decoding rows): the fp16 cache's tokens are the fp32 cache's (but past a near-tie: ``agree``); its
    buffers are fp16 and half the bytes; the combined call ran."""
    reqs = _requests(12, seed=1)
    want, e32, _ = _run(models(spec, "auto"), reqs)
    got, e16, _ = _run(models(spec, "fp16"), reqs)
    assert agree(want, got) >= 10
    assert e16.combined and e16.metrics.prompt_tokens == e32.metrics.prompt_tokens
    assert {a.dtype for a in e16.cache.values()} == {np.dtype(np.float16)}
    assert sum(a.nbytes for a in e16.cache.values()) * 2 == sum(a.nbytes for a in e32.cache.values())


def test_with_the_prefix_cache_the_tokens_stay_and_its_blocks_are_half(models):
    """The prefix cache's pool holds fp16 blocks counted at their real bytes: half a block of the fp32
    cache's, so twice the blocks in one budget; the tokens are those of the fp16 engine without it, and
    the fp32 engine's but past a near-tie."""
    reqs = _requests(15, seed=2)
    want, _, _ = _run(models("llama", "auto"), reqs)
    plain, _, _ = _run(models("llama", "fp16"), reqs)
    got, engine, cache = _run(models("llama", "fp16"), reqs, megabytes=1)
    _, _, cache32 = _run(models("llama", "auto"), reqs, megabytes=1)
    assert tokens(got) == tokens(plain)  # the same engine, with and without reuse: the same columns read
    assert agree(want, got) >= 12
    assert cache.hits > 0 and cache.pool.dtype == np.float16
    assert cache.block_bytes * 2 == cache32.block_bytes and cache.capacity >= 2 * cache32.capacity - 1
    assert cache.pool.nbytes == cache.capacity * cache.block_bytes and 0 < cache.held_bytes <= cache.budget


def test_speculation_keeps_the_tokens(models):
    """Verifying calls (the prompt branch over each row's fp16 past, its new columns written back as fp16)
    on prompts that repeat themselves, every draft checked: the fp32 cache's tokens."""
    rng = np.random.default_rng(6)
    passage = rng.integers(0, 50, 20).tolist()
    # no logprobs asked: a request asking for them is not drafted for
    reqs = [Request(passage + passage + rng.integers(0, 50, int(rng.integers(1, 6))).tolist(), 16) for _ in range(6)]
    want, _, _ = _run(models("llama", "auto", last_only=False), reqs, speculate=True, max_batch=3)
    got, engine, _ = _run(models("llama", "fp16", last_only=False), reqs, speculate=True, max_batch=3)
    assert tokens(got) == tokens(want) and engine.speculation.calls > 0


def test_explain_states_the_halved_cache(capsys):
    """serve --explain's memory budget comes from the buffers: the fp16 cache's MiB are half the fp32's."""
    def explain(*extra):
        rc, out, err = cli(capsys, "serve", "llama", *[a for s in LLAMA for a in ("--set", s)], "--max-batch", "8",
                           "--threads", "1", "--explain", "--no-compile-cache", *extra)
        assert rc == 0, err
        text = out + err
        line = next(x for x in text.splitlines() if x.startswith("memory budget"))
        return float(line.split("KV cache ")[1].split(" MiB")[0]), " MiB at fp16 = " in line

    (half, at16), (full, at32) = explain("--kv-cache-dtype", "fp16"), explain()
    assert half * 2 == pytest.approx(full, abs=0.1) and at16 and not at32
