"""The serving engine's aggregate decoding throughput in this checkout against another one (a commit
before a change), in-process, no HTTP: the same seeded model, the same concurrent requests, the same
threads, each checkout in a fresh child process, alternating, so a change to the engine's step (its
hot path) shows as a ratio rather than as one run's noise.

    python bench/engine_ab.py --root /path/to/old-root [--model small] [--streams 1 8] [--rounds 3]

``--root`` is a folder holding a ``tessera`` link to the other checkout's repository root (as
bench/startup.py takes it). Reported per stream count: tokens/s of each side per round, and the
min and median of (this / other); CPU time over wall time of each child, to see a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MODELS = {"small": ["layers=8", "d=512", "heads=8", "kv_heads=2", "d_ff=1536", "vocab=8000", "ctx=512"]}

CHILD = r"""
import json, sys, time
from tessera.runtime.serving import model as serving_model
from tessera.runtime.serving.engine import Engine, Request
from tessera.runtime.generation.sampling import Sampling
sets, streams, new, threads = json.loads(sys.argv[1])
m = serving_model.load("llama", sets=sets, threads=threads)
out = {}
for n in streams:
    e = Engine(m, max_batch=n, max_queue=8 * n, prefill_chunk=128)
    def run(k):
        hs = [e.submit(Request([(7 * i + j) % 1000 + 1 for j in range(48 + 16 * (i % 4))], new, Sampling()))
              for i in range(k)]
        while any(not h.finished for h in hs):
            e.step()
        return sum(len(h.tokens) for h in hs)
    run(n)  # warm-up
    t = time.perf_counter()
    tokens = run(6 * n)
    out[n] = tokens / (time.perf_counter() - t)
print(json.dumps(out))
"""


def child(root: str | None, sets, streams, new, threads) -> tuple[dict, float]:
    env = dict(os.environ, TESSERA_COMPILE_CACHE="off")
    env.pop("PYTHONPATH", None)
    if root:
        env["PYTHONPATH"] = root
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([sets, streams, new, threads])], env=env,
                          capture_output=True, text=True, cwd="/tmp")
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}, cpu / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="a folder holding a `tessera` link to the other checkout")
    ap.add_argument("--model", choices=list(MODELS), default="small")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    mine_root = tempfile.mkdtemp(prefix="tessera-ab-")  # this checkout, imported as tessera
    (Path(mine_root) / "tessera").symlink_to(HERE)
    rows = {n: {"this": [], "other": []} for n in a.streams}
    for r in range(a.rounds):
        for side, root in (("this", mine_root), ("other", a.root)) if r % 2 == 0 else \
                (("other", a.root), ("this", mine_root)):
            got, share = child(root, MODELS[a.model], a.streams, a.new, a.threads)
            print(f"round {r + 1} {side}: " + ", ".join(f"{n} streams {got[n]:.1f} tok/s" for n in a.streams)
                  + f" (CPU/wall {share:.2f})", flush=True)
            for n in a.streams:
                rows[n][side].append(got[n])
    for n in a.streams:
        ratios = [x / y for x, y in zip(rows[n]["this"], rows[n]["other"])]
        print(f"{n} streams: this/other min {min(ratios):.3f}, median {statistics.median(ratios):.3f} "
              f"(this {statistics.median(rows[n]['this']):.1f}, other {statistics.median(rows[n]['other']):.1f} tok/s)")


if __name__ == "__main__":
    main()
