"""Streaming export: weights go from their source to the file one tensor at a time, the file is the
same model as the in-memory export (inline or with external data), and memory stays at a few tensors."""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import MODELS, build, cli, cli_error
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.backends.onnx import stream
from tessera.runtime.io.weights import SeededWeights, init_weights

SETS = dict(layers=6, d=256, heads=4, vocab=2000, ctx=64)  # about 5 M parameters, none over 2 MB


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _logits(sess, tokens):
    return sess.run(["logits"], {"tokens": tokens})[0]


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("external", [False, True])
def test_written_file_is_the_in_memory_model(tmp_path, external):
    graph = build("gpt2", **SETS)
    weights = SeededWeights(graph, 3)
    files = onnx_export.write(graph, weights, tmp_path / "m.onnx", verify=onnx_export.check, external=external)
    assert files == ([tmp_path / "m.onnx", tmp_path / "m.onnx.data"] if external else [tmp_path / "m.onnx"])
    written = onnx.load(str(tmp_path / "m.onnx"))  # loads the external data too
    onnx.checker.check_model(written, full_check=True)
    assert written.ir_version == onnx_export.IR_VERSION
    want = _initializers(onnx_export.to_onnx(graph, init_weights(graph, 3)))
    got = _initializers(written)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    if external:
        refs = [i for i in onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer
                if i.data_location == onnx.TensorProto.EXTERNAL]
        assert len(refs) > 10
        offsets = [int(next(e.value for e in i.external_data if e.key == "offset")) for i in refs]
        assert all(o % stream.ALIGN == 0 for o in offsets)
    tokens = np.array([[464, 1068, 7, 1999, 0]], np.int64)
    mem = ort.InferenceSession(onnx_export.to_bytes(graph, weights), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(_logits(_session(tmp_path / "m.onnx"), tokens), _logits(mem, tokens))


def test_seeded_values_are_the_documented_draw():
    """Each parameter is N(0, 0.02) from default_rng([seed, crc32(path)]) in float32, biases zero,
    norm scales one (docs/cli.md), whether drawn lazily or all at once."""
    graph = build("gpt2", **SETS)
    lazy = SeededWeights(graph, 5)
    for path, p in graph.params.items():
        if p.init == "zeros":
            want = np.zeros(p.shape, np.float32)
        elif p.init == "ones":
            want = np.ones(p.shape, np.float32)
        else:
            rng = np.random.default_rng([5, zlib.crc32(path.encode())])
            want = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(0.02)
        assert lazy[path].dtype == np.float32 and np.array_equal(lazy[path], want), path
        assert np.array_equal(lazy[path], lazy[path])  # drawn again, the same values


def test_write_holds_a_few_tensors_not_the_model(tmp_path):
    graph = build("gpt2", **SETS)
    sizes = [p.numel * 4 for p in graph.params.values()]
    assert sum(sizes) > 10 * max(sizes)
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        onnx_export.write(graph, SeededWeights(graph, 0), tmp_path / "m.onnx", verify=onnx_export.check)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * max(sizes) + 2 * 2**20, (peak, max(sizes), sum(sizes))


def test_written_file_is_deterministic_and_reproduces_the_in_memory_serialisation(tmp_path):
    graph = build("gpt2", **SETS)
    a = onnx_export.write(graph, SeededWeights(graph, 1), tmp_path / "a.onnx")[0].read_bytes()
    b = onnx_export.write(graph, SeededWeights(graph, 1), tmp_path / "b.onnx")[0].read_bytes()
    assert a == b
    assert a == onnx_export.to_bytes(graph, SeededWeights(graph, 1))


def test_a_weight_of_the_wrong_shape_fails_and_leaves_nothing(tmp_path):
    graph = build("gpt2", **SETS)
    weights = dict(init_weights(graph, 0))
    weights["wte.weight"] = weights["wte.weight"][:10]
    with pytest.raises(ValueError, match="wte.weight has shape"):
        onnx_export.write(graph, weights, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_save_of_an_in_memory_model_streams_its_initializers(tmp_path):
    graph = build("gpt2", **SETS)
    model = onnx_export.to_onnx(graph, init_weights(graph, 2))
    onnx_export.save(model, tmp_path / "m.onnx", verify=onnx_export.check)
    assert onnx.load(str(tmp_path / "m.onnx")) == onnx.load_from_string(onnx_export.to_bytes(graph, SeededWeights(graph, 2)))


# ---------------------------------------------------------------- what compile refuses
SMALL = [MODELS / "gpt2.tsr", "--set", "layers=4", "--set", "d=64", "--set", "heads=2", "--set", "vocab=64",
         "--set", "ctx=16"]


def test_compile_needs_memory_for_its_largest_tensors_only(capsys, tmp_path, monkeypatch):
    from tessera.runtime import pipeline

    graph = build("gpt2", layers=4, d=64, heads=2, vocab=64, ctx=16)
    sizes = [p.numel * 4 for p in graph.params.values()]
    room = 4 * max(sizes)  # less than the weights once, more than three of the largest tensor
    assert room < sum(sizes)
    monkeypatch.setattr(pipeline, "available_memory", lambda: room)
    rc, _, err = cli(capsys, "compile", *SMALL, "-o", tmp_path / "m.onnx")
    assert rc == 0, err
    err = cli_error(capsys, "run", *SMALL, "--input", "tokens=[[1, 2]]")  # a run holds them all
    assert "holding them about 3 times over" in err and "--allow-large" in err


def test_compile_refuses_a_model_larger_than_the_free_disk(capsys, tmp_path, monkeypatch):
    from tessera.runtime import pipeline

    monkeypatch.setattr(pipeline, "available_disk", lambda path: 1000)
    err = cli_error(capsys, "compile", *SMALL, "-o", tmp_path / "m.onnx")
    assert "has 0.0 GiB free" in err and "--allow-large" in err and not (tmp_path / "m.onnx").exists()
