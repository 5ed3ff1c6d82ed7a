"""``tessera report FILE.gguf`` with ``--gguf-weights``: the report's gguf_codes section says which
linears read the file's own codes and the weights' bytes then.

The reference is written here: a tiny Llama (test_gguf's) stored as Q4_1, tied head, whose linears are
all [n, k] with k a multiple of 32; MatMulNBits' layout for 4 bits, block 32, with zero points and one
min per block (onnxruntime's contrib op schema: packed [n, k / 32, 16] uint8, scales [n, k / 32] fp32,
zero points [n, ceil(k / 32 / 2)] uint8; the mins [n, k / 32] fp32) gives the bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli  # noqa: E402
from test_gguf import D, FF, HEADS, KV, LAYERS, VOCAB, _gguf_of, _tiny  # noqa: E402


def _codes_bytes(n: int, k: int) -> int:
    blocks = k // 32
    return n * blocks * 16 + n * blocks * 4 + n * -(-blocks // 2) + n * blocks * 4


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    _gguf_of(_tiny(True), tmp_path / "tiny.gguf", "Q4_1")
    return tmp_path / "tiny.gguf"


def test_the_report_names_the_linears_reading_the_files_codes_and_their_bytes(tiny, capsys):
    rc, out, err = cli(capsys, "report", tiny, "--seq", 16, "--format", "json")
    assert rc == 0, err
    g = json.loads(out)["gguf_codes"]
    hd = D // HEADS
    shapes = [(D, D), (KV * hd, D), (KV * hd, D), (D, D), (FF, D), (FF, D), (D, FF)] * LAYERS + [(VOCAB, D)]
    assert g["mode"] == "codes" and g["codes_linears"] == len(shapes) == 15 and g["by_type"] == {"Q4_1": 15}
    assert {x["node"] for x in g["linears"]} >= {"layers.0.attn.q", "layers.1.mlp.down", "head"}
    floats = sum(n * k for n, k in shapes) * 4
    norms = (2 * LAYERS + 1) * D * 4
    # every linear's fp32 weight replaced by its codes, except the tied table: the embedding still gathers floats
    assert g["float_weights_bytes"] == floats + norms
    assert g["weights_bytes"] == floats + norms - (floats - VOCAB * D * 4) + sum(_codes_bytes(n, k) for n, k in shapes)
    assert "Q4_1: 15" in g["source"] and "codes kept" in g["source"]
    rc, out, err = cli(capsys, "report", tiny, "--seq", 16)
    assert rc == 0, err
    assert "GGUF codes (--gguf-weights codes)" in out and "linears reading the file's own codes" in out


def test_dequantize_codes_fp32_and_quantize_with_the_codes(tiny, capsys):
    rc, out, err = cli(capsys, "report", tiny, "--seq", 16, "--format", "json", "--gguf-weights", "dequantize")
    assert rc == 0, err
    g = json.loads(out)["gguf_codes"]
    assert g["mode"] == "dequantize" and g["codes_linears"] == 0 and g["held"] == {"Q4_1": 15}
    # --quantize int8 quantises only the linears left in float: here none, all read the file's codes
    rc, out, err = cli(capsys, "report", tiny, "--seq", 16, "--format", "json", "--quantize", "int8")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["quantization"]["quantized_linears"] == 0
    assert rep["quantization"]["weights_bytes"] == rep["gguf_codes"]["weights_bytes"]


def test_the_api_report_takes_gguf_weights(tiny):
    import tessera

    rep = tessera.load(str(tiny)).report(seq=16, gguf_weights="codes-fp32")
    assert rep["gguf_codes"]["mode"] == "codes-fp32" and rep["gguf_codes"]["codes_linears"] == 15
    from tessera.runtime.errors import UsageError

    with pytest.raises(UsageError, match="gguf_weights.*codes-fp32"):
        tessera.load(str(tiny)).report(seq=16, gguf_weights="bogus")
