"""What a prefill chunk costs next to a decoding step: to size the serving engine's chunked prefill.

    python bench/prefill_mix_cost.py                          # the issue's Llama shape, 2 threads
    python bench/prefill_mix_cost.py --chunks 16 48 112 --past 0 128 --rounds 5 --threads 2

Why: a served stream's inter-token latency is one decoding step plus whatever else the iteration
runs, here a prefill chunk of a new prompt in a call of its own (runtime/serving/engine.py). Issue
#23 asks p99 inter-token latency at concurrency 16 of at most 3x one stream's step with prompts
arriving, so what a chunk of T tokens costs against a 16-row decoding step (and against one stream's
step) says which chunk sizes fit, and whether any does while the chunk is a separate call.

What runs (one process, the engine's compiled decoder as runtime/serving/model.py loads it, seeded
weights, --threads onnxruntime threads), in alternating rounds so every case sees the same load:

- ``decode-16``: ``Engine.step`` of an engine with --rows requests of --prompt tokens, all decoding
  (the onnxruntime call with the cache bound in place, scheduling, token choice), --steps per round;
- ``decode-1``: the same with one request: one stream's step, the goal's unit;
- ``decode-N`` for N in --proxy-rows: a decoding step of N rows, whose matrix products are those of
  one call over --rows decoding rows and a chunk of N - rows prompt tokens (the combined call of
  docs/serve.md, not built: its attention differs, the chunk's tokens attending causally over its
  own row), against the two calls the engine makes today;
- ``chunk T @P``: one prefill call as the engine makes it (``Engine._prefill_chunk``'s feeds): T
  prompt tokens of one row against P cached positions (P = 0: the prompt's first chunk, against an
  empty past; P > 0: the row's filled columns, the view rounded up to 64 columns), --steps per round;
- ``decode alone``, ``one call T @P`` and ``two calls T @P``: that engine's decoding step alone (the
  unit of the next two), and a whole iteration of an engine with --rows decoding rows
  and one prompt whose chunk of T tokens goes in after P cached positions, run as the combined call
  (``Engine._combined_step``: the decoding rows and the chunk in one onnxruntime call,
  compiler/backends/onnx/mixed_attention.py) and as the two calls the engine makes without it
  (``_prefill_chunk`` then ``_decode_step``), on the same engine; the chunk is rolled back after each
  iteration so every one prefills the same T tokens after P (the decoding rows go on).

Reported per case: best and median ms per call over rounds (and, for each iteration, its CPU time
over the decoding step's, the median of per-round ratios: with ``--threads 1`` onnxruntime runs the
call on this thread, so that ratio is the call's own cost, which a busy machine barely moves), and
each chunk's median as a fraction of ``decode-16``'s median; then the iteration a stream sees at 16 rows with a chunk T (decode-16 +
chunk) in one-stream steps, against the goal's 3; and each iteration, one call and two, as a fraction
of ``decode-16`` and in one-stream steps. Last, issue #23's serving goals at their best case on this
machine (``goal_bounds``): the aggregate tokens/s of --rows streams over one stream's, and the
iteration that carries the prompt tokens those streams need, in one-stream steps, if every iteration
decoded all rows and a prompt token cost its cheapest measured cost; add ``--chunks ... 144`` for the
one stream's prompt in one call (``--goal-prompt``, the mean of bench/serve.py's prompts).

    python bench/prefill_mix_cost.py --chunks 16 48 112 144 --past 0 128 --rounds 5   # with the bound

Not a timed test: the figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonout import write_json  # noqa: E402
from serve import MODELS, _vocab  # noqa: E402


def chunk_feeds(model, t: int, past: int, vocab: int) -> dict[str, np.ndarray]:
    """The feeds of Engine._prefill_chunk for T tokens of one row after ``past`` cached ones."""
    info = model.info
    rng = np.random.default_rng(t * 1000 + past)
    feeds = {info.tokens: rng.integers(1, vocab, (1, t)).astype(np.int64),
             "position_ids": np.arange(past, past + t, dtype=np.int64)[None]}
    width = 0 if past == 0 else -(-past // 64) * 64  # the engine's view width (WIDTH_STEP)
    for layer in info.layers:
        for name, size in ((layer.past_key, layer.head_size), (layer.past_value, layer.value_size)):
            feeds[name] = np.zeros((1, layer.kv_heads, width, size), dtype=model.np_dtype)
    mask = np.zeros((1, width + t), dtype=np.int64)
    mask[0, :past] = 1
    mask[0, width:] = 1
    feeds["attention_mask"] = mask
    if info.length_input:
        feeds[info.length_input] = np.array([past], dtype=np.int64)
    return feeds


def main() -> None:
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine, Request

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="llama")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of the decoding rows")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 48, 112])
    p.add_argument("--past", type=int, nargs="+", default=[0, 128])
    p.add_argument("--steps", type=int, default=4, help="calls per case and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--proxy-rows", type=int, nargs="*", default=[32],
                   help="decoding steps of this many rows too: what one call over --rows decoding rows and a "
                        "chunk of (N - rows) prompt tokens would cost in its matrix products (default 32)")
    p.add_argument("--goal-prompt", type=int, default=144,
                   help="mean prompt tokens of the goals' workload (bench/serve.py's prompts 32-256: 144)")
    p.add_argument("--goal-new", type=int, default=128, help="new tokens a request of that workload (default 128)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    m = MODELS[args.model]
    vocab = _vocab(m["sets"])
    model = serving_model.load(m["spec"], variant=m.get("variant"), sets=m["sets"], threads=args.threads)
    rng = np.random.default_rng(0)
    need = args.rounds * args.steps + 8
    engines = {}
    widths = [(f"decode-{args.rows}", args.rows), ("decode-1", 1)] + [(f"decode-{n}", n) for n in args.proxy_rows]
    for name, rows in widths:
        e = Engine(model, max_batch=rows, max_queue=0, prefill_chunk=max(256, args.prompt))
        for _ in range(rows):
            e.submit(Request(rng.integers(1, vocab, args.prompt).tolist(), need))
        while any(s.prefilling for s in e.rows) or e.queued:
            e.step()
        e.step()  # warm-up at this width
        engines[name] = e
    feeds = {f"chunk {t} @{p0}": chunk_feeds(model, t, p0, vocab) for p0 in args.past for t in args.chunks}
    for f in feeds.values():
        model.run(f)  # warm-up of each shape
    iterations = _iterations(model, args, vocab, rng, (args.rounds * args.steps + 2) * (2 * len(feeds) + 1) + 8)
    times: dict[str, list[float]] = {k: [] for k in [*engines, *feeds, *iterations]}
    cpu: dict[str, list[float]] = {k: [] for k in times}  # this process's CPU ms a call (see --threads 1)
    for _ in range(args.rounds):
        for name, e in engines.items():
            start, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                e.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
        for name, f in feeds.items():
            start, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                model.run(f)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
        for name, run in iterations.items():
            spent, c0 = 0.0, time.process_time()
            for _ in range(args.steps):
                spent += run()
            times[name].append(spent / args.steps * 1e3)
            cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
    big = next(iter(engines))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model}, {args.rows} decoding rows of {args.prompt}+ cached positions, threads "
          f"{args.threads}, {args.rounds} rounds x {args.steps} calls, load average {os.getloadavg()[0]:.1f}")
    for k, v in times.items():
        rel = f"  {med[k] / med[big]:.2f} of {big}" if k.startswith("chunk") else ""
        print(f"  {k:<16} best {min(v):8.1f}  median {med[k]:8.1f} ms{rel}")
    print(f"  {big} = {med[big] / med['decode-1']:.2f} one-stream steps (median)")
    for n in args.proxy_rows:  # a combined call's matrix products, against the chunk as a call of its own
        t = n - args.rows
        alone = f"chunk {t} @{args.past[0]}"
        if alone in med:
            print(f"  decode-{n} (the matrix products of one call over {args.rows} decoding rows and a {t}-token "
                  f"chunk) = {med[f'decode-{n}'] / med[big]:.2f} of {big}; {big} + {alone} as two calls = "
                  f"{(med[big] + med[alone]) / med[big]:.2f}")
    for k in feeds:
        print(f"  {big} + {k}: {(med[big] + med[k]) / med['decode-1']:.2f} one-stream steps (goal for p99 ITL: <= 3)")
    for k in iterations:
        if k != "decode alone":
            print(f"  iteration, {k}: {med[k] / med['decode alone']:.2f} of the same engine's decoding step alone, "
                  f"{med[k] / med[big]:.2f} of {big}, {med[k] / med['decode-1']:.2f} one-stream steps")
            ratios = [c / d for c, d in zip(cpu[k], cpu["decode alone"])]
            print(f"    in CPU time: {statistics.median(ratios):.2f} of the decoding step alone (median of per-round "
                  f"ratios; with --threads 1 the call's own cost, little moved by other processes)")
    bounds = goal_bounds(med, big, args.rows, args.goal_prompt, args.goal_new)
    if bounds:
        print(f"  the serving goals' best case on this machine, from these medians ({args.rows} streams, prompts of "
              f"{args.goal_prompt} tokens, {args.goal_new} new; every iteration decoding all {args.rows} rows, a "
              f"prompt token at its cheapest measured cost {bounds['prompt_token_ms']:.2f} ms ({bounds['cheapest']}), "
              f"nothing else):")
        print(f"    aggregate tokens/s <= {bounds['rate_ratio']:.2f}x one stream (goal >= 6); one stream "
              f"{bounds['one_stream_tok_s']:.1f} tokens/s with its prompt prefilled whole ({bounds['one_stream_prefill']})")
        print(f"    an iteration carrying the {bounds['prompt_tokens_per_iteration']:.1f} prompt tokens the {args.rows} "
              f"streams need >= {bounds['iteration_steps']:.2f} one-stream steps (goal for p99 inter-token latency: <= 3)")
    if args.json:
        write_json(args.json, {"times_ms": times, "median_ms": med, "cpu_ms": cpu, "goal_bounds": bounds}, indent=1)


def goal_bounds(med: dict[str, float], big: str, rows: int, prompt: int, new: int) -> dict | None:
    """Issue #23's serving goals at their best case on this machine, from this run's medians: what no
    scheduler can beat while a prompt token costs what it costs here. Why: the goals were set on
    another CPU; whether they are reachable on this one is a question of these costs, not of the engine.

    - A prompt token's cost: the cheapest of the measured ways in (a chunk alone, ms / T; or the
      combined call's extra over the decoding step alone, / T), so the bound is generous.
    - One stream: ``new - 1`` decoding steps (``decode-1``) plus its prompt in one call (``chunk P @0``
      with P = ``prompt``, else the cheapest token cost x P): ``new`` tokens in that time.
    - ``rows`` streams at best: every iteration decodes all rows (``big``'s step over ``rows``, a
      decoding row's share) and each request's prompt tokens cost the cheapest token cost: ``new``
      tokens per (``new - 1``) x step / rows + ``prompt`` x token cost of machine time.
    - The p99 bound: the streams need ``rows x prompt / (new - 1)`` prompt tokens an iteration on
      average; an iteration carrying them costs at least ``big`` + that many tokens' cost."""
    if big not in med or "decode-1" not in med:
        return None
    per_token = {}
    for k, v in med.items():
        parts = k.split()  # "chunk T @P" and "one call T @P"
        if k.startswith("chunk "):
            per_token[k] = v / int(parts[1])
        elif k.startswith("one call ") and "decode alone" in med:
            per_token[k + " minus the step alone"] = (v - med["decode alone"]) / int(parts[2])
    if not per_token:
        return None
    cheapest = min(per_token, key=per_token.get)
    token_ms = per_token[cheapest]
    whole = f"chunk {prompt} @0"
    prefill_ms = med.get(whole, token_ms * prompt)
    one_s = ((new - 1) * med["decode-1"] + prefill_ms) / 1e3
    many_s = ((new - 1) * med[big] / rows + prompt * token_ms) / 1e3
    need = rows * prompt / (new - 1)
    return {"prompt_token_ms": token_ms, "cheapest": cheapest, "one_stream_tok_s": new / one_s,
            "one_stream_prefill": whole if whole in med else "cheapest token cost x prompt",
            "rate_ratio": one_s / many_s, "prompt_tokens_per_iteration": need,
            "iteration_steps": (med[big] + need * token_ms) / med["decode-1"]}


def _iterations(model, args, vocab: int, rng, need: int) -> dict:
    """``one call T @P`` / ``two calls T @P``: callables timing one engine iteration (--rows decoding
    rows and a chunk of T prompt tokens after P cached ones) as the combined call and as two calls,
    on one engine whose chunk is rolled back after each (its columns unmarked, its ``filled`` reset)."""
    from tessera.runtime.serving.engine import Engine, Request, _Sequence

    e = Engine(model, max_batch=args.rows + 1, max_queue=1, prefill_chunk=max(256, args.prompt))
    if not e.combined:
        print("  (this model has no combined call: one-call cases left out)")
    for _ in range(args.rows):
        e.submit(Request(rng.integers(1, vocab, args.prompt).tolist(), need))
    while any(s.prefilling for s in e.rows) or e.queued:
        e.step()
    longest = max(args.past) + max(args.chunks) + 1
    e.submit(Request(rng.integers(1, vocab, longest).tolist(), 1))
    seq = _Sequence(e.waiting.popleft(), len(e.rows), e.vocab)  # admitted by hand: its prefill is timed below
    e.slots[seq.slot] = 0
    e.rows.append(seq)

    def iteration(t: int, p0: int, one: bool):
        def run() -> float:
            seq.filled = p0
            e.slots[seq.slot, p0:] = 0
            start = time.perf_counter()
            if one:
                e._combined_step(seq, t)
            else:
                e._prefill_chunk(seq, t)
                e._decode_step()
            return time.perf_counter() - start
        return run

    if max(args.past) > 0:  # the row's first max(past) columns, once: every case reads its first p0
        seq.filled = 0
        e._prefill_chunk(seq, max(args.past))
    def decode_alone() -> float:  # this engine's own decoding step, the chunk row left out: the unit
        start = time.perf_counter()
        e._decode_step()
        return time.perf_counter() - start

    cases = {"decode alone": decode_alone}
    for p0 in args.past:
        for t in args.chunks:
            for one in ((True, False) if e.combined else (False,)):
                cases[f"{'one call' if one else 'two calls'} {t} @{p0}"] = iteration(t, p0, one)
    for run in cases.values():
        run()  # warm-up of each shape
    return cases


if __name__ == "__main__":
    main()
