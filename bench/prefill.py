"""Prefill (one forward pass over the prompt, full logits): Tessera against transformers eager and sdpa
on the same weights, and Tessera fused against --no-fuse; with the machine's GEMM ceiling.

    python bench/prefill.py                                   # N = 128 512 1024, every case, 3 rounds
    python bench/prefill.py --n 32 128 512 2048 --cases tessera unfused --rounds 3
    python bench/prefill.py --n 4096 --cases tessera unfused  # beyond 1024: --set ctx=N, Tessera only
    python bench/prefill.py --cases tessera o2 --optimum-python /path/to/venv/bin/python  # optimum's O2
    python bench/prefill.py --n 32 128 --cases tessera unfused --paired --threads 1  # under load: see below

GPT-2 small, fp32, B = 1, the whole model (12 layers and the 50,257-way head, logits for every
position). The weights are transformers' own seeded initialisation of GPT2LMHeadModel, saved once as
safetensors and read by every case. Cases:

  tessera           the default compile (auto kernels: on CPU, one block with no Loop while a site's
                    scores fit 4 MiB, else the tiled kernel)
  unfused           Tessera with --no-fuse (the primitive attention graph)
  portable          Tessera with --attention portable (the tiled Loop kernel at every length)
  hf-eager, hf-sdpa transformers' GPT2LMHeadModel with that attention implementation, torch.no_grad
  o2                optimum's export of the same checkpoint (`optimum-cli export onnx --task text-generation`:
                    no past) optimised by ORTOptimizer at O2 (onnxruntime's fused Attention,
                    SkipLayerNorm, FastGelu), run in onnxruntime like Tessera's file; optimum needs its own
                    environment (it pins an older transformers): --optimum-python exports it there once
                    (bench/optimum_peer.py, shared with bench/embeddings.py)
  ceiling           onnxruntime's MatMul at 1024×768×3072 (the MLP's first product at N = 1024):
                    the GEMM rate this machine reaches at this thread count

The ONNX cases (tessera, unfused, portable, o2) are compiled or exported beforehand, in another process,
and the timed process loads the file as `tessera run model.onnx` does: its peak resident set (the
kernel's high-water mark, VmHWM, loading included) is the "peak MiB" column, beside the resident set
before loading (the interpreter and its libraries: torch for the transformers cases).

Every case runs in its own process, the cases alternate (round 1: each case once, round 2: ...), all
at the same thread count (onnxruntime's intra-op threads, torch.set_num_threads). Each process times
--repeat runs after one warm-up; the table pools the runs of every round: minimum and median, CPU
time over wall time (how many cores were busy; well below --threads means the run did not get its
cores), and GFLOP/s from the minimum: the products that must be computed, 2·N·(the 123.5 M weights
of the linears and the head) + 12 layers · 2·2·768·N(N+1)/2 (causal: Q·Kᵀ and P·V over the visible
pairs); the ratio of that to the ceiling (its best run, measured once before the table and again in
every round, so it sees the same load) is the next column.

--paired (Tessera's ONNX cases only; for a loaded machine): one process per N loads every case's file
and alternates them run by run (A, B, A, B, ... --rounds × --repeat times each, after one warm-up
each), so neighbouring runs see the same load; it reports per case the minimum and median of the
wall time and of the CPU time (at --threads 1 onnxruntime computes on the calling thread, and the CPU
time is the work done, whatever else runs), and against the first case the median of the ratios of
neighbouring runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimum_peer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ("tessera", "unfused", "portable", "hf-eager", "hf-sdpa", "o2", "ceiling")
DEFAULT_CASES = ("tessera", "unfused", "hf-eager", "hf-sdpa", "ceiling")
TESSERA = {"tessera": "auto", "unfused": "unfused", "portable": "portable"}
VOCAB, D, LAYERS = 50257, 768, 12
LINEAR_WEIGHTS = LAYERS * (D * 3 * D + D * D + 2 * D * 4 * D) + D * VOCAB  # 123,532,032
CEILING = (1024, 768, 3072)


def useful_flops(n: int) -> int:
    return 2 * n * LINEAR_WEIGHTS + LAYERS * 2 * 2 * D * n * (n + 1) // 2


def _timed(fn, repeat: int) -> dict:
    fn()  # warm-up
    runs = []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        runs.append({"wall_s": wall, "cpu_s": time.process_time() - c0})
    return {"runs": runs}


def _tokens(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (1, n)).astype(np.int64)


def _memory_mib() -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the process's peak) from /proc/self/status, in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) / 1024
    return out


def tessera_file(folder: Path, attention: str, n: int) -> Path:
    """Compile GPT-2 small with `tessera compile` (once per kernel and context) into the weights folder."""
    ctx = max(n, 1024)
    path = folder / f"tessera-{attention}-{ctx}.onnx"
    if not path.exists():
        cmd = [sys.executable, "-m", "tessera.runtime.cli", "compile", str(ROOT / "models" / "gpt2.tsr"),
               "--variant", "small", "-o", str(path)]
        cmd += ["--no-fuse"] if attention == "unfused" else ["--attention", attention] if attention != "auto" else []
        cmd += ["--set", f"ctx={n}"] if n > 1024 else ["--weights", str(folder / "model.safetensors")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


def _session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_tessera(folder: Path, attention: str, n: int, repeat: int, threads: int) -> dict:
    from tessera.runtime.session import onnx_signature

    path = tessera_file(folder, attention, n)
    before = _memory_mib()
    onnx_signature(path)  # what `tessera run` reads before onnxruntime opens the file
    sess = _session(path, threads)
    feeds = {"tokens": _tokens(n)}
    res = _timed(lambda: sess.run(None, feeds), repeat)
    res["logits"] = sess.run(None, feeds)[0][0, -1, :8].tolist()
    return {**res, "rss_before_mib": before["VmRSS"], "peak_rss_mib": _memory_mib()["VmHWM"]}


def run_o2(folder: Path, n: int, repeat: int, threads: int) -> dict:
    before = _memory_mib()
    sess = _session(folder / "o2" / "model.onnx", threads)
    tokens = _tokens(n)
    given = {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    feeds = {i.name: given[i.name] for i in sess.get_inputs()}
    res = _timed(lambda: sess.run(["logits"], feeds), repeat)
    res["logits"] = sess.run(["logits"], feeds)[0][0, -1, :8].tolist()
    return {**res, "rss_before_mib": before["VmRSS"], "peak_rss_mib": _memory_mib()["VmHWM"]}


def run_hf(folder: Path, attn: str, n: int, repeat: int, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation=attn).eval()
    tokens = torch.from_numpy(_tokens(n))
    before = _memory_mib()
    with torch.no_grad():
        res = _timed(lambda: hf(tokens).logits, repeat)
        res["logits"] = hf(tokens).logits[0, -1, :8].tolist()
    return {**res, "rss_before_mib": before["VmRSS"], "peak_rss_mib": _memory_mib()["VmHWM"]}


def run_ceiling(repeat: int, threads: int) -> dict:
    from matmul_probe import matmul_session

    m, k, n = CEILING
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n), dtype=np.float32)
    sess = matmul_session(w, m, threads)
    x = rng.standard_normal((m, k), dtype=np.float32)
    return _timed(lambda: sess.run(None, {"x": x}), max(repeat, 20))


def run_paired(folder: Path, cases: list[str], n: int, runs: int, threads: int) -> dict:
    """Every case's session in this process, run in turn (A, B, A, B, ...): wall and CPU per run."""
    sessions = {c: _session(tessera_file(folder, TESSERA[c], n), threads) for c in cases}
    feeds = {"tokens": _tokens(n)}
    out = {c: [] for c in cases}
    for sess in sessions.values():
        sess.run(None, feeds)  # warm-up
    for _ in range(runs):
        for c, sess in sessions.items():
            c0, t0 = time.process_time(), time.perf_counter()
            sess.run(None, feeds)
            out[c].append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
    return {"runs": out}


