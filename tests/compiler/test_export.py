"""ONNX export: validity, determinism, names, dynamic dims, and agreement with numpy."""

import hashlib

import numpy as np
import onnx
import pytest

from conftest import MODELS, SMALL_MODELS, build, feeds_for, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.runtime.cli import main
from tessera.runtime.io.weights import init_weights

TINY_GPT2 = ["--set", "layers=2", "--set", "d=64", "--set", "heads=4", "--set", "vocab=1000", "--set", "ctx=128"]


def test_same_spec_and_seed_give_byte_identical_files(tmp_path):
    digests = []
    for i in range(2):
        out = tmp_path / f"m{i}.onnx"
        assert main(["compile", str(MODELS / "gpt2.tsr"), *TINY_GPT2, "--seed", "7", "-o", str(out)]) == 0
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    other = tmp_path / "other.onnx"
    assert main(["compile", str(MODELS / "gpt2.tsr"), *TINY_GPT2, "--seed", "8", "-o", str(other)]) == 0
    assert hashlib.sha256(other.read_bytes()).hexdigest() != digests[0]


def test_model_is_valid_with_named_dynamic_dims(tmp_path):
    out = tmp_path / "gpt2.onnx"
    assert main(["compile", str(MODELS / "gpt2.tsr"), *TINY_GPT2, "-o", str(out)]) == 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= 10
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["B", "T"]
    out_dims = [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert out_dims == ["B", "T", 1000]
    names = {i.name for i in model.graph.initializer}
    assert {"wte.weight", "layers.1.attn.q.weight", "layers.0.mlp.proj.bias"} <= names
    assert any(n.name.startswith("layers.0.attn.q/") for n in model.graph.node)


def _count_onnx_initializer_params(model: onnx.ModelProto) -> int:
    """Independent count: elements of every initializer named like a parameter path (constants have a '/')."""
    total = 0
    for init in model.graph.initializer:
        if "/" in init.name:
            continue
        total += int(np.prod(init.dims)) if init.dims else 1
    return total


def test_gpt2_small_params_from_onnx_equal_the_report(tmp_path):
    graph = build("gpt2", "small")
    weights = {p: np.zeros(v.shape, np.float32) for p, v in graph.params.items()}
    model = onnx_export.to_onnx(graph, weights)
    assert _count_onnx_initializer_params(model) == graph.param_count() == 124_439_808
    # the tied weight is stored once and read twice
    uses = [n for n in model.graph.node if "wte.weight" in n.input]
    assert len(uses) == 2


@pytest.mark.parametrize("spec,sets", SMALL_MODELS, ids=[s for s, _ in SMALL_MODELS])
def test_onnxruntime_agrees_with_the_numpy_interpreter(spec, sets, rng):
    graph = build(spec, **sets)
    weights = init_weights(graph, seed=3)
    # make norms and biases non-trivial so every parameter matters
    for p, w in weights.items():
        if not p.endswith("weight") or w.ndim == 1:
            weights[p] = w + rng.standard_normal(w.shape).astype(np.float32) * 0.1
    feeds = feeds_for(graph, rng, t=7)
    ref = interpret.run(graph, weights, feeds)
    got = ort_run(graph, weights, feeds)
    for name in ref:
        assert got[name].shape == ref[name].shape
        np.testing.assert_allclose(got[name], ref[name], atol=1e-4, rtol=1e-4, err_msg=name)


def test_external_data_for_models_past_2gb(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1000)
    graph = build("gpt2", layers=1, d=16, heads=2, vocab=100, ctx=16)
    files = onnx_export.save(onnx_export.to_onnx(graph, init_weights(graph)), tmp_path / "m.onnx")
    assert [f.name for f in files] == ["m.onnx", "m.onnx.data"]
    onnx_export.check(tmp_path / "m.onnx")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"tokens": np.zeros((1, 3), np.int64)})[0].shape == (1, 3, 100)
