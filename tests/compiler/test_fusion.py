"""Attention fusion: the pattern pass, its reasons, the kernels, and the tiled reference."""

import numpy as np
import pytest

from conftest import SMALL_MODELS, build, feeds_for, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.backends.onnx import export as onnx_export
from tessera.compiler.reference.flash import attention_reference, tiled_attention
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.fuse_attention import FuseAttention
from tessera.runtime.io.weights import init_weights

SMALL = SMALL_MODELS


@pytest.mark.parametrize("spec,sets", SMALL, ids=[s for s, _ in SMALL])
@pytest.mark.parametrize("attention", ["auto", "portable", "block", "attn23"])
def test_fused_and_unfused_exports_agree(spec, sets, attention, rng):
    unfused = build(spec, **sets)
    weights = init_weights(unfused, seed=2)
    feeds = feeds_for(unfused, rng)
    want = ort_run(unfused, weights, feeds)
    fused = build(spec, **sets)
    sites = optimize(fused, Target("cpu"), attention)
    assert sites and all(s.fused for s in sites), [s.describe() for s in sites]
    assert not any(n.op == "softmax" for n in fused.nodes.values())
    got = ort_run(fused, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)
    # the checker too (auto's If holds com.microsoft.MultiHeadAttention for ViT's and BERT's
    # non-causal sites: the domain must be imported although no top-level node uses it)
    onnx_export.check(onnx_export.to_onnx(fused, weights))


def test_gpt2_small_has_twelve_fused_sites():
    g = build("gpt2", "small")
    sites = optimize(g)
    assert len(sites) == 12 and all(s.fused and s.impl == "portable" for s in sites)
    cuda = build("gpt2", "small")
    assert all(s.impl == "gqa" for s in optimize(cuda, Target("cuda", "fp16")))
    assert sum(n.op == "fused_attention" for n in g.nodes.values()) == 12
    assert g.param_count() == 124_439_808  # fusion removes no parameter


HAND_WRITTEN = """
model Hand(d = 16, heads = 2) {
  in x: f32[B, T, d]
  in bias: f32[T, T]
  out y: f32[B, T, d]
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  s = matmul(q, transpose(k)) / sqrt(d / heads)
  y = merge_heads(matmul(softmax(s + bias, axis=-1), v))
}
"""


def test_hand_written_attention_with_a_bias_is_fused(tmp_path, rng):
    spec = tmp_path / "hand.tsr"
    spec.write_text(HAND_WRITTEN)
    unfused = build(str(spec))
    fused = build(str(spec))
    sites = optimize(fused)
    assert [s.fused for s in sites] == [True]
    node = next(n for n in fused.nodes.values() if n.op == "fused_attention")
    assert node.attrs["bias"] and node.attrs["scale"] == pytest.approx(1 / np.sqrt(8))
    assert node.attrs["impl"] == "portable"
    w = init_weights(unfused, 1)
    feeds = {"x": rng.standard_normal((2, 9, 16)).astype(np.float32),
             "bias": rng.standard_normal((9, 9)).astype(np.float32)}
    np.testing.assert_allclose(ort_run(fused, w, feeds)["y"], ort_run(unfused, w, feeds)["y"], atol=1e-5)


def test_near_miss_keeps_its_reason(tmp_path):
    spec = tmp_path / "near.tsr"
    spec.write_text(HAND_WRITTEN.replace("softmax(s + bias, axis=-1)", "softmax(s + bias, axis=-2)"))
    g = build(str(spec))
    (site,) = optimize(g)
    assert not site.fused
    assert "softmax over the query axis" in site.reason
    assert "near.tsr:10:" in site.describe()  # points at the user's line


