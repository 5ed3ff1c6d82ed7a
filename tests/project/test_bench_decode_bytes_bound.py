"""bench/decode_bytes_bound.py's byte counts, against sizes written here: a GGUF file's tensors at their types'
block sizes as ggml defines them (Q4_0: 18 bytes a block of 32, Q8_0: 34), the token embedding counted only
when the head is tied (no ``output.weight``); a compiled graph's MatMulNBits at MLAS's int8-activation packing
(codes, an fp32 scale and an fp32 block sum a block) and a tied float head, MatMul of a Transposed table inside
a subgraph, at 4 bytes a value."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import load_bench

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bench():
    return load_bench("decode_bytes_bound")


def _gguf(path, tied: bool):
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    q4 = gguf.quants.quantize(rng.standard_normal((64, 128)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    q8 = gguf.quants.quantize(rng.standard_normal((96, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    if not tied:
        w.add_tensor("output.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_bytes_count_what_a_token_reads(bench, tmp_path, tied):
    _gguf(tmp_path / "m.gguf", tied)
    q4_0 = 64 * 128 // 32 * 18  # ggml's block_q4_0: an fp16 scale and 16 bytes of nibbles per 32
    q8_0 = 96 * 64 // 32 * 34  # block_q8_0: an fp16 scale and 32 int8 per 32
    got = bench.gguf_bytes(str(tmp_path / "m.gguf"))
    # tied: the table is the head, read whole; untied: output.weight is, the table only gathered
    assert got["bytes"] == q4_0 + q8_0 + 64 * 4
    assert got["tied_head"] is tied and got["by_type"]["Q4_0"] == q4_0


def test_onnx_bytes_count_packed_codes_and_a_tied_float_head(bench, tmp_path):
    n, k, vocab = 48, 64, 40
    codes = numpy_helper.from_array(np.zeros((n, k // 32, 16), np.uint8), "w")
    scales = numpy_helper.from_array(np.ones(n * k // 32, np.float32), "s")
    table = numpy_helper.from_array(np.zeros((vocab, k), np.float32), "embed")
    branch = helper.make_graph(
        [helper.make_node("MatMulNBits", ["x", "w", "s"], ["h"], domain="com.microsoft", K=k, N=n, bits=4,
                          block_size=32, accuracy_level=4),
         helper.make_node("Transpose", ["embed"], ["embed_t"]),
         helper.make_node("MatMul", ["x", "embed_t"], ["logits"])],
        "branch", [], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["logits"], then_branch=branch, else_branch=branch)],
                              "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                    helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              [codes, scales, table])
    onnx.save(helper.make_model(graph), str(tmp_path / "m.onnx"))
    got = bench.onnx_bytes(str(tmp_path / "m.onnx"))
    packed = n * (k // 32) * (16 + 4 + 4)  # 4-bit codes of a block, its fp32 scale, its fp32 block sum
    assert got["matmulnbits"] == 1 and got["matmulnbits_bytes"] == packed
    assert got["fp32_matmul_bytes"] == vocab * k * 4 and got["bytes"] == packed + vocab * k * 4
