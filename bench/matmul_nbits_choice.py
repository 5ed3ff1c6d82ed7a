"""Which kernel each of SmolLM2-135M's products should run: MatMulNBits at accuracy_level 0 (fp32
activations, the weights dequantised inside the kernel) against 4 (the activations quantised to int8
per block of 32), at 1 and 2 threads, one row (decoding) and 128 rows (a prompt); and the 8-bit head
in the other forms onnxruntime runs.

    python bench/matmul_nbits_choice.py                         # all shapes, M = 1 and 128, 1 and 2 threads
    python bench/matmul_nbits_choice.py --rows 1 --shapes head --rounds 9
    python bench/matmul_nbits_choice.py --no-zero-points        # symmetric blocks (int4, int8) instead

Why: at one row onnxruntime 1.31's MatMulNBits did not use the second thread for the two smaller
products of a layer, and the 8-bit head cost 2.5x the 4-bit one (docs/benchmarks/log.md, "int4 and
int8 against llama.cpp's Q4_0 and Q8_0"); the accuracy level is chosen per node when the model is
compiled (compiler/passes/quantize.py, stored_codes.py), so these figures decide it per product.

Shapes (N outputs x K inputs; SmolLM2-135M, hidden 576): qkv 960 x 576 (q, k, v fused), o 576 x 576,
gateup 3072 x 576 (fused), down 576 x 1536, head 49,152 x 576. Forms, each one onnxruntime session
holding one product (random codes and scales: the time does not depend on the values):

- ``fp32``: MatMul over the dequantised weight (what an unquantised linear runs);
- ``nbB-accA``: com.microsoft.MatMulNBits, B bits, block 32, accuracy_level A, with a zero point per
  block (``int4-asym``'s layout, and its 8-bit head's) unless --no-zero-points;
- head only, 8 bits: ``mitf-u8u8``: DynamicQuantizeLinear (one uint8 scale and zero point for the
  activations: at one row, the row's own) and MatMulIntegerToFloat over uint8 weights with zero point
  128 and a scale per output (the u8 x u8 integer GEMM that ``--quantize w8a8`` runs: exact on AVX2
  without VNNI, where u8 x s8 saturates, bench/int8_gemm.py); ``dqmm-u8u8``: DynamicQuantizeMatMul, the
  same in one node.

Every form's output is checked against numpy written here: the fp32 forms and accuracy 0 against
x @ W^T of the weights dequantised in numpy (relative error ~1e-6 expected); accuracy 4 against the same
with x rounded to int8 per block of 32 (scale max|x| / 127) as well, and the integer forms against
their own quantisation of x; the largest error relative to the largest |y| is printed (``err``) beside
the time, and a form whose error against its own emulation passes 1e-3 is flagged WRONG.

Timing: the cases of a shape and row count alternate within each round (every form at 1 and 2
threads, one after the other); per round each takes 2 warm-up calls then --calls calls (fewer where
one call takes long: at most ~0.25 s a case a round); the round's figure is their median; reported:
min and median over rounds, in µs a call. Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonout import write_json  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gateup": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BLOCK = 32
WRONG = 1e-3  # error against a form's own emulation above which it is flagged


def _model(nodes, inits, k: int, n: int) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def codes(n: int, k: int, bits: int, zero_points: bool, rng) -> dict:
    """Random MatMulNBits codes (packed [N, blocks, 32 * bits / 8], low nibble first at 4 bits), scales,
    packed zero points (or None: the default 2^(bits-1)) and the weight they stand for, dequantised
    here in numpy: w = (q - zp) * scale."""
    nb = k // BLOCK
    q = rng.integers(0, 2 ** bits, (n, nb, BLOCK), dtype=np.uint8)
    scales = (rng.random((n, nb)) * 0.004 + 0.001).astype(np.float32)
    zp = rng.integers(0, 2 ** bits, (n, nb), dtype=np.uint8) if zero_points else np.full((n, nb), 2 ** (bits - 1), np.uint8)
    w = ((q.astype(np.float32) - zp[..., None]) * scales[..., None]).reshape(n, k)
    if bits == 4:
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        zpad = np.concatenate([zp, np.zeros((n, nb % 2), np.uint8)], axis=1)
        zpacked = zpad[:, 0::2] | (zpad[:, 1::2] << 4)
    else:
        packed, zpacked = q, zp
    return {"packed": np.ascontiguousarray(packed), "scales": scales, "zeros": zpacked if zero_points else None, "w": w}


def nbits_model(c: dict, n: int, k: int, bits: int, acc: int) -> bytes:
    inits = [numpy_helper.from_array(c["packed"], "b"), numpy_helper.from_array(c["scales"], "s")]
    inputs = ["x", "b", "s"]
    if c["zeros"] is not None:
        inits.append(numpy_helper.from_array(c["zeros"], "z"))
        inputs.append("z")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=BLOCK, accuracy_level=acc)
    return _model([node], inits, k, n)


def row_codes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] as uint8 codes with zero point 128 and one scale per output: [K, N] codes, [N] scales."""
    scale = np.maximum(np.abs(w).max(axis=1), 1e-30) / 127
    q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int16) + 128
    return np.ascontiguousarray(q.T.astype(np.uint8)), scale.astype(np.float32)