def test_explain_through_the_cli(tmp_path, capsys):
    from conftest import MODELS
    from tessera.runtime.cli import main

    out = tmp_path / "m.onnx"
    assert main(["compile", str(MODELS / "worked_example.tsr"), "--explain", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "attention sites: 1 (0 fused, 1 not fused)" in err
    assert "model output (weights)" in err


def test_forcing_a_kernel_that_cannot_express_the_site_is_an_error(capsys, tmp_path):
    from conftest import MODELS
    from tessera.runtime.cli import main

    code = main(["compile", str(MODELS / "bert.tsr"), "--set", "layers=1", "--attention", "gqa",
                 "-o", str(tmp_path / "b.onnx")])
    assert code == 2
    assert "no padding mask" in capsys.readouterr().err


def test_pass_contract_reports_change_once():
    g = build("gpt2", layers=1, d=16, heads=2, vocab=10, ctx=8)
    assert FuseAttention()(g).changed is True
    assert FuseAttention()(g).changed is False


GOLDEN_FUSED = """\
graph Hand
  in  x: f32[B, T, 16]
  in  bias: f32[T, T]
  param q.weight: f32[16, 16]
  param q.bias: f32[16]
  param k.weight: f32[16, 16]
  param k.bias: f32[16]
  param v.weight: f32[16, 16]
  param v.bias: f32[16]
  q: f32[B, T, 16] = linear(x, q.weight, q.bias)
  split_heads: f32[B, 2, T, 8] = split_heads(q) {heads=2}
  k: f32[B, T, 16] = linear(x, k.weight, k.bias)
  split_heads_1: f32[B, 2, T, 8] = split_heads(k) {heads=2}
  v: f32[B, T, 16] = linear(x, v.weight, v.bias)
  split_heads_2: f32[B, 2, T, 8] = split_heads(v) {heads=2}
  matmul_1: f32[B, 2, T, 8] = fused_attention(split_heads, split_heads_1, split_heads_2, bias) \
{bias=True, block_bytes=4194304, causal=False, heads=2, impl=portable, k_tile=16384, kv_heads=2, padding=False, q_tile=16, \
scale=0.353553, window=0}
  merge_heads: f32[B, T, 16] = merge_heads(matmul_1)
  y: f32[B, T, 16] = identity(merge_heads)
  out y: f32[B, T, 16]"""


def test_golden_ir_after_fusion(tmp_path):
    """Spec in, printed IR out: Q·Kᵀ, the 1/sqrt(8) scale, the bias, softmax and ·V became one node."""
    spec = tmp_path / "hand.tsr"
    spec.write_text(HAND_WRITTEN)
    g = build(str(spec))
    optimize(g)
    assert g.dump() == GOLDEN_FUSED


@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 5)])
@pytest.mark.parametrize("tq,tk", [(37, 37), (13, 29)])
def test_tiled_online_softmax_equals_plain_attention(causal, window, tq, tk, rng):
    q = rng.standard_normal((2, 3, tq, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, tk, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, tk, 5)).astype(np.float32)
    mask = np.ones((2, tk), np.int64)
    mask[1, -4:] = 0
    want = attention_reference(q, k, v, 0.3, causal, window, mask)
    for qt, kt in [(8, 8), (16, 5), (64, 64)]:
        got = tiled_attention(q, k, v, 0.3, causal, window, mask, q_tile=qt, k_tile=kt)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_tiled_reference_handles_fully_masked_rows(rng):
    """A sequence whose keys are all padding: every weight is equal, as in the unfused graph."""
    q, k, v = (rng.standard_normal((2, 2, 10, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, 10), np.int64)
    mask[1] = 0
    want = attention_reference(q, k, v, 0.5, key_mask=mask)
    np.testing.assert_allclose(want[1], np.broadcast_to(v[1].mean(-2, keepdims=True), want[1].shape), atol=1e-6)
    np.testing.assert_allclose(tiled_attention(q, k, v, 0.5, key_mask=mask, q_tile=4, k_tile=3), want, atol=1e-6)


def test_numpy_interpreter_runs_fused_graphs(rng):
    g = build("llama", layers=1, d=32, heads=4, kv_heads=2, vocab=50, d_ff=48)
    w = init_weights(g, 0)
    feeds = {"tokens": rng.integers(0, 50, (2, 11)).astype(np.int64)}
    want = interpret.run(g, w, feeds)["logits"]
    optimize(g)
    np.testing.assert_allclose(interpret.run(g, w, feeds)["logits"], want, atol=1e-5)


@pytest.mark.parametrize("spec,sets", [SMALL[0], SMALL[1], SMALL[3], SMALL[5]],
                         ids=["gpt2", "bert", "llama", "transformer"])
def test_portable_kernel_with_many_tiles_and_an_overlapping_last_tile(spec, sets, rng, monkeypatch):
    """Tiles of 16 rows over 37 queries: three tiles, the last one overlapping the second."""
    from tessera.compiler.backends.onnx import attention as attention_onnx

    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 16)
    unfused = build(spec, **sets)
    weights = init_weights(unfused, seed=5)
    feeds = feeds_for(unfused, rng)
    want = ort_run(unfused, weights, feeds)
    fused = build(spec, **sets)
    optimize(fused, Target("cpu"), "portable")
    assert {n.attrs["q_tile"] for n in fused.nodes.values() if n.op == "fused_attention"} == {16}
    got = ort_run(fused, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_portable_kernel_many_tiles_with_a_bias(tmp_path, rng, monkeypatch):
    from tessera.compiler.backends.onnx import attention as attention_onnx

    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 16)
    spec = tmp_path / "hand.tsr"
    spec.write_text(HAND_WRITTEN)
    unfused, fused = build(str(spec)), build(str(spec))
    optimize(fused)
    w = init_weights(unfused, 1)
    feeds = {"x": rng.standard_normal((2, 37, 16)).astype(np.float32),
             "bias": rng.standard_normal((37, 37)).astype(np.float32)}
    np.testing.assert_allclose(ort_run(fused, w, feeds)["y"], ort_run(unfused, w, feeds)["y"], atol=1e-5)


