"""Does onnxruntime's CPU GroupQueryAttention decode over an int8 KV cache, and how close to fp32?

    python bench/kv_int8_probe.py

Why (issue 40 item 2, `--kv-cache-dtype int8`): the schema of com.microsoft GroupQueryAttention in
onnxruntime 1.31 types past_key/past_value as T_CACHE (float, float16, bfloat16, int8, uint8,
float8e4m3fn) with k_scale / v_scale inputs and k_quant_type / v_quant_type attributes. This builds
one GQA node (4 query heads, 2 key/value heads, head size 64, one new token over P cached positions)
with an fp32 cache and with an int8 cache quantised per tensor and per channel (scales [1, kv, 1, hd],
max |x| / 127 of the cached values), runs both on the CPU provider and prints the attention output's
largest absolute difference to fp32 (relative to the output's largest magnitude), and the new
column the kernel wrote into the int8 cache against the same quantisation done in numpy.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

H, KV, D = 4, 2, 64


def session(cache_type, quant: str | None, scale_shape):
    attrs = {"num_heads": H, "kv_num_heads": KV}
    inputs = ["q", "k", "v", "pk", "pv", "sl", "tl"]
    if quant:
        attrs.update(k_quant_type=quant, v_quant_type=quant, kv_cache_bit_width=8)
        inputs += ["", "", "", "", "", "ks", "vs"]
    node = h.make_node("GroupQueryAttention", inputs, ["o", "prk", "prv"], domain="com.microsoft", **attrs)
    vi = [h.make_tensor_value_info("q", TP.FLOAT, [1, 1, H * D]), h.make_tensor_value_info("k", TP.FLOAT, [1, 1, KV * D]),
          h.make_tensor_value_info("v", TP.FLOAT, [1, 1, KV * D]),
          h.make_tensor_value_info("pk", cache_type, [1, KV, None, D]),
          h.make_tensor_value_info("pv", cache_type, [1, KV, None, D]),
          h.make_tensor_value_info("sl", TP.INT32, [1]), h.make_tensor_value_info("tl", TP.INT32, [])]
    if quant:
        vi += [h.make_tensor_value_info("ks", TP.FLOAT, scale_shape), h.make_tensor_value_info("vs", TP.FLOAT, scale_shape)]
    g = h.make_graph([node], "g", vi, [h.make_tensor_value_info("o", TP.FLOAT, None),
                                       h.make_tensor_value_info("prk", cache_type, None),
                                       h.make_tensor_value_info("prv", cache_type, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def main():
    rng = np.random.default_rng(0)
    for past in (128, 1024):
        q, k, v = (rng.standard_normal((1, 1, n * D)).astype(np.float32) for n in (H, KV, KV))
        pk, pv = (rng.standard_normal((1, KV, past + 1, D)).astype(np.float32) for _ in range(2))
        feeds = {"q": q, "k": k, "v": v, "sl": np.array([past], np.int32), "tl": np.array(past + 1, np.int32)}
        ref = session(TP.FLOAT, None, None).run(None, {**feeds, "pk": pk, "pv": pv})[0]
        for quant, axes in (("PER_TENSOR", None), ("PER_CHANNEL", (0, 2))):
            ks = np.abs(pk[:, :, :past]).max(axis=axes, keepdims=axes is not None).astype(np.float32) / 127
            vs = np.abs(pv[:, :, :past]).max(axis=axes, keepdims=axes is not None).astype(np.float32) / 127
            if axes is None:
                ks, vs = ks.reshape(1), vs.reshape(1)
            qk = np.clip(np.round(pk / ks), -127, 127).astype(np.int8)
            qv = np.clip(np.round(pv / vs), -127, 127).astype(np.int8)
            out, prk, _ = session(TP.INT8, quant, list(ks.shape)).run(
                None, {**feeds, "pk": qk, "pv": qv, "ks": ks, "vs": vs})
            want_new = np.clip(np.round(k.reshape(1, KV, 1, D) / ks), -127, 127)
            err = float(np.abs(out - ref).max() / np.abs(ref).max())
            col = int(np.abs(prk[:, :, past:past + 1].astype(np.int32) - want_new.astype(np.int32)).max())
            print(f"past {past:5d} {quant:12s}: output max |diff| / max |fp32| = {err:.4f}; new key column "
                  f"vs numpy's quantisation: max {col} step(s)")


if __name__ == "__main__":
    main()
