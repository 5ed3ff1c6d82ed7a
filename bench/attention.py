"""Benchmark causal attention lowerings: time and peak extra memory, each case in its own process.

    python bench/attention.py                      # all cases, N = 512 2048 8192 16384
    python bench/attention.py --n 2048 --repeat 5  # one length
    python bench/attention.py --n 32 128 512 2048 --cases unfused portable block auto --rounds 3

Cases (B=1, 12 heads of 64, causal unless --no-causal, fp32, CPU provider):
  unfused     the primitive graph: Q·Kᵀ, scale, causal mask, softmax, ·V (forms the N×N scores)
  gqa         Tessera's fused node lowered to com.microsoft.GroupQueryAttention
  mha         Tessera's fused node lowered to com.microsoft.MultiHeadAttention (non-causal only)
  portable    Tessera's fused node lowered to its own tiled Loop kernel (standard ONNX ops)
  block       Tessera's fused node as one block of plain MatMul/Softmax, no Loop
  auto        the default compile (CPU: an If on the length between block and portable)
  gqa-direct  onnxruntime's GroupQueryAttention alone, built by hand (the reference point)
  attention23 the standard opset-23 Attention op alone, built by hand (the exporter is at opset 21)

--rounds R runs the case list R times per length, alternating (each run a fresh process), and
pools the timed runs of a case. CPU/wall is the process's CPU time over wall time during the timed
runs: well below the thread count means the case did not get its cores (rerun it).

Each case runs in a fresh Python process: build the model, open the session, make the inputs,
record the resident set size and reset the peak counter, run once to warm up, then time --repeat
runs. "Extra" memory is the peak resident set over all runs minus the resident set before them.
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

from jsonout import write_json  # the bench folder: this script's own

SPEC = """
model Attention(heads = 12, hd = 64) {
  in q: f32[B, heads, T, hd]
  in k: f32[B, heads, T, hd]
  in v: f32[B, heads, T, hd]
  out y: f32[B, heads, T, hd]
  y = sdpa(q, k, v, causal=CAUSAL)
}
"""
CASES = ("unfused", "gqa", "mha", "portable", "block", "auto", "gqa-direct", "attention23")
DEFAULT_CASES = ("unfused", "gqa", "portable", "gqa-direct")
HEADS, HD = 12, 64


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _model_bytes(case: str, causal: bool = True) -> bytes:
    if case == "attention23":
        from onnx import TensorProto as TP
        from onnx import helper

        node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=int(causal), scale=HD ** -0.5)
        ins = [helper.make_tensor_value_info(n, TP.FLOAT, [1, HEADS, "T", HD]) for n in "qkv"]
        graph = helper.make_graph([node], "attention23", ins, [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = 10
        return model.SerializeToString()
    if case == "gqa-direct":
        from onnx import TensorProto as TP
        from onnx import helper

        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], ["y"],
                                domain="com.microsoft", num_heads=HEADS, kv_num_heads=HEADS)
        ins = [helper.make_tensor_value_info(n, TP.FLOAT, ["B", "T", HEADS * HD]) for n in "qkv"]
        ins += [helper.make_tensor_value_info("seqlens_k", TP.INT32, ["B"]),
                helper.make_tensor_value_info("total", TP.INT32, [])]
        graph = helper.make_graph([node], "gqa", ins, [helper.make_tensor_value_info("y", TP.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        return model.SerializeToString()
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.frontend.elaborate import elaborate
    from tessera.compiler.passes.pipeline import optimize
    from tessera.spec import load_program

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "attention.tsr"
        spec.write_text(SPEC.replace("CAUSAL", "true" if causal else "false"))
        graph, _ = elaborate(load_program(spec))
    optimize(graph, attention=case)
    return onnx_export.to_onnx(graph, {}).SerializeToString()


def run_case(case: str, n: int, repeat: int, causal: bool = True, threads: int = 0) -> dict:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(_model_bytes(case, causal), opts, providers=["CPUExecutionProvider"])
    if case == "gqa-direct":
        feeds = {x: rng.standard_normal((1, n, HEADS * HD), dtype=np.float32) for x in "qkv"}
        feeds["seqlens_k"] = np.array([n - 1], np.int32)
        feeds["total"] = np.array(n, np.int32)
    else:
        feeds = {x: rng.standard_normal((1, HEADS, n, HD), dtype=np.float32) for x in "qkv"}
    base = _rss_kib("VmRSS")  # session and inputs ready; nothing run yet
    reset = _reset_peak()
    sess.run(None, feeds)  # warm-up (counted in the peak: onnxruntime's arena grows here)
    times = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    cpu_wall = (time.process_time() - c0) / (time.perf_counter() - w0)
    peak = _rss_kib("VmHWM")
    return {"case": case, "n": n, "causal": causal, "min_s": min(times), "median_s": statistics.median(times),
            "runs": repeat, "times_s": times, "cpu_wall": cpu_wall,
            "extra_mib": max(0, peak - base) / 1024 if reset else None}


def _unfused_too_big(n: int) -> bool:
    score_bytes = HEADS * n * n * 4
    return score_bytes * 3 > 16 * 1024**3  # three live N×N tensors past 16 GiB would not fit this machine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="*", default=[512, 2048, 8192, 16384], help="sequence lengths")
    p.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=CASES)
    p.add_argument("--repeat", type=int, default=None, help="timed runs per case (default: 5, or 3 at N>=8192)")
    p.add_argument("--rounds", type=int, default=1, help="run the case list this many times per N, alternating")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal attention")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        case, n, repeat, causal, threads = args._child
        print(json.dumps(run_case(case, int(n), int(repeat), causal == "1", int(threads))))
        return
    results = []
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{'causal' if args.causal else 'non-causal'}")
    print(f"{'N':>6} {'case':<11} {'min ms':>9} {'median ms':>10} {'extra MiB':>10} {'CPU/wall':>9}")
    for n in args.n:
        pooled: dict[str, list] = {}
        for case in list(args.cases) * args.rounds:
            if case == "unfused" and _unfused_too_big(n):
                print(f"{n:>6} {case:<11} skipped: one N×N score tensor is {HEADS * n * n * 4 / 2**30:.1f} GiB")
                results.append({"case": case, "n": n, "skipped": True})
                continue
            repeat = args.repeat or (3 if n >= 8192 else 5 if n >= 512 else 50)
            proc = subprocess.run([sys.executable, __file__, "--_child", case, str(n), str(repeat),
                                   str(int(args.causal)), str(args.threads)], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{n:>6} {case:<11} failed: {proc.stderr.strip().splitlines()[-1:]}")
                results.append({"case": case, "n": n, "failed": proc.stderr[-500:]})
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            pooled.setdefault(case, []).append(r)
            extra = f"{r['extra_mib']:.0f}" if r["extra_mib"] is not None else "?"
            print(f"{n:>6} {case:<11} {r['min_s'] * 1e3:>9.3f} {r['median_s'] * 1e3:>10.3f} {extra:>10} "
                  f"{r['cpu_wall']:>9.2f}", flush=True)
        if args.rounds > 1:
            for case, rs in pooled.items():
                times = [t for r in rs for t in r["times_s"]]
                print(f"{n:>6} {case:<11} {min(times) * 1e3:>9.3f} {statistics.median(times) * 1e3:>10.3f} "
                      f"{'':>10} {'pooled':>9}", flush=True)
    if args.json:
        write_json(args.json, results, indent=2)


if __name__ == "__main__":
    main()
