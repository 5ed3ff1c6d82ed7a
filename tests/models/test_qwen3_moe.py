"""Qwen3-MoE (models/qwen3_moe.tsr): a seeded, perturbed Hugging Face Qwen3MoeForCausalLM saved as a
checkpoint folder is the model (model_type "qwen3_moe"): parameter count, logits (numpy interpreter,
onnxruntime, fused) and the cached decoder's greedy tokens for a left-padded batch of two equal
transformers', with the chosen experts' gates renormalised (norm_topk_prob, the released models') or
not; each variant's count equals transformers' model on the meta device (Qwen3-30B-A3B: 30.5 B) and its
active count the total less the experts a token does not run, counted here."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, build, cli, hf_greedy, ort_run, perturbed
from tessera.compiler.analysis.params import parameter_report
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "qwen3_moe.tsr"


@pytest.fixture(scope="module", params=[True, False], ids=["renormalised", "softmax-weights"])
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=200, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=request.param,
                                      decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
                                      rope_theta=10000.0, rms_norm_eps=1e-6)
    model = perturbed(transformers.Qwen3MoeForCausalLM(cfg), 0.1)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(folder)
    return model, folder


def test_logits_and_count_equal_transformers(case):
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = np.random.default_rng(0).integers(1, 200, (2, 19)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    assert all(s.fused for s in optimize(fused))
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(fused, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_cached_greedy_generation_of_a_left_padded_batch_equals_transformers(case, penalty):
    from tessera.runtime.generation.cached import CachedModel, compile_cached, generate
    from tessera.runtime.generation.sampling import Sampling

    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)), weights)
    cached = CachedModel(compiled.SerializeToString(), info)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 200, 11).tolist(), rng.integers(1, 200, 5).tolist()]
    new = 12
    ours = generate(cached, prompts, new, Sampling(repetition_penalty=penalty)).tokens
    assert ours == hf_greedy(model, prompts, new, repetition_penalty=penalty)
    if penalty != 1.0:  # the penalty changed the tokens: its path was taken
        assert ours != hf_greedy(model, prompts, new)
    assert len({t for row in ours for t in row}) > 4, "degenerate: the model repeats one token"


def test_the_folder_alone_is_the_model(case, tmp_path, capsys):
    model, folder = case
    out = tmp_path / "m.onnx"
    rc, stdout, err = cli(capsys, "compile", folder, "--explain", "-o", out)
    assert rc == 0, err
    assert "attention sites: 2 (2 fused, 0 not fused)" in stdout + err, stdout + err
    want = f"top 2 of 6 experts{'' if model.config.norm_topk_prob else ' (not renormalised)'}: sparse"
    assert want in stdout + err, stdout + err


VARIANTS = {
    "30b_a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, moe_intermediate_size=768),
    "235b_a22b": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, moe_intermediate_size=1536),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_counts_equal_transformers_on_the_meta_device(variant):
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
            tie_word_embeddings=False, **VARIANTS[variant]))
    rep = parameter_report(build("qwen3_moe", variant))
    assert rep["total"] == sum(p.numel() for p in model.parameters())
    # active per token: all but the (128 - 8) experts a token does not run, 3 x d x d_expert each, per layer
    cfg = VARIANTS[variant]
    idle = cfg["num_hidden_layers"] * (128 - 8) * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    assert rep["active_per_token"] == rep["total"] - idle
    if variant == "30b_a3b":  # the model card's 30.5 B
        assert round(rep["total"] / 1e9, 1) == 30.5
