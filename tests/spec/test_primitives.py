"""Every primitive: onnxruntime agrees with the numpy interpreter, and the numpy
interpreter agrees with PyTorch's definitions of the same functions."""

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.ops.attention import causal
from tessera.compiler.ops.norm import layernorm
from tessera.compiler.ops import interpret
from tessera.compiler.reference.numerics import erf, sinusoidal_table, softmax
from tessera.runtime.io.weights import init_weights

ALL_OPS = """
block widen(x: [B, T, d], factor = 2) -> [B, T, d * factor] {
  return concat([x, x * 0.5], axis=-1)
}

model Everything(d = 8, heads = 2, window = 2) {
  in x: f32[B, T, d]
  in ids: i64[B, T]
  in mask: i64[B, T]
  in image: f32[B, 3, 8, 8]
  out y: f32[B, T, d]
  out pooled: f32[B, d]
  out patches: f32[B, 4, d]
  out gates: f32[B, T, 4]

  e = embedding(ids, 11, d, name="emb") + sinusoidal(T, d) + embedding(arange(T), 16, d, name="pos")
  h = layernorm(x + e, name="ln") - rmsnorm(x, name="rms") / 2.0
  q = rope(split_heads(linear(h, d, name="q"), heads), 500.0)
  k = split_heads(linear(h, d, bias=false, name="k"), heads)
  v = split_heads(linear(h, d, name="v"), heads)
  s = sliding_window_mask(matmul(q, transpose(k)) * 0.25, window)
  s = padding_mask(s, mask)
  a = merge_heads(matmul(softmax(s, axis=-1), v))
  w = linear(widen(a), d, name="down")
  act = gelu(w) + gelu(w, approx="tanh") + relu(w) + silu(w) + sigmoid(w) + tanh(w) + exp(w * 0.1) + sqrt(w * w + 1.0)
  y = reshape(transpose(reshape(act, [B, T, 2, d / 2]), [0, 1, 3, 2]), [B, T, d]) ** 2.0
  pooled = mean(y, 1) + select(y, 1, 0) + sum(slice(y, 1, 0, 1), 1)
  c = conv2d(image, d, 4, stride=4, name="patch")
  patches = transpose(reshape(c, [B, d, 4]))
  gates = topk_gates(linear(h, 4, name="router"), 2)
}
"""


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    spec = tmp_path_factory.mktemp("spec") / "everything.tsr"
    spec.write_text(ALL_OPS)
    return build(str(spec))


def _feeds(rng, b=2, t=6):
    mask = np.ones((b, t), np.int64)
    mask[1, -3:] = 0
    return {"x": rng.standard_normal((b, t, 8)).astype(np.float32),
            "ids": rng.integers(0, 11, (b, t)).astype(np.int64),
            "mask": mask,
            "image": rng.standard_normal((b, 3, 8, 8)).astype(np.float32)}


def test_every_op_agrees_between_numpy_and_onnxruntime(everything, rng):
    used = {n.op for n in everything.nodes.values()}
    assert {"rope", "causal_mask", "padding_mask", "conv2d", "topk_gates", "sinusoidal", "concat", "slice",
            "select", "mean", "sum", "rmsnorm", "layernorm", "gelu", "reshape", "transpose", "pow"} <= used
    weights = init_weights(everything, seed=5)
    feeds = _feeds(rng)
    ref = interpret.run(everything, weights, feeds)
    got = ort_run(everything, weights, feeds)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=2e-4, atol=2e-4, err_msg=name)
    gates = got["gates"]
    assert np.allclose(gates.sum(-1), 1.0, atol=1e-6) and ((gates > 0).sum(-1) == 2).all()


torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_numpy_ops_match_pytorch(rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    t = torch.from_numpy(x)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(erf(x), torch.erf(t).numpy(), **close)
    v = x
    gelu_exact = 0.5 * v * (1 + erf(v / np.sqrt(2)))
    np.testing.assert_allclose(gelu_exact, F.gelu(t).numpy(), **close)
    w = rng.standard_normal(8).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_allclose(layernorm(x, w, b, 1e-5),
                               F.layer_norm(t, (8,), torch.from_numpy(w), torch.from_numpy(b), 1e-5).numpy(), **close)
    np.testing.assert_allclose(softmax(x, -1), torch.softmax(t, -1).numpy(), **close)
    pe = sinusoidal_table(3, 4)
    np.testing.assert_allclose(pe[1], [0.841, 0.540, 0.010, 1.000], atol=1e-3)  # the seed's D=4, position 1


def test_causal_and_sliding_window_attention_match_pytorch(rng):
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    for window in (0, 3):
        s = causal(q @ np.swapaxes(k, -1, -2) / 2.0, window)
        ours = softmax(s, -1) @ v
        i, j = np.arange(6)[:, None], np.arange(6)[None, :]
        allowed = (j <= i) & ((j > i - window) if window else True)
        ref = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                             attn_mask=torch.from_numpy(allowed)).numpy()
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_use_shares_blocks_between_files(tmp_path):
    (tmp_path / "blocks.tsr").write_text("""
block double(x: [B, T, d]) -> [B, T, d] {
  return x * 2.0
}
""")
    (tmp_path / "main.tsr").write_text("""
use "blocks.tsr"
model M(d = 4) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = double(x)
}
""")
    g = build(str(tmp_path / "main.tsr"))
    x = np.ones((1, 2, 4), np.float32)
    assert (interpret.run(g, {}, {"x": x})["y"] == 2.0).all()


