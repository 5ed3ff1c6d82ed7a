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


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("row", [0, 1])
def test_cached_greedy_generation_equals_transformers(case, cached, row, penalty):
    """One prompt (of 11, or 4 tokens), 14 new tokens: past several chunks of 4 and temperature steps;
    with and without a repetition penalty."""
    from tessera.runtime.generation.cached import generate
    from tessera.runtime.generation.sampling import Sampling

    model, _ = case
    prompt = [_prompts()[row]]
    ours = generate(cached, prompt, 14, Sampling(repetition_penalty=penalty)).tokens
    assert ours == hf_greedy(model, prompt, 14, repetition_penalty=penalty)
    if penalty != 1.0:  # the penalty changed the tokens: its path was taken
        assert ours != hf_greedy(model, prompt, 14)
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


# The released models' text_config (config.json of meta-llama/Llama-4-Scout-17B-16E and
# meta-llama/Llama-4-Maverick-17B-128E); the sizes not given are Llama4TextConfig's defaults (48 layers,
# d 5120, 40 / 8 heads of 128, experts of 8192, dense layers of 16384, vocab 202048)
RELEASED = {
    "scout": dict(num_local_experts=16, interleave_moe_layer_step=1, max_position_embeddings=10485760,
                  rope_parameters={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                                   "rope_theta": 500000.0}),
    "maverick": dict(num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False,
                     max_position_embeddings=1048576),
}
# published totals and active parameters per token (the Hugging Face release post and transformers' Llama 4
# page: "~109B" and "~400B", "17B active"; the totals include the vision tower, which is not modelled here)
PUBLISHED = {"scout": (109e9, 17e9), "maverick": (400e9, 17e9)}


@pytest.mark.parametrize("variant", list(RELEASED))
def test_released_variant_counts_equal_transformers_on_the_meta_device(capsys, variant):
    """`tessera report llama4 --variant scout|maverick`: the text model's total and active parameters per token
    equal transformers' Llama4ForCausalLM built on the meta device from the same config; both near the
    published figures (the text model alone: 1.1% under Scout's ~109B, which counts the vision tower)."""
    import json

    from conftest import cli

    cfg = transformers.Llama4TextConfig(**RELEASED[variant])
    with torch.device("meta"):
        model = transformers.Llama4ForCausalLM(cfg)
    rc, out, err = cli(capsys, "report", "llama4", "--variant", variant, "--format", "json")
    assert rc == 0, err
    params = json.loads(out)["params"]
    assert params["total"] == sum(p.numel() for p in model.parameters())
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.feed_forward, "experts")]
    assert moe == cfg.moe_layers and len(moe) == {"scout": 48, "maverick": 24}[variant]
    experts = model.model.layers[moe[0]].feed_forward.experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // cfg.num_local_experts
    idle = len(moe) * (cfg.num_local_experts - cfg.num_experts_per_tok) * per_expert
    assert params["active_per_token"] == params["total"] - idle
    total, active = PUBLISHED[variant]
    assert abs(params["total"] - total) / total < 0.02
    assert round(params["active_per_token"] / 1e9) == active / 1e9


def test_llama3_rope_scaling_with_equal_bounds_loads_and_equals_transformers(tmp_path):
    """Scout's rope_scaling (llama3, low_freq_factor = high_freq_factor = 1: no frequency smoothed, those of
    wavelengths past original_max_position_embeddings divided by the factor) read from config.json: logits
    equal transformers' over 13 tokens, where the scaling moves them (original context 4)."""
    scaled = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 4, "rope_theta": 10000.0}
    torch.manual_seed(1)
    model = transformers.Llama4ForCausalLM(tiny_config(rope_parameters=scaled)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    built = pipeline.build(SPEC, weights=str(tmp_path))
    assert built.info.hyperparams["rope_type"] == "llama3" and built.info.hyperparams["rope_high_freq"] == 1.0
    weights = pipeline.weights_for(built, str(tmp_path), 0)
    tokens = _tokens()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
        plain = transformers.Llama4ForCausalLM(tiny_config()).eval()
        plain.load_state_dict(model.state_dict())
        assert np.abs(plain(input_ids=torch.from_numpy(tokens)).logits.numpy() - ref).max() > 1e-2
    assert np.abs(interpret.run(built.graph, weights, {"tokens": tokens})["logits"] - ref).max() <= TOL