def paired(args, folder: Path) -> dict:
    cases = [c for c in args.cases if c in TESSERA]
    if len(cases) < 2 or len(cases) != len(args.cases):
        sys.exit("--paired takes two or more of Tessera's cases (tessera, unfused, portable) and nothing else")
    print(f"paired: one process per N, the cases alternating run by run, {args.rounds * args.repeat} runs each, "
          f"threads {args.threads}; {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'N':>5} {'case':<9} {'wall min':>9} {'wall med':>9} {'CPU min':>8} {'CPU med':>8} {'CPU/wall':>8} "
          f"{'÷ first: wall (pairs med)':>25} {'CPU (pairs med)':>16} {'wall min':>9} {'CPU min':>8}")
    rows = []
    for n in args.n:
        cmd = [sys.executable, __file__, "--_paired", str(folder), str(n), str(args.rounds * args.repeat),
               str(args.threads), *cases]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if out.returncode:
            sys.exit(f"paired run at N = {n} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
        first = res[cases[0]]
        for c in cases:
            rs = res[c]
            wall, cpu = [r["wall_s"] for r in rs], [r["cpu_s"] for r in rs]
            pw = statistics.median(r["wall_s"] / f["wall_s"] for r, f in zip(rs, first))
            pc = statistics.median(r["cpu_s"] / f["cpu_s"] for r, f in zip(rs, first))
            mw = min(wall) / min(r["wall_s"] for r in first)
            mc = min(cpu) / min(r["cpu_s"] for r in first)
            busy = statistics.median(r["cpu_s"] / r["wall_s"] for r in rs)
            print(f"{n:>5} {c:<9} {min(wall) * 1e3:>9.1f} {statistics.median(wall) * 1e3:>9.1f} "
                  f"{min(cpu) * 1e3:>8.1f} {statistics.median(cpu) * 1e3:>8.1f} {busy:>8.2f} {pw:>25.3f} {pc:>16.3f} "
                  f"{mw:>9.3f} {mc:>8.3f}", flush=True)
            rows.append({"n": n, "case": c, "runs": len(rs), "wall_min_ms": min(wall) * 1e3,
                         "wall_median_ms": statistics.median(wall) * 1e3, "cpu_min_ms": min(cpu) * 1e3,
                         "cpu_median_ms": statistics.median(cpu) * 1e3, "cpu_wall": busy,
                         "pairs_wall_ratio_median": pw, "pairs_cpu_ratio_median": pc,
                         "wall_min_ratio": mw, "cpu_min_ratio": mc})
    return {"machine": platform.platform(), "threads": args.threads, "paired": True, "rows": rows}


def child(case: str, folder: str, n: int, repeat: int, threads: int) -> dict:
    folder = Path(folder)
    if case == "ceiling":
        res = run_ceiling(repeat, threads)
    elif case in TESSERA:
        res = run_tessera(folder, TESSERA[case], n, repeat, threads)
    elif case == "o2":
        res = run_o2(folder, n, repeat, threads)
    else:
        res = run_hf(folder, case.split("-", 1)[1], n, repeat, threads)
    res["case"] = case
    return res


def make_weights(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval().save_pretrained(folder, safe_serialization=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="*", default=[128, 512, 1024])
    p.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=CASES)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each case once per round)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per process, after one warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", metavar="DIR", help="a folder for (or with) the seeded checkpoint; default: temporary")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--optimum-python", metavar="PYTHON", help=optimum_peer.HELP + " (the o2 case)")
    p.add_argument("--paired", action="store_true",
                   help="Tessera's cases alternating run by run in one process per N (see above)")
    p.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--_paired", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if "o2" in args.cases and not args.optimum_python:
        p.error("the o2 case needs --optimum-python (an environment with optimum-onnx installed)")
    if args._paired:
        folder, n, runs, threads, *cases = args._paired
        print(json.dumps(run_paired(Path(folder), cases, int(n), int(runs), int(threads))))
        return
    if args._child:
        case, folder, n, repeat, threads = args._child
        print(json.dumps(child(case, folder, int(n), int(repeat), int(threads))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.weights or tmp)
        if not (folder / "model.safetensors").exists():
            make_weights(folder)
        if "o2" in args.cases:  # the checkpoint without past ("text-generation"), optimised at O2
            optimum_peer.export(args.optimum_python, folder, folder / "o2", "text-generation", "O2")
        for case in args.cases:  # compiled before any timing, so every round times the same files
            if case in TESSERA:
                for n in args.n:
                    tessera_file(folder, TESSERA[case], n)
        if args.paired:
            results = paired(args, folder)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
            return
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
              f"threads {args.threads}, rounds {args.rounds} × {args.repeat} runs")
        results = {"machine": platform.platform(), "threads": args.threads, "rows": []}
        ceiling, ceiling_runs = None, []
        cases = [c for c in args.cases if c != "ceiling"]
        with_ceiling = "ceiling" in args.cases
        if with_ceiling:  # once before the table (for its ratios), then in every round with the other cases
            ceiling_runs += _spawn(args, "ceiling", folder, 0)["runs"]
            ceiling = _gflops(ceiling_runs)[0]
        print(f"{'N':>5} {'case':<9} {'min ms':>9} {'median ms':>10} {'CPU/wall':>8} {'GFLOP/s':>8} "
              f"{'/ceiling':>8} {'this/tessera (min)':>18} {'peak MiB':>9} {'before':>7}")
        for n in args.n:
            pooled: dict[str, list] = {}
            for _ in range(args.rounds):
                for case in cases:
                    if case.startswith("hf") and n > 1024:
                        continue
                    pooled.setdefault(case, []).append(_spawn(args, case, folder, n))
                if with_ceiling:
                    ceiling_runs += _spawn(args, "ceiling", folder, 0)["runs"]
            if with_ceiling:
                ceiling = _gflops(ceiling_runs)[0]
            base = None
            for case, rs in pooled.items():
                runs = [r for x in rs for r in x["runs"]]
                best = min(r["wall_s"] for r in runs)
                med = statistics.median(r["wall_s"] for r in runs)
                cpu = statistics.median(r["cpu_s"] / r["wall_s"] for r in runs)
                gf = useful_flops(n) / best / 1e9
                base = best if case == "tessera" else base
                rel = f"{best / base:.2f}x" if base else ""
                ratio = f"{gf / ceiling:.2f}" if ceiling else ""
                peak = max(x["peak_rss_mib"] for x in rs)
                before = statistics.median(x["rss_before_mib"] for x in rs)
                print(f"{n:>5} {case:<9} {best * 1e3:>9.1f} {med * 1e3:>10.1f} {cpu:>8.2f} {gf:>8.1f} {ratio:>8} "
                      f"{rel:>18} {peak:>9.0f} {before:>7.0f}", flush=True)
                results["rows"].append({"n": n, "case": case, "min_ms": best * 1e3, "median_ms": med * 1e3,
                                        "cpu_wall": cpu, "gflops": gf, "runs": len(runs),
                                        "peak_rss_mib": peak, "rss_before_mib": before,
                                        "logits": rs[0].get("logits")})
            ref = pooled.get("tessera", [{}])[0].get("logits")
            for case, rs in pooled.items():
                if ref and case != "tessera" and rs[0].get("logits"):  # same weights, same numbers
                    diff = float(np.max(np.abs(np.array(rs[0]["logits"]) - np.array(ref))))
                    print(f"{'':>5} {case}: last position's first 8 logits within {diff:.1e} of tessera's")
        if with_ceiling:
            best, med = _gflops(ceiling_runs)
            cpu = statistics.median(r["cpu_s"] / r["wall_s"] for r in ceiling_runs)
            m, k, n = CEILING
            print(f"GEMM ceiling (onnxruntime MatMul {m}×{k}×{n}, {len(ceiling_runs)} runs in the same rounds): "
                  f"{best:.1f} GFLOP/s best, {med:.1f} median, CPU/wall {cpu:.2f}")
            results["ceiling"] = {"gflops_best": best, "gflops_median": med, "cpu_wall": cpu}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))


def _gflops(runs: list[dict]) -> tuple[float, float]:
    """GFLOP/s of the ceiling's product: from the fastest run and the median run."""
    m, k, n = CEILING
    flops = 2 * m * k * n
    return flops / min(r["wall_s"] for r in runs) / 1e9, flops / statistics.median(r["wall_s"] for r in runs) / 1e9


def _spawn(args, case: str, folder: Path, n: int) -> dict:
    cmd = [sys.executable, __file__, "--_child", case, str(folder), str(n), str(args.repeat), str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode:
        sys.exit(f"{case} at N = {n} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
