"""issue 25, item 3: buffers sized by a user's number are checked before they are allocated.

max_new_tokens=10**9 on a model with a long context allocated the KV cache first (numpy's
MemoryError, "Unable to allocate 119 GiB"), and on a model that declares no context (a sliding
window, or rotary positions without max_ctx) decoded for ever. The cache's size is computed by hand
here: layers x rows x kv_heads x positions x (key + value head sizes) x 4 bytes."""

from __future__ import annotations

import pytest

import tessera
from tessera.runtime import pipeline
from tessera.runtime.pipeline import UsageError

TINY = dict(layers=2, d=32, heads=2, vocab=50, d_ff=64)


def test_a_cache_past_the_memory_is_refused_with_its_size():
    m = tessera.load("llama", ctx=10 ** 9, **TINY)
    new = 10 ** 9 - 10
    # 2 layers x 1 row x 2 kv heads x (2 + new) positions x (16 + 16) x 4 bytes
    need = 2 * 1 * 2 * (2 + new) * 32 * 4
    with pytest.raises(UsageError, match=f"{need:,} bytes"):
        m.generate([1, 2], max_new_tokens=new)


def test_the_budget_is_the_memory_available(monkeypatch):
    m = tessera.load("llama", ctx=64, **TINY)
    need = 2 * 3 * 2 * (4 + 20) * 32 * 4  # three prompts of 4 tokens, 20 new tokens: 36,864 bytes
    monkeypatch.setattr(pipeline, "available_memory", lambda: need - 1)
    with pytest.raises(UsageError, match=f"is {need:,} bytes"):
        m.generate([[1, 2, 3, 4]] * 3, max_new_tokens=20)
    monkeypatch.setattr(pipeline, "available_memory", lambda: need)
    out = m.generate([[1, 2, 3, 4]] * 3, max_new_tokens=20)
    assert [len(r) for r in out] == [20, 20, 20]


def test_a_model_without_a_context_gets_a_cap():
    from tessera.runtime.generation.cached import NO_CONTEXT_CAP

    m = tessera.load("llama", ctx=0, **TINY)  # rotary positions without a trained bound
    with pytest.raises(UsageError, match="declares no context length"):
        m.generate([1, 2], max_new_tokens=10 ** 9)
    with pytest.raises(UsageError, match=f"at most {NO_CONTEXT_CAP - 2:,} new tokens"):
        m.generate([1, 2], max_new_tokens=NO_CONTEXT_CAP - 1)


def test_the_serving_engine_checks_its_one_allocation(monkeypatch):
    from tessera.runtime.serving import model as serving_model
    from tessera.runtime.serving.engine import Engine

    cached = serving_model.load("llama", sets=["layers=2", "d=32", "heads=2", "vocab=50", "d_ff=64", "ctx=10000"])
    need = 2 * 8 * 2 * 10000 * 32 * 4  # 8 slots of 10,000 positions
    monkeypatch.setattr(pipeline, "available_memory", lambda: need // 2)
    with pytest.raises(UsageError, match=f"engine's KV cache .* is {need:,} bytes"):
        Engine(cached, max_batch=8)


SETS = ["--set", "layers=1", "--set", "d=32", "--set", "heads=2", "--set", "vocab=50", "--set", "ctx=16"]


def test_full_json_past_its_budget_is_refused_before_printing(capsys, monkeypatch):
    """run --format json --full of a 10**8-element output ran out of memory; past FULL_MAX_ELEMENTS it is
    refused (pointing to --save) before a byte is printed. The logits here are 1 x 2 x 50 = 100 elements."""
    from conftest import cli, cli_error
    from tessera.runtime.io import outputs

    monkeypatch.setattr(outputs, "FULL_MAX_ELEMENTS", 99)
    err = cli_error(capsys, "run", "gpt2", *SETS, "--input", "tokens=[[1, 2]]", "--format", "json", "--full")
    assert "'logits' has 100 elements" in err and "--save DIR" in err
    monkeypatch.setattr(outputs, "FULL_MAX_ELEMENTS", 100)
    rc, out, err = cli(capsys, "run", "gpt2", *SETS, "--input", "tokens=[[1, 2]]", "--format", "json", "--full")
    assert rc == 0, err


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (), (2, 0), (1, 10)])
def test_full_values_are_written_in_chunks_as_json_would(monkeypatch, shape):
    """An innermost row of 10**8 values was one json.dumps; it is now written ROW_CHUNK values at a time."""
    import io
    import json

    import numpy as np

    from tessera.runtime.io import outputs

    monkeypatch.setattr(outputs, "ROW_CHUNK", 3)
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) / 7
    f = io.StringIO()
    outputs._write_values(a, f)
    assert json.loads(f.getvalue()) == json.loads(json.dumps(a.tolist()))


def _loop_model(trips: int, path):
    """A model whose one Loop adds 1 to x ``trips`` times (the trip count a constant initializer)."""
    import numpy
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph([helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1])],
                             [numpy_helper.from_array(numpy.ones(1, numpy.float32), "one")])
    g = helper.make_graph([helper.make_node("Loop", ["M", "", "x"], ["y"], body=body, name="spin")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                          [numpy_helper.from_array(numpy.array(trips, numpy.int64), "M")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def test_a_loop_with_a_huge_constant_trip_count_is_refused(capsys, tmp_path):
    """A Loop of 10**12 iterations hung `run`; past MAX_LOOP_TRIPS it is refused before running."""
    from conftest import cli, cli_error
    from tessera.runtime.session import MAX_LOOP_TRIPS

    _loop_model(10 ** 12, tmp_path / "big.onnx")
    err = cli_error(capsys, "run", tmp_path / "big.onnx", "--input", "x=[0.0]")
    assert "1,000,000,000,000 times" in err and f"{MAX_LOOP_TRIPS:,}" in err
    _loop_model(5, tmp_path / "small.onnx")
    rc, out, err = cli(capsys, "run", tmp_path / "small.onnx", "--input", "x=[0.0]", "--format", "json")
    assert rc == 0 and '"values": [5.0]' in out, err


def test_an_encoder_decoder_source_past_the_cap_is_refused(capsys):
    """A 100,000-token source hung the encoder; past MAX_SOURCE_TOKENS it is refused before encoding."""
    from conftest import cli_error
    from tessera.runtime.generation.loop import MAX_SOURCE_TOKENS

    row = ", ".join(["1"] * (MAX_SOURCE_TOKENS + 1))
    err = cli_error(capsys, "generate", "transformer", "--set", "layers=1", "--set", "d=32", "--set", "d_ff=64",
                    "--set", "heads=2", "--set", "vocab=50", "--input", f"src=[[{row}]]", "--input",
                    f"src_mask=[[{row}]]", "--start-token", "0", "--max-new-tokens", "2")
    assert f"{MAX_SOURCE_TOKENS + 1:,} tokens per row" in err
