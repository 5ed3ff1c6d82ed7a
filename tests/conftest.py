"""Shared helpers: paths to the bundled specs and small builders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tessera.compiler import onnx_export
from tessera.compiler.elaborate import elaborate
from tessera.spec import load_program

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def build(spec: str, variant: str | None = None, **overrides):
    """Elaborate models/<spec>.tsr (or a path) with a variant and hyperparameter overrides."""
    path = Path(spec) if Path(spec).suffix == ".tsr" else MODELS / f"{spec}.tsr"
    graph, info = elaborate(load_program(path), variant, overrides)
    return graph


def ort_run(graph, weights, feeds, tmp_path=None):
    """Export to ONNX in memory and run it on onnxruntime's CPU provider."""
    import onnxruntime as ort

    model = onnx_export.to_onnx(graph, weights)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
