"""Attention sinks (gpt-oss; issue 39): the softmax's normaliser holds one more learned logit per head
(``self_attn.sinks`` [heads]) that takes weight and weighs no value. Written from primitives as
transformers' eager_attention_forward does (``slice(softmax(concat([s, sink_column], -1)), -1, 0, Tk)``),
by sdpa(sinks=...) and attention(sinks=true); fused into the ``sinks`` feature of the score epilogue.

Checked here against numpy written in this file: the unfused graph; each kernel that takes the feature
(block, portable, gqa through its head_sink input, attn23 through one extra key, auto) against the unfused
graph at lengths on both sides of the portable kernel's tiles, the block budget and attn23's key alignment
(T + 1 a multiple of 8 or not); the numpy references (the interpreter's fused node, plain and tiled flash);
the kernels that cannot (mha; attn23 with a soft-cap too) refusing with the reason;
rows whose keys are all hidden; cached greedy generation (concat and buffer caches, plain and
GroupQueryAttention decoding steps) equal to recomputing each row's whole sequence; --explain; and,
where transformers has gpt-oss, its GptOssAttention's eager attention."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.backends.onnx import attention as onnx_attention
from tessera.compiler.passes import attention_kernels
from tessera.compiler.passes.attention_kernels import Target, why_not
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.reference import flash
from tessera.runtime.io.weights import init_weights

SPEC = """
model S(d = 32, heads = 4, kv_heads = 2, causal = true, window = 0) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = attention(x, heads, kv_heads, causal=causal, window=window, sinks=true, name="self_attn")
}
"""

PADDED = """
model P(d = 16, heads = 2) {
  in x: f32[B, T, d]
  in mask: i64[B, T]
  out y: f32[B, T, d]
  hd = d / heads
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  sinks = parameter([heads], name="sinks")
  y = merge_heads(sdpa(q, k, v, mask=mask, sinks=sinks))
}
"""


def _write(tmp_path, text, name="s.tsr"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _weights(g, seed=3):
    """Weights big enough that the scores and sinks matter (sinks about ±3: near the scores' maxima)."""
    w = {n: a * 4.0 for n, a in init_weights(g, seed).items()}
    for n in w:
        if n.endswith("sinks"):
            w[n] = np.random.default_rng(seed).standard_normal(w[n].shape).astype(np.float32) * 3.0
    return w


def _numpy(x, w, heads=4, kv_heads=2, causal=True, window=0):
    """attention(sinks=true) written out in numpy the way transformers' gpt-oss eager attention does it:
    the sink column concatenated to the masked scores, the row max subtracted, softmax, column dropped."""
    lin = lambda t, n: t @ w[f"self_attn.{n}.weight"].T + w[f"self_attn.{n}.bias"]  # noqa: E731
    b, t, d = x.shape
    hd = d // heads
    split = lambda z, h: z.reshape(b, t, h, hd).transpose(0, 2, 1, 3)  # noqa: E731
    q = split(lin(x, "q"), heads)
    k = np.repeat(split(lin(x, "k"), kv_heads), heads // kv_heads, axis=1)
    v = np.repeat(split(lin(x, "v"), kv_heads), heads // kv_heads, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    if causal:
        hide = j > i
        if window:
            hide |= j <= i - window
        s = np.where(hide, np.finfo(np.float32).min, s)
    col = np.broadcast_to(w["self_attn.sinks"].reshape(1, heads, 1, 1), (b, heads, t, 1))
    c = np.concatenate([s, col], -1)
    c = c - c.max(-1, keepdims=True)
    p = np.exp(c)
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    return lin((p @ v).transpose(0, 2, 1, 3).reshape(b, t, d), "o")


def test_attention_with_sinks_creates_the_parameter_and_the_unfused_graph_equals_numpy(tmp_path):
    spec = _write(tmp_path, SPEC)
    g = build(spec)
    w = _weights(g)
    assert w["self_attn.sinks"].shape == (4,)
    for t in (1, 5, 17):
        x = np.random.default_rng(t).standard_normal((2, t, 32)).astype(np.float32)
        np.testing.assert_allclose(ort_run(g, w, {"x": x})["y"], _numpy(x, w), atol=2e-5, rtol=1e-4)
    # the sinks change the result (a test of the numpy and the spec, not a vacuous one)
    x = np.random.default_rng(0).standard_normal((2, 9, 32)).astype(np.float32)
    no_sinks = dict(w, **{"self_attn.sinks": np.full(4, -1e30, np.float32)})
    assert np.abs(_numpy(x, w) - _numpy(x, no_sinks)).max() > 1e-2


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 6), (False, 0)])
def test_each_kernel_that_takes_sinks_equals_the_unfused_graph(tmp_path, monkeypatch, causal, window):
    monkeypatch.setattr(onnx_attention, "MAX_TILE", 8)  # tiles of 8 rows: lengths cross them
    monkeypatch.setattr(attention_kernels, "BLOCK_BYTES", 2 * 4 * 16 * 16 * 4)  # block up to T = 16
    spec = _write(tmp_path, SPEC)
    ran = set()
    for t in (1, 3, 7, 8, 9, 15, 16, 17, 33):
        g = build(spec, causal=causal, window=window)
        w = _weights(g)
        x = np.random.default_rng(t).standard_normal((2, t, 32)).astype(np.float32)
        want = ort_run(g, w, {"x": x})["y"]
        np.testing.assert_allclose(want, _numpy(x, w, causal=causal, window=window), atol=2e-5, rtol=1e-4)
        kernels = [None, "block", "portable", "attn23"] + (["gqa"] if causal else [])
        for kernel in kernels:
            fused = build(spec, causal=causal, window=window)
            (site,) = optimize(fused, Target("cpu"), kernel)
            assert site.fused, site.reason
            node = fused.nodes[site.node]
            assert node.attrs["sinks"] is True and node.inputs[-1] == "self_attn.sinks"
            got = ort_run(fused, w, {"x": x})["y"]
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4,
                                       err_msg=f"{kernel or 'auto'} ({node.attrs['impl']}) at T = {t}")
            ran.add(node.attrs["impl"] + ("+block" if node.attrs.get("block_bytes") else ""))
    assert {"block", "portable"} <= {r.split("+")[0] for r in ran}