def integer_models(w: np.ndarray, k: int, n: int) -> tuple[dict, tuple]:
    q, s = row_codes(w)
    b = numpy_helper.from_array(q, "b")
    bs = numpy_helper.from_array(s, "bs")
    bz = numpy_helper.from_array(np.full((n,), 128, np.uint8), "bz")
    mitf = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
            helper.make_node("MatMulIntegerToFloat", ["xq", "b", "xs", "bs", "xz", "bz"], ["y"], domain="com.microsoft")]
    dqmm = [helper.make_node("DynamicQuantizeMatMul", ["x", "b", "bs", "bz"], ["y"], domain="com.microsoft")]
    return {"mitf-u8u8": _model(mitf, [b, bs, bz], k, n), "dqmm-u8u8": _model(dqmm, [b, bs, bz], k, n)}, (q, s)


def block_int8(x: np.ndarray) -> np.ndarray:
    """x rounded to int8 per block of 32 along K, scale max|x| / 127 (MatMulNBits' accuracy_level 4)."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK).astype(np.float64)
    scale = np.abs(xb).max(axis=-1, keepdims=True) / 127
    safe = np.where(scale == 0, 1, scale)
    return (np.clip(np.round(xb / safe), -127, 127) * scale).reshape(m, k)


def tensor_u8(x: np.ndarray) -> np.ndarray:
    """x through DynamicQuantizeLinear and back: one uint8 scale and zero point over the tensor."""
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((hi - lo) / 255)
    zp = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(x / scale) + zp, 0, 255)
    return ((q - zp) * np.float64(scale))


def err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def main() -> None:
    import onnxruntime as ort

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    p.add_argument("--bits", type=int, nargs="+", choices=[4, 8], default=[4, 8])
    p.add_argument("--acc", type=int, nargs="+", choices=[0, 4], default=[0, 4])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-zero-points", action="store_true", help="symmetric blocks (the default zero point)")
    p.add_argument("--no-fp32", action="store_true", help="leave out the fp32 MatMul")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    out = []
    print(f"µs a call, min / median over {args.rounds} rounds (each the median of up to {args.calls} calls); "
          f"err: largest |y - numpy| / largest |numpy| (fp32 reference; [own emulation])")
    for shape in args.shapes:
        n, k = SHAPES[shape]
        forms, refs = {}, {}
        for bits in args.bits:
            c = codes(n, k, bits, not args.no_zero_points, rng)
            if "w" not in refs:
                refs["w"] = c["w"]
            for acc in args.acc:
                forms[f"nb{bits}-acc{acc}"] = (nbits_model(c, n, k, bits, acc), c["w"], acc)
            if bits == 8 and shape == "head":
                for name, m in integer_models(c["w"], k, n)[0].items():
                    forms[name] = (m, c["w"], "u8")
        if not args.no_fp32:
            w = refs["w"]
            forms["fp32"] = (_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                                    [numpy_helper.from_array(np.ascontiguousarray(w.T), "w")], k, n), w, 0)
        sessions = {}
        for name, (model, _, _) in forms.items():
            for t in args.threads:
                o = ort.SessionOptions()
                o.intra_op_num_threads, o.inter_op_num_threads = t, 1
                sessions[name, t] = ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])
        for m in args.rows:
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            errs = {}
            for name, (_, w, kind) in forms.items():
                y = sessions[name, args.threads[0]].run(None, {"x": x})[0].astype(np.float64)
                ref = x.astype(np.float64) @ w.T.astype(np.float64)
                if kind == "u8":
                    q, s = row_codes(w)
                    wq = (q.astype(np.float64) - 128).T * s[:, None].astype(np.float64)
                    own = tensor_u8(x) @ wq.T
                elif kind == 4:
                    own = block_int8(x) @ w.T.astype(np.float64)
                else:
                    own = ref
                errs[name] = (err(y, ref), err(y, own))
            times = {key: [] for key in sessions}
            for _ in range(args.rounds):
                for key, sess in sessions.items():
                    for _ in range(2):
                        sess.run(None, {"x": x})
                    calls, start = [], time.perf_counter()
                    while len(calls) < args.calls and (len(calls) < 3 or time.perf_counter() - start < 0.25):
                        t = time.perf_counter()
                        sess.run(None, {"x": x})
                        calls.append(time.perf_counter() - t)
                    times[key].append(statistics.median(calls) * 1e6)
            print(f"{shape} {n} x {k}, M = {m}")
            for name in forms:
                cells = []
                for t in args.threads:
                    ts = times[name, t]
                    cells.append(f"{t}t {min(ts):9.1f} / {statistics.median(ts):9.1f}")
                    out.append({"shape": shape, "n": n, "k": k, "rows": m, "form": name, "threads": t,
                                "min_us": min(ts), "median_us": statistics.median(ts), "rounds_us": ts,
                                "err_fp32": errs[name][0], "err_own": errs[name][1]})
                e = errs[name]
                flag = "  WRONG" if e[1] > WRONG else ""
                print(f"  {name:10s} " + "   ".join(cells) + f"   err {e[0]:.1e} [{e[1]:.1e}]{flag}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
