"""Parameters shared across depth with share= (issue 24): ALBERT's one layer reused by every layer,
equal to transformers' AlbertModel in outputs and in parameter count (sum(p.numel()), shared
tensors counted once), with every layer's attention still fused."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build, ort_run
from tessera.compiler.passes.attention_kernels import Target
from tessera.compiler.passes.pipeline import optimize
from tessera.compiler.ops import interpret
from tessera.spec.diagnostics import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CFG = dict(vocab=40, e=16, d=32, layers=3, heads=4, d_ff=37, ctx=64)

SPEC = """
block albert_layer(h: [B, T, d], heads, d_ff, eps) -> [B, T, d] {
  h = layernorm(h + attention(h, heads, name="attn"), eps, name="attn_ln")
  f = linear(gelu(linear(h, d_ff, name="ffn"), approx="tanh"), d, name="ffn_out")
  return layernorm(f + h, eps, name="out_ln")
}

model Albert(vocab = 40, e = 16, d = 32, layers = 3, heads = 4, d_ff = 37, ctx = 64, eps = 1e-12) {
  in tokens: i64[B, T]
  out y: f32[B, T, d]
  x = embedding(tokens, vocab, e, name="word") + embedding(arange(T), ctx, e, name="pos")
  x = layernorm(x + embedding(tokens * 0, 2, e, name="type"), eps, name="emb_ln")
  h = linear(x, d, name="map_in")
  repeat layers as i {
    h = albert_layer(h, heads, d_ff, eps, share="layer")
  }
  y = h
}
"""

# AlbertModel's names -> the spec's (one layer group of one layer: ALBERT's default sharing)
NAMES = {
    "embeddings.word_embeddings.weight": "word.weight",
    "embeddings.position_embeddings.weight": "pos.weight",
    "embeddings.token_type_embeddings.weight": "type.weight",
    "embeddings.LayerNorm.weight": "emb_ln.weight", "embeddings.LayerNorm.bias": "emb_ln.bias",
    "encoder.embedding_hidden_mapping_in.weight": "map_in.weight",
    "encoder.embedding_hidden_mapping_in.bias": "map_in.bias",
}
LAYER = "encoder.albert_layer_groups.0.albert_layers.0."
for hf, ours in [("attention.query", "attn.q"), ("attention.key", "attn.k"), ("attention.value", "attn.v"),
                 ("attention.dense", "attn.o"), ("attention.LayerNorm", "attn_ln"), ("ffn", "ffn"),
                 ("ffn_output", "ffn_out"), ("full_layer_layer_norm", "out_ln")]:
    for kind in ("weight", "bias"):
        NAMES[f"{LAYER}{hf}.{kind}"] = f"layer.{ours}.{kind}"


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("albert") / "albert.tsr"
    p.write_text(SPEC)
    return str(p)


@pytest.fixture(scope="module")
def hf():
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    cfg = AlbertConfig(vocab_size=CFG["vocab"], embedding_size=CFG["e"], hidden_size=CFG["d"],
                       num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"],
                       intermediate_size=CFG["d_ff"], max_position_embeddings=CFG["ctx"], hidden_act="gelu_new",
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    m = AlbertModel(cfg, add_pooling_layer=False).eval()
    for p in m.parameters():  # off the initial values, so norms and biases matter
        p.data += torch.randn_like(p) * 0.1
    return m


def test_albert_equals_transformers_with_one_shared_layer(spec_path, hf, rng):
    g = build(spec_path)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items() if k in NAMES}
    w = {NAMES[k]: v for k, v in sd.items()}
    assert set(w) == set(g.params)  # every layer reads the one shared copy: no layers.{i}.* parameters
    assert g.param_count() == sum(p.numel() for p in hf.parameters())
    tokens = rng.integers(0, CFG["vocab"], (2, 11)).astype(np.int64)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).last_hidden_state.numpy()
    np.testing.assert_allclose(interpret.run(g, w, {"tokens": tokens})["y"], want, atol=2e-5, rtol=1e-4)
    fused = build(spec_path)
    sites = optimize(fused, Target("cpu"))
    assert len(sites) == CFG["layers"] and all(s.fused for s in sites), [s.describe() for s in sites]
    np.testing.assert_allclose(ort_run(fused, w, {"tokens": tokens})["y"], want, atol=2e-5, rtol=1e-4)


def test_share_on_builtins_and_its_errors(tmp_path):
    p = tmp_path / "s.tsr"
    p.write_text("""
model M(d = 8, bad = false) {
  in x: f32[B, T, d]
  out y: f32[B, T, d]
  repeat 3 as i {
    x = rmsnorm(linear(x, d, share="proj", name="fc"), share="norm", name="ln")
  }
  if bad { x = x + slice(linear(x, 2 * d, share="proj", name="fc_bad"), -1, 0, d) }
  y = x
}
""")
    g = build(str(p))
    assert sorted(g.params) == ["norm.weight", "proj.bias", "proj.weight"]
    with pytest.raises(SpecError, match=r"shared parameter 'proj.weight' is f32\[8, 8\] where it was first made, "
                                        r"but this call needs f32\[16, 8\]"):
        build(str(p), bad=True)
    p.write_text(p.read_text().replace('share="norm"', 'share="1norm"'))
    with pytest.raises(SpecError, match="share= must be a parameter path prefix"):
        build(str(p))


DECODER = """
model Dec(vocab = 61, d = 32, heads = 4, layers = 3) {
  in tokens: i64[B, T]
  out logits: f32[B, T, vocab]
  h = embedding(tokens, vocab, d, name="wte")
  repeat layers as i {
    h += attention(rmsnorm(h, share="shared.ln", name="ln"), heads, causal=true, rope_theta=10000.0,
                   share="shared.attn", name="attn")
    h += swiglu(h, 48, share="shared.mlp", name="mlp")
  }
  logits = linear(rmsnorm(h, name="ln_f"), vocab, bias=false, name="head")
}
"""


def test_a_shared_decoder_generates_with_the_kv_cache_like_recomputation(tmp_path):
    import onnxruntime as ort

    from conftest import Recomputation
    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime import pipeline
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate
    from tessera.runtime.io.weights import init_weights

    p = tmp_path / "dec.tsr"
    p.write_text(DECODER)
    built = pipeline.build(p)
    assert not any(k.startswith("layers.") for k in built.graph.params)
    rng = np.random.default_rng(1)
    weights = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.2
               for k, v in init_weights(built.graph, 3).items()}
    full = ort.InferenceSession(onnx_export.to_onnx(built.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    model, info = compile_cached(pipeline.build(p), weights)
    prompts = [[5, 9, 13, 2, 40], [3, 4]]
    check = Recomputation(full, prompts)
    out = generate(CachedModel(model.SerializeToString(), info), prompts, 12, on_logits=check).tokens
    assert check.worst <= 1e-4
    assert len({t for row in out for t in row}) > 3
