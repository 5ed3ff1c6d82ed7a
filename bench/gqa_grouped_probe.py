"""onnxruntime's CPU GroupQueryAttention decoding step as compiled (H query heads, one token) against the same
step with each key/value head's queries as rows (KV heads, H/KV "tokens"), over caches read from memory.

    python bench/gqa_grouped_probe.py [--positions 1024,4096] [--threads 1] [--buffers 30] [--rounds 3]

Why (issue 40 item 2, docs/benchmarks/log.md "Why a decoding step at 4,096 positions costs what it does"):
onnxruntime 1.31's CPU kernel loops over the query heads, and for each it reads its key/value head's
whole cache (and, over an fp16 cache, converts it to fp32 into a scratch buffer) -- SmolLM2's 9 heads
over 3 key/value heads read and convert each cache 3 times. Given the heads of one key/value head as
the rows of one call (num_heads = kv_num_heads, sequence length H/KV), the kernel reads and converts
each cache once and multiplies H/KV rows at a time. What that form assumes, and this probe arranges:

- every row's rotary position is the token's (position_ids [1, H/KV], all the same);
- the kernel writes all H/KV rows' keys and values into the cache, at the new column and the H/KV - 1
  after it: the same key and value (rows repeated), so the new column is exact, and the buffer needs
  H/KV - 1 spare columns past it, which later steps overwrite before reading;
- rows after the first would see those spare columns through the causal rule (row j sees j more):
  attention_bias [1, 1, H/KV, total + H/KV - 1] hides them (the dtype's lowest value there);
- head_sink, smooth softmax and local windows are per head or per row: not taken (not used here).

Checked here on one call at 64 positions: the grouped output against the compiled form's (max |diff|,
rounding only: the products accumulate in another order) and the new key/value columns equal. Timed: each
configuration a fresh session cycling over --buffers caches of its own (a step's layers: read from
memory, not the last-level cache), alternating, --rounds times; min and median ms per call.
The step's graph is not rewritten by this probe: it measures what such a rewrite would give.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

H, KV, HD = 9, 3, 64  # SmolLM2-135M's attention
G = H // KV


def model(dt, heads: int, rows: int) -> bytes:
    """One GroupQueryAttention: packed q+k+v with do_rotary, past and present one buffer, attention_bias."""
    T = TP.FLOAT16 if dt == np.float16 else TP.FLOAT
    ins = [h.make_tensor_value_info('q', T, [1, rows, (heads + 2 * KV) * HD]),
           h.make_tensor_value_info('pk', T, [1, KV, None, HD]), h.make_tensor_value_info('pv', T, [1, KV, None, HD]),
           h.make_tensor_value_info('sl', TP.INT32, [1]), h.make_tensor_value_info('tl', TP.INT32, []),
           h.make_tensor_value_info('cos', T, [8192, HD // 2]), h.make_tensor_value_info('sin', T, [8192, HD // 2]),
           h.make_tensor_value_info('pos', TP.INT64, [1, rows]), h.make_tensor_value_info('bias', T, [1, 1, rows, None])]
    n = h.make_node('GroupQueryAttention', ['q', '', '', 'pk', 'pv', 'sl', 'tl', 'cos', 'sin', 'pos', 'bias'],
                    ['o', 'ok', 'ov'], domain='com.microsoft', num_heads=heads, kv_num_heads=KV, do_rotary=1,
                    scale=HD ** -0.5)
    outs = [h.make_tensor_value_info(x, T, None) for x in ('o', 'ok', 'ov')]
    m = h.make_model(h.make_graph([n], 'g', ins, outs),
                     opset_imports=[h.make_opsetid('', 17), h.make_opsetid('com.microsoft', 1)])
    m.ir_version = 10
    return m.SerializeToString()


def feeds(dt, form: str, qkv: np.ndarray, filled: int) -> dict:
    """The call's inputs for one token at position ``filled`` whose packed q+k+v is ``qkv`` [H*HD + 2*KV*HD]:
    as compiled ("heads") or grouped."""
    lowest = np.finfo(dt).min
    if form == "heads":
        return dict(q=qkv[None, None].astype(dt), sl=np.array([filled], np.int32), tl=np.array(filled + 1, np.int32),
                    pos=np.array([[filled]]), bias=np.zeros((1, 1, 1, filled + 1), dt))
    q = qkv[:H * HD].reshape(KV, G, HD).transpose(1, 0, 2).reshape(G, KV * HD)  # row j: head g*G + j of each g
    kv = np.repeat(qkv[None, H * HD:], G, axis=0)
    bias = np.zeros((1, 1, G, filled + G), dt)
    bias[..., filled + 1:] = lowest  # the spare columns the kernel writes for rows 1..G-1
    return dict(q=np.concatenate([q, kv], axis=1)[None].astype(dt), sl=np.array([filled + G - 1], np.int32),
                tl=np.array(filled + G, np.int32), pos=np.full((1, G), filled), bias=bias)


def run(session, f: dict, pk, pv, rope):
    io = session.io_binding()
    for k, v in {**f, "pk": pk, "pv": pv, **rope}.items():
        io.bind_cpu_input(k, v)
    io.bind_output('o')
    io.bind_ortvalue_output('ok', ort.OrtValue.ortvalue_from_numpy(pk))
    io.bind_ortvalue_output('ov', ort.OrtValue.ortvalue_from_numpy(pv))
    return io


def output(form: str, o: np.ndarray) -> np.ndarray:
    """The attention output [H*HD] in the compiled form's head order."""
    return o.reshape(-1) if form == "heads" else o.reshape(G, KV, HD).transpose(1, 0, 2).reshape(-1)


