"""One attention recogniser: the fusion pass (--explain) and the report's structure agree.

The two cases are the issue's disagreements: scores shifted by a constant (s - 1.0), which
--explain refused while the report counted it fused; and a bias computed from a model input,
which fusion fused while the report found no attention (no KV cache, the block labelled MLP).
Expected numbers are hand counts from the specs' shapes; numerics are checked against the
unfused graph run by the numpy interpreter and by onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.analysis import costreport
from tessera.compiler.report import attention_section
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.analysis.structure import analyse
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights

SPECS = Path(__file__).resolve().parents[1] / "specs"
SHIFT = str(SPECS / "score_shift.tsr")
MASK_BIAS = str(SPECS / "mask_bias.tsr")


def verdicts(graph):
    """(fused?, reason) per site from the fusion pass, and per attention from the report's structure."""
    st = analyse(graph)
    report = [(a.fusable, a.reason) for a in st.attention]
    sites = optimize(graph.copy())
    explain = [(s.fused, "" if s.fused else s.reason) for s in sites]
    return explain, report


# ------------------------------------------------------------------ s - 1.0: both fuse it
def test_scalar_shift_of_the_scores_is_fused_by_both():
    explain, report = verdicts(build(SHIFT))
    assert explain == report == [(True, "")]


def test_scalar_shift_fuses_as_a_bias_of_minus_the_constant():
    g = build(SHIFT)
    (site,) = optimize(g)
    node = g.nodes[site.node]
    assert node.op == "fused_attention" and node.attrs["bias"] and node.attrs["causal"]
    assert node.attrs["scale"] == pytest.approx(1 / np.sqrt(8))  # d / heads = 8
    assert float(g.consts[node.inputs[3]]) == -1.0
    assert not any(n.op in ("sub", "softmax") for n in g.nodes.values())


def test_scalar_shift_fused_numerics_equal_the_unfused_graph(rng):
    unfused, fused = build(SHIFT), build(SHIFT)
    optimize(fused)
    w = init_weights(unfused, 3)
    feeds = {"x": rng.standard_normal((2, 11, 16)).astype(np.float32),
             "t": rng.standard_normal((11, 11)).astype(np.float32)}
    want = interpret.run(unfused, w, feeds)["y"]
    np.testing.assert_allclose(interpret.run(fused, w, feeds)["y"], want, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(ort_run(fused, w, feeds)["y"], want, atol=1e-5, rtol=1e-5)


def test_report_fused_peak_is_what_fusion_makes_of_a_shifted_site():
    """The report's fused peak (predicted from structure) is the unfused peak of the graph the fusion
    pass actually returns: it fails whenever the report assumes a fusion the pass does not do."""
    before = costreport.build_report(build(SHIFT), "ScoreShift", None, {}, seq=512)
    g = build(SHIFT)
    assert all(s.fused for s in optimize(g))
    after = costreport.build_report(g, "ScoreShift", None, {}, seq=512)
    peak = "activations_peak_bytes"
    assert before["memory"][peak]["fused"] < before["memory"][peak]["unfused"]
    assert after["memory"][peak]["unfused"] == before["memory"][peak]["fused"]


def test_report_fused_peak_of_a_refused_site_is_its_unfused_peak():
    """The seed's worked example returns its attention weights, so fusion refuses it: the report's
    fused figures must then be the unfused ones (the graph fusion returns is unchanged)."""
    spec = Path(__file__).resolve().parents[2] / "models" / "worked_example.tsr"
    g = build(spec)
    assert not any(s.fused for s in optimize(g))
    report = costreport.build_report(build(spec), "WorkedExample", None, {}, seq=512)
    peak = report["memory"]["activations_peak_bytes"]
    assert peak["fused"] == peak["unfused"]
    after = costreport.build_report(g, "WorkedExample", None, {}, seq=512)
    assert after["memory"]["activations_peak_bytes"]["unfused"] == peak["fused"]


def test_tensor_shift_is_refused_by_both_with_one_reason():
    explain, report = verdicts(build(SHIFT, shift=False, tensor_shift=True))
    reason = "a tensor (t) is subtracted from the scores; the fused kernel adds a bias, it does not subtract one"
    assert explain == report == [(False, reason)]


# ------------------------------------------------------------------ a bias computed from a model input
def test_input_derived_bias_is_fused_and_seen_by_the_report():
    explain, report = verdicts(build(MASK_BIAS))
    assert explain == report == [(True, ""), (True, "")]


def test_input_derived_bias_kv_cache_is_counted():
    # two causal self-attentions, each keeping K and V of [B, heads=2, N, hd=8] in fp32:
    # 2 layers x 2 tensors x 2 heads x 8 x 4 bytes = 256 bytes per token; at B = 1, N = 16: 4,096
    rep = costreport.build_report(build(MASK_BIAS), "MaskBias", None, {}, batch=1, seq=16)
    assert rep["memory"]["kv_cache_attentions"] == 2
    assert rep["memory"]["kv_cache_bytes"] == 2 * 2 * 2 * 8 * 4 * 16 == 4096
    assert rep["memory"]["formulas"]["kv_cache_bytes"] == "256·B·N"


def test_input_derived_bias_block_is_labelled_attention():
    labels = [r["label"] for r in parameter_report(build(MASK_BIAS))["table"]]
    # q, k, v, o: 4 x (16 x 16 + 16) = 1,088 parameters
    assert "layers.0.attn (causal self-attention)" in labels, labels
    assert not any(lab.startswith("layers.0.attn (MLP") for lab in labels)


def test_input_derived_bias_fused_numerics(rng):
    unfused, fused = build(MASK_BIAS), build(MASK_BIAS)
    optimize(fused)
    w = init_weights(unfused, 4)
    mask = np.ones((2, 13), np.int64)
    mask[1, -4:] = 0
    feeds = {"x": rng.standard_normal((2, 13, 16)).astype(np.float32), "mask": mask}
    want = interpret.run(unfused, w, feeds)["y"]
    np.testing.assert_allclose(interpret.run(fused, w, feeds)["y"], want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ort_run(fused, w, feeds)["y"], want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the report leaves its graph alone
def test_attention_report_leaves_the_callers_graph_unchanged():
    g = build(MASK_BIAS)
    before = g.dump()
    section = attention_section(g, {"B": 1, "T": 64}, 4, "cpu", "fp32")
    assert section["fused"] == 2 and section["not_fused"] == 0
    assert g.dump() == before
    assert sum(n.op == "softmax" for n in g.nodes.values()) == 2
    assert not any(n.op == "fused_attention" for n in g.nodes.values())


def test_report_and_explain_agree_on_the_bundled_models():
    from conftest import SMALL_MODELS, MODELS

    for spec, sets in SMALL_MODELS + [(str(MODELS / "worked_example.tsr"), {})]:
        explain, report = verdicts(build(spec, **sets))
        assert explain == report, spec


def test_cuda_target_kernel_choice_reads_the_recogniser():
    g = build(MASK_BIAS)
    sites = optimize(g, Target("cuda", "fp16"))
    # a bias rules out GroupQueryAttention and MultiHeadAttention; onnx's Attention (opset 23) takes it
    # as its attn_mask on CUDA (issue 37), so every site gets that kernel, not the portable Loop
    assert [s.impl for s in sites] == ["attn23", "attn23"]
