"""One decoding step of attention (T = 1 query against P cached positions), three lowerings.

    python bench/decode_attention.py                         # P = 128 512 1024 2048, 2 threads
    python bench/decode_attention.py --p 1024 --threads 1 --rounds 5

Why: the cached graph (compiler/passes/kv_cache.py) needs a kernel for the decode phase. The
candidates are the ones docs/generate.md names:

  cached   Tessera's lowering (backends/onnx/cached_attention.py): scores of the cache buffer and
           of the new column as two MatMuls (Kᵀ folded into the product), + additive mask, Softmax,
           two MatMuls with V; the runtime writes the new column into its numpy buffer.
  gqa      com.microsoft.GroupQueryAttention with the cache bound by IOBinding as both past and
           present (shared buffer: the kernel writes the new column in place), seqlens_k, and the
           padding mask as attention_bias.
  mha      com.microsoft.MultiHeadAttention with past_key/past_value (present = past + new, a new
           tensor each step: what "MHA with past" costs on CPU).

Every case: B = 1, 12 heads of 64 (GPT-2 small's attention), fp32, CPU provider, the same
random inputs; one step timed --repeat times after a warm-up, the cases alternating over the
rounds in one process (they share nothing but the process). Reported: min and median per step,
and CPU time over wall time. The outputs of the three are compared (max abs difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

H, HD = 12, 64
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "step", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def cached_model():
    """The cached lowering's step: q [1,H,1,hd], buffer K/V [1,H,C,hd], new k/v [1,H,1,hd], mask [1,1,1,C+1]."""
    scale = helper.make_tensor("scale", F, [], [1 / np.sqrt(HD)])
    n = [helper.make_node("Mul", ["q", "scale"], ["qs"]),
         helper.make_node("Transpose", ["kp"], ["kpt"], perm=[0, 1, 3, 2]),
         helper.make_node("Transpose", ["kn"], ["knt"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["qs", "kpt"], ["s_past"]),
         helper.make_node("MatMul", ["qs", "knt"], ["s_new"]),
         helper.make_node("Concat", ["s_past", "s_new"], ["s"], axis=-1),
         helper.make_node("Add", ["s", "bias"], ["sb"]),
         helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
         helper.make_node("Shape", ["kp"], ["np"], start=2, end=3),
         helper.make_node("Slice", ["p", "zero", "np", "three"], ["pp"]),
         helper.make_node("Slice", ["p", "np", "big", "three"], ["pn"]),
         helper.make_node("MatMul", ["pp", "vp"], ["op"]),
         helper.make_node("MatMul", ["pn", "vn"], ["on"]),
         helper.make_node("Add", ["op", "on"], ["o"])]
    consts = [scale, helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
              helper.make_tensor("three", TensorProto.INT64, [1], [3]),
              helper.make_tensor("big", TensorProto.INT64, [1], [2 ** 62])]
    ins = [_vi("q", F, [1, H, 1, HD]), _vi("kp", F, [1, H, "C", HD]), _vi("vp", F, [1, H, "C", HD]),
           _vi("kn", F, [1, H, 1, HD]), _vi("vn", F, [1, H, 1, HD]), _vi("bias", F, [1, 1, 1, "C1"])]
    return _model(n, ins, [_vi("o", F, None)], consts)


def gqa_model():
    n = [helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "", "", "",
                                                  "bias"], ["o", "presk", "presv"], domain="com.microsoft",
                          num_heads=H, kv_num_heads=H)]
    ins = [_vi("q", F, [1, 1, H * HD]), _vi("k", F, [1, 1, H * HD]), _vi("v", F, [1, 1, H * HD]),
           _vi("pk", F, [1, H, "C", HD]), _vi("pv", F, [1, H, "C", HD]),
           _vi("seqlens_k", TensorProto.INT32, [1]), _vi("total", TensorProto.INT32, []),
           _vi("bias", F, [1, 1, 1, "C"])]
    return _model(n, ins, [_vi("o", F, None), _vi("presk", F, None), _vi("presv", F, None)])


def mha_model():
    n = [helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "bias", "pk", "pv"], ["o", "presk", "presv"],
                          domain="com.microsoft", num_heads=H)]
    ins = [_vi("q", F, [1, 1, H * HD]), _vi("k", F, [1, 1, H * HD]), _vi("v", F, [1, 1, H * HD]),
           _vi("bias", F, [1, 1, 1, "T"]), _vi("pk", F, [1, H, "P", HD]), _vi("pv", F, [1, H, "P", HD])]
    return _model(n, ins, [_vi("o", F, None), _vi("presk", F, None), _vi("presv", F, None)])


