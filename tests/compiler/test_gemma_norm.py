"""Gemma's RMSNorm by name (issue 39 item 6): ``gemma_rmsnorm`` scales by 1 + w, as transformers'
Gemma3RMSNorm, and ``attention(qk_norm="gemma_rmsnorm")`` is Gemma 3's q/k norm (plain ``rmsnorm``,
which the docs once gave for Gemma 3, loads the same weights and scales by w)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.runtime.io.weights import init_weights

NORM = """
model N(d = 8) {
  in x: f32[B, H, T, d]
  out y: f32[B, H, T, d]
  y = gemma_rmsnorm(x, 1e-6, name="n")
}
"""

ATTN = """
model A(d = 16, heads = 2, norm = "gemma_rmsnorm") {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  y = attention(x, heads, causal=true, bias=false, qk_norm=norm, name="attn")
}
"""


def _spec(tmp_path, text):
    p = tmp_path / "m.tsr"
    p.write_text(text)
    return str(p)


def test_gemma_rmsnorm_equals_transformers_gemma3_rmsnorm(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    rng = np.random.default_rng(0)
    w = rng.standard_normal(8).astype(np.float32)
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    hf = Gemma3RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(w))
        want = hf(torch.from_numpy(x)).numpy()
    g = build(_spec(tmp_path, NORM))
    assert {n: p.init for n, p in g.params.items()} == {"n.weight": "zeros"}
    got = ort_run(g, {"n.weight": w}, {"x": x})["y"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _numpy_attention(x, w, heads, offset):
    b, t, d = x.shape
    hd = d // heads
    heads_of = lambda z: z.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)  # noqa: E731
    norm = lambda z, g: z / np.sqrt((z * z).mean(-1, keepdims=True) + 1e-6) * (offset + g)  # noqa: E731
    q = norm(heads_of(x @ w["attn.q.weight"].T), w["attn.q_norm.weight"])
    k = norm(heads_of(x @ w["attn.k.weight"].T), w["attn.k_norm.weight"])
    v = heads_of(x @ w["attn.v.weight"].T)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    s = np.where(np.tri(t, dtype=bool), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ w["attn.o.weight"].T


def test_attention_with_gemma_qk_norm_scales_by_one_plus_w(tmp_path):
    spec = _spec(tmp_path, ATTN)
    g = build(spec)
    rng = np.random.default_rng(1)
    w = {n: (rng.standard_normal(a.shape) * 0.3).astype(np.float32) for n, a in init_weights(g, 0).items()}
    assert w["attn.q_norm.weight"].shape == (8,)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    got = ort_run(g, w, {"x": x})["y"]
    np.testing.assert_allclose(got, _numpy_attention(x, w, 2, 1.0), atol=2e-5, rtol=1e-4)
    plain = ort_run(build(spec, norm="rmsnorm"), w, {"x": x})["y"]  # the trap: same weights, scale w
    np.testing.assert_allclose(plain, _numpy_attention(x, w, 2, 0.0), atol=2e-5, rtol=1e-4)
    assert np.abs(plain - got).max() > 1e-2
