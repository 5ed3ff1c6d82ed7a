"""Qwen3 (models/qwen3.tsr): a seeded, perturbed Hugging Face Qwen3ForCausalLM saved as a checkpoint
folder is the model (config.json through the mapping's [config] table, model_type "qwen3" to the
bundled spec): its parameter count is transformers' ``sum(p.numel())``, its logits equal
transformers' in the numpy interpreter, onnxruntime and the fused graph, the cached decoder's greedy
tokens equal transformers' ``generate`` for a left-padded batch of two, with and without a repetition
penalty, and each variant's parameter count equals transformers' model built from that variant's
config on the meta device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, Recomputation, build, cli, hf_greedy, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "qwen3.tsr"


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def case(request, tmp_path_factory):
    """head_dim 12 with d 32 and 4 heads (a head size of its own: 4 x 12 != 32); q/k norms and every
    other weight moved off their initial values so each one matters."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=request.param)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(folder)
    return model, folder


def test_logits_equal_transformers_unfused_and_fused(case):
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = np.random.default_rng(0).integers(1, 200, (2, 19)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    got_np = interpret.run(built.graph, weights, {"tokens": tokens})["logits"]
    got_ort = ort_run(built.graph, weights, {"tokens": tokens})["logits"]
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    sites = optimize(fused)
    assert len(sites) == 2 and all(s.fused for s in sites), [s.describe() for s in sites]
    got_fused = ort_run(fused, weights, {"tokens": tokens})["logits"]
    for got in (got_np, got_ort, got_fused):
        assert np.abs(got - ref).max() <= TOL


def test_the_q_and_k_norms_matter(case):
    """With the q/k norms' weights back at one, the logits move far past the tolerance: the test above
    checks the norms, not a model they do not change."""
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = dict(pipeline.weights_for(built, str(folder), 0))
    for path in [p for p in weights if p.endswith(("q_norm.weight", "k_norm.weight"))]:
        weights[path] = np.ones_like(weights[path])
    tokens = np.random.default_rng(0).integers(1, 200, (1, 9)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(interpret.run(built.graph, weights, {"tokens": tokens})["logits"] - ref).max() > 100 * TOL


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_cached_greedy_generation_of_a_left_padded_batch_equals_transformers(case, penalty):
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate
    from tessera.runtime.generation.sampling import Sampling

    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    full = ort.InferenceSession(onnx_export.to_onnx(built.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)), weights)
    cached = CachedModel(compiled.SerializeToString(), info)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 200, 11).tolist(), rng.integers(1, 200, 5).tolist()]
    new = 16
    check = Recomputation(full, prompts) if penalty == 1.0 else None
    ours = generate(cached, prompts, new, Sampling(repetition_penalty=penalty), on_logits=check).tokens
    if check is not None:
        assert check.worst <= TOL
    assert ours == hf_greedy(model, prompts, new, repetition_penalty=penalty)
    assert len({t for row in ours for t in row}) > 5, "degenerate: the model repeats one token"


def test_the_folder_alone_is_the_model_every_site_fused(case, tmp_path, capsys):
    import onnxruntime as ort

    model, folder = case
    out = tmp_path / "qwen3.onnx"
    rc, stdout, err = cli(capsys, "compile", folder, "--explain", "-o", out)
    assert rc == 0, err
    assert "attention sites: 2 (2 fused, 0 not fused)" in stdout + err, stdout + err
    tokens = np.random.default_rng(1).integers(1, 200, (1, 7)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"tokens": tokens})[0]
    assert np.abs(got - ref).max() <= TOL


# each variant's config.json fields (huggingface.co/Qwen/Qwen3-*): Qwen3-0.6B has 596,049,920 parameters
VARIANTS = {
    "0_6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "1_7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=151936, head_dim=128,
                                                                       **VARIANTS[variant]))
    want = sum(p.numel() for p in model.parameters())
    assert build("qwen3", variant).param_count() == want
    if variant == "0_6b":
        assert want == 596_049_920
