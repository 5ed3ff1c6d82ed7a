"""The op registry: every op has every facet, every op the frontend and the passes can emit is
registered, incomplete or unknown ops are errors; and conv1d, the op added through it, checked
against a direct loop, PyTorch, onnxruntime and a hand count of its cost."""

from __future__ import annotations

import ast
import concurrent.futures
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, build, ort_run
from tessera.compiler import ops
from tessera.compiler.analysis import cost, memory, params
from tessera.compiler.ir import dims
from tessera.compiler.ir.graph import Graph, TensorType
from tessera.compiler.ops import registry
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights
from tessera.spec.diagnostics import SpecError

COMPILER = ROOT / "compiler"


# ------------------------------------------------------------------ facets
def test_every_registered_op_has_every_facet():
    defs = ops.all_ops()
    assert len(defs) >= 40
    for name, d in defs.items():
        assert d.name == name
        for facet in ("rule", "reference"):
            assert callable(getattr(d, facet)), (name, facet)
        assert isinstance(d.cost, registry.Cost), name
        assert d.cost.kind in ("free", "per_element", "product", "custom"), name
        if d.cost.kind == "product":
            assert d.cost.macs is not None, name
        if d.cost.kind == "per_element":
            assert d.cost.category and d.cost.per > 0, name
        if d.cost.kind == "custom":
            assert d.cost.flops is not None, name
        assert callable(d.saved) or all(p == "out" or isinstance(p, int) for p in d.saved), name
        assert set(d.traits) <= set(registry.TRAITS), name
        assert d.doc, f"op '{name}' has no docstring on its type rule"


def test_the_onnx_lowering_table_covers_every_registered_op_and_nothing_else():
    from tessera.compiler.backends.onnx.lowerings import LOWERINGS, lowering

    registered = set(ops.all_ops())
    assert registered - set(LOWERINGS) == set(), "ops without an ONNX lowering"
    assert set(LOWERINGS) - registered == set(), "lowerings of ops the registry does not define"
    assert all(callable(f) for f in LOWERINGS.values())
    with pytest.raises(KeyError, match="no_such_op"):
        lowering("no_such_op")


def test_traits_are_consistent():
    dense, mm = ops.with_trait("dense"), ops.with_trait("matmul_class")
    assert {"linear", "conv1d", "conv2d"} <= dense <= mm
    assert {"matmul", "fused_attention"} <= mm
    for name in ops.with_trait("alias"):
        assert ops.get(name).cost.kind == "free", name
    for name, d in ops.all_ops().items():
        if d.cost.kind == "product" or d.cost.per_pair:
            assert name in mm, name


