"""Time to first token with a shared prefix cached against cold (``--prefix-cache-mb``, issue 40).

    python bench/prefix_cache.py                                   # a Llama shape, 2,000-token prefix
    python bench/prefix_cache.py --prefix 2000 --tail 32 --rounds 5 --threads 1 --set layers=4

One engine (runtime/serving/engine.py, the decoder runtime/serving/model.py loads, seeded weights)
with the prefix cache; per round, alternating: ``cold`` -- a request whose prompt is a fresh
--prefix tokens and a --tail, into an empty store (the cache cleared first); ``warm`` -- a request
whose prompt is the same --prefix (stored by the round's cold request) and another --tail. The time
is from submit to the first new token, the engine stepped by hand with nothing else running (the
engine's own scheduling: a lone prompt in chunks of up to 512 tokens). Reported: min and median of
each over the rounds, and cold / warm. The machine is shared: compare within a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

LLAMA = ["layers=4", "d=256", "heads=8", "kv_heads=2", "d_ff=1024", "vocab=2000", "ctx=4096"]


def main(argv=None) -> dict:
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request
    from tessera.runtime.serving.prefix_cache import PrefixCache

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="llama")
    p.add_argument("--set", dest="sets", action="append", default=None)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--tail", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mb", type=float, default=512)
    a = p.parse_args(argv)
    sets = list(LLAMA)
    for s in a.sets or []:
        sets = [x for x in sets if x.split("=")[0] != s.split("=")[0]] + [s]
    model = serving_model.load(a.spec, sets=sets, threads=a.threads)
    engine = Engine(model, max_batch=2, prefill_chunk=256, capacity=a.prefix + a.tail + 8)
    cache = PrefixCache.for_engine(engine, a.mb)
    rng = np.random.default_rng(0)
    vocab = model.vocab

    def ttft(prompt):
        h = engine.submit(Request(prompt, 1))
        t0 = time.perf_counter()
        while not h.finished:
            engine.step()
        return time.perf_counter() - t0

    times = {"cold": [], "warm": []}
    ttft(rng.integers(0, vocab, a.prefix + a.tail).tolist())  # warm-up: sessions, shapes
    for _ in range(a.rounds):
        for key in list(cache.key):
            if key in cache.key:
                cache._evict(key)
        head = rng.integers(0, vocab, a.prefix).tolist()
        times["cold"].append(ttft(head + rng.integers(0, vocab, a.tail).tolist()))
        times["warm"].append(ttft(head + rng.integers(0, vocab, a.tail).tolist()))
    out = {k: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)} for k, v in times.items()}
    out["cold_over_warm_median"] = out["cold"]["median_ms"] / out["warm"]["median_ms"]
    out["cold_over_warm_min"] = out["cold"]["min_ms"] / out["warm"]["min_ms"]
    out["held_mib"] = cache.held_bytes / 2**20
    out["config"] = {"sets": sets, "prefix": a.prefix, "tail": a.tail, "threads": a.threads, "rounds": a.rounds}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
