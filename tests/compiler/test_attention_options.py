"""The standard attention block's options (issue 12): separate q/k/v and output bias, head_dim,
partial rotary in both layouts, the score scale, an additive score bias (a tensor or a block),
logit soft-capping, per-head q/k norm, and sliding/global layers alternating by layer index.

Each case runs the block unfused in the numpy interpreter and fused in onnxruntime (tiles of 16
rows, so the causal diagonal, the window and the bias slicing are all exercised), against a numpy
reference written here and against PyTorch with transformers' own rotary and soft-capped
attention functions (GPT-NeoX's apply_rotary_pos_emb, GPT-J's, Gemma 2's eager attention,
Qwen3's RMSNorm)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run, Recomputation
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.ops import interpret
from tessera.runtime.io.weights import init_weights
from tessera.spec.diagnostics import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPEC = """
block alibi_like(heads, n) -> [heads, n, n] {
  let slope = 0.5
  i = cast(reshape(arange(n), [n, 1]), "f32")
  j = cast(reshape(arange(n), [1, n]), "f32")
  h = cast(reshape(arange(heads), [heads, 1, 1]), "f32") + 1.0
  return abs(i - j) * (-slope) / h
}

model A(d = 32, heads = 4, kv_heads = 2, head_dim = 0, qkv_bias = true, o_bias = false,
        rope_theta = 10000.0, rope_dims = 0, rope_fraction = 1.0, rope_layout = "half",
        scale = 0.0, softcap = 0.0, qk_norm = "none", causal = true, window = 0, biased = false,
        bias_block = false, q_bias = qkv_bias, k_bias = qkv_bias, v_bias = qkv_bias,
        qk_norm_scope = "head") {
  in x: f32[B, T, d]
  in bias: f32[heads, T, T]
  out y: f32[B, T, d]
  sb = none
  if biased { sb = bias }
  blk = none
  if bias_block { blk = alibi_like }
  y = attention(x, heads, kv_heads=kv_heads, causal=causal, window=window, rope_theta=rope_theta,
                qkv_bias=qkv_bias, o_bias=o_bias, head_dim=head_dim, rope_dims=rope_dims,
                rope_fraction=rope_fraction, rope_layout=rope_layout, scale=scale, softcap=softcap,
                qk_norm=qk_norm, score_bias=sb, score_bias_block=blk, q_bias=q_bias, k_bias=k_bias,
                v_bias=v_bias, qk_norm_scope=qk_norm_scope, name="attn")
}
"""

CASES = {
    "defaults": dict(),
    "head_dim_no_scale_rmsnorm": dict(head_dim=16, scale=1.0, qk_norm="rmsnorm"),
    "neox_partial_fraction": dict(rope_fraction=0.25, kv_heads=4, o_bias=True),
    "gptj_interleaved_dims": dict(rope_layout="interleaved", rope_dims=4, qkv_bias=False),
    "softcap_window_scale": dict(softcap=5.0, scale=0.4, window=5),
    "bias_tensor_bidirectional": dict(biased=True, causal=False, rope_theta=0.0),
    "bias_block_layernorm": dict(bias_block=True, qk_norm="layernorm", rope_theta=0.0),
    # issue 24: Whisper's k projection has no bias; OLMo-2 normalises q and k over all heads at once
    "no_k_bias": dict(k_bias=False, o_bias=True),
    "only_v_bias": dict(qkv_bias=False, v_bias=True),
    "rmsnorm_across_heads": dict(qk_norm="rmsnorm", qk_norm_scope="all"),
    "layernorm_across_heads": dict(qk_norm="layernorm", qk_norm_scope="all", rope_theta=0.0),
    # ModernBERT's local attention: a two-sided window over bidirectional attention
    "two_sided_window": dict(causal=False, window=5, rope_theta=160000.0),
    "two_sided_window_bias": dict(causal=False, window=9, biased=True, softcap=4.0),
}


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("attn") / "attn.tsr"
    p.write_text(SPEC)
    return str(p)


# ------------------------------------------------------------------ numpy reference
def _np_rope(x, theta, r, interleaved):
    t = x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, r, 2) / r)
    f = np.arange(t)[:, None] * inv[None, :]
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        c, s = np.cos(f), np.sin(f)
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = np.empty_like(xr)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = b * c + a * s
    else:
        c, s = np.cos(f), np.sin(f)
        a, b = xr[..., : r // 2], xr[..., r // 2:]
        out = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return np.concatenate([out, rest], axis=-1)


def _np_norm(x, w, b, eps, kind):
    if kind == "rmsnorm":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def numpy_attention(x, w, bias, o):
    x = x.astype(np.float64)
    heads, kvh = o["heads"], o["kv_heads"]
    hd = o["head_dim"] or o["d"] // heads
    bsz, t, _ = x.shape

    def proj(name, n):
        y = x @ w[f"attn.{name}.weight"].T
        if f"attn.{name}.bias" in w:
            y = y + w[f"attn.{name}.bias"]
        if o.get("qk_norm_scope") == "all" and name in ("q", "k") and o["qk_norm"] != "none":
            y = _np_norm(y, w[f"attn.{name}_norm.weight"], w.get(f"attn.{name}_norm.bias"), 1e-6, o["qk_norm"])
        return y.reshape(bsz, t, n, hd).transpose(0, 2, 1, 3)

    q, k, v = proj("q", heads), proj("k", kvh), proj("v", kvh)
    if o["qk_norm"] != "none" and o.get("qk_norm_scope") != "all":
        q = _np_norm(q, w["attn.q_norm.weight"], w.get("attn.q_norm.bias"), 1e-6, o["qk_norm"])
        k = _np_norm(k, w["attn.k_norm.weight"], w.get("attn.k_norm.bias"), 1e-6, o["qk_norm"])
    if o["rope_theta"] > 0:
        r = o["rope_dims"] or int(hd * o["rope_fraction"])
        q = _np_rope(q, o["rope_theta"], r, o["rope_layout"] == "interleaved")
        k = _np_rope(k, o["rope_theta"], r, o["rope_layout"] == "interleaved")
    k, v = np.repeat(k, heads // kvh, axis=1), np.repeat(v, heads // kvh, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * (o["scale"] or 1 / np.sqrt(hd))
    if o["softcap"]:
        s = np.tanh(s / o["softcap"]) * o["softcap"]
    if o["biased"]:
        s = s + bias
    if o["bias_block"]:
        i, j = np.arange(t)[:, None], np.arange(t)[None, :]
        s = s + (-0.5 * np.abs(i - j))[None] / (np.arange(heads) + 1.0)[:, None, None]
    if o["causal"]:
        i, j = np.arange(t)[:, None], np.arange(t)[None, :]
        hide = (j > i) | ((j <= i - o["window"]) if o["window"] else False)
        s = np.where(hide, -np.inf, s)
    elif o["window"]:  # two-sided: keys less than `window` away on either side
        i, j = np.arange(t)[:, None], np.arange(t)[None, :]
        s = np.where(np.abs(j - i) >= o["window"], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(bsz, t, heads * hd) @ w["attn.o.weight"].T
    return y + w["attn.o.bias"] if "attn.o.bias" in w else y


# ------------------------------------------------------------------ PyTorch + transformers reference
@torch.no_grad()
def torch_attention(x, w, bias, o):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    tw = {k: torch.from_numpy(v) for k, v in w.items()}
    x = torch.from_numpy(x)
    heads, kvh = o["heads"], o["kv_heads"]
    hd = o["head_dim"] or o["d"] // heads
    bsz, t, _ = x.shape
    F = torch.nn.functional

    def proj(name, n):  # [B, T, n, hd]
        y = F.linear(x, tw[f"attn.{name}.weight"], tw.get(f"attn.{name}.bias"))
        if o.get("qk_norm_scope") == "all" and name in ("q", "k") and o["qk_norm"] == "rmsnorm":
            norm = Olmo2RMSNorm(n * hd, eps=1e-6)  # OLMo-2: q_norm over the whole projection
            norm.weight.data = tw[f"attn.{name}_norm.weight"]
            y = norm(y)
        elif o.get("qk_norm_scope") == "all" and name in ("q", "k") and o["qk_norm"] == "layernorm":
            y = F.layer_norm(y, (n * hd,), tw[f"attn.{name}_norm.weight"], tw[f"attn.{name}_norm.bias"], 1e-6)
        return y.view(bsz, t, n, hd)

    q, k, v = proj("q", heads), proj("k", kvh), proj("v", kvh)
    if o.get("qk_norm_scope") == "all":
        pass
    elif o["qk_norm"] == "rmsnorm":
        for name in ("q", "k"):
            norm = Qwen3RMSNorm(hd, eps=1e-6)
            norm.weight.data = tw[f"attn.{name}_norm.weight"]
            if name == "q":
                q = norm(q)
            else:
                k = norm(k)
    elif o["qk_norm"] == "layernorm":
        q = F.layer_norm(q, (hd,), tw["attn.q_norm.weight"], tw["attn.q_norm.bias"], 1e-6)
        k = F.layer_norm(k, (hd,), tw["attn.k_norm.weight"], tw["attn.k_norm.bias"], 1e-6)
    if o["rope_theta"] > 0:
        r = o["rope_dims"] or int(hd * o["rope_fraction"])
        if o["rope_layout"] == "interleaved":  # GPT-J: [B, T, H, hd], sin/cos from its sinusoid table
            assert o["rope_theta"] == 10000.0
            sincos = create_sinusoidal_positions(t, r)[None]
            sin, cos = torch.split(sincos, r // 2, dim=-1)
            q = torch.cat([gptj_rope(q[..., :r], sin, cos), q[..., r:]], -1)
            k = torch.cat([gptj_rope(k[..., :r], sin, cos), k[..., r:]], -1)
        else:  # GPT-NeoX: [B, H, T, hd], cos/sin [1, T, r] over the rotated features
            inv = 1.0 / (o["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
            f = torch.arange(t).float()[:, None] * inv[None]
            emb = torch.cat([f, f], -1)[None]
            qh, kh = neox_rope(q.transpose(1, 2), k.transpose(1, 2), emb.cos(), emb.sin())
            q, k = qh.transpose(1, 2), kh.transpose(1, 2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = torch.zeros(t, t)
    if o["causal"]:
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        hide = (j > i) | ((j <= i - o["window"]) if o["window"] else torch.zeros_like(j > i))
        mask = mask.masked_fill(hide, torch.finfo(torch.float32).min)
    elif o["window"]:  # transformers' ModernBERT mask: |q - kv| <= sliding_window, which is window - 1
        from transformers.masking_utils import sliding_window_bidirectional_overlay

        see = sliding_window_bidirectional_overlay(o["window"] - 1)
        keep = torch.tensor([[see(0, 0, i, j) for j in range(t)] for i in range(t)])
        mask = mask.masked_fill(~keep, torch.finfo(torch.float32).min)
    mask = mask[None, None]
    if o["biased"]:
        mask = mask + torch.from_numpy(bias)[None]
    if o["bias_block"]:
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        mask = mask + (-0.5 * (i - j).abs().float())[None, None] / (torch.arange(heads) + 1.0)[None, :, None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = heads // kvh, hd
    module.eval()
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=o["scale"] or hd ** -0.5,
                                     softcap=o["softcap"] or None)
    return F.linear(out.reshape(bsz, t, heads * hd), tw["attn.o.weight"], tw.get("attn.o.bias")).numpy()


DEFAULTS = dict(d=32, heads=4, kv_heads=2, head_dim=0, qkv_bias=True, o_bias=False, rope_theta=10000.0,
                rope_dims=0, rope_fraction=1.0, rope_layout="half", scale=0.0, softcap=0.0, qk_norm="none",
                causal=True, window=0, biased=False, bias_block=False, qk_norm_scope="head")


@pytest.mark.parametrize("kernel", ["portable", "block"])
@pytest.mark.parametrize("case", list(CASES))
def test_option_matches_numpy_and_transformers_fused_and_unfused(spec_path, case, rng, monkeypatch, kernel):
    from tessera.compiler.backends.onnx import attention as attention_onnx

    sets = CASES[case]
    o = {**DEFAULTS, **sets}
    unfused = build(spec_path, **sets)
    w = init_weights(unfused, seed=3)
    w = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.3) for k, v in w.items()}  # non-trivial norms, biases
    t = 37
    feeds = {"x": rng.standard_normal((2, t, 32)).astype(np.float32),
             "bias": rng.standard_normal((4, t, t)).astype(np.float32)}
    want_np = numpy_attention(feeds["x"], w, feeds["bias"], o)
    want_torch = torch_attention(feeds["x"], w, feeds["bias"], o)
    np.testing.assert_allclose(want_np, want_torch, atol=2e-5, rtol=1e-4)
    got = interpret.run(unfused, w, feeds)["y"]
    np.testing.assert_allclose(got, want_torch, atol=2e-5, rtol=1e-4)

    fused = build(spec_path, **sets)
    sites = optimize(fused, Target("cpu"), kernel)
    assert len(sites) == 1 and sites[0].fused and sites[0].impl == kernel, [s.describe() for s in sites]
    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 16)
    from tessera.compiler.backends.onnx import export as onnx_export
    used = {i.name for i in onnx_export.to_onnx(fused, w).graph.input}
    ort = ort_run(fused, w, {k: v for k, v in feeds.items() if k in used})["y"]
    np.testing.assert_allclose(ort, want_torch, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(interpret.run(fused, w, feeds)["y"], want_torch, atol=2e-5, rtol=1e-4)


def test_parameters_follow_the_options(spec_path):
    g = build(spec_path, head_dim=16, qkv_bias=False, o_bias=True, qk_norm="rmsnorm")
    shapes = {p: v.shape for p, v in g.params.items()}
    assert shapes == {"attn.q.weight": (64, 32), "attn.k.weight": (32, 32), "attn.v.weight": (32, 32),
                      "attn.o.weight": (32, 64), "attn.o.bias": (32,), "attn.q_norm.weight": (16,),
                      "attn.k_norm.weight": (16,)}


def test_per_projection_bias_and_norm_width_set_the_parameters(spec_path):
    g = build(spec_path, qkv_bias=True, k_bias=False, qk_norm="rmsnorm", qk_norm_scope="all")
    shapes = {p: v.shape for p, v in g.params.items()}
    assert shapes == {"attn.q.weight": (32, 32), "attn.q.bias": (32,), "attn.k.weight": (16, 32),
                      "attn.v.weight": (16, 32), "attn.v.bias": (16,), "attn.o.weight": (32, 32),
                      "attn.q_norm.weight": (32,), "attn.k_norm.weight": (16,)}
    with pytest.raises(SpecError, match="unknown qk_norm_scope layer"):
        build(spec_path, qk_norm="rmsnorm", qk_norm_scope="layer")


def test_two_sided_window_unfused_in_onnx_and_refused_where_no_kernel_computes_it(spec_path, rng):
    """The local_mask op's own lowering (no fusion) equals the numpy reference; the contrib kernels
    and the cached ones (whose one additive mask is causal) do not list the feature, and a causal
    mask on top of a two-sided window stays unfused."""
    from tessera.compiler.backends.onnx.attention import kernel_features
    sets = dict(causal=False, window=4, rope_theta=0.0)
    g = build(spec_path, **sets)
    w = init_weights(g, seed=5)
    x = rng.standard_normal((2, 13, 32)).astype(np.float32)
    want = numpy_attention(x, w, None, {**DEFAULTS, **sets})
    bias = np.zeros((4, 13, 13), np.float32)  # declared by the test's model, unused here
    np.testing.assert_allclose(ort_run(g, w, {"x": x, "bias": bias})["y"], want, atol=2e-5, rtol=1e-4)
    for impl in ("gqa", "mha", "cached", "phased"):
        assert "local_window" not in kernel_features(impl), impl
    assert "local_window" in kernel_features("portable") and "local_window" in kernel_features("block")


def test_a_causal_mask_over_a_two_sided_window_is_not_fused(tmp_path):
    p = tmp_path / "both.tsr"
    p.write_text("""
