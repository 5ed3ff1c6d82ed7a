"""onnxruntime's CPU GroupQueryAttention decoding over an fp16 cache against fp32, the kernel alone.

    python bench/kv_fp16_gqa_probe.py [--positions 4096] [--rounds 3] [--threads 2] [--buffers 30]

Why (``--kv-cache-dtype fp16``, compiler/passes/kv_cache_dtype.py): the decoding step runs this kernel
in fp16 over the fp16 buffer. One com.microsoft.GroupQueryAttention node at SmolLM2-135M's shape (9 query
heads, 3 key/value heads, head 64), one new token over P cached positions, past and present bound to one
buffer (the new column written in place, as the engine binds them); with and without attention_bias
(the engine's CPU step has it), unpacked q/k/v and the packed q+k+v with do_rotary (cos/sin caches of
8,192 positions); fp32 and fp16 throughout (``f16``), and fp32 queries over an fp16 cache (``mixed``:
T float, T_CACHE float16, which the schema allows). Each configuration is a fresh session, the
configurations alternating, --rounds times; min and median ms per call over every call.

``--buffers N`` (default 1): the calls cycle over N caches of their own, as a decoding step's N layers
do. With one, the cache (6 MiB at 4,096 positions in fp32) stays in the CPU's last-level cache from call
to call, which a model's step never sees: SmolLM2's 30 layers hold 190 MB at 4,096 positions (fp32),
read from memory each step. ``--buffers 30`` measures the kernel as the step runs it.
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h


def model(dt, S, bias, rot, mixed=False, H=9, KV=3, hd=64):
    T = TP.FLOAT16 if dt == np.float16 else TP.FLOAT
    C = TP.FLOAT16 if mixed else T  # the cache's type
    ins = [h.make_tensor_value_info('q', T, [1, 1, (H+2*KV)*hd if rot else H*hd])]
    names = ['q', '', ''] if rot else ['q', 'k', 'v']
    if not rot:
        ins += [h.make_tensor_value_info('k', T, [1, 1, KV*hd]), h.make_tensor_value_info('v', T, [1, 1, KV*hd])]
    ins += [h.make_tensor_value_info('pk', C, [1, KV, S, hd]), h.make_tensor_value_info('pv', C, [1, KV, S, hd]),
           h.make_tensor_value_info('sl', TP.INT32, [1]), h.make_tensor_value_info('tl', TP.INT32, [])]
    names += ['pk', 'pv', 'sl', 'tl']
    attrs = dict(num_heads=H, kv_num_heads=KV)
    if rot:
        ins += [h.make_tensor_value_info('cos', T, [8192, hd//2]), h.make_tensor_value_info('sin', T, [8192, hd//2]), h.make_tensor_value_info('pos', TP.INT64, [1, 1])]
        names += ['cos', 'sin', 'pos']; attrs['do_rotary'] = 1
    else:
        names += ['', '', '']
    if bias:
        ins += [h.make_tensor_value_info('bias', T, [1, 1, 1, None])]; names += ['bias']
    outs = [h.make_tensor_value_info('o', T, None), h.make_tensor_value_info('ok', C, None), h.make_tensor_value_info('ov', C, None)]
    n = h.make_node('GroupQueryAttention', names, ['o','ok','ov'], domain='com.microsoft', **attrs)
    m = h.make_model(h.make_graph([n], 'g', ins, outs), opset_imports=[h.make_opsetid('', 17), h.make_opsetid('com.microsoft', 1)])
    m.ir_version = 10
    return m.SerializeToString()


def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--positions", type=int, default=4096)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--buffers", type=int, default=1, help="caches the calls cycle over (a step's layers)")
    a.add_argument("--only", choices=["packed-bias"], help="only the engine's CPU configuration")
    o = a.parse_args(argv)
    S = o.positions
    res = {}
    for _ in range(o.rounds):
        for bias in ((True,) if o.only else (False, True)):
            for rot in ((True,) if o.only else (False, True)):
                for dt, mixed in ((np.float32, False), (np.float16, False)) + (() if o.only else ((np.float32, True),)):
                    so = ort.SessionOptions()
                    so.intra_op_num_threads = o.threads
                    s = ort.InferenceSession(model(dt, S, bias, rot, mixed), so, providers=['CPUExecutionProvider'])
                    r = np.random.default_rng(0)
                    cdt = np.float16 if mixed else dt
                    feed = dict(q=r.standard_normal((1, 1, (576 + 384) if rot else 576)).astype(dt),
                                sl=np.array([S - 2], np.int32), tl=np.array(S - 1, np.int32))
                    if not rot:
                        feed.update(k=r.standard_normal((1, 1, 192)).astype(dt), v=r.standard_normal((1, 1, 192)).astype(dt))
                    else:
                        feed.update(cos=r.standard_normal((8192, 32)).astype(dt), sin=r.standard_normal((8192, 32)).astype(dt),
                                    pos=np.array([[S - 2]]))
                    if bias:
                        feed['bias'] = np.zeros((1, 1, 1, S - 1), dt)
                    ios = []
                    for _ in range(o.buffers):  # each its own cache, as each layer of a step
                        caches = {k: r.standard_normal((1, 3, S, 64)).astype(cdt) for k in ("pk", "pv")}
                        io = s.io_binding()
                        for k, v in {**feed, **caches}.items():
                            io.bind_cpu_input(k, v)
                        io.bind_output('o')
                        io.bind_ortvalue_output('ok', ort.OrtValue.ortvalue_from_numpy(caches['pk']))
                        io.bind_ortvalue_output('ov', ort.OrtValue.ortvalue_from_numpy(caches['pv']))
                        ios.append((io, caches))
                    for i in range(3 * o.buffers):
                        s.run_with_iobinding(ios[i % o.buffers][0])
                    ts = []
                    for i in range(max(40, 2 * o.buffers)):
                        t = time.perf_counter()
                        s.run_with_iobinding(ios[i % o.buffers][0])
                        ts.append(time.perf_counter() - t)
                    name = "mixed" if mixed else "f16" if dt == np.float16 else "f32"
                    res.setdefault((("bias" if bias else "no bias"), ("packed" if rot else "unpacked"), name), []).extend(ts)
    for k, ts in sorted(res.items()):
        print(f"P={S} buffers={o.buffers} threads={o.threads} {k[0]:8s} {k[1]:9s} {k[2]:6s} min {min(ts) * 1e3:.3f} med {np.median(ts) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
