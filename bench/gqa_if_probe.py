"""Probe: does GroupQueryAttention inside an ONNX If still write into a past/present buffer bound with
IOBinding to the If's outputs, and what does one decoding step of it cost?

    python bench/gqa_if_probe.py

Why: Tessera's cached attention is an If per layer (prefill: the tiled kernel; decode: plain ops,
backends/onnx/cached_attention.py). Its decode branch is about a dozen nodes per layer, which at
int4 costs a tenth of a step (docs/benchmarks/log.md, "Where the int4 difference is");
onnxruntime-genai's builder does the same work in one GroupQueryAttention over a shared buffer.
GroupQueryAttention shares the buffer only when past_key and present_key are the same memory
(bench/gqa_buffer_probe.py), and an If's outputs are allocated by the If, so whether the sharing
survives the If decides whether the decode branch can use it while the prefill branch keeps the
tiled kernel.

One layer (12 heads of 64, fp32, 2 threads), a buffer of 1024 positions with 100 filled, the new
token written at slot 100 (seqlens_k = 100, total_sequence_length = 101), the GQA node alone and
the same node as the then-branch of an If; the buffer bound as past and present. Checked: the new
key lands in the bound buffer, the output equals a numpy attention over the 101 positions, and the
step time (a copy of the 6 MiB buffer pair would take well over 100 us). On onnxruntime 1.31.1,
this session's AMD EPYC (2026-12-02), two runs: written in place both ways, output within 2.4e-7,
14-22 / 15-25 us alone and 15-23 / 16-26 us inside the If (min / median of 300 steps), against
0.040 / 0.058 ms for Tessera's decode branch alone at 128 positions (bench/decode_attention.py,
which timed GroupQueryAttention with a binding rebuilt every step until 2026-12-02). Tessera's decode
branch now does this (backends/onnx/cached_attention.py ``_lower_gqa_decode``; the loop's binding is
runtime/generation/cached.py ``BoundStep``).
"""
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP, helper

H, KV, HD, CAP = 12, 12, 64, 1024
GQA_INPUTS = ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_len"]


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def gqa(outputs):
    return helper.make_node("GroupQueryAttention", GQA_INPUTS, outputs, domain="com.microsoft",
                            num_heads=H, kv_num_heads=KV, scale=1 / np.sqrt(HD))


def session(inside_if: bool):
    """The GQA node alone, or as the then-branch of an If whose else-branch passes the past through."""
    outs = ["out", "present_key", "present_value"]
    if inside_if:
        then_g = helper.make_graph([gqa(["o", "pk", "pv"])], "then", [], [vi(n, TP.FLOAT, None) for n in ("o", "pk", "pv")])
        else_g = helper.make_graph([helper.make_node("Identity", [i], [o]) for i, o in
                                    (("q", "o2"), ("past_key", "pk2"), ("past_value", "pv2"))], "else", [],
                                   [vi(n, TP.FLOAT, None) for n in ("o2", "pk2", "pv2")])
        nodes = [helper.make_node("If", ["cond"], outs, then_branch=then_g, else_branch=else_g)]
    else:
        nodes = [gqa(outs)]
    inputs = [vi("q", TP.FLOAT, [1, 1, H * HD]), vi("k", TP.FLOAT, [1, 1, KV * HD]), vi("v", TP.FLOAT, [1, 1, KV * HD]),
              vi("past_key", TP.FLOAT, [1, KV, CAP, HD]), vi("past_value", TP.FLOAT, [1, KV, CAP, HD]),
              vi("seqlens_k", TP.INT32, [1]), vi("total_len", TP.INT32, [])]
    if inside_if:
        inputs.insert(0, vi("cond", TP.BOOL, []))
    g = helper.make_graph(nodes, "step", inputs, [vi(n, TP.FLOAT, None) for n in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.log_severity_level = 2, 3
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])


def main() -> None:
    rng = np.random.default_rng(0)
    filled = 100
    for inside_if in (False, True):
        s = session(inside_if)
        kb = np.zeros((1, KV, CAP, HD), np.float32)
        vb = np.zeros_like(kb)
        kb[:, :, :filled] = rng.standard_normal((1, KV, filled, HD))
        vb[:, :, :filled] = rng.standard_normal((1, KV, filled, HD))
        q, k, v = (rng.standard_normal((1, 1, H * HD)).astype(np.float32) for _ in range(3))
        feeds = {"q": q, "k": k, "v": v, "past_key": kb, "past_value": vb,
                 "seqlens_k": np.array([filled], np.int32), "total_len": np.array(filled + 1, np.int32)}
        if inside_if:
            feeds["cond"] = np.array(True)
        io = s.io_binding()
        for name, arr in feeds.items():
            io.bind_cpu_input(name, arr)
        out = np.empty((1, 1, H * HD), np.float32)
        io.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        io.bind_output("present_key", "cpu", 0, np.float32, list(kb.shape), kb.ctypes.data)  # the past's memory
        io.bind_output("present_value", "cpu", 0, np.float32, list(vb.shape), vb.ctypes.data)
        s.run_with_iobinding(io)
        in_place = np.allclose(kb[0, :, filled], k.reshape(KV, HD)) and np.allclose(vb[0, :, filled], v.reshape(KV, HD))
        keys, values = kb[0, :, :filled + 1], vb[0, :, :filled + 1]
        scores = q.reshape(H, 1, HD) @ keys.transpose(0, 2, 1) / np.sqrt(HD)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        ref = ((p / p.sum(-1, keepdims=True)) @ values).reshape(1, 1, H * HD)
        times = []
        for _ in range(300):  # the same step again: the new column lands in the same slot
            t0 = time.perf_counter()
            s.run_with_iobinding(io)
            times.append(time.perf_counter() - t0)
        print(f"{'inside an If' if inside_if else 'alone'}: new column written into the bound buffer: {in_place}; "
              f"output against numpy {np.abs(out - ref).max():.1e}; step min {min(times) * 1e6:.0f} "
              f"median {statistics.median(times) * 1e6:.0f} us (buffers {2 * kb.nbytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
