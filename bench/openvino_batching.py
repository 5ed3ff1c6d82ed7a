"""Many streams at once against OpenVINO GenAI's ContinuousBatchingPipeline on the same checkpoint (issue 40).

    python bench/openvino_batching.py FOLDER --ov-model OV_FOLDER --ov-python /work/venvs/ov/bin/python \
        --streams 16 --prompt 128 --new 64 --rounds 3 --threads 2 [--quantize int4 --ov-int4-model OV_INT4]

FOLDER is a Hugging Face checkpoint folder Tessera reads; OV_FOLDER the same checkpoint exported by optimum-intel
(bench/openvino_peer.py says how; ``--weight-format int4 --group-size 32`` for OV_INT4). Each case runs in a fresh
process, the cases alternating round by round, at ``--threads`` threads: ``--streams`` requests of ``--prompt``
token ids each (seeded, one per stream, the same ids for both) decoded greedily to ``--new`` tokens, end of sequence
ignored, submitted together:

- Tessera: the serving engine (runtime/serving/engine.py, the engine ``tessera serve`` and ``tessera batch`` run,
  its defaults: continuous batching, GroupQueryAttention decoding over the buffer cache), in process, no HTTP;
  ``--max-batch`` = the streams;
- OpenVINO: ``ContinuousBatchingPipeline.generate`` over the same ids (its paged attention; prefix caching off,
  as the prompts share nothing; ``INFERENCE_PRECISION_HINT`` f32 unless ``--ov-precision default``: its CPU plugin
  computes in bf16 on a CPU with AVX512-BF16 otherwise; Tessera computes in fp32).

Each process warms up with one short request, then submits all the streams and steps its engine in a loop of its own
(Tessera's ``Engine.step``, OpenVINO's ``add_request``/``step``/``read``), noting when each stream's tokens appear:
aggregate new tokens / wall seconds; time to first token (from the submission) and inter-token latency (between a
stream's successive tokens; tokens read in one step share a time) at p50 and p99. Reported per case: min and median
over the rounds, the ratio Tessera ÷ OpenVINO per round (> 1: Tessera faster), CPU/wall of each process, and how many
streams' greedy tokens agree (fp32 both: they should, up to near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_timed  # noqa: E402

OV_SCRIPT = r"""
import json, sys, time
import numpy as np, openvino as ov, openvino_genai as ovg
folder, threads, new, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
prompts = json.loads(sys.argv[4])
props = {"INFERENCE_NUM_THREADS": threads}
if precision != "default":
    props["INFERENCE_PRECISION_HINT"] = precision
sc = ovg.SchedulerConfig()
sc.cache_size = 1  # GB of KV blocks: room for every stream's whole sequence
sc.max_num_seqs = len(prompts)
sc.enable_prefix_caching = False
pipe = ovg.ContinuousBatchingPipeline(folder, sc, "CPU", props)
def config(n):
    c = ovg.GenerationConfig(); c.max_new_tokens = n; c.do_sample = False; c.ignore_eos = True
    return c
def run(ps, n):
    start = time.perf_counter()
    handles = [pipe.add_request(i, ov.Tensor(np.array([p], dtype=np.int64)), config(n)) for i, p in enumerate(ps)]
    tokens, stamps = [[] for _ in ps], [[] for _ in ps]
    while pipe.has_non_finished_requests():
        pipe.step()
        now = time.perf_counter() - start
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():
                    tokens[i].extend(int(t) for t in out.generated_ids)
                    stamps[i].extend([now] * len(out.generated_ids))
    return tokens, stamps, time.perf_counter() - start
run([prompts[0][:8]], 2)  # warm-up
tokens, stamps, wall = run(prompts, new)
print(json.dumps({"tokens": tokens, "stamps": stamps, "wall_s": wall}))
"""

TESSERA_SCRIPT = r"""
import json, sys, time
from tessera.runtime import driver
from tessera.runtime.options import EngineOptions
from tessera.runtime.serving.engine import Engine, Request
folder, threads, new, quantize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
prompts = json.loads(sys.argv[4])
kw = {} if quantize == "none" else {"quantize": quantize}
o = EngineOptions(spec=folder, threads=threads, max_batch=len(prompts), provider="cpu",
                  max_context=max(map(len, prompts)) + new + 8, **kw)