model M() {
  in q: f32[B, 2, T, 8]
  in k: f32[B, 2, T, 8]
  in v: f32[B, 2, T, 8]
  out y: f32[B, 2, T, 8]
  y = matmul(softmax(causal_mask(local_window_mask(matmul(q, transpose(k)), 3)), axis=-1), v)
}
""")
    sites = optimize(build(str(p)))
    assert len(sites) == 1 and not sites[0].fused
    assert "two-sided local window" in sites[0].describe()


def test_softcap_is_fused_with_its_cap_and_scale(spec_path):
    g = build(spec_path, softcap=5.0, scale=0.4)
    optimize(g)
    (node,) = [n for n in g.nodes.values() if n.op == "fused_attention"]
    assert node.attrs["softcap"] == 5.0
    assert node.attrs["scale"] == pytest.approx(0.4 / 5.0)
    plain = build(spec_path)
    optimize(plain)
    assert all("softcap" not in n.attrs for n in plain.nodes.values() if n.op == "fused_attention")


def test_a_mask_before_the_soft_cap_is_attention_but_not_fused(tmp_path):
    p = tmp_path / "capmask.tsr"
    p.write_text("""
model M() {
  in q: f32[B, 2, T, 8]
  in k: f32[B, 2, T, 8]
  in v: f32[B, 2, T, 8]
  out y: f32[B, 2, T, 8]
  s = causal_mask(matmul(q, transpose(k)) * 0.3)
  y = matmul(softmax(tanh(s / 5.0) * 5.0, axis=-1), v)
}
""")
    g = build(str(p))
    sites = optimize(g)
    assert len(sites) == 1 and not sites[0].fused
    assert "before the scores are soft-capped" in sites[0].describe()


ALTERNATING = """
model Alt(layers = 4, d = 32, heads = 4, window = 5) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  repeat layers as i {
    if i % 2 == 0 {
      x = x + attention(x, heads, causal=true, window=window, rope_theta=10000.0, softcap=20.0, name="attn")
    } else {
      x = x + attention(x, heads, causal=true, rope_theta=10000.0, softcap=20.0, name="attn")
    }
  }
  y = x
}
"""


def test_sliding_and_global_layers_alternate_and_stay_fused(tmp_path, rng, monkeypatch):
    from tessera.compiler.backends.onnx import attention as attention_onnx

    p = tmp_path / "alt.tsr"
    p.write_text(ALTERNATING)
    unfused, fused = build(str(p)), build(str(p))
    sites = optimize(fused, Target("cpu"), "portable")
    assert [s.fused for s in sites] == [True] * 4
    windows = [n.attrs["window"] for n in fused.nodes.values() if n.op == "fused_attention"]
    assert windows == [5, 0, 5, 0]
    # the same parameter paths whichever branch a layer takes
    assert {k for k in unfused.params if k.startswith("layers.1.")} == \
        {k.replace("layers.0.", "layers.1.") for k in unfused.params if k.startswith("layers.0.")}
    w = init_weights(unfused, seed=4)
    x = rng.standard_normal((2, 23, 32)).astype(np.float32)
    monkeypatch.setattr(attention_onnx, "SCORE_BLOCK_BUDGET", 1)
    monkeypatch.setattr(attention_onnx, "MAX_TILE", 8)
    want = interpret.run(unfused, w, {"x": x})["y"]
    np.testing.assert_allclose(ort_run(fused, w, {"x": x})["y"], want, atol=1e-5, rtol=1e-5)
    # the window matters: a global-only stack differs
    glob = build(str(p), window=0)
    assert np.abs(interpret.run(glob, w, {"x": x})["y"] - want).max() > 1e-3


@pytest.mark.parametrize("sets,message", [
    (dict(rope_dims=3), "'dims' must be even"),
    (dict(rope_dims=10), "'dims' must be even and at most the head size 8"),
    (dict(rope_layout="pairs"), "'layout' must be one of 'half', 'interleaved'"),
    (dict(qk_norm="l2"), "unknown qk_norm l2"),
    (dict(rope_fraction=1.5), "rope_fraction must be in (0, 1], got 1.5"),
])
def test_bad_options_are_positioned_errors(spec_path, sets, message):
    with pytest.raises(SpecError) as err:
        build(spec_path, **sets)
    assert message in str(err.value)
    assert "nn.tsr:" in str(err.value) and "called at" in "\n".join(err.value.notes + [str(err.value)])


def test_a_negative_head_dim_is_refused_where_attention_is_called(tmp_path):
    p = tmp_path / "neg.tsr"
    p.write_text("""model M() {
  in x: f32[B, T, 32]
  out y: f32[B, T, 32]
  y = attention(x, 4, head_dim=-8)
}
""")
    with pytest.raises(SpecError) as err:
        build(str(p))
    assert "head_dim must be positive (or 0: d / heads), got -8" in str(err.value)
    assert any("neg.tsr:4:" in n for n in err.value.notes)


DECODER = """
model Dec(vocab = 97, d = 32, heads = 4, kv_heads = 2, layers = 2) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="wte")
  repeat layers as i {
    h += attention(rmsnorm(h, name="ln"), heads, kv_heads=kv_heads, causal=true, rope_theta=10000.0,
                   rope_dims=4, rope_layout="interleaved", softcap=3.0, qk_norm="rmsnorm", name="attn")
  }
  logits = linear(rmsnorm(h, name="ln_f"), vocab, bias=false, name="head")
}
"""


# issue 24: OLMo-2's q/k norm over all heads, and no k bias, in the cached decoder
DECODER_ALL_HEADS = DECODER.replace('qk_norm="rmsnorm"', 'qk_norm="rmsnorm", qk_norm_scope="all", k_bias=false')


@pytest.mark.parametrize("spec", [DECODER, DECODER_ALL_HEADS], ids=["per_head", "all_heads"])
@pytest.mark.parametrize("mode", ["buffer", "concat"])
def test_cached_generation_with_partial_interleaved_rope_and_softcap_equals_recomputation(tmp_path, mode, spec):
    """The cache pass hands rope nodes position_ids; partial interleaved rotary and the soft-cap must
    give, at every step, the logits of the uncached model over the whole sequence so far."""
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime import pipeline
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate

    p = tmp_path / "dec.tsr"
    p.write_text(spec)
    built = pipeline.build(p)
    weights = init_weights(built.graph, 7)
    rng = np.random.default_rng(0)
    weights = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.2 for k, v in weights.items()}
    full = ort.InferenceSession(onnx_export.to_onnx(built.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    model, info = compile_cached(pipeline.build(p), weights, mode=mode)
    cached = CachedModel(model.SerializeToString(), info)
    prompts = [[5, 9, 13, 2, 40, 41, 7, 8, 90], [3, 4]]
    check = Recomputation(full, prompts)

    out = generate(cached, prompts, 24, on_logits=check).tokens
    assert check.worst <= 1e-4
    assert len({t for row in out for t in row}) > 3, "degenerate: one token repeated"


@pytest.mark.parametrize("sets", [dict(softcap=5.0, scale=0.4, causal=False, rope_theta=0.0),
                                  dict(softcap=5.0, causal=True), dict(biased=True, causal=False)])
def test_fused_cost_counts_what_the_unfused_ops_count(spec_path, sets):
    """The fused node's FLOPs by category equal the ops it replaces (scale, divide, tanh, multiply,
    bias, masks, softmax, the two products), so fusion changes no figure of the report."""
    from tessera.compiler.analysis import cost

    def totals(g):
        out = {}
        for c in cost.node_costs(g)[0]:
            for cat, f in c.flops.items():
                out[cat] = out.get(cat, 0) + f.evaluate({"B": 2, "T": 37})
        return out

    unfused, fused = build(spec_path, **sets), build(spec_path, **sets)
    optimize(fused)
    assert totals(fused) == totals(unfused)