CAUSAL_VARIANTS = """
model Causal(heads = 2, hd = 8, window = 0, past = false, masked = false, biased = false) {
  in q: f32[B, heads, T, hd]
  in k: f32[B, heads, T, hd]
  in v: f32[B, heads, T, hd]
  in kp: f32[B, heads, P, hd]
  in vp: f32[B, heads, P, hd]
  in mask: i64[B, P + T]
  in bias: f32[T, P + T]
  out y: f32[B, heads, T, hd]
  if past {
    k = concat([kp, k], axis=2)
    v = concat([vp, v], axis=2)
  }
  s = matmul(q, transpose(k)) * 0.3
  if biased { s = s + bias }
  s = causal_mask(s, window=window)
  if masked { s = padding_mask(s, mask) }
  y = matmul(softmax(s, axis=-1), v)
}
"""


@pytest.mark.parametrize("kernel", ["portable", "block", "auto-short", "auto-long"])
@pytest.mark.parametrize("sets", [dict(), dict(window=5), dict(past=True), dict(past=True, window=7),
                                  dict(masked=True, past=True), dict(biased=True, past=True)],
                         ids=["causal", "window", "past", "past-window", "past-padding", "past-bias"])
def test_portable_causal_kernel_with_many_tiles(tmp_path, rng, monkeypatch, sets, kernel):
    """Causal tiles mask only their diagonal block; with cached keys (P of them) the diagonal moves right.
    The block kernel (no Loop) gives the same, alone and as the short branch of auto's If on the
    length (auto-short); auto-long takes the If's other branch, the tiled Loop."""
    from tessera.compiler.backends.onnx import attention as attention_onnx
    from tessera.compiler.passes import attention_kernels

    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 16)
    if kernel == "auto-long":
        monkeypatch.setattr(attention_kernels, "BLOCK_BYTES", 1)
    spec = tmp_path / "causal.tsr"
    spec.write_text(CAUSAL_VARIANTS)
    unfused, fused = build(str(spec), **sets), build(str(spec), **sets)
    sites = optimize(fused, Target("cpu"), "auto" if kernel.startswith("auto") else kernel)
    assert [s.fused for s in sites] == [True], [s.describe() for s in sites]
    node = next(n for n in fused.nodes.values() if n.op == "fused_attention")
    assert node.attrs["impl"] == ("block" if kernel == "block" else "portable")
    assert node.attrs.get("block_bytes", 0) == {"auto-short": 4 * 2**20, "auto-long": 1}.get(kernel, 0)
    b, t, p = 2, 37, 11
    feeds = {name: rng.standard_normal((b, 2, n, 8)).astype(np.float32)
             for name, n in (("q", t), ("k", t), ("v", t), ("kp", p), ("vp", p))}
    feeds["mask"] = np.ones((b, p + t), np.int64)
    feeds["mask"][1, :14] = 0  # left padding in the second sequence: its first three query rows see no key
    feeds["bias"] = rng.standard_normal((t, p + t)).astype(np.float32)
    used = {i.name for i in onnx_export.to_onnx(fused, {}).graph.input}
    feeds = {k: v for k, v in feeds.items() if k in used}
    got, want = ort_run(fused, {}, feeds)["y"], ort_run(unfused, {}, feeds)["y"]
    if sets.get("masked"):
        # rows that see no key are meaningless: both give equal weights, the unfused graph over all
        # keys, the tiled kernel over the keys it scans; they must only be finite
        assert np.isfinite(got[1, :, :3]).all()
        got[1, :, :3] = want[1, :, :3]
    np.testing.assert_allclose(got, want, atol=1e-5)


