"""The CUDA check for a lent GPU machine: fused GPT-2 small in fp16 on onnxruntime's CUDA provider,
checked against the CPU in fp32 and timed. One script, one run:

    python bench/cuda_check.py            # N = 1024, B = 1; exits 1 if the check fails

It compiles GPT-2 small twice from the same seed: fp32 for the CPU (attention fused for
--target cpu) and fp16 for CUDA (--target cuda --dtype fp16, so GroupQueryAttention's flash
kernel). The logits must agree within 1e-2 (max abs difference, fp16 against fp32); it then
times the CUDA run (min and median of 10 after warm-up) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def compiled(target: str, dtype: str) -> tuple[bytes, list]:
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.frontend.elaborate import elaborate
    from tessera.compiler.passes.pipeline import optimize
    from tessera.compiler.passes.attention_kernels import Target
    from tessera.runtime.io.weights import init_weights
    from tessera.spec import load_program

    graph, _ = elaborate(load_program(ROOT / "models" / "gpt2.tsr"), "small")
    weights = init_weights(graph, 0)
    sites = optimize(graph, Target(target, dtype), lower_precision=True)
    return onnx_export.to_onnx(graph, weights).SerializeToString(), sites


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--tolerance", type=float, default=1e-2)
    args = p.parse_args()
    import onnxruntime as ort

    tokens = np.random.default_rng(0).integers(0, 50257, (1, args.n)).astype(np.int64)
    cpu_model, _ = compiled("cpu", "fp32")
    cpu = ort.InferenceSession(cpu_model, providers=["CPUExecutionProvider"])
    want = cpu.run(None, {"tokens": tokens})[0]
    gpu_model, sites = compiled("cuda", "fp16")
    gpu = ort.InferenceSession(gpu_model, providers=["CUDAExecutionProvider"])
    if gpu.get_providers()[0] != "CUDAExecutionProvider":
        print(json.dumps({"ok": False, "error": "CUDA provider not active", "providers": gpu.get_providers()}))
        return 1
    got = gpu.run(None, {"tokens": tokens})[0]
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        gpu.run(None, {"tokens": tokens})
        times.append(time.perf_counter() - t0)
    diff = float(np.abs(got.astype(np.float32) - want).max())
    result = {"ok": diff <= args.tolerance, "max_abs_diff": diff, "n": args.n,
              "kernels": sorted({s.impl for s in sites if s.fused}),
              "cuda_min_ms": min(times) * 1e3, "cuda_median_ms": statistics.median(times) * 1e3,
              "device": ort.get_device()}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
