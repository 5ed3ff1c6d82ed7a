"""Sparse experts (compiler/ops/experts.py, compiler/passes/sparse_moe.py) against the dense moe block
and against a Mixtral mixture of experts written here in numpy; the report's MACs against a hand count.
(The comparison with Hugging Face's MixtralForCausalLM is in test_families.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, Recomputation, build, cli, ort_run
from tessera.compiler import ops
from tessera.compiler.analysis import costreport
from tessera.compiler.ir.graph import Graph, TensorType
from tessera.compiler.ir import dims
from tessera.compiler.passes.sparse_moe import DISABLED, SparseExperts
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights

SMALL = dict(layers=2, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48, experts=4, top=2)
TOL = 1e-5


def mixtral_moe(x, router, experts, k):
    """Mixtral's block (transformers' MixtralSparseMoeBlock): softmax over all router logits, the top k,
    renormalised; each token's output is the weighted sum of its k experts' w2(silu(w1 x) * w3 x)."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = flat @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = np.argsort(-p[t])[:k]
        w = p[t, top] / p[t, top].sum()
        for wi, e in zip(w, top):
            w1, w3, w2 = experts[e]
            g = flat[t] @ w1.T
            out[t] += wi * ((g / (1 + np.exp(-g)) * (flat[t] @ w3.T)) @ w2.T)
    return out.reshape(x.shape)


def _weights(graph, rng, scale=0.3):
    """Seeded weights moved off their initial scale, so that routing varies from token to token."""
    return {k: (v + rng.standard_normal(v.shape) * scale).astype(v.dtype) for k, v in init_weights(graph, 0).items()}


def _sparse(graph, impl="gather"):
    g = graph.copy()
    result = SparseExperts(impl=impl)(g)
    return g, result.notes