def _op_literals(path: Path) -> set[str]:
    """Op names written as literals where the frontend and the passes make nodes: the first
    argument of emit/add_node, the second of replace_node, the helpers that wrap emit
    (_unary_builtin, _scalar_math, _reduce), ``node.op = "..."``, and the operator table
    of the elaborator's tensor arithmetic."""
    found: set[str] = set()
    # parsed in a thread of its own: in a full run on CPython 3.11.7, ast.parse in pytest's thread once raised
    # "SystemError: AST constructor recursion depth mismatch (before=123, after=74)" -- the interpreter's
    # recursion counters of that thread left inconsistent by something earlier in the run (it passes alone);
    # a fresh thread starts from its own counters
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        tree = pool.submit(ast.parse, path.read_text()).result()

    def lit(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            fname = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            pos = {"emit": 0, "add_node": 0, "replace_node": 1, "_unary_builtin": 0, "_scalar_math": 1,
                   "_reduce": 1}.get(fname)
            if pos is not None and len(n.args) > pos and lit(n.args[pos]):
                found.add(lit(n.args[pos]))
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                targets, values = ([t], [n.value]) if not isinstance(t, ast.Tuple) else (
                    t.elts, n.value.elts if isinstance(n.value, ast.Tuple) else [])
                for tt, v in zip(targets, values):
                    if isinstance(tt, ast.Attribute) and tt.attr == "op" and lit(v):
                        found.add(lit(v))
                    if isinstance(tt, ast.Name) and tt.id.endswith("_OP") and lit(v):  # FUSED_OP = "..."
                        found.add(lit(v))
        elif isinstance(n, ast.FunctionDef) and n.name == "_tensor_binop":
            for d in ast.walk(n):
                if isinstance(d, ast.Dict):
                    found |= {lit(v) for v in d.values if lit(v)}
    return found


def test_every_op_the_frontend_and_passes_emit_is_registered():
    frontend = _op_literals(COMPILER / "frontend" / "builtins.py") | _op_literals(COMPILER / "frontend" / "elaborate.py")
    passes = set().union(*(_op_literals(p) for d in ("passes", "patterns") for p in (COMPILER / d).glob("*.py")))
    # the scan itself must see the ops it is meant to see
    assert {"linear", "conv1d", "conv2d", "relu", "sqrt", "mean", "sum", "add", "pow", "neg", "identity"} <= frontend
    assert {"fused_attention", "cast"} <= passes
    missing = sorted(n for n in frontend | passes if not ops.is_registered(n))
    assert not missing, f"emitted but not registered: {missing}"


@pytest.mark.parametrize("spec,overrides", [
    ("gpt2", dict(layers=1, d=32, heads=4, vocab=50, ctx=16)),
    ("llama", dict(layers=1, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48)),
    ("transformer", dict(layers=1, d=32, heads=4, vocab=50, d_ff=64)),
])
def test_graphs_after_the_passes_hold_only_registered_ops(spec, overrides):
    from tessera.compiler.passes.pipeline import optimize

    g = build(spec, None, **overrides)
    optimize(g)
    used = {n.op for n in g.nodes.values()}
    assert "fused_attention" in used
    assert all(ops.is_registered(o) for o in used), used - set(ops.all_ops())


# ------------------------------------------------------------------ errors
def test_an_op_without_a_cost_or_memory_facet_is_refused_at_registration():
    def rule(t, a):
        """x"""
        return [t[0]]

    for missing in ("cost", "saved", "reference"):
        facets = dict(reference=lambda x, a, ev: x[0], cost=registry.free(), saved=())
        del facets[missing]
        with pytest.raises(registry.RegistryError, match=missing):
            registry.op("test_incomplete_op", **facets)(rule)
        assert not ops.is_registered("test_incomplete_op")


def test_bad_definitions_are_refused():
    def rule(t, a):
        return [t[0]]

    ok = dict(reference=lambda x, a, ev: x[0], cost=registry.free(), saved=())
    with pytest.raises(registry.RegistryError, match="defined twice"):
        registry.op("linear", **ok)(rule)
    with pytest.raises(registry.RegistryError, match="unknown trait"):
        registry.op("test_bad_trait", **ok, traits=("dnese",))(rule)
    with pytest.raises(registry.RegistryError, match="registry.Cost"):
        registry.op("test_bad_cost", **{**ok, "cost": 0})(rule)
    with pytest.raises(registry.RegistryError, match="saved"):
        registry.op("test_bad_saved", **{**ok, "saved": ("input",)})(rule)
    assert not any(ops.is_registered(n) for n in ("test_bad_trait", "test_bad_cost", "test_bad_saved"))


def test_an_unknown_op_is_named():
    with pytest.raises(ops.UnknownOp, match="unknown op 'mystery_kernel'"):
        ops.get("mystery_kernel")
    g = Graph("g")
    x = g.add_input("x", TensorType("f32", dims.shape((2, 3))))
    g.add_node("mystery_kernel", [x.name], [TensorType("f32", dims.shape((2, 3)))], {}, "blk", None)
    with pytest.raises(ops.ShapeError, match="mystery_kernel"):
        ops.check_graph(g)
    with pytest.raises(ops.UnknownOp, match="mystery_kernel"):
        interpret.run(g, {}, {"x": np.zeros((2, 3), np.float32)})


# ------------------------------------------------------------------ conv1d
WHISPER = """
model Front(d = 16, n_mels = 80, frames = 63) {
  in mel: f32[B, n_mels, frames]
  out h: f32[B, d, (frames - 1) // 2 + 1]
  h = gelu(conv1d(mel, d, 3, padding=1, name="conv1"))
  h = gelu(conv1d(h, d, 3, stride=2, padding=1, name="conv2"))
}
"""


def _spec(tmp_path, text, name="front.tsr"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def conv1d_loop(x, w, b, stride, pad):
    """y[n, o, i] = b[o] + sum over c, j of x_padded[n, c, i*stride + j] * w[o, c, j]."""
    n, c, length = x.shape
    o, c2, k = w.shape
    assert c == c2
    xp = np.zeros((n, c, length + 2 * pad), np.float64)
    xp[:, :, pad:pad + length] = x
    out_len = (length + 2 * pad - k) // stride + 1
    y = np.zeros((n, o, out_len), np.float64)
    for bi in range(n):
        for oi in range(o):
            for i in range(out_len):
                total = 0.0
                for ci in range(c):
                    for j in range(k):
                        total += xp[bi, ci, i * stride + j] * w[oi, ci, j]
                y[bi, oi, i] = total + (b[oi] if b is not None else 0.0)
    return y


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    return build(_spec(tmp_path_factory.mktemp("spec"), WHISPER, "front.tsr"))


def test_conv1d_shapes_follow_whisper(front):
    conv = [n for n in front.nodes.values() if n.op == "conv1d"]
    assert [front.type_of(n.outputs[0]).shape[1:] for n in conv] == [(16, 63), (16, 32)]
    assert front.params["conv1.weight"].shape == (16, 80, 3)
    assert front.params["conv1.bias"].shape == (16,)
    assert front.params["conv2.weight"].shape == (16, 16, 3)


def test_conv1d_matches_a_loop_and_pytorch_in_numpy_and_onnxruntime(front, rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    weights = init_weights(front, seed=3)
    mel = rng.standard_normal((2, 80, 63)).astype(np.float32)

    def gelu(v):
        return F.gelu(torch.from_numpy(np.asarray(v, np.float32))).numpy()

    # the loop, layer by layer, with torch's exact GELU between
    w1, b1, w2, b2 = (weights[p] for p in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"))
    loop = gelu(conv1d_loop(gelu(conv1d_loop(mel, w1, b1, 1, 1)), w2, b2, 2, 1))
    t = F.gelu(F.conv1d(torch.from_numpy(mel), torch.from_numpy(w1), torch.from_numpy(b1), padding=1))
    t = F.gelu(F.conv1d(t, torch.from_numpy(w2), torch.from_numpy(b2), stride=2, padding=1)).numpy()
    np.testing.assert_allclose(loop, t, rtol=1e-4, atol=1e-5)
    ours = interpret.run(front, weights, {"mel": mel})["h"]
    ort = ort_run(front, weights, {"mel": mel})["h"]
    assert ours.shape == ort.shape == (2, 16, 32)
    np.testing.assert_allclose(ours, t, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ort, t, rtol=1e-4, atol=1e-5)


def test_conv1d_without_bias_and_padding_on_a_symbolic_length(tmp_path, rng):
    torch = pytest.importorskip("torch")
    g = build(_spec(tmp_path, """
model M() {
  in x: f32[B, 4, T]
  out y: f32[B, 6, T - 4]
  y = conv1d(x, 6, 5, bias=false)
}
"""))
    weights = init_weights(g, seed=1)
    for length in (9, 20):
        x = rng.standard_normal((1, 4, length)).astype(np.float32)
        want = torch.nn.functional.conv1d(torch.from_numpy(x), torch.from_numpy(weights["conv1d.weight"])).numpy()
        np.testing.assert_allclose(conv1d_loop(x, weights["conv1d.weight"], None, 1, 0), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(interpret.run(g, weights, {"x": x})["y"], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ort_run(g, weights, {"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def _conv1d_types(x_shape, w_shape):
    return [TensorType("f32", dims.shape(x_shape)), TensorType("f32", dims.shape(w_shape))]


def test_conv1d_type_rule_names_the_problem():
    attrs = {"kernel": 3, "stride": 1, "padding": 1}
    with pytest.raises(ops.ShapeError, match="expects 80 input channels, got 81"):
        ops.infer("conv1d", _conv1d_types((2, 81, 10), (8, 80, 3)), attrs)
    with pytest.raises(ops.ShapeError, match=r"expects \[B, C, L\]"):
        ops.infer("conv1d", _conv1d_types((81, 10), (8, 81, 3)), attrs)
    with pytest.raises(ops.ShapeError, match="stride >= 1"):
        ops.infer("conv1d", _conv1d_types((2, 8, 10), (8, 8, 3)), {**attrs, "stride": 0})
    with pytest.raises(ops.ShapeError, match="shorter than the kernel 5"):
        ops.infer("conv1d", _conv1d_types((2, 8, 2), (8, 8, 5)), {**attrs, "kernel": 5})
    with pytest.raises(ops.ShapeError, match=r"weight must be \[out, in, 3\]"):
        ops.infer("conv1d", _conv1d_types((2, 8, 10), (8, 8, 5)), attrs)
    # 10 + 2 - 3 = 9 is not a multiple of 2: rounded down, as PyTorch does
    (out,) = ops.infer("conv1d", _conv1d_types((2, 8, 10), (4, 8, 3)), {**attrs, "stride": 2})
    assert tuple(int(d) for d in out.shape) == (2, 4, 5)


@pytest.mark.parametrize("body,message", [
    ("y = conv1d(x, 6, 3, stride=2, padding=1)", "not a multiple of stride 2"),
    ("y = conv1d(x, 6, 3, stride=0)", "'stride' must be at least 1"),
    ("y = conv1d(x, 6, 3, padding=-1)", "'padding' must be at least 0"),
    ("y = conv1d(x, 6, 0)", "'kernel' must be at least 1"),
    ("y = conv1d(mean(x, 2), 6, 3)", "expects [B, C, L]"),
])
def test_conv1d_spec_errors_point_at_the_call(tmp_path, body, message):
    path = _spec(tmp_path, f"""
model M() {{
  in x: f32[B, 4, T]
  out y: f32[B, 6, T]
  {body}
}}
""")
    with pytest.raises(SpecError) as err:
        build(path)
    assert message in str(err.value)
    assert "conv1d" in str(err.value)


def test_conv1d_cost_memory_and_role_by_hand(front):
    costs, st = cost.node_costs(front)
    by_name = {c.node: c for c in costs}
    c1, c2 = by_name["conv1"], by_name["conv2"]
    # conv1: B x 16 out channels x 63 positions, each 80 in channels x 3 taps
    assert c1.macs.evaluate({"B": 1}) == 16 * 63 * 80 * 3
    # conv2: 16 x 32 outputs ((63 + 2 - 3) // 2 + 1 = 32), each 16 x 3
    assert c2.macs.evaluate({"B": 2}) == 2 * 16 * 32 * 16 * 3
    assert c1.kind == c2.kind == "dense"
    assert c1.flops["matmul"].evaluate({"B": 1}) == 2 * 16 * 63 * 80 * 3
    assert c1.flops["bias"].evaluate({"B": 1}) == 16 * 63
    node = front.nodes["conv1"]
    assert memory.saved_values(node, lambda v: v in front.params) == ["mel"]
    assert memory.saved_values(node, lambda v: False) == []
    assert params.role(front, st, "conv1") == "convolution"
