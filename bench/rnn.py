"""Benchmark the recurrent encoder of RNNsearch: onnx's GRU op against the Scan lowering against PyTorch.

    flock /tmp/tessera-bench.lock python bench/rnn.py                  # T = 50 and 500
    flock /tmp/tessera-bench.lock python bench/rnn.py --t 50 --repeat 20 --threads 1

The encoder is the paper's: a bidirectional GRU, 620 inputs, 1000 hidden units per direction
(``bidirectional(x, 1000)`` of spec/stdlib/nn.tsr), fp32 on onnxruntime's CPU provider, B = 1.
Cases, all with the same weights and input:
  onnx-gru   Tessera's scans lowered to onnx's GRU op (the default, --recurrence auto)
  scan       the same scans lowered to ONNX Scan over the step body (--recurrence scan)
  torch      torch.nn.GRU(bidirectional=True, batch_first=True) under torch.inference_mode()

The cases alternate within each round (one run of each per round, after one warm-up run of each),
so drift of a shared machine hits them alike. Per case: min and median wall time, and the process
CPU time of the same runs (CPU / wall > 1 means more than one thread worked). Both runtimes get the
same thread count (--threads). Outputs are compared before timing (max abs difference printed).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


SPEC = """
model Encoder(d = 620, n = 1000) {
  in x: f32[B, T, d]
  out h: f32[B, T, 2 * n]
  h = bidirectional(x, n, name="enc")
}
"""
CASES = ("onnx-gru", "scan", "torch")


def _sessions(threads: int, seed: int = 0):
    import onnxruntime as ort
    import tempfile

    from tessera.compiler.backends.onnx import export
    from tessera.compiler.frontend.elaborate import elaborate
    from tessera.compiler.passes.pipeline import build_pipeline
    from tessera.runtime.io.weights import init_weights
    from tessera.spec import load_program

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "encoder.tsr"
        p.write_text(SPEC)
        graph, _ = elaborate(load_program(p))
    weights = init_weights(graph, seed)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sessions = {}
    for case, mode in (("onnx-gru", "auto"), ("scan", "scan")):
        g = graph.copy()
        build_pipeline(recurrence=mode)(g)
        sessions[case] = ort.InferenceSession(export.to_bytes(g, weights), opts, providers=["CPUExecutionProvider"])
    return sessions, weights


def _torch_gru(weights, threads: int):
    import torch

    torch.set_num_threads(threads)
    m = torch.nn.GRU(620, 1000, batch_first=True, bidirectional=True)
    sd = {}
    for suffix, seg in (("", "enc.fwd.cell"), ("_reverse", "enc.bwd.cell")):
        for a, b in (("weight_ih", "ih.weight"), ("bias_ih", "ih.bias"), ("weight_hh", "hh.weight"),
                     ("bias_hh", "hh.bias")):
            sd[f"{a}_l0{suffix}"] = torch.from_numpy(np.ascontiguousarray(weights[f"{seg}.{b}"]))
    m.load_state_dict(sd)
    return m.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", type=int, nargs="+", default=[50, 500], help="source lengths (default 50 500)")
    ap.add_argument("--repeat", type=int, default=10, help="timed rounds per length (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of both runtimes (default 1)")
    args = ap.parse_args()

    import torch

    sessions, weights = _sessions(args.threads)
    ref = _torch_gru(weights, args.threads)
    run = {
        "onnx-gru": lambda x: sessions["onnx-gru"].run(["h"], {"x": x})[0],
        "scan": lambda x: sessions["scan"].run(["h"], {"x": x})[0],
        "torch": lambda x: ref(torch.from_numpy(x))[0].numpy(),
    }
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
          f"onnxruntime threads {args.threads}, torch {torch.__version__}; bidirectional GRU 620 -> 2 x 1000, B = 1")
    print(f"{'T':>5} {'case':>9} {'min ms':>9} {'median ms':>10} {'cpu/wall':>9}  max |diff| vs torch")
    rng = np.random.default_rng(0)
    for t in args.t:
        x = rng.standard_normal((1, t, 620)).astype(np.float32)
        with torch.inference_mode():
            outs = {c: run[c](x) for c in CASES}  # warm-up and check
            wall = {c: [] for c in CASES}
            cpu = {c: [] for c in CASES}
            for _ in range(args.repeat):
                for c in CASES:
                    w0, c0 = time.perf_counter(), time.process_time()
                    run[c](x)
                    wall[c].append(time.perf_counter() - w0)
                    cpu[c].append(time.process_time() - c0)
        for c in CASES:
            diff = float(np.abs(outs[c] - outs["torch"]).max())
            ratio = sum(cpu[c]) / sum(wall[c])
            print(f"{t:>5} {c:>9} {min(wall[c]) * 1e3:>9.2f} {statistics.median(wall[c]) * 1e3:>10.2f} "
                  f"{ratio:>9.2f}  {diff:.1e}")


if __name__ == "__main__":
    main()
