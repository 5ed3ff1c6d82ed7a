"""``tessera report`` against the sequence length and batch: the report is closed-form in B and N,
so its time must not grow with them.

    flock /tmp/tessera-bench.lock python bench/report_scale.py
    python bench/report_scale.py --spec llama --repeat 5

Each (N, B) is timed in this one process after a warm-up report (imports and the device table
are paid once), as the median of --repeat runs of the command's main(); CPU time is given
with wall time so contention on a shared machine shows (a ratio well under 1 means waiting).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time

SIZES = [(1024, 1), (10**6, 1), (10**9, 1), (10**12, 1), (10**12, 10**8)]


def _once(spec: str, n: int, b: int) -> tuple[float, float]:
    from tessera.runtime.cli import main

    w0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["report", spec, "--seq", str(n), "--batch", str(b), "--format", "json"])
    if rc != 0:
        raise SystemExit(f"report {spec} --seq {n} --batch {b} failed with status {rc}")
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="gpt2", help="a bundled spec or .tsr file (default gpt2)")
    p.add_argument("--repeat", type=int, default=3, help="runs per size, the median is reported (default 3)")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    _once(args.spec, 1024, 1)
    rows = []
    for n, b in SIZES:
        runs = [_once(args.spec, n, b) for _ in range(args.repeat)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        rows.append({"spec": args.spec, "seq": n, "batch": b, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                     "cpu_over_wall": round(cpu / wall, 2)})
        print(f"{args.spec:8s} N={n:<14,d} B={b:<12,d} {wall:7.3f} s wall  {cpu:7.3f} s CPU  "
              f"(CPU/wall {cpu / wall:.2f})", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
