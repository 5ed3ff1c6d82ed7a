"""One linear's product on this CPU, by kernel and by rows: why `--quantize w8a8` exists.

    python bench/int8_gemm.py                       # [M, 768] x [768, 3072], M = 1 16 64 128, 2 threads
    python bench/int8_gemm.py --rows 1 8 16 32 --k 768 --n 768 --rounds 9

Each case is one onnxruntime session holding one product over the same shapes (the weights random:
the time does not depend on the values), timed in alternating rounds (the median of --calls calls a
round; reported: the min over rounds, and per row):

- ``fp32``: MatMul (what an unquantised linear runs);
- ``nbits8``, ``nbits4``: com.microsoft.MatMulNBits, 8 and 4 bits, block 32, accuracy_level 4 (int8
  activations per block inside the kernel): ``--quantize int8`` / ``int4``, and onnxruntime-genai's
  ``-p int8`` / ``-p int4``;
- ``w8a8``: what Tessera lowers ``--quantize w8a8``'s linear to (compiler/backends/onnx/lowerings/
  linalg.py, built here by the exporter from a one-linear spec): each row quantised with its own
  scale, MatMulIntegerToFloat (u8 x u8 integer GEMM: exact on AVX2 without VNNI, where u8 x s8 saturates), the row scale;
- ``dqmm``: com.microsoft.DynamicQuantizeMatMul (one activation scale for the whole tensor: as fast,
  but a row's result then depends on the other rows, which is why w8a8 does not use it).

Not a timed test: the figures depend on the machine (VNNI, AMX) and what else runs on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jsonout import write_json  # noqa: E402


def _model(nodes, inits, k: int, n: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _w8a8(k: int, n: int) -> bytes:
    """Tessera's own export of one w8a8 linear (no bias, the output head quantised)."""
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.quantize import QuantizeWeights
    from tessera.runtime import pipeline
    from tessera.runtime.io.weights import SeededWeights

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "one.tsr"
        spec.write_text(f"model One(k = {k}, n = {n}) {{\n  in x: f32[B, k]\n  out y: f32[B, n]\n"
                        f"  y = linear(x, n, bias=false, name=\"proj\")\n}}\n")
        built = pipeline.build(spec, None, [])
    weights = SeededWeights(built.graph, 0)
    QuantizeWeights(pipeline.quant_config("w8a8", head=True))(built.graph)
    return onnx_export.to_bytes(built.graph, weights)


def models(k: int, n: int) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), "w")
    out = {"fp32": _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [w], k, n).SerializeToString()}
    for bits in (8, 4):
        packed = numpy_helper.from_array(rng.integers(0, 255, (n, k // 32, 32 * bits // 8), dtype=np.uint8), "b")
        scales = numpy_helper.from_array((rng.random((n, k // 32)) * 0.01).astype(np.float32), "s")
        node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=32, accuracy_level=4)
        out[f"nbits{bits}"] = _model([node], [packed, scales], k, n).SerializeToString()
    out["w8a8"] = _w8a8(k, n)
    q = numpy_helper.from_array(rng.integers(-127, 127, (k, n), dtype=np.int8), "b")
    s = numpy_helper.from_array(np.full((n,), 0.001, np.float32), "s")
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "b", "s"], ["y"], domain="com.microsoft")
    out["dqmm"] = _model([node], [q, s], k, n).SerializeToString()
    return out


def main() -> None:
    import onnxruntime as ort

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls per case and round (their median is the round's)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    sessions = {name: ort.InferenceSession(m, opts, providers=["CPUExecutionProvider"])
                for name, m in models(args.k, args.n).items()}
    rows = []
    print(f"[M, {args.k}] x [{args.k}, {args.n}], {args.threads} threads, min over {args.rounds} rounds of the median "
          f"of {args.calls} calls; ms (µs per row)")
    for m in args.rows:
        x = np.random.default_rng(m).standard_normal((m, args.k)).astype(np.float32)
        times = {name: [] for name in sessions}
        for _ in range(args.rounds):
            for name, sess in sessions.items():
                for _ in range(3):
                    sess.run(None, {"x": x})
                calls = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    sess.run(None, {"x": x})
                    calls.append(time.perf_counter() - t)
                times[name].append(statistics.median(calls) * 1e3)
        best = {name: min(t) for name, t in times.items()}
        rows.append({"rows": m, **{f"{name}_ms": v for name, v in best.items()}})
        print(f"M={m:<4} " + "  ".join(f"{name} {v:.3f} ({v / m * 1e3:.1f})" for name, v in best.items())
              + f"  | fp32 / w8a8 {best['fp32'] / best['w8a8']:.2f}, nbits8 / w8a8 {best['nbits8'] / best['w8a8']:.2f}")
    if args.json:
        write_json(args.json, rows, indent=1)


if __name__ == "__main__":
    main()
