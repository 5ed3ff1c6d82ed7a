"""Llama 4 text (models/llama4.tsr): a seeded, perturbed Hugging Face Llama4ForCausalLM saved as a checkpoint
folder is the model (model_type "llama4_text"): its stacked expert tensors unstacked by the mapping, parameter
count and logits (numpy interpreter, onnxruntime, fused) equal transformers'; the cached decoder's greedy
tokens equal transformers' greedy generate, and for a left-padded batch its logits equal Tessera's own
uncached graph over each row at every step. The tiny config has 4 layers alternating a rope layer (chunked
attention over blocks of 4 positions, the weightless q/k norm, a dense SwiGLU) and a NoPE layer (full
attention, temperature tuning with floor_scale 4, a mixture of 4 experts, top 2, and a shared expert), at
lengths of 13 and more, so every chunk boundary and several temperature steps are crossed; each feature is
shown to move transformers' logits, so none is idle."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, Recomputation, hf_greedy, ort_run
from tessera.compiler.ops import interpret
from tessera.compiler.passes.pipeline import optimize
from tessera.runtime import pipeline

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SPEC = MODELS / "llama4.tsr"
VOCAB = 100


def tiny_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                interleave_moe_layer_step=2, attention_chunk_size=4, no_rope_layer_interval=2, floor_scale=4,
                attn_scale=0.5, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.Llama4TextConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(tiny_config()).eval()
    assert model.config.moe_layers == [1, 3] and model.config.no_rope_layers == [1, 0, 1, 0]
    assert model.config.layer_types == ["chunked_attention", "full_attention"] * 2
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(folder)
    return model, folder


def _tokens():
    return np.random.default_rng(0).integers(1, VOCAB, (2, 13)).astype(np.int64)


def test_logits_and_count_equal_transformers(case):
    model, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(built, str(folder), 0)
    assert built.graph.param_count() == sum(p.numel() for p in model.parameters())
    tokens = _tokens()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    fused = pipeline.build(SPEC, weights=str(folder)).graph
    assert all(s.fused for s in optimize(fused))
    for got in (interpret.run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(built.graph, weights, {"tokens": tokens})["logits"],
                ort_run(fused, weights, {"tokens": tokens})["logits"]):
        assert np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("change", [dict(attention_chunk_size=64), dict(attn_temperature_tuning=False),
                                    dict(use_qk_norm=False)], ids=["chunk", "tuning", "qk_norm"])
def test_each_feature_moves_transformers_logits_at_this_length(case, change):
    """Without the chunks, the temperature or the q/k norm transformers' logits move: each is tested, not idle."""
    model, _ = case
    other = transformers.Llama4ForCausalLM(tiny_config(**change)).eval()
    other.load_state_dict(model.state_dict())
    tokens = torch.from_numpy(_tokens())
    with torch.no_grad():
        assert (other(input_ids=tokens).logits - model(input_ids=tokens).logits).abs().max() > 1e-2


@pytest.fixture(scope="module")
def cached(case):
    from tessera.runtime.generation.cached import CachedModel, compile_cached

    _, folder = case
    built = pipeline.build(SPEC, weights=str(folder))
    compiled, info = compile_cached(pipeline.build(SPEC, weights=str(folder)),
                                    pipeline.weights_for(built, str(folder), 0))
    assert info.mode == "concat"  # chunked attention takes the concatenated cache
    return CachedModel(compiled.SerializeToString(), info)


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(1, VOCAB, 11).tolist(), rng.integers(1, VOCAB, 4).tolist()]


@pytest.mark.parametrize("row", [0, 1])
def test_cached_greedy_generation_equals_transformers(case, cached, row):
    """One prompt (of 11, or 4 tokens), 14 new tokens: past several chunks of 4 and temperature steps."""
    from tessera.runtime.generation.cached import generate

    model, _ = case
    prompt = [_prompts()[row]]
    ours = generate(cached, prompt, 14).tokens
    assert ours == hf_greedy(model, prompt, 14)
    assert len(set(ours[0])) > 3, "degenerate: the model repeats one token"


def test_cached_logits_of_a_left_padded_batch_equal_the_uncached_graph(case, cached):
    """Prompts of 11 and 4 tokens, left-padded into one batch, 14 greedy steps: at each, every row's logits
    equal Tessera's uncached graph over the row's whole sequence (conftest.Recomputation), so each row's
    temperature and chunks follow its own positions. (transformers computes the temperature at the padded
    batch's slot positions, so a left-padded row's are not its own: not the reference here.)"""
    import onnxruntime as ort

    from tessera.compiler.backends.onnx import export as onnx_export
    from tessera.compiler.passes.pipeline import PipelineOptions, pipeline as passes
    from tessera.runtime.generation.cached import generate

    _, folder = case
    ref = pipeline.build(SPEC, weights=str(folder))
    weights = pipeline.weights_for(ref, str(folder), 0)
    passes("full", PipelineOptions(attention="unfused"))(ref.graph)
    full = ort.InferenceSession(onnx_export.to_onnx(ref.graph, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    check = Recomputation(full, _prompts())
    generate(cached, _prompts(), 14, on_logits=check)
    assert check.worst <= TOL, f"max |cached - uncached| logits: {check.worst:.2e}"


def test_the_default_count_equals_transformers_on_the_meta_device():
    """The spec's defaults are Llama4TextConfig's (Llama 4 Scout's text model: 16 experts at every layer):
    107.8 B parameters, and active per token all but the 15 experts of 16 a token does not run."""
    from conftest import build
    from tessera.compiler.analysis.params import parameter_report

    cfg = transformers.Llama4TextConfig()
    with torch.device("meta"):
        model = transformers.Llama4ForCausalLM(cfg)
    rep = parameter_report(build("llama4"))
    assert rep["total"] == sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].feed_forward.experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // cfg.num_local_experts
    idle = len(cfg.moe_layers) * (cfg.num_local_experts - cfg.num_experts_per_tok) * per_expert
    assert rep["active_per_token"] == rep["total"] - idle
