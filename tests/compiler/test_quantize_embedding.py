"""The token embedding at 8 bits under --quantize (compiler/passes/quantize.py, ``QuantConfig.embedding``;
the ``embedding_nbits`` op, lowered to onnxruntime's GatherBlockQuantized).

References, all numpy written here: the table cut into blocks of 32 along each row (the last one padded
with zeros), each block quantised symmetrically (scale max|w| / 127, codes rounded to nearest) and
dequantised; the gathered rows of the compiled model (onnxruntime) and of the numpy interpreter must
equal those rows. Under int4-asym the codes carry zero points: the rows must equal (codes - zero point)
x scale computed here from the stored codes. A tiny Llama's logits must equal those of the float model
whose weights are replaced by their numpy dequantisation (the linears at 4 bits, the head and the
embedding at 8), and stay near the fp32 model's; a tied head and its embedding share one set of codes
and the float table is gone, which the file's initializers and the report's bytes show (hand counts).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import MODELS, build, cli, cli_error, ort_run
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.ops import interpret
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.compiler.reference.quant import ParamValues
from tessera.runtime.io.weights import SeededWeights

LLAMA = dict(layers=2, d=64, heads=4, kv_heads=2, d_ff=96, vocab=200, ctx=64)
SETS = [x for k, v in LLAMA.items() for x in ("--set", f"{k}={v}")]
TABLE_SPEC = """model Table(vocab = 90, d = 64) {
  in tokens: i64[B, T]
  out h: f32[B, T, d]
  h = embedding(tokens, vocab, d, name="wte")
}
"""


def dequantised_rows(w: np.ndarray, bits: int = 8, block: int = 32) -> np.ndarray:
    """Each row of ``w`` in blocks of ``block`` (the last padded with zeros), quantised symmetrically
    (scale max|w| / (2^(bits-1) - 1)) and back, cut to the row's length."""
    n, k = w.shape
    nb = -(-k // block)
    b = np.zeros((n, nb * block), np.float32)
    b[:, :k] = w
    b = b.reshape(n, nb, block)
    qmax = np.float32(2 ** (bits - 1) - 1)
    scale = np.abs(b).max(axis=-1, keepdims=True) / qmax
    q = np.clip(np.rint(b / np.where(scale > 0, scale, 1)), -qmax - 1, qmax)
    return (q * scale).reshape(n, -1)[:, :k].astype(np.float32)


def _table(tmp_path, d: int):
    spec = tmp_path / "table.tsr"
    spec.write_text(TABLE_SPEC)
    graph = build(str(spec), d=d)
    return graph, {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}


@pytest.mark.parametrize("d", [64, 48])  # whole blocks, and a last block padded
def test_the_gather_returns_the_numpy_block_dequantised_rows(tmp_path, d):
    graph, weights = _table(tmp_path, d)
    w = weights["wte.weight"]
    ids = np.array([[0, 5, 89, 5], [17, 1, 2, 88]], np.int64)
    result = QuantizeWeights(QuantConfig("int8", embedding="8"))(graph)
    (note,) = result.notes
    assert note.embedding and note.quantized and note.bits == 8
    assert [n.op for n in graph.nodes.values()][0] == "embedding_nbits" and "wte.weight" not in graph.params
    want = dequantised_rows(w)[ids]
    got = ort_run(graph, weights, {"tokens": ids})["h"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    np.testing.assert_allclose(interpret.run(graph, ParamValues(graph, weights), {"tokens": ids})["h"], want,
                               rtol=0, atol=1e-7)
    assert np.abs(got - w[ids]).max() > 0  # the rows are the codes', not the float table's
    model = onnx_export.to_onnx(graph, weights)
    assert [n.op_type for n in model.graph.node if n.domain == "com.microsoft"] == ["GatherBlockQuantized"]


def test_int4_asym_gathers_its_codes_with_their_zero_points(tmp_path):
    graph, weights = _table(tmp_path, 64)
    ids = np.array([[3, 0, 89]], np.int64)
    QuantizeWeights(QuantConfig("int4-asym"))(graph)  # the embedding at 8 bits by default, with zero points
    (node,) = [n for n in graph.nodes.values() if n.op == "embedding_nbits"]
    assert node.op == "embedding_nbits" and node.attrs["zero_points"] == 1
    values = ParamValues(graph, weights)
    codes, scales, zeros = (np.asarray(values[p]) for p in node.inputs[1:])
    assert codes.dtype == np.uint8 and codes.shape == (90, 2, 32) and zeros.shape == (90, 2)
    table = ((codes.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(90, 64)
    np.testing.assert_allclose(ort_run(graph, weights, {"tokens": ids})["h"], table[ids], rtol=0, atol=1e-7)
    w = weights["wte.weight"]
    assert np.abs(table - w).max() < 0.01 * np.abs(w).max()  # 255 levels over each block's range


def _logits(graph, weights: dict, tokens: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    return sess.run(None, {"tokens": tokens})[0]


@pytest.mark.parametrize("tied", [False, True])
def test_int4_logits_are_those_of_the_numpy_dequantised_model(tied):
    graph = build("llama", tied=tied, **LLAMA)
    weights = {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab"], (2, 11)).astype(np.int64)
    result = QuantizeWeights(QuantConfig("int4", activations="float"))(graph)  # head and embedding: 8 bits
    (table,) = [n for n in result.notes if n.embedding]
    assert table.quantized and table.reason == ("shared" if tied else "")
    assert "embed.weight" not in graph.params
    got = _logits(graph, weights, tokens)

    ref = {p: (dequantised_rows(w, 4) if w.ndim == 2 else w) for p, w in weights.items()}
    ref["embed.weight"] = dequantised_rows(weights["embed.weight"], 8)
    ref["head.weight"] = dequantised_rows(weights["embed.weight" if tied else "head.weight"], 8)
    np.testing.assert_allclose(got, _logits(build("llama", tied=False, **LLAMA), ref, tokens), atol=1e-4, rtol=0)
    # the embedding's 8 bits are seen, and cost little: against the same model gathering from the float
    # table, the logits move, by under 1 % of their largest
    ref["embed.weight"] = weights["embed.weight"]
    moved = np.abs(_logits(build("llama", tied=False, **LLAMA), ref, tokens) - got).max()
    assert 1e-5 < moved < 0.01 * np.abs(got).max()


@pytest.mark.parametrize("tied", [False, True])
def test_int8_with_the_8_bit_table_stays_near_fp32(tied):
    """The whole model at 8 bits (linears, head and table; int8 activations in the products): the logits
    within 2 % of the fp32 model's largest (measured 0.4-1.0 % on these seeded weights)."""
    graph = build("llama", tied=tied, **LLAMA)
    weights = {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}
    tokens = np.random.default_rng(1).integers(0, LLAMA["vocab"], (2, 11)).astype(np.int64)
    fp32 = _logits(build("llama", tied=tied, **LLAMA), weights, tokens)
    QuantizeWeights(QuantConfig("int8", head="8", embedding="8"))(graph)
    assert any(n.op == "embedding_nbits" for n in graph.nodes.values())
    assert np.abs(_logits(graph, weights, tokens) - fp32).max() < 0.02 * np.abs(fp32).max()


def _initializers(path) -> dict[str, onnx.TensorProto]:
    model = onnx.load(str(path))
    return {t.name: t for t in model.graph.initializer}


def _bytes(t: onnx.TensorProto) -> int:
    return onnx.numpy_helper.to_array(t).nbytes


def test_a_tied_table_is_one_set_of_codes_in_the_file_and_the_report(capsys, tmp_path):
    """SmolLM2's layout: the head tied to the embedding. At 8 bits both read one uint8 [vocab, blocks, 32]
    initializer; no float [vocab, d] table is left; the report's weights bytes fall by the float table's
    4 x vocab x d bytes against --quantize-embedding float, and equal the file's parameter bytes."""
    vocab, d = LLAMA["vocab"], LLAMA["d"]
    sizes = {}
    for choice in ("auto", "float"):
        out = tmp_path / f"{choice}.onnx"
        rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--set", "tied=true", "--quantize", "int4",
                         "--quantize-embedding", choice, "--explain", "-o", out)
        assert rc == 0, err
        inits = _initializers(out)
        floats = [n for n, t in inits.items() if tuple(t.dims) == (vocab, d)]
        model = onnx.load(str(out))
        gathers = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
        if choice == "auto":
            assert "the head and the embedding read one set of 8-bit codes" in err, err
            assert not floats and len(gathers) == 1
            codes = gathers[0].input[0]
            assert tuple(inits[codes].dims) == (vocab, d // 32, 32) and inits[codes].data_type == onnx.TensorProto.UINT8
            assert any(n.op_type == "MatMulNBits" and n.input[1] == codes for n in model.graph.node)
        else:
            assert "the embedding float, as --quantize-embedding float asks" in err, err
            assert floats == ["embed.weight"] and not gathers
        rc, out_json, err = cli(capsys, "report", MODELS / "llama.tsr", *SETS, "--set", "tied=true",
                                "--quantize", "int4", "--quantize-embedding", choice, "--format", "json")
        assert rc == 0, err
        q = json.loads(out_json)["quantization"]
        assert q["embedding_bits"] == (8 if choice == "auto" else None)
        assert q["weights_bytes"] == sum(_bytes(t) for n, t in inits.items() if "/" not in n)  # the file's params
        sizes[choice] = q["weights_bytes"]
    assert sizes["float"] - sizes["auto"] == 4 * vocab * d


def test_ids_past_the_quantised_table_are_a_clear_error(capsys, tmp_path):
    out = tmp_path / "m.onnx"
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "-o", out)
    assert rc == 0, err
    err = cli_error(capsys, "run", out, "--input", "tokens=[[1, 250]]")
    assert "holds 250 at [0, 1], but its values index the 200 rows of 'embed.weight'" in err, err


def test_an_untied_table_stores_codes_and_scales(capsys):
    """Without a tied head the table's codes are its own: 1 byte an element plus a 4-byte scale a block."""
    vocab, d = LLAMA["vocab"], LLAMA["d"]
    got = {}
    for choice in ("8", "float"):
        rc, out, err = cli(capsys, "report", MODELS / "llama.tsr", *SETS, "--quantize", "int8",
                           "--quantize-embedding", choice, "--format", "json")
        assert rc == 0, err
        got[choice] = json.loads(out)["quantization"]["weights_bytes"]
    assert got["float"] - got["8"] == 4 * vocab * d - (vocab * d + 4 * vocab * (d // 32))


@pytest.mark.parametrize("tied", [False, True])
def test_int8_by_default_the_head_at_8_bits_and_the_table_only_where_that_head_is_tied(tied):
    """int8's defaults (llama.cpp's Q8_0 layout): the head at 8 bits; a table tied to it gathers the
    head's codes (one set, the float table gone); an untied table stays float. Logits against the
    float model whose weights are replaced here by their numpy dequantisation."""
    graph = build("llama", tied=tied, **LLAMA)
    weights = {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}
    tokens = np.random.default_rng(1).integers(0, LLAMA["vocab"], (2, 11)).astype(np.int64)
    result = QuantizeWeights(QuantConfig("int8", activations="float"))(graph)
    (table,) = [n for n in result.notes if n.embedding]
    head = next(n for n in result.notes if n.head)
    assert head.quantized and head.bits == 8
    assert table.quantized == tied and (table.reason == "shared" if tied else "int8's default" in table.reason)
    assert ("embed.weight" in graph.params) == (not tied)
    got = _logits(graph, weights, tokens)

    ref = {p: (dequantised_rows(w, 8) if w.ndim == 2 and p != "embed.weight" else w) for p, w in weights.items()}
    ref["head.weight"] = dequantised_rows(weights["embed.weight" if tied else "head.weight"], 8)
    if tied:
        ref["embed.weight"] = dequantised_rows(weights["embed.weight"], 8)
    np.testing.assert_allclose(got, _logits(build("llama", tied=False, **LLAMA), ref, tokens), atol=1e-4, rtol=0)
    # the head's 8 bits are seen: against the same model with the float head the logits move
    ref["head.weight"] = weights["embed.weight" if tied else "head.weight"]
    assert np.abs(_logits(build("llama", tied=False, **LLAMA), ref, tokens) - got).max() > 1e-5


def test_int8_says_its_untied_table_stayed_float_in_the_file_and_the_report(capsys, tmp_path):
    """The metadata and the report state what the file stores (the table float: embedding_bits 0 / null),
    not int8's 8 bits for a tied table; with the table tied they say 8."""
    for tied, bits in (("false", 0), ("true", 8)):
        out = tmp_path / f"int8-{tied}.onnx"
        rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--set", f"tied={tied}", "--quantize", "int8",
                         "-o", out)
        assert rc == 0, err
        meta = {e.key: e.value for e in onnx.load(str(out), load_external_data=False).metadata_props}
        q = json.loads(meta["tessera.quantize"])
        assert (q["head_bits"], q["embedding_bits"]) == (8, bits), q
        rc, out_json, err = cli(capsys, "report", MODELS / "llama.tsr", *SETS, "--set", f"tied={tied}",
                                "--quantize", "int8", "--format", "json")
        assert rc == 0, err
        report = json.loads(out_json)["quantization"]
        assert report["embedding_bits"] == (bits or None) and report["quantized_embeddings"] == (1 if bits else 0)
        if not bits:
            assert ["int8's default" in e["reason"] for e in report["embeddings_in_float"]] == [True]


def test_w8a8_keeps_the_table_float_by_default_and_position_tables_stay_float():
    assert QuantConfig("w8a8", 0).embedding_bits is None and QuantConfig("int4").embedding_bits == 8
    graph = build("gpt2", "small", layers=1, d=64, heads=2, vocab=100, ctx=32)
    notes = [n for n in QuantizeWeights(QuantConfig("int4"))(graph).notes if n.embedding]
    by_table = {n.weight: n for n in notes}
    assert by_table["wte.weight"].quantized and not by_table["wpe.weight"].quantized
    assert "position table" in by_table["wpe.weight"].reason


def test_bad_embedding_choices_are_clear_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:  # argparse's own error for a value outside the choices
        cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--quantize-embedding", "4",
            "-o", tmp_path / "x.onnx")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--quantize-embedding: invalid choice: '4'" in err and "Traceback" not in err
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "w8a8", "--quantize-embedding", "8",
                    "-o", tmp_path / "x.onnx")
    assert "GatherBlockQuantized does not read" in err
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize-embedding", "8", "-o", tmp_path / "x.onnx")
    assert "need --quantize" in err
    with pytest.raises(PassError, match="quantize embedding must be one of"):
        QuantConfig("int4", embedding="16").check()
    import tessera
    from tessera.runtime.errors import UsageError

    with pytest.raises(UsageError, match="quantize_embedding must be one of"):
        tessera.load(MODELS / "llama.tsr", **LLAMA).compile(tmp_path / "x.onnx", quantize="int4",
                                                            quantize_embedding="4")


def test_the_gather_runs_on_cuda(cuda_stub, tmp_path):
    """onnxruntime-gpu registers GatherBlockQuantized's CUDA kernel for uint8 codes (float, fp16 and bf16
    scales): the quantised table is gathered on the device, not moved to the CPU."""
    import tessera

    out = tmp_path / "cuda.onnx"

    tessera.load(MODELS / "llama.tsr", **LLAMA).compile(out, quantize="int4", target="cuda", dtype="fp16")
    assert any(n.op_type == "GatherBlockQuantized" for n in onnx.load(str(out)).graph.node)
    (report,) = cuda_stub.check(out, seq=5)
    assert report["providers"][:1] == ["CUDAExecutionProvider"], report
    assert not any(op == "GatherBlockQuantized" for op, _ in report["cpu_nodes"]), report["cpu_nodes"]