def session(model, threads):
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads, o.log_severity_level = threads, 1, 3
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, nargs="*", default=[128, 512, 1024, 2048], help="cached positions")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=200, help="steps timed per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sess = {"cached": session(cached_model(), args.threads), "gqa": session(gqa_model(), args.threads),
            "mha": session(mha_model(), args.threads)}
    print(f"B=1, {H} heads of {HD}, T=1, fp32, {args.threads} threads, {os.cpu_count()} cores; "
          f"{args.rounds} rounds x {args.repeat} steps, cases alternating")
    print("| P | case | ms/step min | ms/step median | CPU/wall | max abs diff vs cached |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for p in args.p:
        cap = p + 64  # the buffer holds more slots than are filled; the rest are masked
        kbuf = np.zeros((1, H, cap, HD), np.float32)
        vbuf = np.zeros_like(kbuf)
        kbuf[:, :, :p] = rng.standard_normal((1, H, p, HD))
        vbuf[:, :, :p] = rng.standard_normal((1, H, p, HD))
        q, k, v = (rng.standard_normal((1, H, 1, HD)).astype(np.float32) for _ in range(3))
        flat = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(1, 1, H * HD))  # noqa: E731
        neg = np.finfo(np.float32).min
        bias_cached = np.full((1, 1, 1, cap + 1), neg, np.float32)
        bias_cached[..., :p] = 0
        bias_cached[..., -1] = 0
        # gqa: the new column goes into slot p of the shared buffer; slots past p+1 are beyond total
        k_o, v_o = ort.OrtValue.ortvalue_from_numpy(kbuf.copy()), ort.OrtValue.ortvalue_from_numpy(vbuf.copy())
        bias_gqa = np.zeros((1, 1, 1, cap), np.float32)

        def run_cached():
            return sess["cached"].run(["o"], {"q": q, "kp": kbuf, "vp": vbuf, "kn": k, "vn": v, "bias": bias_cached})[0]

        # The binding is made once, as a decoding loop would keep it: the buffers stay bound as past
        # and present, q/k/v arrive in GroupQueryAttention's [B, 1, H*hd] layout (a graph's
        # projections give them so), and each step binds its inputs and runs. (Until 2026-12-02 this
        # case built a new binding, transposed q/k/v and copied the output in every timed step, which
        # made it look 1.5-3x slower than it is.)
        q3, k3, v3 = flat(q), flat(k), flat(v)
        seqlens, total, bias_p = np.array([p], np.int32), np.array(p + 1, np.int32), bias_gqa[..., :p + 1].copy()
        o_gqa = np.empty((1, 1, H * HD), np.float32)
        io = sess["gqa"].io_binding()
        io.bind_ortvalue_input("pk", k_o), io.bind_ortvalue_input("pv", v_o)
        io.bind_output("o", "cpu", 0, np.float32, list(o_gqa.shape), o_gqa.ctypes.data)
        io.bind_ortvalue_output("presk", k_o), io.bind_ortvalue_output("presv", v_o)

        def run_gqa():
            io.bind_cpu_input("q", q3), io.bind_cpu_input("k", k3), io.bind_cpu_input("v", v3)
            io.bind_cpu_input("seqlens_k", seqlens), io.bind_cpu_input("total", total), io.bind_cpu_input("bias", bias_p)
            sess["gqa"].run_with_iobinding(io)
            return o_gqa

        past_k, past_v = np.ascontiguousarray(kbuf[:, :, :p]), np.ascontiguousarray(vbuf[:, :, :p])
        bias_mha = np.zeros((1, 1, 1, p + 1), np.float32)

        def run_mha():
            return sess["mha"].run(["o"], {"q": flat(q), "k": flat(k), "v": flat(v), "bias": bias_mha,
                                           "pk": past_k, "pv": past_v})[0]

        ref = run_cached().transpose(0, 2, 1, 3).reshape(1, 1, H * HD)
        diffs = {"cached": 0.0, "gqa": float(np.abs(run_gqa() - ref).max()), "mha": float(np.abs(run_mha() - ref).max())}
        times = {c: [] for c in sess}
        cpu = {c: [0.0, 0.0] for c in sess}
        fns = {"cached": run_cached, "gqa": run_gqa, "mha": run_mha}
        for _ in range(args.rounds):
            for c, fn in fns.items():
                fn()
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    fn()
                    times[c].append(time.perf_counter() - t0)
                cpu[c][0] += time.process_time() - c0
                cpu[c][1] += time.perf_counter() - w0
        for c in fns:
            print(f"| {p} | {c} | {min(times[c]) * 1e3:.3f} | {statistics.median(times[c]) * 1e3:.3f} | "
                  f"{cpu[c][0] / cpu[c][1]:.2f} | {diffs[c]:.1e} |")


if __name__ == "__main__":
    main()
