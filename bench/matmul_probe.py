"""One fp32 MatMul, x [M, K] times a weight [K, N], as an onnxruntime CPU session at a thread count.

The benchmarks' measures of what this machine can do: bench/prefill.py's GEMM ceiling (M = 1024) and
bench/generate.py's memory bandwidth (a GEMV, M = 1, streams its weight once). Shared so that both
measure with the same session settings as the models they are compared with."""

from __future__ import annotations

import numpy as np


def matmul_session(w: np.ndarray, m: int, threads: int):
    """An onnxruntime session computing y = x @ w for x of shape [m, K] (input "x", output "y")."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10  # onnxruntime 1.31 loads IR versions up to 13; onnx 1.23 writes 14 by default
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
