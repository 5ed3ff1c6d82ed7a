"""The experts builtin's options (compiler/ops/experts.py: expert biases, a router bias, gpt-oss's clamped
SwiGLU) against gpt-oss's mixture of experts written here in numpy from transformers' GptOssMLP (router
with a bias, top k then softmax over them, gate and up biased, gate clamped above, up clamped both
sides, (up + 1) * gate * sigmoid(alpha * gate), down biased), through the numpy interpreter and both
ONNX lowerings on onnxruntime (gather, and com.microsoft.MoE with its fc biases and swiglu_limit); the
refusals of options that do not fit."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.passes.sparse_moe import SparseExperts
from tessera.runtime.io.weights import init_weights
from tessera.spec.diagnostics import SpecError

SPEC = """
model M(d = 16, e = 5, k = 2, f = 12) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = experts(x, e, k, f, bias=true, router_bias=true, act="clamped_swiglu", ARGS name="moe")
}
"""


def gpt_oss_moe(x, w, e, k, alpha, limit):
    """transformers' GptOssMLP in float64: logits = x R^T + r; the top k, softmax over them; per chosen
    expert gate_up = x W + b split even/odd (here already as gate and up), the clamped SwiGLU, down."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = flat @ w["moe.router.weight"].T.astype(np.float64) + w["moe.router.bias"]
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = np.argsort(-logits[t])[:k]
        s = np.exp(logits[t, top] - logits[t, top].max())
        for gate_w, i in zip(s / s.sum(), top):
            p = f"moe.experts.{i}.ffn."
            gate = flat[t] @ w[p + "gate.weight"].T + w[p + "gate.bias"]
            up = flat[t] @ w[p + "up.weight"].T + w[p + "up.bias"]
            gate = np.minimum(gate, limit)
            up = np.clip(up, -limit, limit)
            glu = gate * (1 / (1 + np.exp(-gate * alpha)))
            out[t] += gate_w * (((up + 1) * glu) @ w[p + "down.weight"].T + w[p + "down.bias"])
    return out.reshape(x.shape)


def _build(tmp_path, args=""):
    (tmp_path / "m.tsr").write_text(SPEC.replace("ARGS", args))
    return build(str(tmp_path / "m.tsr"))


@pytest.mark.parametrize("args,alpha,limit", [("", 1.702, 7.0), ("alpha=1.3, limit=0.8,", 1.3, 0.8)],
                         ids=["gpt-oss-defaults", "tight-limit"])
def test_clamped_biased_experts_equal_gpt_oss_in_numpy(tmp_path, args, alpha, limit):
    graph = _build(tmp_path, args)
    (node,) = [n for n in graph.nodes.values() if n.op == "sparse_moe"]
    assert node.attrs["act"] == "clamped_swiglu" and node.attrs["bias"] is True
    assert (node.attrs["alpha"], node.attrs["limit"]) == (alpha, limit)
    # every parameter, biases included, drawn off zero and large enough that the clamps bite
    rng = np.random.default_rng(7)
    w = {p: (v + rng.standard_normal(v.shape) * 0.6).astype(np.float32) for p, v in init_weights(graph, 0).items()}
    x = (rng.standard_normal((2, 9, 16)) * 2).astype(np.float32)
    want = gpt_oss_moe(x, w, 5, 2, alpha, limit)
    flat = x.reshape(-1, 16)
    gate = flat @ w["moe.experts.0.ffn.gate.weight"].T + w["moe.experts.0.ffn.gate.bias"]
    assert (gate > limit).any() and (np.abs(flat @ w["moe.experts.0.ffn.up.weight"].T) > limit).any(), \
        "the test's inputs must reach the clamps"
    outs = {"numpy": interpret.run(graph, w, {"x": x})["y"]}
    for impl in ("gather", "moe"):
        g = graph.copy()
        SparseExperts(impl=impl)(g)
        assert [n.attrs["impl"] for n in g.nodes.values() if n.op == "sparse_moe"] == [impl]
        outs[impl] = ort_run(g, w, {"x": x})["y"]
    for name, got in outs.items():
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), name


