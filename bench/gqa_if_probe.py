"""Probe: does GroupQueryAttention inside an ONNX If still write into a past/present buffer bound with
IOBinding to the If's outputs, and what does one decoding step of it cost?

    python bench/gqa_if_probe.py

Why: Tessera's cached attention is an If per layer (prefill: the tiled kernel; decode: plain ops,
backends/onnx/cached_attention.py). Its decode branch is about a dozen nodes per layer, which at
int4 costs a tenth of a step (docs/BENCHMARKS.md, "Where the int4 difference is");
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
runtime/generate.py ``BoundStep``).
"""
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP, helper


H, KV, HD, CAP = 12, 12, 64, 1024
def vi(n, t, s): return helper.make_tensor_value_info(n, t, s)
gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_len"],
                       ["o", "pk", "pv"], domain="com.microsoft", num_heads=H, kv_num_heads=KV, scale=0.125)
then_g = helper.make_graph([gqa], "then", [], [vi("o", TP.FLOAT, None), vi("pk", TP.FLOAT, None), vi("pv", TP.FLOAT, None)])
else_g = helper.make_graph([helper.make_node("Identity", ["q"], ["o2"]), helper.make_node("Identity", ["past_key"], ["pk2"]),
                            helper.make_node("Identity", ["past_value"], ["pv2"])], "else", [],
                           [vi("o2", TP.FLOAT, None), vi("pk2", TP.FLOAT, None), vi("pv2", TP.FLOAT, None)])
def model(use_if):
    nodes = [helper.make_node("If", ["cond"], ["out", "present_key", "present_value"], then_branch=then_g, else_branch=else_g)] if use_if else \
            [helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_len"],
                              ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=H, kv_num_heads=KV, scale=0.125)]
    ins = [vi("cond", TP.BOOL, []), vi("q", TP.FLOAT, [1, 1, H * HD]), vi("k", TP.FLOAT, [1, 1, KV * HD]), vi("v", TP.FLOAT, [1, 1, KV * HD]),
           vi("past_key", TP.FLOAT, [1, KV, CAP, HD]), vi("past_value", TP.FLOAT, [1, KV, CAP, HD]),
           vi("seqlens_k", TP.INT32, [1]), vi("total_len", TP.INT32, [])]
    if not use_if: ins = ins[1:]
    g = helper.make_graph(nodes, "g", ins, [vi("out", TP.FLOAT, None), vi("present_key", TP.FLOAT, None), vi("present_value", TP.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]); m.ir_version = 10
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
for use_if in (False, True):
    s = model(use_if)
    kb = np.zeros((1, KV, CAP, HD), np.float32); vb = np.zeros_like(kb)
    filled = 100
    kb[:, :, :filled] = rng.standard_normal((1, KV, filled, HD)); vb[:, :, :filled] = rng.standard_normal((1, KV, filled, HD))
    q, k, v = (rng.standard_normal((1, 1, H * HD)).astype(np.float32) for _ in range(3))
    b = s.io_binding()
    feeds = dict(q=q, k=k, v=v, past_key=kb, past_value=vb, seqlens_k=np.array([filled], np.int32), total_len=np.array(filled + 1, np.int32))
    if use_if: feeds["cond"] = np.array(True)
    for n, a in feeds.items(): b.bind_cpu_input(n, a)
    out = np.empty((1, 1, H * HD), np.float32)
    b.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    b.bind_output("present_key", "cpu", 0, np.float32, list(kb.shape), kb.ctypes.data)
    b.bind_output("present_value", "cpu", 0, np.float32, list(vb.shape), vb.ctypes.data)
    s.run_with_iobinding(b)
    wrote = np.allclose(kb[0, :, filled], k.reshape(KV, HD))
    # reference attention
    K = kb[0, :, :filled + 1]; V = vb[0, :, :filled + 1]; Q = q.reshape(H, 1, HD)
    sc = Q @ K.transpose(0, 2, 1) * 0.125; p = np.exp(sc - sc.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    ref = (p @ V).reshape(1, 1, H * HD)
    t = []
    for _ in range(300):
        t0 = time.perf_counter(); s.run_with_iobinding(b); t.append(time.perf_counter() - t0)
    print(f"if={use_if}: new column written into the bound buffer: {wrote}; output vs numpy {np.abs(out - ref).max():.1e}; step min {min(t)*1e6:.0f} median {statistics.median(t)*1e6:.0f} us (buffer {kb.nbytes/2**20:.1f} MiB)")
