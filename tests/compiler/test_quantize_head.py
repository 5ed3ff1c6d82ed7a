"""The output head's bits under --quantize (compiler/passes/quantize.py, ``QuantConfig.head``):
8 bits by default under int4 and int4-asym (llama.cpp's layout), float by default under int8 and w8a8,
``--quantize-head float|8|4`` to choose, ``--quantize-head`` alone the scheme's head bits as before.

The reference is numpy written here: each linear's weight quantised and dequantised as MatMulNBits'
symmetric blocks state it (scale max|w| / (2^(bits-1) - 1) per block of 32, codes rounded to nearest),
put back into the float model, whose logits the quantised model's must equal (products in fp32:
--quantize-activations float). A tied head is checked against the untied model whose head holds the
embedding's 8-bit dequantisation while its embedding keeps the float table (--quantize-embedding float:
the embedding's own 8 bits are tests/compiler/test_quantize_embedding.py's): the gather reads the float
table, the head its 8-bit codes.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import MODELS, build, cli, cli_error
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.backends.onnx.bound_step import general_graph
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.runtime.io.weights import SeededWeights

LLAMA = dict(layers=2, d=64, heads=4, kv_heads=2, d_ff=96, vocab=200, ctx=64)
SETS = [x for k, v in LLAMA.items() for x in ("--set", f"{k}={v}")]


def dequantised(w: np.ndarray, bits: int, block: int = 32) -> np.ndarray:
    """Symmetric block quantisation and back, in float32 as MatMulNBits' default zero point implies."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(n, k // block, block)
    qmax = np.float32(2 ** (bits - 1) - 1)
    scale = np.abs(b).max(axis=-1, keepdims=True) / qmax
    q = np.clip(np.rint(b / np.where(scale > 0, scale, 1)), -qmax - 1, qmax)
    return (q * scale).reshape(n, k).astype(np.float32)


def _logits(graph, weights: dict, tokens: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    return sess.run(None, {"tokens": tokens})[0]


@pytest.mark.parametrize("tied", [False, True])
def test_int4_quantises_the_head_at_8_bits_by_default(tied):
    graph = build("llama", tied=tied, **LLAMA)
    weights = {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab"], (2, 11)).astype(np.int64)
    result = QuantizeWeights(QuantConfig("int4", activations="float", embedding="float"))(graph)
    head = next(n for n in result.notes if n.head)
    assert head.quantized and head.bits == 8
    assert all(n.bits == 4 for n in result.notes if not n.head and not n.embedding)
    got = _logits(graph, weights, tokens)

    ref_graph = build("llama", tied=False, **LLAMA)
    ref = {p: (dequantised(w, 4) if w.ndim == 2 and p != "embed.weight" else w) for p, w in weights.items()}
    ref["head.weight"] = dequantised(weights["embed.weight" if tied else "head.weight"], 8)
    want = _logits(ref_graph, ref, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # the head's 8 bits matter: at 4 bits the logits are elsewhere
    ref["head.weight"] = dequantised(weights["embed.weight" if tied else "head.weight"], 4)
    assert np.abs(_logits(ref_graph, ref, tokens) - got).max() > 100 * 1e-4


def test_the_head_choices_and_the_old_flag():
    def head_of(config):
        graph = build("llama", **LLAMA)
        notes = QuantizeWeights(config)(graph).notes
        n = next(n for n in notes if n.weight == "head.weight")
        return n.bits if n.quantized else None

    assert head_of(QuantConfig("int4")) == 8 and head_of(QuantConfig("int4-asym")) == 8
    assert head_of(QuantConfig("int8")) == 8 and head_of(QuantConfig("w8a8", 0)) is None  # w8a8: float, as before
    assert head_of(QuantConfig("int4", head="float")) is None and head_of(QuantConfig("int4", head="4")) == 4
    assert head_of(QuantConfig("int8", head="8")) == 8 and head_of(QuantConfig("int4-asym", head="4")) == 4
    # the old --quantize-head (True in the API): the scheme's head bits
    assert head_of(QuantConfig("int4", head=True)) == 4 and head_of(QuantConfig("int4-asym", head=True)) == 8
    assert head_of(QuantConfig("int8", head=True)) == 8 and head_of(QuantConfig("int4", head=False)) is None
    with pytest.raises(PassError, match="8 bits or float"):
        QuantConfig("w8a8", 0, head="4").check()


def test_the_default_int4_graph_has_the_head_as_matmulnbits_at_8_bits(capsys, tmp_path):
    for extra, bits in (([], 8), (["--quantize-head", "float"], None), (["--quantize-head", "4"], 4),
                        (["--quantize-head"], 4)):
        out = tmp_path / "dec.onnx"
        rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--kv-cache", "--quantize", "int4", *extra,
                         "--explain", "-o", out)
        assert rc == 0, err
        g = general_graph(onnx.load(str(out)))
        nbits = {n.input[1]: {a.name: a.i for a in n.attribute}["bits"] for n in g.node if n.op_type == "MatMulNBits"}
        head = [b for name, b in nbits.items() if name.startswith("head.")]
        assert head == ([] if bits is None else [bits]), (extra, nbits)
        assert set(b for name, b in nbits.items() if not name.startswith("head.")) == {4}
        if bits is None:
            assert any(n.op_type == "MatMul" and n.input[1].startswith("head.") for n in g.node)
        meta = {e.key: e.value for e in onnx.load(str(out), load_external_data=False).metadata_props}
        assert json.loads(meta["tessera.quantize"])["head_bits"] == (bits or 0)
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--explain",
                     "-o", tmp_path / "full.onnx")
    assert rc == 0 and "the output head at 8 bits, the default of int4, int4-asym and int8" in err, err


def test_a_bad_head_choice_is_a_clear_error(capsys, tmp_path):
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "w8a8", "--quantize-head", "4",
                    "-o", tmp_path / "x.onnx")
    assert "8 bits or float" in err
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize-head", "8", "-o", tmp_path / "x.onnx")
    assert "need --quantize" in err
    import tessera
    from tessera.runtime.errors import UsageError

    with pytest.raises(UsageError, match="quantize_head must be one of"):
        tessera.load(MODELS / "llama.tsr", **LLAMA).compile(tmp_path / "x.onnx", quantize="int4", quantize_head="16")
