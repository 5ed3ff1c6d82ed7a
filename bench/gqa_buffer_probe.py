"""Probe: does onnxruntime's CPU GroupQueryAttention write into a shared past/present buffer?

    python bench/gqa_buffer_probe.py

One GroupQueryAttention node (4 heads over 2 key/value heads, head size 8), a cache buffer of
16 positions bound with IOBinding as both past_key and present_key (and the same for values),
seqlens_k = filled + T - 1 and total_sequence_length = 16. A prefill of 5 tokens and two steps of
1: after each, the rows of the buffer that hold data and whether the new keys landed in place.
On onnxruntime 1.31.1 (CPU) they do: the kernel shares the buffer when the two are the same
memory, so a GQA lowering could decode without per-step copies too. It addresses each row's
cache from slot 0 by its length (no attention mask), which is why Tessera's left-padded batches
use their own buffer mode instead (docs/generate.md).
"""
import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto
B, H, G, hd, MAX = 1, 4, 2, 8, 16
node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"], ["o", "presk", "presv"],
                        domain="com.microsoft", num_heads=H, kv_num_heads=G)
F = TensorProto.FLOAT
g = helper.make_graph([node], "g", [helper.make_tensor_value_info("q", F, [B, "T", H*hd]), helper.make_tensor_value_info("k", F, [B, "T", G*hd]),
    helper.make_tensor_value_info("v", F, [B, "T", G*hd]), helper.make_tensor_value_info("pk", F, [B, G, "P", hd]),
    helper.make_tensor_value_info("pv", F, [B, G, "P", hd]), helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
    helper.make_tensor_value_info("total", TensorProto.INT32, [])],
    [helper.make_tensor_value_info("o", F, None), helper.make_tensor_value_info("presk", F, None), helper.make_tensor_value_info("presv", F, None)])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]); m.ir_version = 10
sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
pk = np.zeros((B, G, MAX, hd), np.float32); pv = np.zeros_like(pk)
pk_o, pv_o = ort.OrtValue.ortvalue_from_numpy(pk), ort.OrtValue.ortvalue_from_numpy(pv)
filled = 0
for T in (5, 1, 1):
    q = rng.standard_normal((B, T, H*hd)).astype(np.float32); k = rng.standard_normal((B, T, G*hd)).astype(np.float32); v = rng.standard_normal((B, T, G*hd)).astype(np.float32)
    io = sess.io_binding()
    for n, a in (("q", q), ("k", k), ("v", v)): io.bind_cpu_input(n, a)
    io.bind_ortvalue_input("pk", pk_o); io.bind_ortvalue_input("pv", pv_o)
    io.bind_cpu_input("seqlens_k", np.array([filled + T - 1], np.int32)); io.bind_cpu_input("total", np.array(MAX, np.int32))
    io.bind_output("o", "cpu"); io.bind_ortvalue_output("presk", pk_o); io.bind_ortvalue_output("presv", pv_o)
    try:
        sess.run_with_iobinding(io)
    except Exception as e:
        print("T", T, "failed:", str(e)[:300]); break
    filled += T
    print("T", T, "buffer rows filled:", int((np.abs(pk).sum(-1) > 0).sum()), "expected", G * filled,
          "new k written in place:", np.allclose(pk[0, :, filled - T:filled], k.reshape(B, T, G, hd)[0].transpose(1, 0, 2)))