def test_interpreter_checks_ids_and_positions_like_the_runtime():
    from tessera.compiler.ir.signature import InputError, input_limits

    g = build("gpt2", layers=1, d=8, heads=2, vocab=16, ctx=8)
    assert input_limits(g).ids == {"tokens": (16, "wte.weight")}
    assert input_limits(g).dims == {"T": (8, "wpe.weight")}
    w = init_weights(g, 0)
    with pytest.raises(InputError, match=r"holds 16 at \[1, 0\].*must be in \[0, 16\)"):
        interpret.run(g, w, {"tokens": np.array([[1], [16]], np.int64)})
    with pytest.raises(InputError, match="T=9 is longer than the 8 positions of 'wpe.weight'"):
        interpret.run(g, w, {"tokens": np.zeros((1, 9), np.int64)})
    assert interpret.run(g, w, {"tokens": np.full((1, 8), 15, np.int64)})["logits"].shape == (1, 8, 16)


SIGN = """
model S() {
  in x: f32[B, T]
  in n: i64[B, T]
  out y: f32[B, T]
  out m: i64[B, T]
  y = sign(x) * (sign(-2.5) + sign(0.0) + 2.0)
  m = sign(n) * sign(7)
}
"""


def test_sign_of_tensors_and_numbers_equals_numpy(tmp_path):
    """sign: -1, 0 or 1, float and integer tensors in the interpreter and onnxruntime, and numbers at
    elaboration (sign(-2.5) + sign(0.0) + 2.0 = 1.0, sign(7) = 1); the expected values are np.sign's."""
    spec = tmp_path / "sign.tsr"
    spec.write_text(SIGN)
    g = build(str(spec))
    x = np.array([[-3.5, -0.0, 0.0, 1e-30, 2.0]], dtype=np.float32)
    n = np.array([[-4, 0, 9, -1, 1]], dtype=np.int64)
    want = {"y": np.sign(x) * 1.0, "m": np.sign(n)}
    for got in (interpret.run(g, {}, {"x": x, "n": n}), ort_run(g, {}, {"x": x, "n": n})):
        np.testing.assert_array_equal(got["y"], want["y"])
        np.testing.assert_array_equal(got["m"], want["m"])
        assert got["m"].dtype == np.int64


GATHER = """
model G(d = 6) {
  in x: f32[B, T, d]
  in pos: i64[B, T, T]
  out y: f32[B, T, T]
  y = gather(x, pos, -1)
}
"""


def test_gather_along_an_axis_equals_torch_gather(tmp_path, rng):
    """gather(x, index, axis): torch.gather's values (DeBERTa's c2p lookup: a [B, T, 2k] score read at
    [B, T, T] relative positions), negative indices counted from the end, in the interpreter and
    onnxruntime; an index that does not match x off the axis is a positioned error."""
    torch = pytest.importorskip("torch")
    spec = tmp_path / "gather.tsr"
    spec.write_text(GATHER)
    g = build(str(spec))
    x = rng.standard_normal((2, 5, 6)).astype(np.float32)
    pos = rng.integers(-6, 6, size=(2, 5, 5))
    ref = torch.gather(torch.from_numpy(x), -1, torch.from_numpy(pos) % 6).numpy()
    for got in (interpret.run(g, {}, {"x": x, "pos": pos}), ort_run(g, {}, {"x": x, "pos": pos})):
        np.testing.assert_array_equal(got["y"], ref)
    bad = tmp_path / "bad.tsr"
    bad.write_text(GATHER.replace("in pos: i64[B, T, T]", "in pos: i64[B, 3, T]"))
    from tessera.spec.diagnostics import SpecError
    with pytest.raises(SpecError, match=r"gather's index must match x on every axis but -1: axis 1 is 3"):
        build(str(bad))


def test_lists_compare_item_by_item(tmp_path):
    """`kinds != []` and `kinds == [...]`: equal lengths and equal items (numbers by value, as `==`)."""
    from tessera.compiler.frontend.elaborate import elaborate
    from tessera.spec import load_program

    spec = tmp_path / "lists.tsr"
    spec.write_text("""
model L(kinds = []) {
  in x: f32[B, 2]
  out y: f32[B, 2]
  assert kinds == [] or kinds == ["a", 2] or kinds == [1.0, [2]] : "unexpected"
  assert [1, 2] != [1, 2, 3] and [1, 2] != [2, 1] and [3] == [3.0] : "list comparison"
  y = x
}
""")
    for kinds in ([], ["a", 2], [1, [2]]):
        elaborate(load_program(spec), None, {"kinds": kinds})
    from tessera.spec.diagnostics import SpecError
    with pytest.raises(SpecError, match="unexpected"):
        elaborate(load_program(spec), None, {"kinds": ["a", 3]})
