"""topk_indices and topk_mask (compiler/ops/attention.py, their builtins and ONNX lowerings) against
torch.topk on values without ties and against numpy written here on values with ties (the lower index
first, as ONNX TopK documents), through the numpy interpreter and onnxruntime, fp32 and fp16; and a
hand-written DeepSeek-style choice built from them (the group mask) against the experts builtin."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops import interpret
from tessera.spec.diagnostics import SpecError

SPEC = """
model M(e = 8, k = 3) {
  in s: DT[B, T, e]
  out i: i64[B, T, k]
  out m: bool[B, T, e]
  out v: DT[B, T, k]
  i = topk_indices(s, k)
  m = topk_mask(s, k)
  v = gather(s, i, -1)
}
"""


def _graph(tmp_path, dtype="f32", k=3):
    (tmp_path / "m.tsr").write_text(SPEC.replace("DT", dtype).replace("k = 3", f"k = {k}"))
    return build(str(tmp_path / "m.tsr"))


def _numpy_topk(s, k):
    """Per row: the positions sorted by value descending, equal values by position ascending."""
    flat = s.reshape(-1, s.shape[-1])
    idx = np.array([sorted(range(len(r)), key=lambda j: (-float(r[j]), j))[:k] for r in flat]).reshape(
        s.shape[:-1] + (k,))
    mask = np.zeros(s.shape, bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return idx, mask


@pytest.mark.parametrize("k", [1, 3, 8])
def test_equal_torch_topk_without_ties(tmp_path, k):
    import torch

    s = np.random.default_rng(k).standard_normal((2, 5, 8)).astype(np.float32)
    want_v, want_i = torch.topk(torch.from_numpy(s), k, dim=-1)
    graph = _graph(tmp_path, k=k)
    for name, out in (("numpy", interpret.run(graph, {}, {"s": s})), ("onnxruntime", ort_run(graph, {}, {"s": s}))):
        assert (out["i"] == want_i.numpy()).all(), name
        assert np.array_equal(out["v"], want_v.numpy()), name
        mask = np.zeros(s.shape, bool)
        np.put_along_axis(mask, want_i.numpy(), True, axis=-1)
        assert (out["m"] == mask).all() and out["m"].dtype == np.bool_, name


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_ties_go_to_the_lower_index(tmp_path, dtype):
    rng = np.random.default_rng(9)
    s = rng.integers(-2, 3, (3, 6, 8)).astype(np.float16 if dtype == "f16" else np.float32)  # many ties
    want_i, want_m = _numpy_topk(s, 3)
    graph = _graph(tmp_path, dtype)
    for name, out in (("numpy", interpret.run(graph, {}, {"s": s})), ("onnxruntime", ort_run(graph, {}, {"s": s}))):
        assert (out["i"] == want_i).all(), name
        assert (out["m"] == want_m).all(), name


def test_a_group_choice_written_with_them_equals_the_builtin(tmp_path):
    """DeepSeek's group-limited choice written by hand (the groups' two best summed, topk_mask of the groups,
    the eligible scores' topk_indices) chooses what the experts builtin's routing chooses."""
    from tessera.compiler.ops.experts import route

    spec = """
model M(e = 8, g = 4) {
  in s: f32[N, e]
  out i: i64[N, 2]
  grouped = reshape(s, [N, g, e / g])
  best2 = sum(gather(grouped, topk_indices(grouped, 2), -1), -1)
  keep = reshape(expand(reshape(topk_mask(best2, 2), [N, g, 1]), [N, g, e / g]), [N, e])
  i = topk_indices(where(keep, s, -1000000.0), 2)
}
"""
    (tmp_path / "g.tsr").write_text(spec)
    graph = build(str(tmp_path / "g.tsr"))
    s = np.random.default_rng(2).random((40, 8)).astype(np.float32)
    # the builtin's reference with sigmoid scores: choose on sigmoid(logits) + bias; feed logits whose
    # sigmoid is s and a zero bias
    logits = np.log(s / (1 - s)).astype(np.float32)
    want, _ = route(logits, 2, True, {"scoring": "sigmoid", "groups": 4, "top_groups": 2, "correction_bias": True},
                    np.zeros(8, np.float32))
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert np.abs(sig - s).max() < 1e-6
    for name, out in (("numpy", interpret.run(graph, {}, {"s": s})), ("onnxruntime", ort_run(graph, {}, {"s": s}))):
        assert (np.sort(out["i"], -1) == np.sort(want, -1)).all(), name


@pytest.mark.parametrize("body,msg", [
    ("topk_mask(s, 9)", r"k=9 is more than the last axis' 8"),
    ("topk_mask(s, 0)", r"'k' must be at least 1"),
    ("topk_indices(cast(s, \"i64\"), 2)", r"top-k needs a floating-point tensor"),
])
def test_bad_calls_are_positioned_errors(tmp_path, body, msg):
    (tmp_path / "bad.tsr").write_text(f"model M(e = 8) {{\n  in s: f32[B, e]\n  out y: bool[B, e]\n  y = {body}\n}}\n")
    with pytest.raises(SpecError, match=r"bad\.tsr:\d+:\d+.*" + msg):
        build(str(tmp_path / "bad.tsr"))


def test_they_are_no_mixture_in_explain_or_the_report(tmp_path):
    from tessera.compiler.analysis import structure
    from tessera.compiler.passes.sparse_moe import SparseExperts

    graph = _graph(tmp_path)
    assert SparseExperts()(graph.copy()).notes == []
    assert structure.analyse(graph).experts == []