# ---------------------------------------------------------------- the op against numpy written here
@pytest.mark.parametrize("impl", ["moe", "gather"])
@pytest.mark.parametrize("t", [1, 7])
def test_op_matches_mixtral_in_numpy(rng, impl, t):
    e, k, d, f = 5, 2, 16, 24
    g = Graph("moe")
    B, T = dims.symbol("B"), dims.symbol("T")
    g.add_input("x", TensorType("f32", (B, T, dims.dim(d))))
    x = rng.standard_normal((3, t, d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    experts = [tuple(rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((f, d), (f, d), (d, f)))
               for _ in range(e)]
    logits = (x @ router.T).astype(np.float32)
    want = mixtral_moe(x, router, experts, k)
    got = ops.get("sparse_moe").reference([x, logits] + [w for ex in experts for w in ex], {"k": k, "experts": e}, None)
    assert np.abs(got - want).max() <= TOL
    # through onnxruntime: the op alone in a graph (router logits as a second input)
    from tessera.compiler.ir.graph import Param

    g.add_input("logits", TensorType("f32", (B, T, dims.dim(e))))
    names = []
    for i, ex in enumerate(experts):
        for part, w in zip(("gate", "up", "down"), ex):
            path = f"experts.{i}.{part}.weight"
            g.add_param(Param(path, tuple(w.shape), "f32", "normal"))
            names.append(path)
    node = g.add_node("sparse_moe", ["x", "logits"] + names, [TensorType("f32", (B, T, dims.dim(d)))],
                      {"k": k, "experts": e, "impl": impl}, "", None)
    g.outputs.append(node.outputs[0])
    weights = {p: w for p, w in zip(names, [w for ex in experts for w in ex])}
    out = ort_run(g, weights, {"x": x, "logits": logits})[node.outputs[0]]
    assert np.abs(out - want).max() <= TOL


def test_op_type_rule_errors():
    f32 = lambda *s: TensorType("f32", dims.shape(s))  # noqa: E731
    good = [f32(2, 8), f32(2, 3)] + [f32(4, 8), f32(4, 8), f32(8, 4)] * 3
    assert ops.infer("sparse_moe", good, {"k": 2, "experts": 3})[0].shape == good[0].shape
    cases = [(good, {"k": 4, "experts": 3}, "1 <= k <= experts"),
             (good[:-1], {"k": 2, "experts": 3}, "3 weights per expert"),
             ([good[0], f32(2, 4)] + good[2:], {"k": 2, "experts": 3}, "logits must be"),
             (good[:2] + [f32(4, 8), f32(4, 8), f32(8, 5)] + good[5:], {"k": 2, "experts": 3}, "expert 0 down"),
             (good, {"k": 2, "experts": 3, "impl": "fast"}, "impl must be")]
    for types, attrs, msg in cases:
        with pytest.raises(ops.ShapeError, match=msg):
            ops.infer("sparse_moe", types, attrs)


# ---------------------------------------------------------------- the pass on the stdlib's dense block
@pytest.mark.parametrize("impl", ["moe", "gather"])
def test_sparse_equals_dense_numpy_and_onnxruntime(rng, impl):
    dense = build("mixtral", None, **SMALL)
    sparse, notes = _sparse(dense, impl)
    assert [n.sparse for n in notes] == [True, True] and all(n.impl == impl for n in notes)
    ops_left = {n.op for n in sparse.nodes.values()}
    assert "sparse_moe" in ops_left and not ops_left & {"topk_gates", "silu", "slice"}
    w = _weights(dense, rng)
    feeds = {"tokens": rng.integers(0, 50, (2, 19)).astype(np.int64)}
    want = interpret.run(dense, w, feeds)["logits"]
    want_ort = ort_run(dense, w, feeds)["logits"]
    got_ort = ort_run(sparse, w, feeds)["logits"]
    # sparse against dense, each run the same way: numpy interpreter, onnxruntime (absolute, logits up to ~8)
    assert np.abs(interpret.run(sparse, w, feeds)["logits"] - want).max() <= TOL
    assert np.abs(got_ort - want_ort).max() <= TOL
    # and onnxruntime against numpy (fp32 rounding of the whole model, as for the dense graph)
    assert np.abs(got_ort - want).max() <= TOL * np.abs(want).max()


def test_block_output_matches_numpy_mixtral(rng, tmp_path):
    """One moe block (the stdlib's, made sparse) against mixtral_moe above, on the block's own input."""
    spec = build_spec(tmp_path, """
model M(d = 16) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = moe(x, 6, 2, 20, name="moe")
}""")
    sparse, notes = _sparse(spec)
    assert notes[0].sparse
    w = _weights(spec, rng, 0.4)
    x = rng.standard_normal((2, 9, 16)).astype(np.float32)
    experts = [tuple(w[f"moe.experts.{e}.ffn.{p}.weight"] for p in ("gate", "up", "down")) for e in range(6)]
    want = mixtral_moe(x, w["moe.router.weight"], experts, 2)
    assert np.abs(interpret.run(sparse, w, {"x": x})["y"] - want).max() <= TOL
    assert np.abs(ort_run(sparse, w, {"x": x})["y"] - want).max() <= TOL


def build_spec(tmp_path, text):
    path = tmp_path / "m.tsr"
    path.write_text(text)
    return build(str(path))


def test_non_swiglu_experts_stay_dense_with_a_reason(tmp_path):
    graph = build_spec(tmp_path, """
model M(d = 16) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = moe(x, 4, 2, 20, ffn=mlp, name="moe")
}""")
    before = len(graph.nodes)
    result = SparseExperts()(graph)
    (site,) = result.notes
    assert not site.sparse and "SwiGLU" in site.reason
    assert len(graph.nodes) == before and not result.changed


def test_disabled_keeps_the_dense_form():
    graph = build("mixtral", None, **SMALL)
    result = SparseExperts(enabled=False)(graph)
    assert [n.reason for n in result.notes] == [DISABLED, DISABLED]
    assert "sparse_moe" not in {n.op for n in graph.nodes.values()}


# ---------------------------------------------------------------- cost: the active experts only
def test_report_macs_are_the_active_count_by_hand():
    b, n = 2, 64
    d, layers, heads, kv, vocab, f, e, k = 32, 2, 4, 2, 50, 48, 4, 2
    hd = d // heads
    dense = build("mixtral", None, **SMALL)
    sparse, _ = _sparse(dense)
    per_token = layers * (d * d * 2 + d * kv * hd * 2      # q, o; k, v (grouped-query heads)
                          + d * e                          # router
                          + k * 3 * d * f)                 # the k experts each token runs
    per_token += d * vocab                                 # head
    attention = layers * heads * n * n * hd * 2            # q·kᵀ and p·v, every pair (macs.total)
    hand = b * n * per_token + b * attention
    rep = costreport.build_report(sparse, "M", None, {}, batch=b, seq=n)
    assert rep["macs"]["total"] == hand
    assert rep["macs"]["active"] == hand                   # nothing left to discount
    drep = costreport.build_report(dense, "M", None, {}, batch=b, seq=n)
    assert drep["macs"]["total"] - hand == b * n * layers * (e - k) * 3 * d * f
    assert drep["macs"]["active"] == hand                  # the dense report's sparse estimate agrees
    assert rep["params"]["total"] == drep["params"]["total"]
    assert rep["params"]["active_per_token"] == drep["params"]["active_per_token"]
    assert rep["params"]["moe"]["dense_in_graph"] is False and drep["params"]["moe"]["dense_in_graph"] is True
    assert any("sparse: each token runs its top 2 of 4" in t for t in rep["notes"])
    assert rep["flops"]["matmul"] == 2 * hand


# ---------------------------------------------------------------- the command line
def test_cli_report_compile_and_explain(capsys, tmp_path):
    sets = [a for kv in SMALL.items() for a in ("--set", f"{kv[0]}={kv[1]}")]
    import json

    rc, out, _ = cli(capsys, "report", "mixtral", *sets, "--format", "json", "-N", "16")
    sparse = json.loads(out)
    rc2, out2, _ = cli(capsys, "report", "mixtral", *sets, "--format", "json", "-N", "16", "--no-sparse-moe")
    dense = json.loads(out2)
    assert rc == rc2 == 0
    assert dense["macs"]["total"] - sparse["macs"]["total"] == 16 * 2 * (4 - 2) * 3 * 32 * 48
    assert sparse["macs"]["total"] == dense["macs"]["active"]
    import onnx

    for flag, want in (([], True), (["--no-sparse-moe"], False)):
        path = tmp_path / f"m{len(flag)}.onnx"
        rc, _, err = cli(capsys, "compile", "mixtral", *sets, "-o", path, "--explain", *flag)
        assert rc == 0, err
        assert ("ScatterND" in {n.op_type for n in onnx.load(str(path)).graph.node}) == want
        assert "mixtures of experts: 2 (2 sparse, 0 dense)" in err if want else "0 sparse, 2 dense" in err


def test_quantised_experts_stay_dense(capsys, tmp_path):
    sets = [a for kv in SMALL.items() for a in ("--set", f"{kv[0]}={kv[1]}")]
    rc, _, err = cli(capsys, "compile", "mixtral", *sets, "-o", tmp_path / "q.onnx", "--explain",
                     "--quantize", "int8", "--quantize-block", "16")
    assert rc == 0, err
    assert "experts are quantised" in err



# ---------------------------------------------------------------- KV-cached decoding (T = 1 per step)
@pytest.mark.parametrize("impl", ["gather", "moe"])
def test_cached_decoder_runs_sparse_experts_and_equals_dense_recomputation(rng, impl, monkeypatch):
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime import pipeline
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

    sets = [f"{k}={v}" for k, v in SMALL.items()]
    built = pipeline.build(MODELS / "mixtral.tsr", None, sets)
    weights = _weights(built.graph, rng)
    from tessera.compiler.passes import sparse_moe

    monkeypatch.setattr(sparse_moe, "DEFAULT_IMPL", impl)
    model, info = compile_cached(built, weights)
    from tessera.compiler.backends.onnx.bound_step import general_graph

    assert ("ScatterND" if impl == "gather" else "MoE") in {n.op_type for n in general_graph(model).node}
    dense = pipeline.build(MODELS / "mixtral.tsr", None, sets)
    full = ort.InferenceSession(onnx_export.to_onnx(dense.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    prompts = [rng.integers(1, 50, 9).tolist(), rng.integers(1, 50, 4).tolist()]
    check = Recomputation(full, prompts, relative=True)
    generate(CachedModel(model.SerializeToString(), info), prompts, 6, on_logits=check)
    assert check.worst <= TOL


@pytest.mark.parametrize("impl", ["gather", "moe"])
def test_fp16_sparse_is_close_to_fp16_dense(rng, impl):
    """--dtype fp16: both lowerings run in onnxruntime (the gather form sums in fp32: the CPU provider has
    no fp16 ScatterND add) and stay as close to fp32 as the dense fp16 graph does."""
    from tessera.compiler.passes.precision import LowerPrecision

    dense = build("mixtral", None, **SMALL)
    w = _weights(dense, rng)
    feeds = {"tokens": rng.integers(0, 50, (2, 11)).astype(np.int64)}
    want = interpret.run(dense, w, feeds)["logits"]
    sparse, _ = _sparse(dense, impl)
    LowerPrecision("fp16")(sparse)
    LowerPrecision("fp16")(dense)
    err_dense = np.abs(ort_run(dense, w, feeds)["logits"] - want).max()
    err_sparse = np.abs(ort_run(sparse, w, feeds)["logits"] - want).max()
    assert err_sparse <= max(2 * err_dense, 1e-2 * np.abs(want).max()), (err_sparse, err_dense)


def test_gates_used_outside_the_block_stay_dense(tmp_path, rng):
    """A hand-written mixture whose gates are also a model output: the sum can go, the gates cannot,
    so the pass leaves it dense and says why; the graph still runs."""
    graph = build_spec(tmp_path, """
model M(d = 16) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  out gates: f32[B, T, 4]
  gates = topk_gates(linear(x, 4, bias=false, name="router"), 2)
  y = 0.0
  repeat 4 as e {
    y += swiglu(x, 20, name="expert") * slice(gates, -1, e, e + 1)
  }
}""")
    result = SparseExperts()(graph)
    (site,) = result.notes
    assert not site.sparse and "also read by identity" in site.reason
    w = _weights(graph, rng)
    x = rng.standard_normal((1, 3, 16)).astype(np.float32)
    assert ort_run(graph, w, {"x": x})["y"].shape == (1, 3, 16)


def qwen_moe(x, router, experts, k):
    """Qwen2-MoE's routing with norm_topk_prob=false (transformers' Qwen2MoeSparseMoeBlock, shared
    expert aside): softmax over all router logits, the top k kept as they are (not renormalised)."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = flat @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for e in np.argsort(-p[t])[:k]:
            w1, w3, w2 = experts[e]
            g = flat[t] @ w1.T
            out[t] += p[t, e] * ((g / (1 + np.exp(-g)) * (flat[t] @ w3.T)) @ w2.T)
    return out.reshape(x.shape)


@pytest.mark.parametrize("impl", ["gather", "moe"])
def test_unnormalised_gates_stay_sparse_and_equal_qwen_moe(rng, tmp_path, impl):
    """Issue 24: moe(..., normalize=false) once needed a dense router the sparse pass refused."""
    spec = build_spec(tmp_path, """
model M(d = 16, normalize = false) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = moe(x, 6, 2, 20, normalize=normalize, name="moe")
}""")
    sparse, notes = _sparse(spec, impl)
    assert notes[0].sparse and notes[0].impl == impl
    (node,) = [n for n in sparse.nodes.values() if n.op == "sparse_moe"]
    assert node.attrs["normalize"] is False
    w = _weights(spec, rng, 0.4)
    x = rng.standard_normal((2, 9, 16)).astype(np.float32)
    experts = [tuple(w[f"moe.experts.{e}.ffn.{p}.weight"] for p in ("gate", "up", "down")) for e in range(6)]
    want = qwen_moe(x, w["moe.router.weight"], experts, 2)
    assert np.abs(want - mixtral_moe(x, w["moe.router.weight"], experts, 2)).max() > 1e-2  # not the renormalised
    for g in (spec, sparse):  # dense (topk_gates normalize=false) and sparse, numpy and onnxruntime
        assert np.abs(interpret.run(g, w, {"x": x})["y"] - want).max() <= TOL
        assert np.abs(ort_run(g, w, {"x": x})["y"] - want).max() <= TOL


EXPERTS = """
model M(d = 16, e = 6, k = 2, f = 8, normalize = true) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = experts(x, e, k, f, normalize=normalize, name="moe")
}
"""

DENSE = EXPERTS.replace('experts(x, e, k, f, normalize=normalize, name="moe")',
                        'moe(x, e, k, f, normalize=normalize, name="moe")')


@pytest.mark.parametrize("normalize", [True, False])
def test_the_experts_builtin_equals_the_dense_moe_block_and_numpy(tmp_path, normalize):
    """experts(...) is one sparse_moe node with the moe block's parameter paths: with the same weights
    it equals the dense block in the interpreter and onnxruntime, and numpy written here (softmax over
    the top-k logits, or over all of them kept at the top k; each token's chosen SwiGLU experts)."""
    from conftest import build, ort_run
    from tessera.compiler.ops import interpret
    from tessera.runtime.io.weights import init_weights

    (tmp_path / "s.tsr").write_text(EXPERTS)
    (tmp_path / "d.tsr").write_text(DENSE)
    sparse = build(str(tmp_path / "s.tsr"), normalize=normalize)
    dense = build(str(tmp_path / "d.tsr"), normalize=normalize)
    assert [n.op for n in sparse.nodes.values()] == ["linear", "sparse_moe", "identity"]
    assert set(sparse.params) == set(dense.params) and sparse.param_count() == dense.param_count()
    w = init_weights(dense, seed=5)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    logits = x.reshape(-1, 16) @ w["moe.router.weight"].T
    want = np.zeros((10, 16), np.float32)
    for t in range(10):
        top = np.argsort(-logits[t], kind="stable")[:2]
        p = np.exp(logits[t] - logits[t].max())
        gates = (p[top] / p[top].sum()) if normalize else (p / p.sum())[top]
        for e, g in zip(top, gates):
            pre = f"moe.experts.{e}.ffn."
            a = x.reshape(-1, 16)[t] @ w[pre + "gate.weight"].T
            want[t] += g * (((a / (1 + np.exp(-a))) * (x.reshape(-1, 16)[t] @ w[pre + "up.weight"].T))
                            @ w[pre + "down.weight"].T)
    for got in (interpret.run(sparse, w, {"x": x})["y"], ort_run(sparse, w, {"x": x})["y"],
                interpret.run(dense, w, {"x": x})["y"]):
        np.testing.assert_allclose(got.reshape(-1, 16), want, rtol=1e-5, atol=1e-6)


def test_experts_builtin_errors_are_positioned(tmp_path):
    """top past count: a SpecError at the call (file:line:col), no traceback."""
    from tessera.spec.diagnostics import SpecError

    (tmp_path / "bad.tsr").write_text(EXPERTS.replace("k = 2", "k = 7"))
    with pytest.raises(SpecError, match=r"bad\.tsr:\d+:\d+.*experts: top=7 is more than count=6"):
        build(str(tmp_path / "bad.tsr"))