def test_biases_alone_with_plain_swiglu(tmp_path):
    """bias=true without the clamp: silu(gate) * up, each biased, against numpy; both lowerings."""
    (tmp_path / "m.tsr").write_text(SPEC.replace('router_bias=true, act="clamped_swiglu", ARGS', ""))
    graph = build(str(tmp_path / "m.tsr"))
    assert "moe.router.bias" not in graph.params and "moe.experts.4.ffn.down.bias" in graph.params
    rng = np.random.default_rng(3)
    w = {p: (v + rng.standard_normal(v.shape) * 0.4).astype(np.float32) for p, v in init_weights(graph, 0).items()}
    x = rng.standard_normal((1, 7, 16)).astype(np.float32)
    flat = x.reshape(-1, 16).astype(np.float64)
    logits = flat @ w["moe.router.weight"].T
    want = np.zeros_like(flat)
    for t in range(7):
        top = np.argsort(-logits[t])[:2]
        s = np.exp(logits[t, top] - logits[t, top].max())
        for gw, i in zip(s / s.sum(), top):
            p = f"moe.experts.{i}.ffn."
            g = flat[t] @ w[p + "gate.weight"].T + w[p + "gate.bias"]
            u = flat[t] @ w[p + "up.weight"].T + w[p + "up.bias"]
            want[t] += gw * ((g / (1 + np.exp(-g)) * u) @ w[p + "down.weight"].T + w[p + "down.bias"])
    for impl in ("gather", "moe"):
        g = graph.copy()
        SparseExperts(impl=impl)(g)
        assert np.abs(ort_run(g, w, {"x": x})["y"].reshape(-1, 16) - want).max() <= 1e-4, impl
    assert np.abs(interpret.run(graph, w, {"x": x})["y"].reshape(-1, 16) - want).max() <= 1e-4


def test_parameter_count_and_paths(tmp_path):
    graph = _build(tmp_path)
    d, e, f = 16, 5, 12
    assert graph.param_count() == e * d + e + e * (3 * d * f + 2 * f + d)
    assert graph.params["moe.experts.3.ffn.gate.bias"].shape == (f,)
    assert graph.params["moe.experts.3.ffn.down.bias"].shape == (d,)


@pytest.mark.parametrize("args,msg", [
    ('act="gelu",', r"'act' must be one of 'swiglu', 'clamped_swiglu'"),
    ('act="swiglu", limit=7.0,', r"'limit' applies to act=\"clamped_swiglu\" only"),
    ('limit=-1.0,', r"'limit' of the clamped SwiGLU must be a finite number > 0"),
    ('bias=1,', r"'bias' must be true or false"),
])
def test_bad_options_are_positioned_errors(tmp_path, args, msg):
    text = SPEC.replace("ARGS", args)
    if "act=" in args:
        text = text.replace('act="clamped_swiglu", ', "")
    if "bias=1" in args:
        text = text.replace("bias=true, router_bias", "router_bias")
    (tmp_path / "bad.tsr").write_text(text)
    with pytest.raises(SpecError, match=r"bad\.tsr:\d+:\d+.*" + msg):
        build(str(tmp_path / "bad.tsr"))


def test_the_op_refuses_unknown_activation_and_stray_clamp():
    from tessera.compiler import ops
    from tessera.compiler.ir import dims
    from tessera.compiler.ir.graph import TensorType

    f32 = lambda *s: TensorType("f32", dims.shape(s))  # noqa: E731
    biased = [f32(2, 8), f32(2, 2)] + [f32(4, 8), f32(4, 8), f32(8, 4), f32(4), f32(4), f32(8)] * 2
    assert ops.infer("sparse_moe", biased, {"k": 1, "experts": 2, "bias": True})[0].shape == biased[0].shape
    cases = [({"act": "gelu"}, "act must be one of"),
             ({"act": "clamped_swiglu", "alpha": 1.0}, "finite limit > 0"),
             ({"limit": 7.0}, "belong to act='clamped_swiglu'"),
             ({"bias": False}, "3 weights per expert")]
    for extra, msg in cases:
        with pytest.raises(ops.ShapeError, match=msg):
            ops.infer("sparse_moe", biased, {"k": 1, "experts": 2, "bias": True, **extra})
    bad_bias = biased[:5] + [f32(5)] + biased[6:]
    with pytest.raises(ops.ShapeError, match="expert 0 gate bias must be"):
        ops.infer("sparse_moe", bad_bias, {"k": 1, "experts": 2, "bias": True})


def test_the_cost_counts_biases_and_clamps_by_hand(tmp_path):
    """MACs: the k experts' 3·d·f each (biases add no multiply-adds); FLOPs' elementwise: the plain SwiGLU's
    n·k·f + 2·n·k·d, plus n·k·(2f + d) bias adds and 4·n·k·f for the clamp (min, clip, + 1, alpha·g)."""
    from tessera.compiler.analysis import cost

    graph = _build(tmp_path)
    (c,) = [c for c in cost.node_costs(graph)[0] if c.op == "sparse_moe"]
    b, t, d, k, f = 2, 9, 16, 2, 12
    n = b * t
    bind = {"B": b, "T": t}
    assert c.macs.evaluate(bind) == n * k * 3 * d * f
    flops = {kind: v.evaluate(bind) for kind, v in c.flops.items()}
    assert flops["elementwise"] == n * k * f + 2 * n * k * d + n * k * (2 * f + d) + 4 * n * k * f
