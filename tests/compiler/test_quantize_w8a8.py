"""The w8a8 scheme (--quantize w8a8): int8 weights with one scale per output row, each activation
row quantised to int8 at run time, the product in onnxruntime's integer GEMM. Checked against numpy
written here from the scheme's definition, row by row whatever the batch holds, against the
interpreter, against fp32, in files, the report and the command line's errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from conftest import MODELS, build, cli, cli_error, feeds_for
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.ops import interpret
from tessera.compiler.reference import quant
from tessera.runtime.io.weights import SeededWeights

TINY = dict(layers=2, d=64, heads=4, vocab=1000, ctx=128)
W8A8 = QuantConfig("w8a8", quant.ROWS)


def product_here(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x W^T in w8a8's arithmetic, written from its definition: W rounded per output row to int8
    (scale = max|w_row| / 127), each row of x likewise (scale = max|x_row| / 127), the integer
    product, times both scales. In float64."""
    ws = np.abs(w).max(axis=1) / 127
    wq = np.round(w / ws[:, None])
    xs = np.abs(x).max(axis=-1, keepdims=True) / 127
    xq = np.round(x / np.where(xs > 0, xs, 1))  # a row of zeros: zeros
    return (xq @ wq.T) * ws * xs


ONE_LINEAR = """model One(d = 64, n = 48) {
  in x: f32[B, T, d]
  out y: f32[B, T, n]
  y = linear(x, n, name="proj")
}
"""


