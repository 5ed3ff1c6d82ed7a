"""Whole GPT-2 small forward pass, fused attention against unfused, each case in its own process.

    python bench/gpt2_forward.py                 # N = 1024 and 4096, B = 1
    python bench/gpt2_forward.py --n 1024 --repeat 5

GPT-2 small's learned position table has 1,024 rows; to run N = 4096 the model is built with
--set ctx=4096 (3.1 M more parameters, the same work per token otherwise). Weights are seeded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CASES = ("unfused", "auto", "portable")


def run_case(attention: str, n: int, repeat: int) -> dict:
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.frontend.elaborate import elaborate
    from tessera.compiler.passes.pipeline import optimize
    from tessera.runtime.weights import init_weights
    from tessera.spec import load_program

    graph, _ = elaborate(load_program(ROOT / "models" / "gpt2.tsr"), "small", {"ctx": max(1024, n)})
    optimize(graph, attention=attention)
    model = onnx_export.to_onnx(graph, init_weights(graph, 0)).SerializeToString()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    del model
    tokens = np.random.default_rng(0).integers(0, 50257, (1, n)).astype(np.int64)
    sess.run(None, {"tokens": tokens})
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, {"tokens": tokens})
        times.append(time.perf_counter() - t0)
    return {"attention": attention, "n": n, "min_s": min(times), "median_s": statistics.median(times), "runs": repeat}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        a, n, r = args._child
        print(json.dumps(run_case(a, int(n), int(r))))
        return
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'N':>6} {'attention':<10} {'min s':>8} {'median s':>9} {'unfused/this (median)':>22}")
    results = []
    for n in args.n:
        base = None
        for case in args.cases:
            proc = subprocess.run([sys.executable, __file__, "--_child", case, str(n), str(args.repeat)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{n:>6} {case:<10} failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            base = r["median_s"] if case == "unfused" else base
            ratio = f"{base / r['median_s']:.2f}x" if base else ""
            print(f"{n:>6} {case:<10} {r['min_s']:>8.3f} {r['median_s']:>9.3f} {ratio:>22}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
