"""--quantize int4-asym: asymmetric int4 blocks with zero points and a per-block scale search
(compiler/reference/quant.py quantize_zp), the head at 8 bits under --quantize-head.

The zero points' layout against onnxruntime's MatMulNBits as its schema states it (element by
element here), the lowering against the interpreter, the fused q/k/v of the cached decoder, and the
quantiser's error against the symmetric int4's, on weights off any 4-bit grid and on weights on
one of its own (reproduced exactly, but for a few blocks).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import MODELS, build, cli, feeds_for
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.backends.onnx.bound_step import general_graph
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.ops import interpret
from tessera.compiler.reference import quant
from tessera.runtime.io.weights import SeededWeights

TINY = dict(layers=2, d=64, heads=4, vocab=1000, ctx=128)


def unpack_here(packed, scales, zeros, block, k):
    """MatMulNBits with 4-bit zero points, element by element: zero point of block b of row n in
    byte b // 2 of row n's zero points, low nibble for even b; value = (q - zp) * scale."""
    n, nb, blob = packed.shape
    w = np.zeros((n, nb * block), np.float64)
    for row in range(n):
        for b in range(nb):
            zbyte = int(zeros[row, b // 2])
            zp = zbyte & 0xF if b % 2 == 0 else zbyte >> 4
            for j in range(blob):
                byte = int(packed[row, b, j])
                for t, q in enumerate((byte & 0xF, byte >> 4)):
                    w[row, b * block + 2 * j + t] = (q - zp) * float(scales[row, b])
    return w[:, :k]


@pytest.mark.parametrize("k, block", [(64, 32), (96, 32), (80, 16)])
def test_zero_points_are_matmulnbits_layout(k, block, rng):
    n = 20
    w = rng.standard_normal((n, k)).astype(np.float32) + 0.5  # off-centre: the zero points matter
    packed, scales, zeros = quant.quantize_zp(w, 4, block)
    assert zeros.dtype == np.uint8 and zeros.shape == quant.zeros_shape(n, k, 4, block)
    here = unpack_here(packed, scales, zeros, block, k)
    np.testing.assert_allclose(quant.dequantize(packed, scales, 4, block, k, zeros), here, rtol=0, atol=1e-6)
    assert np.abs(here - w).max() <= np.repeat(scales, block, axis=1)[:, :k].max()  # within a step
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, n])],
                              [onnx.numpy_helper.from_array(packed, "B"), onnx.numpy_helper.from_array(scales, "scales"),
                               onnx.numpy_helper.from_array(zeros, "zp")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x.astype(np.float64) @ here.T, rtol=1e-4, atol=1e-4)


def test_the_search_beats_symmetric_int4_off_the_grid_and_reproduces_a_4bit_grid(rng):
    w = (rng.standard_normal((256, 576)) * 0.05).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 6  # outliers, as real weights have
    p, s = quant.quantize(w, 4, 32)
    sym = ((quant.dequantize(p, s, 4, 32, 576) - w) ** 2).mean()
    p, s, z = quant.quantize_zp(w, 4, 32, search=1)
    plain = ((quant.dequantize(p, s, 4, 32, 576, z) - w) ** 2).mean()
    p, s, z = quant.quantize_zp(w, 4, 32)
    grid = quant.dequantize(p, s, 4, 32, 576, z)
    searched = ((grid - w) ** 2).mean()
    assert searched < plain < sym and searched < 0.5 * sym  # measured: 0.43 of symmetric's error
    p, s, z = quant.quantize_zp(grid, 4, 32)  # weights on such a 4-bit grid come back as they are, but for
    again = quant.dequantize(p, s, 4, 32, 576, z)  # blocks an outlier spans unevenly (measured: 9 of 4,608)
    exact = (np.abs(again - grid).reshape(256, 18, 32).max(-1) <= 1e-6).mean()
    assert exact >= 0.99


@pytest.mark.parametrize("activations, tol", [("float", 1e-4), ("int8", 2e-2)])
def test_lowering_equals_the_interpreter(activations, tol, rng):
    graph = build("gpt2", **TINY)  # biases: the bias comes after the zero points
    weights = SeededWeights(graph, 0)
    result = QuantizeWeights(QuantConfig("int4-asym", 16, head=True, activations=activations))(graph)
    nodes = [n for n in graph.nodes.values() if n.op == "linear_nbits"]
    assert {n.attrs["zero_points"] for n in nodes} == {1} and len(nodes) == 13
    head = next(n for n in nodes if n.inputs[1].startswith("wte.weight"))
    assert head.attrs["bits"] == 8 and {n.attrs["bits"] for n in nodes if n is not head} == {4}
    assert all(n.quantized for n in result.notes if not n.embedding)
    # the token table at 8 bits with zero points (int4-asym's default), read by the interpreter and the gather
    (table,) = [n for n in graph.nodes.values() if n.op == "embedding_nbits"]
    assert table.attrs["zero_points"] == 1 and table.inputs[1] == head.inputs[1]
    feeds = feeds_for(graph, rng, b=2, t=9)
    want = interpret.run(graph, weights, feeds)["logits"]
    sess = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=tol, atol=tol)


def test_the_cached_decoder_fuses_qkv_with_their_zero_points(tmp_path, capsys):
    import tessera
    from tessera.runtime.generation import cached as gen

    m = tessera.load(MODELS / "llama.tsr", layers=2, d=64, heads=4, kv_heads=2, d_ff=96, vocab=300, ctx=64)
    files = m.compile(tmp_path / "dec.onnx", kv_cache=True, quantize="int4-asym", quantize_head=True)
    nodes = [n for n in general_graph(onnx.load(str(files[0]))).node if n.op_type == "MatMulNBits"]
    # per layer q+k+v, o, gate+up, down; and the head
    assert len(nodes) == 2 * 4 + 1 and all(len(n.input) >= 4 and n.input[3] for n in nodes)
    steps = list(gen.stream(gen.CachedModel.from_onnx(files[0]), [[5, 6, 7]], 4))
    assert len(steps) == 4
    rc, out, err = cli(capsys, "generate", MODELS / "llama.tsr", "--set", "layers=2", "--set", "d=64", "--set",
                       "heads=4", "--set", "kv_heads=2", "--set", "d_ff=96", "--set", "vocab=300", "--set", "ctx=64",
                       "--input", "tokens=[[5, 6, 7]]", "--max-new-tokens", 4, "--quantize", "int4-asym",
                       "--format", "json", "-q")
    assert rc == 0, err
    assert json.loads(out)["outputs"][0]["tokens"] == [s[0] for s in steps]


def test_the_report_counts_the_zero_points(capsys):
    sets = [f"--set={k}={v}" for k, v in TINY.items()]
    rc, out, err = cli(capsys, "report", MODELS / "gpt2.tsr", *sets, "--quantize", "int4-asym", "--format", "json")
    assert rc == 0, err
    q = json.loads(out)["quantization"]
    # 12 linears of 64 x 64 or 256: packed 4 bits, a scale (4 bytes) and half a zero point byte per block of 32;
    # and the tied head at 8 bits (the default), asymmetric too
    assert q["scheme"] == "int4-asym" and q["quantized_linears"] == 13 and q["head_bits"] == 8