def test_rows_round_within_half_a_step(rng):
    w = rng.standard_normal((48, 80)).astype(np.float32)
    q, scales = quant.quantize_rows(w)
    assert q.dtype == np.int8 and q.shape == (48, 80) and scales.shape == (48,)
    assert np.all(np.abs(q) <= 127) and np.all(np.abs(q).max(axis=1) == 127)
    np.testing.assert_allclose(scales, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.all(np.abs(q * scales[:, None] - w) <= scales[:, None] / 2 + 1e-6)


def test_the_exported_product_is_w8a8s_arithmetic_row_by_row(rng, tmp_path):
    """One linear (with a bias) through the pass and the ONNX lowering, on onnxruntime: x W^T + b as written above, and
    each row's result the same whatever the other rows of the batch hold (one scale per row: a
    request's tokens must not depend on what the serving engine runs beside it)."""
    spec = tmp_path / "one.tsr"
    spec.write_text(ONE_LINEAR)
    graph = build(str(spec))
    seeded = SeededWeights(graph, 0)
    weights = {path: np.asarray(seeded[path]) for path in graph.params}
    weights["proj.bias"] = rng.standard_normal(48).astype(np.float32)  # seeded biases are zeros
    QuantizeWeights(QuantConfig("w8a8", quant.ROWS, head=True))(graph)  # the one linear is the output
    assert [n.op for n in graph.nodes.values() if n.op.startswith("linear")] == ["linear_int8"]
    sess = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    x[1] *= 40  # rows of very different ranges in one batch
    x[2, 0] = 0  # and a row of zeros
    got = sess.run(None, {"x": x})[0]
    want = product_here(x.astype(np.float64), weights["proj.weight"].astype(np.float64)) + weights["proj.bias"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[2, 0], weights["proj.bias"], rtol=1e-6)  # a row of zeros: the bias alone
    for b in range(3):
        alone = sess.run(None, {"x": x[b:b + 1]})[0]
        np.testing.assert_array_equal(alone[0], got[b])
        for t in range(5):
            np.testing.assert_array_equal(sess.run(None, {"x": x[b:b + 1, t:t + 1]})[0][0, 0], got[b, t])
    # the interpreter's reference computes the same
    np.testing.assert_allclose(interpret.run(graph, weights, {"x": x})["y"], got, rtol=1e-6, atol=1e-6)


def test_the_pass_makes_int8_linears_with_a_scale_per_row():
    graph = build("gpt2", **TINY)
    result = QuantizeWeights(W8A8)(graph)
    kinds = [n.op for n in graph.nodes.values() if n.op in ("linear", "linear_int8", "linear_nbits")]
    assert kinds.count("linear") == 1 and kinds.count("linear_int8") == 12  # the tied head stays float
    p = graph.params["layers.0.mlp.fc.weight.w8a8_packed"]
    assert p.dtype == "i8" and p.shape == (256, 64)  # [out, in]; written [in, out] for the kernel
    assert graph.params["layers.0.mlp.fc.weight.w8a8_scales"].shape == (256,)
    assert sum(n.quantized for n in result.notes) == 12


def test_lowering_equals_the_interpreter(rng):
    """The interpreter computes the kernel's own arithmetic (compiler/reference/quant.py), so the two
    agree but for float rounding, which can move one activation across a rounding boundary in a
    later layer (one quantisation step there): the bound allows that."""
    graph = build("gpt2", **TINY)
    weights = SeededWeights(graph, 0)
    QuantizeWeights(QuantConfig("w8a8", quant.ROWS, head=True))(graph)
    feeds = feeds_for(graph, rng, b=2, t=9)
    want = interpret.run(graph, weights, feeds)["logits"]
    got = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_accuracy_against_fp32(rng):
    graph = build("gpt2", **TINY)
    weights = SeededWeights(graph, 0)
    feeds = {"tokens": rng.integers(0, 1000, (2, 33)).astype(np.int64)}
    ref = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    QuantizeWeights(W8A8)(graph)
    got = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    # measured on this seeded model over three draws of the tokens: max 0.010-0.012 (int8's MatMulNBits
    # 0.007-0.010), argmax agreement 0.97-0.98 (int8 0.97-1.0); the bounds leave room for the draw
    assert np.abs(got - ref).max() <= 0.04
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_the_file_holds_int8_weights_in_the_kernels_layout(capsys, tmp_path):
    sets = [f"--set={k}={v}" for k, v in TINY.items()]
    rc, _, err = cli(capsys, "compile", MODELS / "gpt2.tsr", *sets, "--quantize", "w8a8", "-o", tmp_path / "q.onnx")
    assert rc == 0, err
    model = onnx.load(str(tmp_path / "q.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    w = inits["layers.0.mlp.fc.weight.w8a8_packed"]
    assert w.data_type == TensorProto.INT8 and list(w.dims) == [64, 256]  # [K, N], as MatMulIntegerToFloat takes B
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph.node) == 12
    meta = {e.key: e.value for e in model.metadata_props}
    assert json.loads(meta["tessera.quantize"]) == {"scheme": "w8a8", "block_size": 0, "head": False,
                                                     "head_bits": 0, "embedding_bits": 0, "activations": "int8"}


def test_report_gives_the_w8a8_weight_bytes(capsys):
    rc, out, err = cli(capsys, "report", MODELS / "gpt2.tsr", "--variant", "small", "--quantize", "w8a8",
                       "--format", "json")
    assert rc == 0, err
    q = json.loads(out)["quantization"]
    # hand count: 12 layers of q, k, v, o (768x768), fc (3072x768), proj (768x3072), one byte each and
    # one fp32 scale per output row; everything else (embeddings, tied head, biases, norms) in fp32
    quantised = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    rows = 12 * (4 * 768 + 3072 + 768)
    rest = 124_439_808 - quantised
    assert q["weights_bytes"] == quantised + rows * 4 + rest * 4
    assert q["scheme"] == "w8a8" and q["granularity"] == "per row"
    rc, out, err = cli(capsys, "report", MODELS / "gpt2.tsr", "--variant", "small", "--quantize", "w8a8")
    assert rc == 0 and "Quantisation (w8a8, per row, head float, embedding float)" in out


@pytest.mark.parametrize("args, expected", [
    (["--quantize", "w8a8", "--quantize-block", "32"], "--quantize-block and --quantize-activations apply to int8"),
    (["--quantize", "w8a8", "--quantize-activations", "float"], "apply to int8 and int4"),
    (["--quantize", "w8a8", "--dtype", "fp16"], "--quantize w8a8 computes in fp32"),
    (["--quantize", "w8a8", "--target", "cuda"], "MatMulIntegerToFloat has no CUDA kernel"),
])
def test_bad_w8a8_options_are_clean_errors(capsys, tmp_path, args, expected):
    sets = [f"--set={k}={v}" for k, v in TINY.items()]
    assert expected in cli_error(capsys, "compile", MODELS / "gpt2.tsr", *sets, *args, "-o", tmp_path / "q.onnx")


def test_generate_with_w8a8_mostly_agrees_with_fp32_and_fuses_qkv(capsys, tmp_path):
    """The cached decoder with w8a8: q, k and v fused into one int8 linear (fuse_linears concatenates
    the int8 rows and their scales), greedy tokens before the first disagreement with fp32 >= 90 %."""
    sets = ["--set", "layers=2", "--set", "d=128", "--set", "heads=4", "--set", "vocab=500", "--set", "ctx=64"]
    prompts = "tokens=[[464, 68, 7, 12], [99, 3], [250, 251, 252, 253, 254, 255]]"

    def greedy(*extra):
        rc, out, err = cli(capsys, "generate", MODELS / "gpt2.tsr", *sets, "--input", prompts,
                           "--max-new-tokens", "12", "--format", "json", *extra)
        assert rc == 0, err
        return [row["tokens"] for row in json.loads(out)["outputs"]]

    fp32, w8a8 = greedy(), greedy("--quantize", "w8a8", "--quantize-head")
    assert [len(r) for r in w8a8] == [12, 12, 12]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(fp32, w8a8)]
    assert sum(same_prefix) >= 0.9 * 36, (fp32, w8a8)
    rc, _, err = cli(capsys, "compile", MODELS / "gpt2.tsr", *sets, "--kv-cache", "--quantize", "w8a8",
                     "-o", tmp_path / "dec.onnx")
    assert rc == 0, err
    from tessera.compiler.backends.onnx.bound_step import general_graph

    nodes = general_graph(onnx.load(str(tmp_path / "dec.onnx"))).node
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in nodes) == 8  # per layer: q+k+v, o, fc, proj