NARROW_VALUES = """
model Narrow(heads = 2, hd = 12, hv = 4) {
  in q: f32[B, heads, T, hd]
  in k: f32[B, heads, T, hd]
  in v: f32[B, heads, T, hv]
  out y: f32[B, heads, T, hv]
  y = sdpa(q, k, v, causal=true)
}
"""


@pytest.mark.parametrize("kernel", ["portable", "block"])
def test_value_heads_of_their_own_size_fuse_and_equal_numpy(tmp_path, rng, monkeypatch, kernel):
    """sdpa's v [B, H, Tk, hv] with hv != hd (DeepSeek-V3's latent attention: values narrower than q/k):
    fused, over many tiles, equal to causal softmax attention written here in numpy."""
    from tessera.compiler.backends.onnx import attention as attention_onnx

    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 16)
    spec = tmp_path / "narrow.tsr"
    spec.write_text(NARROW_VALUES)
    fused = build(str(spec))
    assert [x.fused for x in optimize(fused, Target("cpu"), kernel)] == [True]
    t = 37
    q, k = (rng.standard_normal((2, 2, t, 12)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 2, t, 4)).astype(np.float32)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(12) + np.triu(np.full((t, t), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = weights / weights.sum(-1, keepdims=True) @ v
    got = ort_run(fused, {}, {"q": q, "k": k, "v": v})["y"]
    assert got.shape == (2, 2, t, 4)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(interpret.run(fused, {}, {"q": q, "k": k, "v": v})["y"], want, atol=1e-5)


def test_block_kernel_choice_follows_the_score_bytes(tmp_path):
    """CPU auto: a site whose whole score block is known to fit BLOCK_BYTES gets the block kernel; one
    known not to fit, the tiled kernel alone; one with a run-time length, the tiled kernel with the
    block in front (block_bytes); forced kernels and CUDA never get the If."""
    def site(t, target=Target("cpu"), attention="auto"):
        spec = tmp_path / f"s{t}.tsr"
        spec.write_text(f"""
model Static(heads = 12, hd = 64) {{
  in q: f32[1, heads, {t}, hd]
  in k: f32[1, heads, {t}, hd]
  in v: f32[1, heads, {t}, hd]
  out y: f32[1, heads, {t}, hd]
  y = sdpa(q, k, v, causal=true)
}}
""")
        g = build(str(spec))
        (s,) = optimize(g, target, attention)
        node = next(n for n in g.nodes.values() if n.op == "fused_attention")
        return s, node.attrs.get("block_bytes", 0)

    short, extra = site(128)  # 12 · 128 · 128 · 4 bytes = 0.75 MiB
    assert (short.impl, extra) == ("block", 0) and "0.75 MiB" in short.impl_reason
    assert "no Loop" in short.describe()
    long, extra = site(1024)  # 48 MiB
    assert (long.impl, extra) == ("portable", 0) and "block" not in long.impl_reason
    dynamic, extra = site("T")
    assert (dynamic.impl, extra) == ("portable", 4 * 2**20)
    assert "block kernel (no Loop) while the B·H·Tq·Tk scores fit 4 MiB" in dynamic.describe()
    assert site("T", attention="portable")[1] == 0
    assert site("T", Target("cuda", "fp16"))[0].impl == "gqa" and site("T", Target("cuda", "fp16"))[1] == 0


def test_causal_mask_with_fewer_keys_than_queries_is_not_fused(tmp_path):
    spec = tmp_path / "short.tsr"
    spec.write_text("""
model Short(heads = 2, hd = 8) {
  in q: f32[B, heads, T, hd]
  in k: f32[B, heads, S, hd]
  in v: f32[B, heads, S, hd]
  out y: f32[B, heads, T, hd]
  y = matmul(softmax(causal_mask(matmul(q, transpose(k))), axis=-1), v)
}
""")
    sites = optimize(build(str(spec)))
    assert [s.fused for s in sites] == [False]
    assert "keys (S) may be fewer than the queries (T)" in sites[0].reason


GEMMA2_SMALL = dict(layers=2, d=64, heads=4, kv_heads=2, head_dim=16, d_ff=96, vocab=50, window=8)


@pytest.mark.parametrize("kernel, spec", [("gqa", "gemma2"), ("attn23", "t5"), ("attn23", "gemma2")])
def test_contrib_and_opset23_kernels_equal_the_unfused_graph_on_cpu(kernel, spec, rng):
    """GroupQueryAttention and onnx's Attention (opset 23) with Gemma 2's soft-cap and sliding window (the
    scale times c, the softcap attribute c: both cap as c·tanh(scale·s / c), Attention-23 before its mask),
    and onnx's Attention with T5's padding mask and relative bias (keys padded to a multiple of 8 and hidden):
    the CUDA kernels of issue 37, held to the unfused graph by onnxruntime's CPU kernels of the same ops."""
    # a cap of 0.5 bites (scores of order 1; at the spec's 50 a kernel ignoring the cap would pass)
    sets = dict(GEMMA2_SMALL, attn_softcap=0.5) if spec == "gemma2" else \
        dict(layers=2, d=32, heads=4, d_kv=8, vocab=50, d_ff=64)
    unfused = build(spec, **sets)
    weights = init_weights(unfused, seed=2)
    if spec == "gemma2":  # queries and keys large enough that the scores reach the cap
        weights = {n: w * 10 if n.endswith((".q.weight", ".k.weight")) else w for n, w in weights.items()}
    feeds = feeds_for(unfused, rng, t=13)
    want = ort_run(unfused, weights, feeds)
    if spec == "gemma2":  # the cap changes the result
        loose = ort_run(build(spec, **dict(sets, attn_softcap=50.0)), weights, feeds)
        assert max(np.abs(loose[n] - want[n]).max() for n in want) > 1e-3
    fused = build(spec, **sets)
    sites = optimize(fused, Target("cpu"), kernel)
    assert sites and all(s.fused and s.impl == kernel for s in sites), [s.describe() for s in sites]
    got = ort_run(fused, weights, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=2e-5, rtol=1e-4, err_msg=name)