def check(dt) -> tuple[float, bool]:
    """(max |grouped - compiled| over the output, whether the new key and value columns are equal) for one
    call at 64 positions (filled 40)."""
    r = np.random.default_rng(0)
    S, filled = 64, 40
    qkv = r.standard_normal((H + 2 * KV) * HD).astype(np.float32)
    caches = [r.standard_normal((1, KV, S, HD)).astype(dt) for _ in range(2)]
    rope = dict(cos=r.standard_normal((8192, HD // 2)).astype(dt), sin=r.standard_normal((8192, HD // 2)).astype(dt))
    got = {}
    for form, heads, rows in (("heads", H, 1), ("grouped", KV, G)):
        s = ort.InferenceSession(model(dt, heads, rows), providers=['CPUExecutionProvider'])
        pk, pv = (c.copy() for c in caches)
        io = run(s, feeds(dt, form, qkv, filled), pk, pv, rope)
        s.run_with_iobinding(io)
        got[form] = (output(form, io.get_outputs()[0].numpy()), pk[0, :, filled].copy(), pv[0, :, filled].copy())
    a, b = got["heads"], got["grouped"]
    diff = float(np.abs(a[0].astype(np.float64) - b[0]).max())
    return diff, bool(np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2]))


def main(argv=None) -> dict:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--positions", default="1024,4096")
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--buffers", type=int, default=30, help="caches the calls cycle over (a step's layers)")
    a.add_argument("--rounds", type=int, default=3)
    o = a.parse_args(argv)
    for dt in (np.float32, np.float16):
        diff, cols = check(dt)
        print(f"check {np.dtype(dt).name}: max |grouped - compiled| {diff:.3g}; new key/value columns equal: {cols}")
    res: dict = {}
    for P in (int(x) for x in o.positions.split(",")):
        filled = P - G  # the grouped form's spare columns fit the buffer
        for _ in range(o.rounds):
            for dt in (np.float32, np.float16):
                for form, heads, rows in (("heads", H, 1), ("grouped", KV, G)):
                    so = ort.SessionOptions()
                    so.intra_op_num_threads = o.threads
                    so.log_severity_level = 4
                    s = ort.InferenceSession(model(dt, heads, rows), so, providers=['CPUExecutionProvider'])
                    r = np.random.default_rng(0)
                    rope = dict(cos=r.standard_normal((8192, HD // 2)).astype(dt),
                                sin=r.standard_normal((8192, HD // 2)).astype(dt))
                    f = feeds(dt, form, r.standard_normal((H + 2 * KV) * HD).astype(np.float32), filled)
                    keep = [(r.standard_normal((1, KV, P, HD)).astype(dt), r.standard_normal((1, KV, P, HD)).astype(dt))
                            for _ in range(o.buffers)]
                    ios = [run(s, f, pk, pv, rope) for pk, pv in keep]
                    for i in range(2 * o.buffers):
                        s.run_with_iobinding(ios[i % o.buffers])
                    ts = []
                    for i in range(max(40, 3 * o.buffers)):
                        t = time.perf_counter()
                        s.run_with_iobinding(ios[i % o.buffers])
                        ts.append(time.perf_counter() - t)
                    res.setdefault((P, np.dtype(dt).name, form), []).extend(ts)
    out = {}
    for (P, dt, form), ts in sorted(res.items()):
        out[f"{P} {dt} {form}"] = {"min_ms": 1e3 * min(ts), "median_ms": 1e3 * float(np.median(ts))}
        print(f"P={P} threads={o.threads} buffers={o.buffers} {dt:8s} {form:8s} min {1e3 * min(ts):.3f} "
              f"med {1e3 * np.median(ts):.3f} ms/call")
    return out


if __name__ == "__main__":
    main()
