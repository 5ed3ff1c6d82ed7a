"""fp16 export: weights and computation in half precision, the interface in fp32; checked against fp32."""

import numpy as np
import onnx
import pytest

from conftest import build, ort_run
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.precision import LowerPrecision
from tessera.runtime.io.weights import init_weights
from conftest import SMALL_MODELS as SMALL, feeds_for


@pytest.mark.parametrize("spec,sets", SMALL, ids=[s for s, _ in SMALL])
def test_fp16_export_matches_fp32(spec, sets, rng):
    want_graph = build(spec, **sets)
    weights = init_weights(want_graph, seed=4)
    feeds = feeds_for(want_graph, rng)
    want = ort_run(want_graph, weights, feeds)
    graph = build(spec, **sets)
    optimize(graph, Target("cpu", "fp16"))
    LowerPrecision("fp16")(graph)
    model = onnx_export.to_onnx(graph, weights)
    inits = {i.name: i.data_type for i in model.graph.initializer if "/" not in i.name}
    assert set(inits.values()) == {onnx.TensorProto.FLOAT16}, "every parameter is stored in fp16"
    got = ort_run(graph, weights, feeds)
    for name in want:
        assert got[name].dtype == np.float32  # the interface stays fp32
        scale = max(1.0, float(np.abs(want[name]).max()))
        assert np.abs(got[name] - want[name]).max() <= 1e-2 * scale, name


def test_bf16_export_for_the_cpu_is_refused_clearly(tmp_path, capsys):
    from conftest import MODELS
    from tessera.runtime.cli import main

    code = main(["compile", str(MODELS / "gpt2.tsr"), "--set", "layers=1", "--dtype", "bf16",
                 "-o", str(tmp_path / "m.onnx")])
    assert code == 2
    assert "--dtype bf16: onnxruntime's CPU kernels take no bfloat16" in capsys.readouterr().err