def test_the_fused_node_s_numpy_reference_and_the_tiled_flash_reference(tmp_path):
    """The interpreter's fused_attention (reference/score_epilogue.softmax) and flash.py's plain and
    tiled (online softmax: the sink seeds the running max and sum) attention equal numpy's concat form,
    padded rows whose every key is hidden included (their weight goes to the sink: output 0)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 13, 8)).astype(np.float32) for _ in range(3))
    sinks = (rng.standard_normal(4) * 3).astype(np.float32)
    mask = np.ones((2, 13), np.int64)
    mask[1, :] = 0  # row 1: every key hidden
    mask[0, 3:7] = 0
    s = np.where((mask != 0)[:, None, None, :], q @ k.transpose(0, 1, 3, 2) * 0.3, np.finfo(np.float32).min)
    c = np.concatenate([s, np.broadcast_to(sinks.reshape(1, 4, 1, 1), (2, 4, 13, 1))], -1)
    p = np.exp(c - c.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True))[..., :-1] @ v
    np.testing.assert_allclose(want[1], 0, atol=1e-6)
    got = flash.attention_reference(q, k, v, 0.3, key_mask=mask, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for qt, kt in ((4, 4), (5, 3), (16, 16)):
        tiled = flash.tiled_attention(q, k, v, 0.3, key_mask=mask, q_tile=qt, k_tile=kt, sinks=sinks)
        np.testing.assert_allclose(tiled, want, atol=1e-5)
    causal = flash.tiled_attention(q, k, v, 0.3, causal=True, q_tile=4, k_tile=3, sinks=sinks)
    np.testing.assert_allclose(causal, flash.attention_reference(q, k, v, 0.3, causal=True, sinks=sinks), atol=1e-5)
    from tessera.compiler.ops import attention as attention_ops
    a = {"scale": 0.3, "causal": False, "window": 0, "padding": True, "bias": False, "heads": 4, "kv_heads": 4,
         "sinks": True}
    np.testing.assert_allclose(attention_ops._fused_ref([q, k, v, mask, sinks], a, None), want, atol=1e-5)


def test_padded_rows_and_keys_with_sinks_fused_equal_unfused(tmp_path):
    spec = _write(tmp_path, PADDED, "p.tsr")
    for t in (4, 11):
        g = build(spec)
        w = _weights(g)
        x = np.random.default_rng(t).standard_normal((2, t, 16)).astype(np.float32)
        mask = np.ones((2, t), np.int64)
        mask[1, : t // 2] = 0
        mask[0, 1] = 0
        want = ort_run(g, w, {"x": x, "mask": mask})["y"]
        for kernel in (None, "block", "portable"):
            fused = build(spec)
            (site,) = optimize(fused, Target("cpu"), kernel)
            assert site.fused, site.reason
            np.testing.assert_allclose(ort_run(fused, w, {"x": x, "mask": mask})["y"], want, atol=2e-5, rtol=1e-4)


def test_kernels_without_sinks_refuse_them_with_the_reason(tmp_path):
    spec = _write(tmp_path, SPEC)
    g = build(spec, causal=False)
    optimize(g, Target("cpu"), "block")
    (node,) = [n for n in g.nodes.values() if n.op == "fused_attention"]
    assert "attention sinks" in why_not("mha", node, g, Target("cpu"))
    assert why_not("attn23", node, g, Target("cpu")) is None  # the sink as one more key
    node.attrs["softcap"] = 30.0  # which onnx's Attention would cap too
    assert "soft-cap with attention sinks" in why_not("attn23", node, g, Target("cpu"))


def test_a_sink_column_varying_over_queries_is_attention_but_not_fused(tmp_path):
    spec = _write(tmp_path, """
