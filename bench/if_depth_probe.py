"""Probe: does onnxruntime prepack a MatMul's constant weight read from an outer scope when the MatMul
sits one, two or three Ifs deep?

    python bench/if_depth_probe.py [--rounds 3] [--threads 2]

Why: compiler/backends/onnx/bound_step.py puts a cached decoder's bound decoding step in a branch of
one top-level If, and its weights stay initializers of the main graph that the branch reads from the
outer scope; that only pays if onnxruntime still prepacks them there (MLAS packs a MatMul's constant
B once at load; an unpacked B is packed again on every call). The serving engine's combined call
(backends/onnx/mixed_attention.py) was tried as a branch of its own one level further down (the
general branch holding an If on the call's marker: combined call, else the general graph): its
MatMuls, now two Ifs deep, took twice as long (onnxruntime's profiler: 362 against 186 ms for the
same 61 MatMuls of a 65-token call, 2026-12-03), and the engine's tokens/s fell from 220 to 171.
This probe shows the cause alone.

One MatMul [64, 768] x [768, 3072] (fp32, the weight an initializer of the main graph), as the main
graph's node (depth 0) and as the then-branch of 1, 2, 3 nested Ifs (the else branches the same
MatMul); per depth and round the median of 30 calls after 3 warm-up calls, the depths alternating
within a round. Measured on onnxruntime 1.31.1, the Intel Xeon, 2 threads, 2026-12-03, two rounds:
depth 0 / 1 / 2 / 3 = 1.95 / 1.92 / 4.13 / 4.45 ms and 2.16 / 0.98 / 5.32 / 5.39 ms: from two Ifs
down the weight is packed on every call (2-5x the time). So a weight's readers may sit at most one
If below the initializer; bound_step.py keeps every branch that reads weights one level down.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

M, K, N = 64, 768, 3072


def _matmul(out: str):
    return helper.make_graph([helper.make_node("MatMul", ["x", "W"], [out])], f"{out}_graph", [],
                             [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])


def model(depth: int, weight: np.ndarray):
    """The MatMul ``depth`` Ifs down (each If's then-branch the next level, its else-branch a MatMul)."""
    g = _matmul("y0")
    for d in range(1, depth + 1):
        node = helper.make_node("If", ["c"], [f"y{d}"], then_branch=g, else_branch=_matmul(f"y{d}_else"))
        g = helper.make_graph([node], f"level{d}", [], [helper.make_tensor_value_info(f"y{d}", TensorProto.FLOAT, None)])
    graph = helper.make_graph(list(g.node), "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K]),
                                                      helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info(g.output[0].name, TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "W")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    feeds = {"x": rng.standard_normal((M, K)).astype(np.float32), "c": np.array(True)}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
    sessions = {d: ort.InferenceSession(model(d, weight).SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"]) for d in range(4)}
    want = feeds["x"] @ weight
    for d, s in sessions.items():  # every depth computes the product
        np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-3)
    print(f"onnxruntime {ort.__version__}, MatMul [{M}, {K}] x [{K}, {N}], {args.threads} threads: ms per call "
          "(median of 30) at depth 0 / 1 / 2 / 3")
    for r in range(args.rounds):
        times = {}
        for d in (range(4) if r % 2 == 0 else reversed(range(4))):
            s = sessions[d]
            for _ in range(3):
                s.run(None, feeds)
            ts = []
            for _ in range(30):
                start = time.perf_counter()
                s.run(None, feeds)
                ts.append(time.perf_counter() - start)
            times[d] = statistics.median(ts) * 1e3
        print(f"round {r}: " + " / ".join(f"{times[d]:.2f}" for d in range(4)))


if __name__ == "__main__":
    main()
