"""Adaptive speculation inside the batch against plain decoding and every draft checked (issue 40).

    python bench/serve_adaptive.py                          # streams 1 4 16, 3 rounds, 2 threads
    python bench/serve_adaptive.py --streams 1 16 --rounds 2 --new 96

One process, one seeded Llama-shaped model loaded twice as the server loads it: ``plain`` -- the
engine without speculation (last-position logits, the combined call), what `tessera serve` runs
without --speculative; ``plain-all`` -- the same engine on a model giving every position's logits in every call (no
combined call: a prompt chunk and the decoding step are two calls; what --speculative compiled
before 2026-12-07's sixteenth session, and still does on CUDA), no speculation; ``fixed`` --
`--speculative ngram` checking every draft (adaptive=False); ``adaptive`` -- `--speculative ngram` as it
now runs (speculation.py: the number of drafts chosen per step from measured call times and acceptance
rates). ``fixed`` and ``adaptive`` run the model `serve --speculative` compiles on the CPU: the combined
call, with every position's logits in the short calls that check drafts (``check_tokens``). Per concurrency C, C requests at once, each a
random 24-token passage twice and its first 8 tokens (prompt lookup finds the passage; a seeded
model's greedy output falls into loops, which it finds too), greedy, --new tokens, no end-of-sequence;
the engine stepped by hand from submit to the last token. Cases alternate within each round; the
adaptive engine keeps its measured prices across rounds (as a server does). Reported per C and case:
aggregate tokens/s min / median over rounds, the ratio of medians to plain, and drafted / accepted /
verifying calls / declined steps of the last round. Every case's tokens are compared with plain's; a
request that differs is listed with the step where it first does and plain decoding's top-2 logit
margin there (a verifying call's attention rounds differently from a decoding step's).
The machine is shared: compare within a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

LLAMA = ["layers=6", "d=512", "heads=8", "kv_heads=4", "d_ff=1536", "vocab=8000", "ctx=512"]


def main(argv=None) -> dict:
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request
    from tessera.runtime.generation import cached as gen
    from tessera.runtime.serving.speculation import Speculation

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", dest="sets", action="append", default=None)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=Speculation.DRAFT_TOKENS)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    sets = list(LLAMA)
    for s in a.sets or []:
        sets = [x for x in sets if x.split("=")[0] != s.split("=")[0]] + [s]
    plain_model = serving_model.load("llama", sets=sets, threads=a.threads)
    all_model = serving_model.load("llama", sets=sets, threads=a.threads, last_only=False)
    spec_model = serving_model.load("llama", sets=sets, threads=a.threads, check_tokens=a.draft_tokens + 1)
    vocab = plain_model.vocab
    top = max(a.streams)
    engines = {"plain": Engine(plain_model, max_batch=top, max_queue=top, prefill_chunk=256),
               "plain-all": Engine(all_model, max_batch=top, max_queue=top, prefill_chunk=256),
               "fixed": Engine(spec_model, max_batch=top, max_queue=top, prefill_chunk=256),
               "adaptive": Engine(spec_model, max_batch=top, max_queue=top, prefill_chunk=256)}
    Speculation(a.draft_tokens, adaptive=False).attach(engines["fixed"])
    Speculation(a.draft_tokens, adaptive=True).attach(engines["adaptive"])
    rng = np.random.default_rng(0)

    def run(engine, prompts):
        handles = [engine.submit(Request(list(p), a.new)) for p in prompts]
        t0 = time.perf_counter()
        while any(not h.finished for h in handles):
            engine.step()
        dt = time.perf_counter() - t0
        return sum(len(h.tokens) for h in handles) / dt, [h.tokens for h in handles]

    for engine in engines.values():  # warm-up: sessions, shapes, the adaptive engine's first prices
        run(engine, [rng.integers(0, vocab, 40).tolist() for _ in range(top)])
    out, differ = {}, []
    for c in a.streams:
        rates = {k: [] for k in engines}
        for _ in range(a.rounds):
            prompts = []
            for _ in range(c):
                passage = rng.integers(0, vocab, 24).tolist()
                prompts.append(passage + passage + passage[:8])
            ref = None
            for name, engine in engines.items():
                spec = engine.speculation
                if spec is not None:
                    spec.drafted = spec.accepted = spec.calls = spec.declined = 0
                rate, tokens = run(engine, prompts)
                if ref is None:
                    ref = tokens
                for i, (want, got) in enumerate(zip(ref, tokens)):
                    if want != got:  # where it first differs, and plain decoding's top-2 margin there
                        j = next(k for k in range(len(want)) if want[k] != got[k])
                        seen = []
                        gen.generate(plain_model, [prompts[i]], j + 1, on_logits=lambda s, lg: seen.append(lg[0]))
                        top = np.sort(seen[-1])[-2:]
                        differ.append({"case": name, "streams": c, "at": j, "margin": float(top[1] - top[0])})
                rates[name].append(rate)
        row = {}
        for name, r in rates.items():
            row[name] = {"min": round(min(r), 1), "median": round(statistics.median(r), 1),
                         "x_plain_median": round(statistics.median(r) / statistics.median(rates["plain"]), 3)}
            spec = engines[name].speculation
            row[name]["combined_calls"] = engines[name].combined_calls  # since the start (warm-up included)
            if spec is not None:
                row[name].update(drafted=spec.drafted, accepted=spec.accepted, calls=spec.calls,
                                 declined=spec.declined)
        out[f"streams_{c}"] = row
        print(c, json.dumps(row), flush=True)
    out["differ"] = differ  # requests whose tokens differ from plain's (float rounding at a near tie)
    print("differ", differ, flush=True)
    out["config"] = {"sets": sets, "rounds": a.rounds, "new": a.new, "threads": a.threads,
                     "draft_tokens": a.draft_tokens}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