model V(d = 16, heads = 2) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  q = split_heads(linear(x, d, name="q"), heads)
  k = split_heads(linear(x, d, name="k"), heads)
  v = split_heads(linear(x, d, name="v"), heads)
  s = causal_mask(matmul(q, transpose(k)) * 0.25)
  col = matmul(q, transpose(slice(k, 2, 0, 1)))
  y = merge_heads(matmul(slice(softmax(concat([s, col], -1), axis=-1), -1, 0, T), v))
}
""", "v.tsr")
    g = build(spec)
    (site,) = optimize(g, Target("cpu"))
    assert not site.fused and "sink column" in site.reason


DECODER = """
model GptOssLike(vocab = 50, d = 32, layers = 2, heads = 4, kv_heads = 2, window = 0) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="embed")
  repeat layers as i {
    h += attention(rmsnorm(h, 1e-5, name="attn_norm"), heads, kv_heads, causal=true, rope_theta=10000.0,
                   bias=true, window=window, sinks=true, name="self_attn")
    h += swiglu(rmsnorm(h, 1e-5, name="mlp_norm"), 48, name="mlp")
  }
  logits = linear(rmsnorm(h, 1e-5, name="norm"), vocab, bias=false, name="head")
}
"""


@pytest.mark.parametrize("cache,decode,window", [("concat", "auto", 0), ("buffer", "plain", 0),
                                                 ("buffer", "gqa", 0), ("concat", "auto", 3)])
def test_cached_generation_with_sinks_equals_recomputing_the_whole_sequence(tmp_path, cache, decode, window):
    """Prompts of 7 and 2 tokens (left-padded to one batch), then 8 greedy steps: at each, the cached
    decoder's logits equal the unfused graph over the row's whole sequence, for the concat cache (the
    phased kernel: tiled prefill, plain decoding step), the buffer cache with the plain decoding step and
    with GroupQueryAttention's (its head_sink), and a sliding window."""
    from conftest import cached_equals_recomputation
    from tessera.compiler import build as compiler_build
    from tessera.compiler.passes.pipeline import PipelineOptions
    from tessera.runtime import pipeline as rt

    path = tmp_path / "gptoss.tsr"
    path.write_text(DECODER.replace("window = 0", f"window = {window}"))
    built = rt.build(str(path), None, [])
    weights = _weights(built.graph, 0)
    done = compiler_build.compile_cached(built.graph, weights, built.info,
                                         PipelineOptions(cache=cache, decode=decode))
    assert [s.fused for s in done.sites] == [True, True]
    ops = {n.op_type for n in done.model.graph.node}
    from tessera.compiler.backends.onnx.walk import all_nodes
    gqa = [n for n in all_nodes(done.model.graph.node) if n.op_type == "GroupQueryAttention"]
    if decode == "gqa":
        assert gqa and all(len(n.input) == 12 and n.input[11] for n in gqa), "head_sink not passed"
    else:
        assert not gqa, ops
    cached_equals_recomputation(path, weights, done, 8)