@pytest.mark.parametrize("scheme", ["int4", "w8a8"])
def test_the_cost_of_a_quantised_linear_counts_its_bias_only_when_it_has_one(scheme):
    """A quantised linear's bias is input 3 (the `quantized` trait): Llama's bias-free linears add no
    bias FLOPs once quantised (a bias-free MatMulNBits has three inputs, which a count of "input 2 is
    the bias" took for one); GPT-2's biases count as they do in float, one add per output element."""
    from tessera.compiler.analysis import cost

    def bias_flops(spec, sets, quantize):
        graph = build(spec, **sets)
        if quantize:
            QuantizeWeights(quantize)(graph)
        costs, _ = cost.node_costs(graph)
        return cost.flops_by_category(costs).get("bias")

    config = QuantConfig("w8a8", quant.ROWS) if scheme == "w8a8" else QuantConfig("int4")
    llama = dict(layers=1, d=64, heads=4, kv_heads=2, vocab=100, d_ff=64)
    assert bias_flops("llama", llama, None) is None and bias_flops("llama", llama, config) is None
    assert bias_flops("gpt2", TINY, config) == bias_flops("gpt2", TINY, None)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ('{"scheme": "w8a8", "block_size": -1, "head": false, "activations": "int8"}', "block_size must be an integer"),
    ('{"scheme": "w8a8", "head": false, "activations": "int8"}', "has no 'block_size'"),
    ('[1, 2]', "must be a JSON object"),
])
def test_a_files_quantize_metadata_is_read_as_untrusted_input(text, message):
    """`serve --explain` reads tessera.quantize back from the file: a changed value is a ModelFileError
    naming the file and the key, not a traceback."""
    from tessera.runtime import metadata
    from tessera.runtime.errors import ModelFileError

    good = '{"scheme": "w8a8", "block_size": 0, "head": false, "activations": "int8"}'
    assert metadata.quantization(good, "m.onnx") == json.loads(good)
    with pytest.raises(ModelFileError, match=message) as e:
        metadata.quantization(text, "m.onnx")
    assert "m.onnx: its 'tessera.quantize' metadata is malformed" in str(e.value)
