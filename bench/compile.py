"""Time and peak memory of `tessera compile`, each run in its own process, the cases alternating.

    python bench/compile.py                          # GPT-2 small and a 2-layer llama2_7b, 3 rounds
    python bench/compile.py --cases gpt2_small --repeat 5 --json out/compile.json

Each run is the command a user types (python -m tessera.runtime.cli compile ...), writing a fresh
file (the previous output is deleted first, outside the timing). Reported per case: wall time of
the whole process (imports included) and of the compile itself (what the command prints), the
process's CPU time (user + system, from wait4) over wall time -- well under 1 with more cores than
runnable threads means the machine was busy with other work -- and its peak resident memory
(ru_maxrss) against the bytes of the model's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "gpt2_small": ["gpt2", "--variant", "small"],
    "llama2_7b_2layers": ["llama", "--variant", "llama2_7b", "--set", "layers=2"],
    "llama2_7b_8layers": ["llama", "--variant", "llama2_7b", "--set", "layers=8"],
}
DEFAULT = ["gpt2_small", "llama2_7b_2layers"]


def run_once(case: str, out: Path) -> dict:
    for f in (out, out.with_name(out.name + ".data")):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tessera.runtime.cli", "compile", *CASES[case], "-o", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed ({proc.returncode}): {stderr}")
    m = re.search(r"([\d,]+) parameters, ([\d.]+) MB, ([\d.]+) s", stdout)
    files = [out] + ([out.with_name(out.name + ".data")] if out.with_name(out.name + ".data").exists() else [])
    size = sum(f.stat().st_size for f in files)
    cpu = usage.ru_utime + usage.ru_stime
    return {"case": case, "wall_s": wall, "compile_s": float(m.group(3)), "cpu_s": cpu, "cpu_over_wall": cpu / wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "file_bytes": size,
            "rss_over_file": usage.ru_maxrss * 1024 / size}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        rs = [r for r in runs if r["case"] == case]
        col = lambda k: [r[k] for r in rs]  # noqa: E731
        out[case] = {"runs": len(rs), "file_bytes": rs[0]["file_bytes"],
                     "wall_min_s": min(col("wall_s")), "wall_median_s": statistics.median(col("wall_s")),
                     "compile_min_s": min(col("compile_s")), "compile_median_s": statistics.median(col("compile_s")),
                     "cpu_over_wall": [round(x, 2) for x in col("cpu_over_wall")],
                     "peak_rss_max_bytes": max(col("peak_rss_bytes")),
                     "rss_over_file_max": max(col("rss_over_file"))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=DEFAULT, choices=list(CASES))
    p.add_argument("--repeat", type=int, default=3, help="rounds; each round runs every case once (default 3)")
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench-compile"),
                   help="where the compiled files go (deleted at the end)")
    p.add_argument("--json", metavar="FILE", help="also write the runs and the summary as JSON")
    args = p.parse_args()
    folder = Path(args.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for r in range(args.repeat):
            for case in args.cases:
                res = run_once(case, folder / f"{case}.onnx")
                runs.append(res)
                print(f"round {r + 1} {case}: wall {res['wall_s']:.2f} s (compile {res['compile_s']:.1f} s), "
                      f"cpu/wall {res['cpu_over_wall']:.2f}, peak RSS {res['peak_rss_bytes'] / 1e6:,.0f} MB "
                      f"= {res['rss_over_file']:.2f}x the {res['file_bytes'] / 1e6:,.0f} MB written", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = summarise(runs)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                               "cpus": os.cpu_count(), "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
