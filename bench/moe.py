"""Sparse experts against the dense moe block: a Mixtral-shaped model, the same seeded weights,
prefill of N tokens (B = 1) in onnxruntime on the CPU.

    python bench/moe.py                                   # d = 2048 (half of 8x7b's widths), 2 layers, N = 512
    python bench/moe.py --full                            # 8x7b's real widths, 2 layers (about 12 GB per case)
    python bench/moe.py --cases dense moe gather --n 128 512 --repeat 5 --json out/moe.json

Cases: ``dense`` (--no-sparse-moe: every expert on every token, unselected ones weighed by zero),
``gather`` (sparse, standard ops: TopK, Gather, ScatterND; what compile builds by default) and
``moe`` (sparse, onnxruntime's com.microsoft.MoE). Each case is compiled once to a file and opened in its own session; then the
runs alternate between the cases (one run of each per round), so drift on a noisy machine hits
them alike. Reported per case and N: wall time min and median, CPU time (process) min and median,
the largest logit difference against the dense case, and the MACs the report counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

HALF = {"layers": 2, "d": 2048, "heads": 16, "kv_heads": 4, "d_ff": 7168, "experts": 8, "top": 2}
TINY = {"layers": 2, "d": 256, "heads": 4, "kv_heads": 2, "d_ff": 512, "vocab": 1000}
FULL = {"layers": 2}  # the 8x7b variant's own widths: d 4096, d_ff 14336, 32 heads, 8 kv heads
CASES = ("dense", "gather", "moe")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="8x7b's real widths (d 4096, d_ff 14336) with 2 layers")
    p.add_argument("--tiny", action="store_true", help="a small model (d 256), to check the script")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--n", nargs="+", type=int, default=[512], help="prompt lengths (default 512)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per N (default 5)")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default, all cores)")
    p.add_argument("--decode", type=int, metavar="NEW", default=0,
                   help="instead of prefill: KV-cached greedy decoding of NEW tokens after a prompt of the first "
                        "--n tokens, per case (tokens/s of the decode steps, T = 1 each)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.decode:
        return decode(args)

    import onnxruntime as ort

    import tessera
    from tessera.compiler.passes.sparse_moe import SparseExperts

    sets = FULL if args.full else TINY if args.tiny else HALF
    print(f"model: mixtral 8x7b with {sets}; B = 1; onnxruntime {ort.__version__}, "
          f"threads {args.threads or os.cpu_count()} ({os.cpu_count()} cores)", flush=True)
    sessions = {}
    tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR"))
    m = tessera.load(ROOT / "models" / "mixtral.tsr", variant="8x7b", **sets)
    for case in args.cases:
        t0 = time.perf_counter()
        path = Path(tmp.name) / f"{case}.onnx"
        if case != "dense":  # the pipeline with its sparse-experts pass off, then the pass with this lowering
            built, meta = m._optimized(sparse_moe=False)
            SparseExperts(impl=case)(built.graph)
            from tessera.compiler.backends.onnx import export as onnx_export

            onnx_export.write(built.graph, m.weights, path, meta, verify=None)
        else:
            m.compile(path, sparse_moe=False, check=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        sessions[case] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        gc.collect()
        print(f"  {case}: compiled and opened in {time.perf_counter() - t0:.1f} s", flush=True)
    results = []
    rng = np.random.default_rng(0)
    for n in args.n:
        feeds = {"tokens": rng.integers(0, sets.get("vocab", 32000), (1, n)).astype(np.int64)}
        outs = {c: sessions[c].run(None, feeds)[0] for c in args.cases}  # warm-up, and the outputs compared
        wall = {c: [] for c in args.cases}
        cpu = {c: [] for c in args.cases}
        for _ in range(args.repeat):
            for c in args.cases:
                w0, c0 = time.perf_counter(), time.process_time()
                sessions[c].run(None, feeds)
                wall[c].append(time.perf_counter() - w0)
                cpu[c].append(time.process_time() - c0)
        ref = outs.get("dense")
        for c in args.cases:
            row = {"case": c, "n": n, "wall_min": min(wall[c]), "wall_median": statistics.median(wall[c]),
                   "cpu_min": min(cpu[c]), "cpu_median": statistics.median(cpu[c]),
                   "max_diff_vs_dense": float(np.abs(outs[c] - ref).max()) if ref is not None else None}
            results.append(row)
        base = next((r for r in results if r["n"] == n and r["case"] == "dense"), None)
        print(f"N = {n}:")
        for r in [r for r in results if r["n"] == n]:
            ratio = ""
            if base is not None and r["case"] != "dense":
                ratio = (f"  speed-up vs dense: {base['wall_min'] / r['wall_min']:.2f}x (min), "
                         f"{base['wall_median'] / r['wall_median']:.2f}x (median)")
            diff = "" if r["max_diff_vs_dense"] is None else f"  max |diff| vs dense {r['max_diff_vs_dense']:.2e}"
            print(f"  {r['case']:7s} wall {r['wall_min'] * 1e3:9.1f} ms min {r['wall_median'] * 1e3:9.1f} ms median"
                  f"  cpu {r['cpu_min'] * 1e3:9.1f} ms min {r['cpu_median'] * 1e3:9.1f} ms median{diff}{ratio}",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sets": sets, "threads": args.threads, "results": results}, indent=2))
    tmp.cleanup()
    return 0


def decode(args) -> int:
    """Greedy decoding with the KV cache, the cases alternating round by round."""
    import tessera
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes import sparse_moe
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

    sets = FULL if args.full else TINY if args.tiny else HALF
    m = tessera.load(ROOT / "models" / "mixtral.tsr", variant="8x7b", **sets)
    models = {}
    tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR"))
    for case in args.cases:
        sparse_moe.DEFAULT_IMPL = case if case != "dense" else "gather"  # the lowering of this case
        model, _ = compile_cached(m._fresh(), m.weights, sparse_moe=case != "dense")
        path = Path(tmp.name) / f"{case}.onnx"
        onnx_export.save(model, path)  # a file: more than 2 GB cannot be one serialised proto
        del model
        gc.collect()
        models[case] = CachedModel.from_onnx(path, threads=args.threads or None)
    prompt = [np.random.default_rng(0).integers(1, sets.get("vocab", 32000), args.n[0]).tolist()]
    rates = {c: [] for c in args.cases}
    tokens = {}
    for _ in range(args.repeat):
        for c in args.cases:
            r = generate(models[c], prompt, args.decode)
            rates[c].append(r.stats.decode_tokens_per_s)
            tokens[c] = r.tokens
    print(f"decode: prompt {args.n[0]}, {args.decode} new tokens, {args.repeat} rounds; {sets}")
    for c in args.cases:
        same = "" if c == "dense" else f"  same tokens as dense: {tokens[c] == tokens.get('dense', tokens[c])}"
        print(f"  {c:7s} {max(rates[c]):7.2f} tok/s best {statistics.median(rates[c]):7.2f} tok/s median{same}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