model = driver.serve_model(o.model, o)
eng = Engine(model, max_batch=len(prompts), capacity=o.max_context)
def run(ps, n):
    start = time.perf_counter()
    hs = [eng.submit(Request(list(p), n, ignore_eos=True)) for p in ps]
    stamps = [[] for _ in ps]
    while not all(h.finished for h in hs):
        eng.step()
        now = time.perf_counter() - start
        for i, h in enumerate(hs):
            stamps[i].extend([now] * (len(h.tokens) - len(stamps[i])))
    assert all(h.error is None for h in hs), [h.error for h in hs]
    return [list(h.tokens) for h in hs], stamps, time.perf_counter() - start
run([prompts[0][:8]], 2)  # warm-up
tokens, stamps, wall = run(prompts, new)
print(json.dumps({"tokens": tokens, "stamps": stamps, "wall_s": wall}))
"""


def timed(cmd: list[str]) -> tuple[dict, float]:
    """(the JSON the process printed last, its CPU time ÷ wall time)."""
    text, wall, cpu = run_timed(cmd)
    return json.loads(text[text.index("{"):text.rindex("}") + 1]), cpu / wall


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))] if xs else float("nan")


def stream_prompts(streams: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, length).tolist() for _ in range(streams)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--ov-model", required=True)
    p.add_argument("--ov-int4-model", help="the checkpoint exported at int4 (group 32): an int4 pair of cases")
    p.add_argument("--ov-python", required=True)
    p.add_argument("--ov-precision", default="f32", help="f32 (default), or 'default' for the plugin's own")
    p.add_argument("--quantize", default=None, help="Tessera's scheme for the int4 pair (e.g. int4)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152)
    a = p.parse_args()
    prompts = stream_prompts(a.streams, a.prompt, a.vocab)
    pairs = [("fp32", "none", a.ov_model)]
    if a.ov_int4_model and a.quantize:
        pairs.append(("int4", a.quantize, a.ov_int4_model))
    tessera_cmd = [sys.executable, "-c", TESSERA_SCRIPT]
    results = {}
    for rnd in range(a.rounds):
        for label, quantize, ov_model in pairs:
            for who in ("tessera", "openvino"):
                if who == "tessera":
                    res, cpu = timed(tessera_cmd + [a.folder, str(a.threads), str(a.new), json.dumps(prompts), quantize])
                else:
                    res, cpu = timed([a.ov_python, "-c", OV_SCRIPT, ov_model, str(a.threads), str(a.new),
                                      json.dumps(prompts), a.ov_precision])
                tps = a.streams * a.new / res["wall_s"]
                ttft = [st[0] * 1000 for st in res["stamps"]]
                itl = [(b - c) * 1000 for st in res["stamps"] for c, b in zip(st, st[1:])]
                r = {"tps": tps, "cpu": cpu, "tokens": res["tokens"], "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99),
                     "itl50": pct(itl, 50), "itl99": pct(itl, 99)}
                results.setdefault((label, who), []).append(r)
                print(f"round {rnd + 1} {label} {who}: {tps:.1f} tokens/s, TTFT p50/p99 {r['ttft50']:.0f}/"
                      f"{r['ttft99']:.0f} ms, ITL p50/p99 {r['itl50']:.1f}/{r['itl99']:.1f} ms (CPU/wall {cpu:.2f})",
                      flush=True)
    print(f"\n{a.streams} streams x {a.prompt} + {a.new} tokens, {a.threads} threads, {a.rounds} rounds alternating")
    for label, _, _ in pairs:
        t, o = results[(label, "tessera")], results[(label, "openvino")]
        ratios = [x["tps"] / y["tps"] for x, y in zip(t, o)]
        agree = sum(x == y for x, y in zip(t[-1]["tokens"], o[-1]["tokens"]))
        print(f"{label}: Tessera {min(x['tps'] for x in t):.1f} / {statistics.median(x['tps'] for x in t):.1f}, "
              f"OpenVINO {min(x['tps'] for x in o):.1f} / {statistics.median(x['tps'] for x in o):.1f} tokens/s "
              f"(min / median); Tessera ÷ OpenVINO min {min(ratios):.2f}, median {statistics.median(ratios):.2f}; "
              f"streams whose greedy tokens agree: {agree} of {a.streams}")
        for who, rs in (("Tessera", t), ("OpenVINO", o)):
            med = {k: statistics.median(x[k] for x in rs) for k in ("ttft50", "ttft99", "itl50", "itl99")}
            print(f"  {who}: TTFT p50 / p99 {med['ttft50']:.0f} / {med['ttft99']:.0f} ms, inter-token p50 / p99 "
                  f"{med['itl50']:.1f} / {med['itl99']:.1f} ms (medians over the rounds)")


if __name__ == "__main__":
    main()