def test_explain_names_the_kernel_or_the_reason(tmp_path, capsys):
    from conftest import cli, cli_error

    spec = _write(tmp_path, SPEC)
    code, out, err = cli(capsys, "compile", spec, "--explain", "-o", str(tmp_path / "s.onnx"))
    assert code == 0, err
    assert "self_attn.sdpa" in out + err and "fused -> portable: the block kernel" in out + err, out + err
    err = cli_error(capsys, "compile", spec, "--attention", "mha", "-o", str(tmp_path / "m.onnx"))
    assert "MultiHeadAttention computes no" in err and "attention sinks" in err, err
    code, out, err = cli(capsys, "compile", spec, "--explain", "--attention", "gqa", "-o", str(tmp_path / "g.onnx"))
    assert code == 0 and "fused -> gqa: forced" in out + err, out + err


QKV = """
model A(heads = 4, kv_heads = 2, hd = 8) {
  in q: f32[B, heads, T, hd]
  in k: f32[B, kv_heads, T, hd]
  in v: f32[B, kv_heads, T, hd]
  out y: f32[B, heads, T, hd]
  sinks = parameter([heads], name="sinks")
  y = sdpa(q, repeat_kv(k, heads / kv_heads), repeat_kv(v, heads / kv_heads), causal=true, sinks=sinks)
}
"""


@pytest.mark.parametrize("t", [1, 7, 20])
def test_fused_sinks_equal_transformers_gpt_oss_eager_attention(tmp_path, monkeypatch, t):
    """transformers' own gpt-oss attention (modeling_gpt_oss.eager_attention_forward: the sinks
    concatenated to the masked scores, max subtracted, softmax, column dropped) on the same q, k, v and
    sinks, against each kernel that takes them."""
    torch = pytest.importorskip("torch")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    monkeypatch.setattr(onnx_attention, "MAX_TILE", 8)
    spec = _write(tmp_path, QKV, "qkv.tsr")
    rng = np.random.default_rng(t)
    q = rng.standard_normal((2, 4, t, 8)).astype(np.float32) * 2
    k, v = (rng.standard_normal((2, 2, t, 8)).astype(np.float32) * 2 for _ in range(2))
    sinks = (rng.standard_normal(4) * 3).astype(np.float32)

    class Module(torch.nn.Module):
        num_key_value_groups = 2

        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.from_numpy(sinks))

    module = Module().eval()
    causal = torch.triu(torch.full((t, t), torch.finfo(torch.float32).min), 1)[None, None]
    with torch.no_grad():
        hf, _ = gpt_oss.eager_attention_forward(module, torch.from_numpy(q), torch.from_numpy(k),
                                                torch.from_numpy(v), causal, 8 ** -0.5)
    want = hf.transpose(1, 2).numpy()  # it returns [B, T, H, hd]
    for kernel in (None, "block", "portable", "gqa"):
        g = build(spec)
        (site,) = optimize(g, Target("cpu"), kernel)
        assert site.fused, site.reason
        got = ort_run(g, {"sinks": sinks}, {"q": q, "k": k, "v": v})["y"]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=f"{kernel} ({site.impl})")
