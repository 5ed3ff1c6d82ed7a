"""--quantize-activations per kind of product (compiler/passes/activations.py): MatMulNBits' accuracy_level
in the emitted graph, node by node, for each value; and the logits of a product kept in fp32 against numpy.

The levels are read from the ONNX file compile writes (onnx's own reader), each MatMulNBits node named
by the linear it lowers. The numerics' reference is numpy written here: the int4 weights dequantised as
MatMulNBits' symmetric blocks state them (test_quantize_head.dequantised), put back into the float
model; with every product in fp32 the quantised model's logits equal that model's to fp32 rounding,
and with one kind left at int8 activations they do not.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import MODELS, build, cli, cli_error
from test_quantize_head import LLAMA, SETS, _logits, dequantised
from tessera.compiler.backends.onnx.bound_step import general_graph
from tessera.compiler.passes import activations as act
from tessera.compiler.passes.base import PassError
from tessera.compiler.passes.quantize import QuantConfig, QuantizeWeights
from tessera.runtime.io.weights import SeededWeights

# the ONNX node of each linear (fused: q+k+v, gate+up) -> its kind
NODE_KINDS = {"attn.q+k+v": "qkv", "attn.o": "o", "mlp.gate+up": "gate-up", "mlp.down": "down", "head": "head"}


def _levels(path) -> dict[str, set[int]]:
    """{kind: the accuracy levels of its MatMulNBits nodes} of a compiled file."""
    out: dict[str, set[int]] = {}
    for n in general_graph(onnx.load(str(path))).node:
        if n.op_type != "MatMulNBits":
            continue
        linear = n.name.split("/")[0]
        kind = next(k for suffix, k in NODE_KINDS.items() if linear == suffix or linear.endswith("." + suffix))
        out.setdefault(kind, set()).add({a.name: a.i for a in n.attribute}["accuracy_level"])
    return out


@pytest.mark.parametrize("value, floats", [(None, set()), ("int8", set()), ("float", set(NODE_KINDS.values())),
                                           ("float:down", {"down"}), ("float:down,head", {"down", "head"}),
                                           ("float:qkv,gate-up", {"qkv", "gate-up"})])
def test_each_kind_runs_at_the_level_the_option_asks(value, floats, capsys, tmp_path):
    out = tmp_path / "dec.onnx"
    extra = [] if value is None else ["--quantize-activations", value]
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--kv-cache", "--quantize", "int4", *extra, "-o", out)
    assert rc == 0, err
    want = {k: {0 if k in floats else 4} for k in NODE_KINDS.values()}
    assert _levels(out) == want


def test_explain_says_which_products_run_which_way(capsys, tmp_path):
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--quantize-activations",
                     "float:down", "--explain", "-o", tmp_path / "full.onnx")
    assert rc == 0, err
    assert "activations: fp32 activations in down (--quantize-activations float:down), int8 in the rest" in err
    rc, _, err = cli(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--explain",
                     "-o", tmp_path / "full2.onnx")
    assert rc == 0 and "activations: int8 activations in every product" in err, err


def test_a_kind_kept_in_fp32_computes_in_fp32():
    """float:qkv,o,gate-up,down,head names every kind of this model: the logits then equal the float
    model over the dequantised weights (as ``float`` does); leaving one kind out (down at int8) moves them."""
    graph = build("llama", **LLAMA)
    weights = {p: np.array(v) for p, v in SeededWeights(graph, 0).items()}
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab"], (2, 11)).astype(np.int64)
    ref = {p: (dequantised(w, 8 if p == "head.weight" else 4) if w.ndim == 2 and p != "embed.weight" else w)
           for p, w in weights.items()}
    want = _logits(build("llama", **LLAMA), ref, tokens)
    got = {}
    for value in ("float:qkv,o,gate-up,down,head", "float:qkv,o,gate-up,head"):
        g = build("llama", **LLAMA)
        QuantizeWeights(QuantConfig("int4", activations=value, embedding="float"))(g)
        got[value] = _logits(g, weights, tokens)
    np.testing.assert_allclose(got["float:qkv,o,gate-up,down,head"], want, atol=1e-4, rtol=0)
    assert np.abs(got["float:qkv,o,gate-up,head"] - want).max() > 10 * 1e-4


def test_kinds_from_the_names_and_the_head():
    assert [act.kind(f"layers.3.{n}", False) for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up",
                                                       "mlp.down", "proj")] == \
        ["qkv", "qkv", "qkv", "o", "gate-up", "gate-up", "down", "other"]
    assert act.kind("head", True) == "head" and act.kind("layers.0.mlp.down", True) == "head"


@pytest.mark.parametrize("bad", ["fp16", "float:", "float:mlp", "int8:down", "float:down,,head"])
def test_a_bad_value_is_a_clear_error(bad, capsys, tmp_path):
    err = cli_error(capsys, "compile", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--quantize-activations",
                    bad, "-o", tmp_path / "x.onnx")
    assert "activations must be int8, float or float:KIND[,KIND...]" in err and "Traceback" not in err
    with pytest.raises(PassError, match="qkv, o, gate-up, down, head, other"):
        QuantConfig("int4", activations=bad).check()


def test_the_report_says_which_products_run_which_way(capsys):
    import json

    rc, out, err = cli(capsys, "report", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--quantize-activations",
                       "float:down,head", "--format", "json")
    assert rc == 0, err
    q = json.loads(out)["quantization"]
    assert q["activations"] == "float:down,head"
    assert q["activations_in_words"] == ("fp32 activations in down, head (--quantize-activations float:down,head), "
                                         "int8 in the rest")


def test_serve_explains_the_activations_the_file_records(capsys):
    rc, _, err = cli(capsys, "serve", MODELS / "llama.tsr", *SETS, "--quantize", "int4", "--quantize-activations",
                     "float:down", "--explain")
    assert rc == 0, err
    assert "one scale per 32 input features, activations fp32 in down, int8 in the rest;" in err, err
